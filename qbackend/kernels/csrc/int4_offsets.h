/* An int4 weight's per-(row, group) offset, w = u * scale + offset (u = q + 8): float32
 * offsets, or (``codes``) int8 codes c with offset c * scale. An integer zero point z gives
 * c = -8 - z (lowering/weight_only.py): 5 bytes of scale and offset per group instead of 8.
 * Read by the int16 kernels (weight_only_int16.c) and the dequantize (weight_dequantize.c). */
#ifndef QB_INT4_OFFSETS_H
#define QB_INT4_OFFSETS_H
#include <stddef.h>
#include <stdint.h>

static inline __attribute__((always_inline)) float group_offset(const void* offset, int codes, const float* scale, size_t g) {
  return codes ? (float)((const int8_t*)offset)[g] * scale[g] : ((const float*)offset)[g];
}
#endif
