/* The depthwise kernels' epilogue kinds (depthwise_conv_int8.c, depthwise_conv_int8_vnni.c): a
 * constant in each compiled row function, chosen once a call. A kind is the activation (enum
 * activation), plus FLOAT_OUT for a float32 output, or PACKS_CLAMP for a clamp-only uint8 output
 * into [0, 255] whose clamp starts at or below 0, where the byte packs' saturation is the low
 * clamp. Checked per pixel, kind and clamps had cost a third of the epilogue: one Zen 3 thread,
 * 144 ch 56x56, ReLU6 262 -> 202 us, hardswish 540 -> 431, SiLU float out 556 -> 513. */
#ifndef QB_DEPTHWISE_KINDS_H
#define QB_DEPTHWISE_KINDS_H

#include "vec_math.h" /* enum activation */

#define FLOAT_OUT 8
#define PACKS_CLAMP 16
#define ACTIVATIONS 5 /* enum activation's count */

/* X(kind) for every kind a row table holds */
#define EPILOGUE_KINDS(X) X(0) X(1) X(2) X(3) X(4) X(8) X(9) X(10) X(11) X(12) X(16)

/* A call's kind (lo's level on the output grid: lo * out_inv_scale + out_zp), or -1 for an
 * activation out of enum activation. */
static inline int epilogue_kind(int activation, int float_out, float lo, float out_inv_scale, int out_zp, int qmin, int qmax) {
  if (activation < 0 || activation >= ACTIVATIONS) return -1;
  if (activation == CLAMP_ONLY && !float_out && qmin == 0 && qmax == 255 && !(lo * out_inv_scale + out_zp > 0)) return PACKS_CLAMP;
  return activation + (float_out ? FLOAT_OUT : 0);
}

#endif
