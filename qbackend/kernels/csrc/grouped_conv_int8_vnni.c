/* grouped_conv_int8.c built for CPUs with AVX512-VNNI (qbackend/kernels/kernel_build.py gives this
 * file the flags): qb_grouped_conv_vnni, whose dot products are vpdpbusd (exact in int32). */
#define QB_VNNI 1
#include "grouped_conv_int8.c"
