/* Global average pooling (adaptive_avg_pool2d to 1x1) of a uint8 NHWC tensor whose output
 * keeps the input's scale and zero point, as PT2E quantizes a classifier head's pool.
 *
 * Why: on the int8 tensor torch needs a quantized-tensor copy, its pool and int_repr (three
 * ops; 12 vs 9 us for MobileNetV2's 1280x7x7 head at batch 1, 68 vs 31 at batch 8), and as
 * an own kernel the pool joins the kernel chain around it. The reference dequantizes, averages
 * and quantizes again with the same parameters: q = round((sum - HW * zp) / HW) + zp,
 * computed here with an exact integer numerator and one float division (round half to even).
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "call_structs.h"
#include "vec_math.h"

static inline uint8_t requantize(int64_t sum, const global_avg_pool_call_t* c) {
  return round_to_grid((float)(sum - (int64_t)c->HW * c->zp) / (float)c->HW, c->zp, c->qmin, c->qmax);
}

/* Returns 0 (one signature with the other kernels). */
int qb_global_avg_pool_u8_call(int threads, const global_avg_pool_call_t* c, const uint8_t* x, uint8_t* y) {
  const int C = c->C, HW = c->HW, groups = (C + 7) / 8;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
  for (int n = 0; n < c->N; n++)
    for (int g = 0; g < groups; g++) {
      const uint8_t* image = x + (size_t)n * HW * C + g * 8;
      uint8_t* out = y + (size_t)n * C + g * 8;
      if (g * 8 + 8 <= C) {
        __m256i sum = _mm256_setzero_si256(); /* 8 channels in int32: exact up to 8M pixels */
        for (int p = 0; p < HW; p++)
          sum = _mm256_add_epi32(sum, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(image + (size_t)p * C))));
        int32_t sums[8];
        _mm256_storeu_si256((__m256i*)sums, sum);
        for (int i = 0; i < 8; i++) out[i] = requantize(sums[i], c);
      } else {
        for (int i = 0; g * 8 + i < C; i++) {
          int64_t sum = 0;
          for (int p = 0; p < HW; p++) sum += image[(size_t)p * C + i];
          out[i] = requantize(sum, c);
        }
      }
    }
  return 0;
}
