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

#define FLOAT_BLOCK 32 /* channels a task sums: 128 bytes of each pixel, 4 vectors */

/* The pool of quantize(x) for a float32 NHWC x, without the uint8 tensor between them: the same
 * integers (each value quantized as quantize_per_tensor does, then summed per channel as above).
 * Why: a squeeze-excitation block (RegNetY's, EfficientNet's, MobileNetV3's) multiplies the
 * conv's float result, so the graph quantized the whole tensor only for the pool: a pass over it
 * writing uint8 and a second reading those bytes. Returns 0. */
int qb_global_avg_pool_quantize_call(int threads, const global_avg_pool_call_t* c, const float* x, uint8_t* y) {
  const int C = c->C, HW = c->HW, blocks = (C + FLOAT_BLOCK - 1) / FLOAT_BLOCK;
  const __m256 inv = _mm256_set1_ps(c->x_inv_scale), zp = _mm256_set1_ps((float)c->x_zp);
  const __m256 lo = _mm256_set1_ps((float)c->x_qmin), hi = _mm256_set1_ps((float)c->x_qmax);
  const __m256i nan_as = _mm256_set1_epi32(c->x_nan_as);
  const int check_nan = c->x_nan_as != c->x_qmin;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
  for (int n = 0; n < c->N; n++)
    for (int b = 0; b < blocks; b++) {
      const int c0 = b * FLOAT_BLOCK, width = C - c0 < FLOAT_BLOCK ? C - c0 : FLOAT_BLOCK, vectors = width / 8;
      const float* image = x + (size_t)n * HW * C + c0;
      __m256i sum[FLOAT_BLOCK / 8] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                                      _mm256_setzero_si256()};
      int64_t rest[8] = {0};
      for (int p = 0; p < HW; p++) {
        const float* pixel = image + (size_t)p * C;
        for (int v = 0; v < vectors; v++)
          sum[v] = _mm256_add_epi32(sum[v], quantize8_or_nan(pixel + 8 * v, inv, zp, lo, hi, nan_as, check_nan));
        for (int i = 8 * vectors; i < width; i++)
          rest[i - 8 * vectors] += grid_value_or_nan(pixel[i], c->x_inv_scale, c->x_zp, c->x_qmin, c->x_qmax, c->x_nan_as);
      }
      uint8_t* out = y + (size_t)n * C + c0;
      for (int v = 0; v < vectors; v++) {
        int32_t sums[8];
        _mm256_storeu_si256((__m256i*)sums, sum[v]);
        for (int i = 0; i < 8; i++) out[8 * v + i] = requantize(sums[i], c);
      }
      for (int i = 8 * vectors; i < width; i++) out[i] = requantize(rest[i - 8 * vectors], c);
    }
  return 0;
}
