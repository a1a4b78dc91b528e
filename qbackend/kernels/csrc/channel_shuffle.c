/* ShuffleNet's channel shuffle of two halves in one pass: what
 * cat([a, b], 1).view(N, 2, C / 2, H, W).transpose(1, 2).contiguous() holds, written as the
 * channels-last [N, C, H, W] tensor out[p][2k + g] = (g == 0 ? a : b)[p][k], k < half.
 *
 * Why: ATen runs it as a cat, a copy into the 5-D view (a channels-last tensor has no such
 * view) and the transposed copy, 210-330 us per ShuffleNetV2 block at batch 1 on the AVX2
 * EPYC; this reads each input once and writes the output once. Pure data movement: the
 * reference's values bit for bit.
 *
 * a / b: pixel rows of ``half`` contiguous channels, ``a_stride`` / ``b_stride`` elements apart
 * (a channel slice of a wider channels-last tensor too): float32, or uint8 read as the
 * reference's dequantize gives them ((q - zero point) * scale: the uint8 cat that starts a
 * ShuffleNetV2 stage, dequantized for the shuffle). The output: the whole shuffle, or its two
 * halves (ShuffleNetV2's next block splits it: ``first`` gets channels [0, half / 2) of a and b
 * interleaved, ``second`` the rest); the whole or the second half float32 or, quantized as
 * quantize_per_tensor gives it (round half to even of x * inv_scale, plus the zero point,
 * clamped; a NaN as qmin), uint8: the next block's branch reads it quantized, which spares a
 * float tensor's write and read.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "call_structs.h"
#include "vec_math.h"

/* 8 channels from k of a pixel row, as float32. */
static inline __attribute__((always_inline)) __m256 load8(const shuffle_call_t* c, const void* row, int k, int in_u8) {
  if (!in_u8) return _mm256_loadu_ps((const float*)row + k);
  const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)((const uint8_t*)row + k)));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(c->in_zp))), _mm256_set1_ps(c->in_scale));
}

static inline __attribute__((always_inline)) float load1(const shuffle_call_t* c, const void* row, int k, int in_u8) {
  return in_u8 ? (float)(((const uint8_t*)row)[k] - c->in_zp) * c->in_scale : ((const float*)row)[k];
}

static inline __attribute__((always_inline)) void store8(const shuffle_call_t* c, __m256 v, void* out, long j, int out_u8) {
  if (out_u8)
    store_quantized8(_mm256_mul_ps(v, _mm256_set1_ps(c->inv_scale)), _mm256_set1_ps((float)c->zero_point),
                     _mm256_set1_ps((float)c->qmin), _mm256_set1_ps((float)c->qmax), (uint8_t*)out + j);
  else
    _mm256_storeu_ps((float*)out + j, v);
}

static inline __attribute__((always_inline)) void store1(const shuffle_call_t* c, float v, void* out, long j, int out_u8) {
  if (out_u8)
    ((uint8_t*)out)[j] = round_to_grid(v * c->inv_scale, c->zero_point, c->qmin, c->qmax);
  else
    ((float*)out)[j] = v;
}

/* Channels [from, to) of a pixel's rows of a and b, interleaved into out (2 (to - from) values). */
static inline __attribute__((always_inline)) void interleave(const shuffle_call_t* c, const void* ra, const void* rb, int from,
                                                             int to, void* out, int in_u8, int out_u8) {
  int k = from;
  for (; k + 8 <= to; k += 8) {
    const __m256 va = load8(c, ra, k, in_u8), vb = load8(c, rb, k, in_u8);
    const __m256 low = _mm256_unpacklo_ps(va, vb);  /* a0 b0 a1 b1 | a4 b4 a5 b5 */
    const __m256 high = _mm256_unpackhi_ps(va, vb); /* a2 b2 a3 b3 | a6 b6 a7 b7 */
    store8(c, _mm256_permute2f128_ps(low, high, 0x20), out, 2 * (k - from), out_u8);
    store8(c, _mm256_permute2f128_ps(low, high, 0x31), out, 2 * (k - from) + 8, out_u8);
  }
  for (; k < to; k++) {
    store1(c, load1(c, ra, k, in_u8), out, 2 * (k - from), out_u8);
    store1(c, load1(c, rb, k, in_u8), out, 2 * (k - from) + 1, out_u8);
  }
}

/* qb_shuffle_call with the element types constant (each combination its own loop). */
static inline __attribute__((always_inline)) void shuffle(int threads, const shuffle_call_t* c, const void* a, const void* b,
                                                          void* first, void* second, int in_u8, int out_u8) {
  const int quarter = c->half / 2, rest = c->half - quarter, in_size = in_u8 ? 1 : 4, out_size = out_u8 ? 1 : 4;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long p = 0; p < c->pixels; p++) {
    const char *ra = (const char*)a + p * c->a_stride * in_size, *rb = (const char*)b + p * c->b_stride * in_size;
    if (!c->halves) {
      interleave(c, ra, rb, 0, c->half, (char*)first + p * 2 * c->half * out_size, in_u8, out_u8);
    } else {
      interleave(c, ra, rb, 0, quarter, (float*)first + p * 2 * quarter, in_u8, 0);
      interleave(c, ra, rb, quarter, c->half, (char*)second + p * 2 * rest * out_size, in_u8, out_u8);
    }
  }
}

/* The shuffle as ``c`` says (its only entry, a kernel chain step too): ``first`` the whole
 * shuffle, or its first half and ``second`` its second. */
int qb_shuffle_call(int threads, const shuffle_call_t* c, const void* a, const void* b, void* first, void* second) {
  if (c->in_u8)
    c->out_u8 ? shuffle(threads, c, a, b, first, second, 1, 1) : shuffle(threads, c, a, b, first, second, 1, 0);
  else
    c->out_u8 ? shuffle(threads, c, a, b, first, second, 0, 1) : shuffle(threads, c, a, b, first, second, 0, 0);
  return 0;
}
