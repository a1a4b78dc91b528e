/* bf16 <-> float32 for 8 lanes (AVX2): the conversions of torch's c10::BFloat16, so that a
 * kernel writing bf16 gives the bits torch's ``.to(torch.bfloat16)`` of its float32 result
 * would. Used by the weight dequantize (weight_dequantize.c) and the bf16 SiLU-and-multiply
 * (silu_mul.c). */
#ifndef QB_BF16_H
#define QB_BF16_H
#include <immintrin.h>
#include <stdint.h>

/* 8 floats as bf16, rounded to nearest even (a NaN becomes the quiet NaN 0x7FC0). */
static inline __m128i bf16x8(__m256 f) {
  const __m256i bits = _mm256_castps_si256(f);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}

/* 8 bf16 values as floats (exact). */
static inline __m256 f32x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif
