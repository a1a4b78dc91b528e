/* A KV cache's rows as int8 for attention (qbackend/llm/kv_int8.py): each row of D floats becomes
 * q = round_half_even(x / s), s = max|x| / 127 (s = 1 for a row of zeros), so |q| <= 127 and
 * q * s is within s / 2 of x. A row with a NaN or an infinity gets s = NaN: its dequantized
 * values are NaN, as attention over the float row would make its output. D % 8 == 0. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* Rows ``first`` .. ``last`` - 1 of ``blocks`` blocks (a cache's batch x heads), ``block``
 * elements apart in x / q and ``scale_block`` apart in the scales; rows D apart (contiguous). */
void qb_quantize_kv_rows(int blocks, long block, long scale_block, int first, int last, int D, const float* x, int8_t* q,
                         float* scales) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int b = 0; b < blocks; b++)
    for (int r = first; r < last; r++) {
      const float* row = x + b * block + (long)r * D;
      int8_t* out = q + b * block + (long)r * D;
      __m256 m = _mm256_setzero_ps();
      for (int d = 0; d < D; d += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(row + d)));
      float lanes[8], top = 0.0f;
      _mm256_storeu_ps(lanes, m);
      int finite = 1;
      for (int d = 0; d < D; d++) finite &= isfinite(row[d]);
      for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
      const float s = !finite ? NAN : top > 0.0f ? top / 127.0f : 1.0f;
      scales[b * scale_block + r] = s;
      const __m256 divisor = _mm256_set1_ps(finite ? s : 1.0f);
      for (int d = 0; d < D; d += 8) {
        const __m256i ints = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(row + d), divisor)); /* (nearest, ties even) */
        const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1));
        _mm_storel_epi64((__m128i*)(out + d), _mm_packs_epi16(words, words));
      }
    }
}
