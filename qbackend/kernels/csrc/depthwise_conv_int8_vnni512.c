/* depthwise_conv_int8_vnni.c built on zmm registers (qb_dwconv_vnni512_call): 64 channels a
 * step, for cores that run zmm vpdpbusd at full rate (isa.py: where the GEMM runs on zmm). */
#define QB_ZMM 1
#include "depthwise_conv_int8_vnni.c"
