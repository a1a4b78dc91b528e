/* Quantize a float32 NCHW tensor to uint8 NHWC in one pass: a model's input before its first
 * conv, which oneDNN and qbackend's kernels read channels-last. Quantizing in NCHW and then
 * transposing the uint8 tensor cost 0.7 ms for 8x3x224x224 (a 3-channel byte transpose).
 *
 * The reference's arithmetic: round_half_even(x * inv_scale) + zero_point, clamped, with
 * inv_scale the float32 of 1 / scale (what quantized_decomposed multiplies by): bit-exact.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define PIXELS 8

void qb_quantize_nchw_to_nhwc(int threads, int N, int C, int HW, const float* x, float inv_scale, int zero_point,
                              int qmin, int qmax, uint8_t* y) {
  const int blocks = (HW + PIXELS - 1) / PIXELS;
  const __m256 inv = _mm256_set1_ps(inv_scale), zp = _mm256_set1_ps((float)zero_point);
  const __m256 lo = _mm256_set1_ps((float)qmin), hi = _mm256_set1_ps((float)qmax);
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
  for (int n = 0; n < N; n++)
    for (int b = 0; b < blocks; b++) {
      const int p0 = b * PIXELS, pixels = HW - p0 < PIXELS ? HW - p0 : PIXELS;
      uint8_t* out = y + ((size_t)n * HW + p0) * C;
      for (int c = 0; c < C; c++) {
        const float* in = x + ((size_t)n * C + c) * HW + p0;
        int32_t q[PIXELS];
        if (pixels == PIXELS) {
          __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(in), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          v = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(v, zp), lo), hi);
          _mm256_storeu_si256((__m256i*)q, _mm256_cvtps_epi32(v));
        } else {
          for (int i = 0; i < pixels; i++) {
            __m128 v = _mm_round_ss(_mm_setzero_ps(), _mm_set_ss(in[i] * inv_scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            float f = _mm_cvtss_f32(v) + (float)zero_point;
            f = f < (float)qmin ? (float)qmin : f > (float)qmax ? (float)qmax : f;
            q[i] = (int32_t)f;
          }
        }
        for (int i = 0; i < pixels; i++) out[(size_t)i * C + c] = (uint8_t)q[i];
      }
    }
}
