/* ShuffleNet's channel shuffle of two halves in one pass: what
 * cat([a, b], 1).view(N, 2, C / 2, H, W).transpose(1, 2).contiguous() holds, written as the
 * channels-last [N, C, H, W] tensor out[p][2k + g] = (g == 0 ? a : b)[p][k], k < half.
 *
 * Why: ATen runs it as a cat, a copy into the 5-D view (a channels-last tensor has no such
 * view) and the transposed copy, 210-330 us per ShuffleNetV2 block at batch 1 on the AVX2
 * EPYC; this reads each input once and writes the output once. Pure data movement: the
 * reference's values bit for bit.
 *
 * a / b: float32 pixel rows of ``half`` contiguous channels, ``a_stride`` / ``b_stride``
 * floats apart (a channel slice of a wider channels-last tensor too); out: 2 * half per row.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "vec_math.h"

/* Channels [from, to) of a pixel's rows of a and b, interleaved into row (2 (to - from) floats). */
static inline void interleave(const float* ra, const float* rb, int from, int to, float* row) {
  int k = from;
  for (; k + 8 <= to; k += 8) {
    const __m256 va = _mm256_loadu_ps(ra + k), vb = _mm256_loadu_ps(rb + k);
    const __m256 low = _mm256_unpacklo_ps(va, vb);  /* a0 b0 a1 b1 | a4 b4 a5 b5 */
    const __m256 high = _mm256_unpackhi_ps(va, vb); /* a2 b2 a3 b3 | a6 b6 a7 b7 */
    _mm256_storeu_ps(row + 2 * (k - from), _mm256_permute2f128_ps(low, high, 0x20));
    _mm256_storeu_ps(row + 2 * (k - from) + 8, _mm256_permute2f128_ps(low, high, 0x31));
  }
  for (; k < to; k++) {
    row[2 * (k - from)] = ra[k];
    row[2 * (k - from) + 1] = rb[k];
  }
}

void qb_shuffle_pair_f32(int threads, long pixels, int half, const float* a, long a_stride, const float* b,
                         long b_stride, float* out) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long p = 0; p < pixels; p++) interleave(a + p * a_stride, b + p * b_stride, 0, half, out + p * 2 * half);
}

#define QUANTIZED_STEP 8 /* channels of each input interleaved and quantized at a time */

/* The shuffle's two halves at once (ShuffleNetV2's next block splits it): ``first`` gets
 * channels [0, quarter) of a and b interleaved (float32), ``second`` channels [quarter, half):
 * float32, or with ``second_u8`` uint8 as quantize_per_tensor gives them (the next block's
 * branch reads it quantized: round half to even of x * inv_scale, plus the zero point,
 * clamped; a NaN as qmin), which spares that float half's write and read. */
void qb_shuffle_halves_f32(int threads, long pixels, int half, const float* a, long a_stride, const float* b,
                           long b_stride, float* first, void* second, int second_u8, float inv_scale, int zero_point,
                           int qmin, int qmax) {
  const int quarter = half / 2, rest = half - quarter;
  const __m256 inv = _mm256_set1_ps(inv_scale), zp = _mm256_set1_ps((float)zero_point);
  const __m256 lo = _mm256_set1_ps((float)qmin), hi = _mm256_set1_ps((float)qmax);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long p = 0; p < pixels; p++) {
    const float *ra = a + p * a_stride, *rb = b + p * b_stride;
    interleave(ra, rb, 0, quarter, first + p * 2 * quarter);
    if (!second_u8) {
      interleave(ra, rb, quarter, half, (float*)second + p * 2 * rest);
      continue;
    }
    uint8_t* row = (uint8_t*)second + p * 2 * rest;
    float pairs[2 * QUANTIZED_STEP];
    for (int k = quarter; k < half; k += QUANTIZED_STEP) {
      const int count = half - k < QUANTIZED_STEP ? half - k : QUANTIZED_STEP;
      interleave(ra, rb, k, k + count, pairs);
      int j = 0;
      for (; j + 8 <= 2 * count; j += 8) store_quantized8(_mm256_mul_ps(_mm256_loadu_ps(pairs + j), inv), zp, lo, hi, row + 2 * (k - quarter) + j);
      for (; j < 2 * count; j++) row[2 * (k - quarter) + j] = round_to_grid(pairs[j] * inv_scale, zero_point, qmin, qmax);
    }
  }
}
