/* conv_gemm_int8.c built for CPUs with AMX-INT8 (qb_conv_call_amx): the zmm build, whose 1x1
 * convs of stride 1 and linears run on AMX tiles (TDPBUSD: 16 x 16 outputs of 64 products each
 * an instruction); conv_gemm_int8.c's qb_amx_ready tells the loader whether this CPU and Linux
 * let it run. Why: on a Sapphire Rapids Xeon oneDNN's AMX kernels ran most 1x1 convs 2x faster
 * than the zmm build, so the measured choice handed them to oneDNN, a torch call each that also
 * cut the kernel chain. */
#define QB_VNNI 1
#define QB_ZMM 1
#define QB_AMX 1
#include "conv_gemm_int8.c"
