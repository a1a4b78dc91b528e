/* Weight-only int4 / int8 weights written out as float32 or bf16 rows, for a dense matmul
 * (qbackend/llm/dense_weight_only.py).
 *
 * Why: with many activation rows (a prompt's prefill) the weight-only kernels are
 * compute-bound (unpacking per weight, int16 or bf16 products): a 512-row 2048 -> 5632 int4
 * layer took 97 ms on qbackend's int16 kernel and 80 ms on torch's bf16 one, where a dense bf16
 * matmul of the same sizes took 29 ms (Zen 4 EPYC, avx512_bf16, 2 threads). Writing a few
 * hundred rows of the weight at a time and multiplying them densely keeps the weights int4 in
 * memory. torch's elementwise ops took 90 ms to dequantize that layer: hence this pass.
 *
 * int4: qbackend's neutral storage, uint8 [N][K/2], u = q + 8 with the even column in the low
 * nibble; w = u * scale + offset per (row, group), the int16 kernel's constants (offset holds
 * the -8 * scale), one fused multiply-add. int8: int8 [N][K], w = q * scale per row.
 * bf16: rounded to nearest even, as torch's conversion (a NaN stays a quiet NaN).
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "bf16.h"
#include "int4_offsets.h"

/* 16 consecutive floats of a row: to out[0..15] as float32 or bf16. */
static inline void store16(__m256 first, __m256 second, int bf16, void* out, size_t index) {
  if (bf16) {
    uint16_t* o = (uint16_t*)out + index;
    _mm_storeu_si128((__m128i*)o, bf16x8(first));
    _mm_storeu_si128((__m128i*)(o + 8), bf16x8(second));
  } else {
    float* o = (float*)out + index;
    _mm256_storeu_ps(o, first);
    _mm256_storeu_ps(o + 8, second);
  }
}

/* A group's 16 possible bf16 weights, u * scale + offset for u = 0 .. 15 (rounded as bf16x8
 * rounds each weight), as two byte tables for vpshufb, each in both 128-bit lanes. */
static inline void bf16_tables(__m256 s, __m256 o, __m256i* low, __m256i* high) {
  const __m128i first = bf16x8(_mm256_fmadd_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), s, o));
  const __m128i second = bf16x8(_mm256_fmadd_ps(_mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15), s, o));
  const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15); /* (low bytes, then high) */
  const __m128i a = _mm_shuffle_epi8(first, split), b = _mm_shuffle_epi8(second, split);
  *low = _mm256_broadcastsi128_si256(_mm_unpacklo_epi64(a, b));
  *high = _mm256_broadcastsi128_si256(_mm_unpackhi_epi64(a, b));
}

/* 32 weights (16 bytes of storage) of one group as bf16 by table lookup: the same bits as the
 * arithmetic path, at a quarter of its instructions (a prompt's prefill writes out every
 * weight of every layer once). */
static inline void bf16_by_table(const uint8_t* bytes, __m256i low, __m256i high, uint16_t* o) {
  const __m128i v = _mm_loadu_si128((const __m128i*)bytes), nibble = _mm_set1_epi8(15);
  const __m128i even = _mm_and_si128(v, nibble), odd = _mm_and_si128(_mm_srli_epi16(v, 4), nibble);
  const __m256i index = _mm256_set_m128i(_mm_unpackhi_epi8(even, odd), _mm_unpacklo_epi8(even, odd));
  const __m256i l = _mm256_shuffle_epi8(low, index), h = _mm256_shuffle_epi8(high, index);
  const __m256i a = _mm256_unpacklo_epi8(l, h), b = _mm256_unpackhi_epi8(l, h); /* (per lane: columns 0-7, 8-15) */
  _mm256_storeu_si256((__m256i*)o, _mm256_permute2x128_si256(a, b, 0x20));
  _mm256_storeu_si256((__m256i*)(o + 16), _mm256_permute2x128_si256(a, b, 0x31));
}

/* Rows [0, rows) of an int4 weight of K columns (K % 16 == 0, group % 16 == 0, K % group == 0);
 * u, scale, offset and out start at the first of them. ``offset``: see int4_offsets.h. */
void qb_int4_dequantize(int threads, int rows, int K, int group, int codes, const uint8_t* u, const float* scale,
                        const void* offset, int bf16, void* out) {
  const int groups = K / group;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int r = 0; r < rows; r++) {
    const uint8_t* row = u + (size_t)r * (K / 2);
    for (int g = 0; g < groups; g++) {
      const size_t at = (size_t)r * groups + g;
      const __m256 s = _mm256_set1_ps(scale[at]), o = _mm256_set1_ps(group_offset(offset, codes, scale, at));
      if (bf16 && group % 32 == 0) {
        __m256i low, high;
        bf16_tables(s, o, &low, &high);
        for (int k = g * group; k < (g + 1) * group; k += 32) bf16_by_table(row + k / 2, low, high, (uint16_t*)out + (size_t)r * K + k);
        continue;
      }
      for (int k = g * group; k < (g + 1) * group; k += 16) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(row + k / 2)));
        const __m256 even = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
        const __m256 odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
        const __m256 low = _mm256_unpacklo_ps(even, odd), high = _mm256_unpackhi_ps(even, odd); /* (per 128-bit lane) */
        const __m256 first = _mm256_permute2f128_ps(low, high, 0x20), second = _mm256_permute2f128_ps(low, high, 0x31);
        store16(_mm256_fmadd_ps(first, s, o), _mm256_fmadd_ps(second, s, o), bf16, out, (size_t)r * K + k);
      }
    }
  }
}

/* Rows [0, rows) of an int8 weight of K columns (K % 16 == 0), one scale per row. */
void qb_int8_dequantize(int threads, int rows, int K, const int8_t* q, const float* scale, int bf16, void* out) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int r = 0; r < rows; r++) {
    const __m256 s = _mm256_set1_ps(scale[r]);
    const int8_t* row = q + (size_t)r * K;
    for (int k = 0; k < K; k += 16) {
      const __m128i bytes = _mm_loadu_si128((const __m128i*)(row + k));
      const __m256 first = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
      const __m256 second = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
      store16(_mm256_mul_ps(first, s), _mm256_mul_ps(second, s), bf16, out, (size_t)r * K + k);
    }
  }
}
