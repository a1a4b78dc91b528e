/* Quantize the n floats of a dense float32 tensor (any dim order: the bytes keep it) to uint8
 * or int8: every activation quantize that is not a conv input's (quantize_nhwc.c).
 *
 * Why not ATen's quantize_per_tensor: it maps a NaN to qmax, where the reference
 * (quantized_decomposed: clamp, which keeps the NaN, then the integer conversion) stores 0;
 * and it costs a quantized tensor per call. Here: the reference's arithmetic
 * (round_half_even(x * inv_scale) + zero_point, clamped), a NaN stored as ``nan_byte`` (0 as
 * the reference; 128 where an int8 quantize runs as uint8 + 128: lowering/signed_int8.py).
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "call_structs.h"
#include "vec_math.h"

#define CHUNK 16384 /* values per parallel task */

/* n values with AVX2, 32 per step: two packs and one lane permute to 32 ordered bytes. */
static void quantize_run256(const float* x, long n, float inv_scale, int zp, int lo, int hi, int bias, int nan_byte,
                            uint8_t* y) {
  const __m256 vinv = _mm256_set1_ps(inv_scale), vzp = _mm256_set1_ps((float)zp), vlo = _mm256_set1_ps((float)lo),
               vhi = _mm256_set1_ps((float)hi);
  const __m256i nan_value = _mm256_set1_epi32(nan_byte ^ bias), flip = _mm256_set1_epi8((char)bias);
  const int check_nan = (nan_byte ^ bias) != lo;
  long i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i a = quantize8_or_nan(x + i, vinv, vzp, vlo, vhi, nan_value, check_nan);
    const __m256i b = quantize8_or_nan(x + i + 8, vinv, vzp, vlo, vhi, nan_value, check_nan);
    const __m256i c = quantize8_or_nan(x + i + 16, vinv, vzp, vlo, vhi, nan_value, check_nan);
    const __m256i d = quantize8_or_nan(x + i + 24, vinv, vzp, vlo, vhi, nan_value, check_nan);
    /* per 128-bit lane: packs(a, b) = a0-3 b0-3 | a4-7 b4-7; packus of those two -> dwords a0 b0 c0 d0 | a1 b1 c1 d1 */
    const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)(y + i), _mm256_xor_si256(ordered, flip));
  }
  for (; i < n; i++) y[i] = (uint8_t)(grid_value_or_nan(x[i], inv_scale, zp, lo, hi, nan_byte ^ bias) ^ bias);
}

/* quantize_run256 with AVX512, where the CPU has it: 64 values per step (55 vs 62 us at
 * [512, 1536] on an AMX Xeon), then 16 with one saturating narrow. */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void quantize_run512(const float* x, long n, float inv_scale,
                                                                               int zp, int lo, int hi, int bias,
                                                                               int nan_byte, uint8_t* y) {
  const __m512 vinv = _mm512_set1_ps(inv_scale), vzp = _mm512_set1_ps((float)zp), vlo = _mm512_set1_ps((float)lo),
               vhi = _mm512_set1_ps((float)hi);
  const __m512i nan_value = _mm512_set1_epi32(nan_byte ^ bias);
  const __m128i flip = _mm_set1_epi8((char)bias);
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i flip64 = _mm512_set1_epi8((char)bias);
  long i = 0;
  for (; i + 64 <= n; i += 64) {  /* 64 values: two packs and one lane permute to 64 ordered bytes */
    __m512i ints[4];
    for (int k = 0; k < 4; k++) {
      const __m512 v = _mm512_loadu_ps(x + i + 16 * k);
      const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(v, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      ints[k] = _mm512_mask_mov_epi32(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_add_ps(q, vzp), vlo), vhi)),
                                      _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan_value);
    }
    const __m512i bytes = _mm512_packus_epi16(_mm512_packs_epi32(ints[0], ints[1]), _mm512_packs_epi32(ints[2], ints[3]));
    _mm512_storeu_si512((void*)(y + i), _mm512_xor_si512(_mm512_permutexvar_epi32(order, bytes), flip64));
  }
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(v, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i ints = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_add_ps(q, vzp), vlo), vhi));
    ints = _mm512_mask_mov_epi32(ints, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan_value);
    _mm_storeu_si128((__m128i*)(y + i), _mm_xor_si128(_mm512_cvtusepi32_epi8(ints), flip));
  }
  for (; i < n; i++) y[i] = (uint8_t)(grid_value_or_nan(x[i], inv_scale, zp, lo, hi, nan_byte ^ bias) ^ bias);
}

/* ``is_signed``: y is int8 (computed biased by 128 in [0, 255], then flipped back); ``wide``:
 * the AVX512 step (the caller knows whether the CPU has it and may rule it out). */
void qb_quantize_dense(int threads, long n, const float* x, float inv_scale, int zero_point, int qmin, int qmax,
                       int is_signed, int nan_byte, int wide, uint8_t* y) {
  const int bias = is_signed ? 128 : 0;
  const long chunks = (n + CHUNK - 1) / CHUNK;
  wide = wide && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#pragma omp parallel for num_threads(chunks > 1 ? threads : 1) schedule(static)
  for (long c = 0; c < chunks; c++) {
    const long start = c * CHUNK, count = n - start < CHUNK ? n - start : CHUNK;
    (wide ? quantize_run512 : quantize_run256)(x + start, count, inv_scale, zero_point + bias, qmin + bias, qmax + bias, bias,
                                               nan_byte, y + start);
  }
}

/* qb_quantize_dense as a kernel chain step (X_TO_Y): 0. */
int qb_quantize_dense_call(int threads, const quantize_call_t* c, const float* x, uint8_t* y) {
  qb_quantize_dense(threads, c->n, x, c->inv_scale, c->zp, c->qmin, c->qmax, c->is_signed, c->nan_byte, c->wide, y);
  return 0;
}
