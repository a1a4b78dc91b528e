/* conv_gemm_int8.c built for CPUs with AVX512-VNNI (qbackend/kernels/kernel_build.py gives this file the
 * flags): qb_conv_call_vnni, whose dot products are vpdpbusd on ymm registers (exact in int32,
 * no int16 pair limit; 32 registers). conv_gemm_int8.c's qb_has_avx512_vnni tells the loader
 * whether this CPU can run it. */
#define QB_VNNI 1
#include "conv_gemm_int8.c"
