/* Depthwise 3x3, 5x5 and 7x7 int8 convolution (uint8 NHWC activations, per-channel int8 weights), with
 * bias, a post-op (GELU, SiLU or hardswish, then a clamp: none / relu / relu6 / hardtanh) and
 * requantization to uint8, or a float32 output (EfficientNet's and MobileNetV3's
 * squeeze-excitation blocks multiply it in float), for AVX2.
 *
 * Why: torch 2.13's onednn::qconv_pointwise spends ~50 us per call before computing and runs
 * depthwise convs at 3-11 GMAC/s here (MobileNetV2: 2 ms of its 8 ms). This kernel works on
 * 16 channels at a time: two taps' activations are interleaved as int16 pairs and multiplied
 * with the matching weight pairs by vpmaddwd into int32 sums.
 *
 * Padding taps read a row of zero-point bytes, so every output pixel sums all 9 taps and the
 * zero point is removed once per channel: acc - x_zp * sum(w), folded into ``add``.
 * Lane order: vpunpck{l,h}wd work within 128-bit halves, so the "lo" int32 sums hold channels
 * 0-3 and 8-11 of a 16-channel group and "hi" 4-7 and 12-15; weights and per-channel
 * constants are packed in that order and vpackssdw restores the natural order.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "call_structs.h"
#include "vec_math.h"

#define MAX_KERNEL 7
#define MAX_PAIRS ((MAX_KERNEL * MAX_KERNEL + 1) / 2)
#define LANES 16
#define PIXEL_BLOCK 8 /* output pixels of a row per step */

/* 16 activations of a tap: a load, or for a last group of ``tail`` channels (C % 16) that would
 * read past the end of x, a copy of the tail's bytes (loads elsewhere read the next pixel's
 * channels, which meet zero weights). */
static inline __m256i tap_lanes(const uint8_t* p, int tail, const uint8_t* x_end) {
  if (tail && (uintptr_t)p + LANES > (uintptr_t)x_end) {
    uint8_t staged[LANES] = {0};
    memcpy(staged, p, (size_t)tail);
    return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)staged));
  }
  return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
}

/* Channels [16 g, 16 g + 16) of one output pixel (the first ``tail`` of them when tail > 0):
 * taps[] point at the window's pixels, ``groups`` is the packing's channel groups. */
static inline __attribute__((always_inline)) void pixel_group(const uint8_t* const* taps, int g, int tail, int pairs, int groups,
                                                              const uint8_t* x_end, const int16_t* weight, const float* mult,
                                                              const float* add, int activation, __m256 vlo, __m256 vhi,
                                                              __m256 vinv, __m256 vzp, __m256 vqlow, __m256 vqhigh, __m128i vqmin,
                                                              __m128i vqmax, uint8_t* y, float* yf) {
  __m256i acc_lo = _mm256_setzero_si256(), acc_hi = _mm256_setzero_si256();
  for (int p = 0; p < pairs; p++) {
    const __m256i even = tap_lanes(taps[2 * p] + g * LANES, tail, x_end);
    const __m256i odd = tap_lanes(taps[2 * p + 1] + g * LANES, tail, x_end);
    const __m256i* w = (const __m256i*)(weight + ((size_t)p * groups + g) * 2 * LANES);
    acc_lo = _mm256_add_epi32(acc_lo, _mm256_madd_epi16(_mm256_unpacklo_epi16(even, odd), _mm256_loadu_si256(w)));
    acc_hi = _mm256_add_epi32(acc_hi, _mm256_madd_epi16(_mm256_unpackhi_epi16(even, odd), _mm256_loadu_si256(w + 1)));
  }
  const float* m = mult + (size_t)g * LANES;
  const float* c = add + (size_t)g * LANES;
  __m256 f[2] = {_mm256_fmadd_ps(_mm256_cvtepi32_ps(acc_lo), _mm256_loadu_ps(m), _mm256_loadu_ps(c)),
                 _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc_hi), _mm256_loadu_ps(m + 8), _mm256_loadu_ps(c + 8))};
  if (activation != CLAMP_ONLY) activate_lanes(activation, f, 2); /* (a group's two vectors in lockstep) */
  /* (max_ps / min_ps return their second operand for a NaN: this order keeps one, as the reference's clamp) */
  const __m256 f_lo = _mm256_min_ps(vhi, _mm256_max_ps(vlo, f[0]));
  const __m256 f_hi = _mm256_min_ps(vhi, _mm256_max_ps(vlo, f[1]));
  if (yf) { /* lo holds channels 0-3 and 8-11, hi 4-7 and 12-15 */
    const __m256 first = _mm256_permute2f128_ps(f_lo, f_hi, 0x20), second = _mm256_permute2f128_ps(f_lo, f_hi, 0x31);
    if (!tail) {
      _mm256_storeu_ps(yf, first);
      _mm256_storeu_ps(yf + 8, second);
    } else { /* (the next pixel's channels follow: only the tail's are written) */
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      _mm256_maskstore_ps(yf, _mm256_cmpgt_epi32(_mm256_set1_epi32(tail), lane), first);
      _mm256_maskstore_ps(yf + 8, _mm256_cmpgt_epi32(_mm256_set1_epi32(tail - 8), lane), second);
    }
    return;
  }
  /* clamped as floats first (a NaN lands on qmin, an infinity on the range's end, as the
   * reference's quantize stores them); round half to even, as torch's quantize does */
  const __m256 q_lo = _mm256_min_ps(_mm256_max_ps(_mm256_fmadd_ps(f_lo, vinv, vzp), vqlow), vqhigh);
  const __m256 q_hi = _mm256_min_ps(_mm256_max_ps(_mm256_fmadd_ps(f_hi, vinv, vzp), vqlow), vqhigh);
  const __m256i q16 = _mm256_packs_epi32(_mm256_cvtps_epi32(q_lo), _mm256_cvtps_epi32(q_hi));
  const __m128i q8 = _mm_min_epu8(_mm_max_epu8(_mm_packus_epi16(_mm256_castsi256_si128(q16), _mm256_extracti128_si256(q16, 1)),
                                                vqmin), vqmax);
  if (!tail) {
    _mm_storeu_si128((__m128i*)y, q8);
  } else { /* the tail's bytes in 8 / 4 / 2 / 1-byte pieces (no library call a pixel) */
    __m128i rest = q8;
    if (tail & 8) {
      _mm_storel_epi64((__m128i*)y, rest);
      y += 8, rest = _mm_srli_si128(rest, 8);
    }
    const uint32_t low = (uint32_t)_mm_cvtsi128_si32(rest);
    if (tail & 4) memcpy(y, &low, 4), y += 4;
    const uint32_t next = tail & 4 ? (uint32_t)_mm_extract_epi32(rest, 1) : low;
    if (tail & 2) memcpy(y, &next, 2), y += 2;
    if (tail & 1) *y = (uint8_t)(tail & 2 ? next >> 16 : next);
  }
}

/* weight: [pairs][G][2 (lo, hi)][16] int16, pairs = (K * K + 1) / 2, G = ceil(C / 16) (channels
 * past C zero); mult, add: [G][2][8] float. f = clamp(activation(acc * mult + add), lo, hi);
 * y = f / out_scale + out_zp, rounded and clamped to [qmin, qmax], or yf = f when yf is not NULL.
 * Pixels are C channels apart in x and y: a last partial group runs in place (pixel_group);
 * padded copies of the whole tensors had cost such layers 15-50% (Zen 3, batch 8, best of 4
 * alternated processes: 72 channels at 56x56 1573 -> 1023 us, 120 at 28x28 5x5 1125 -> 972). */
static int dwconv(int threads, int N, int H, int W, int C, int K, int stride_h, int stride_w, int pad_h, int pad_w, int OH, int OW,
                  const uint8_t* x, int x_zp, const int16_t* weight, const float* mult, const float* add, int activation,
                  float lo, float hi, float out_inv_scale, int out_zp, int qmin, int qmax, uint8_t* y, float* yf) {
  const int full = C / LANES, tail = C % LANES, groups = full + (tail > 0), pairs = (K * K + 1) / 2;
  const uint8_t* x_end = x + (size_t)N * H * W * C;
  uint8_t* zero_row = malloc((size_t)groups * LANES); /* (not on the stack: C is the caller's, up to 2^31) */
  if (!zero_row) return -1;
  memset(zero_row, x_zp, (size_t)groups * LANES);
  const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi), vinv = _mm256_set1_ps(out_inv_scale);
  const __m256 vzp = _mm256_set1_ps((float)out_zp);
  const __m128i vqmin = _mm_set1_epi8((char)qmin), vqmax = _mm_set1_epi8((char)qmax);
  const __m256 vqlow = _mm256_set1_ps((float)qmin), vqhigh = _mm256_set1_ps((float)qmax);
  /* A window inside the image is its first tap plus these offsets: the per-tap bounds checks had
   * cost small-channel layers half their time (one Zen 3 thread, 16 channels at 112x112: 359 ->
   * 191 us; 32 with SiLU, float out: 747 -> 573; 672 at 14x14 unchanged). */
  ptrdiff_t tap_offsets[MAX_KERNEL * MAX_KERNEL];
  for (int r = 0; r < K; r++)
    for (int col = 0; col < K; col++) tap_offsets[r * K + col] = ((ptrdiff_t)r * W + col) * C;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
  for (int n = 0; n < N; n++)
    for (int oh = 0; oh < OH; oh++) {
      const uint8_t* taps[PIXEL_BLOCK][MAX_PAIRS * 2];
      for (int ow0 = 0; ow0 < OW; ow0 += PIXEL_BLOCK) {
        const int block = OW - ow0 < PIXEL_BLOCK ? OW - ow0 : PIXEL_BLOCK;
        for (int b = 0; b < block; b++) {
          const int ih0 = oh * stride_h - pad_h, iw0 = (ow0 + b) * stride_w - pad_w;
          if (ih0 >= 0 && ih0 + K <= H && iw0 >= 0 && iw0 + K <= W) { /* inside the image: offsets from its first tap */
            const uint8_t* first = x + (((size_t)n * H + ih0) * W + iw0) * C;
            for (int t = 0; t < K * K; t++) taps[b][t] = first + tap_offsets[t];
          } else {
            for (int r = 0; r < K; r++) { /* (rows and columns as loops: t / K and t % K were two divisions a tap) */
              const int ih = ih0 + r;
              const uint8_t* row = x + ((size_t)n * H + ih) * W * C;
              for (int col = 0; col < K; col++) {
                const int iw = iw0 + col;
                taps[b][r * K + col] = (ih < 0 || ih >= H || iw < 0 || iw >= W) ? zero_row : row + (size_t)iw * C;
              }
            }
          }
          taps[b][K * K] = taps[b][K * K - 1];
        }
        const size_t first_pixel = ((size_t)n * OH + oh) * OW + ow0;
        for (int g = 0; g < groups; g++) /* (a group's weights, 64 bytes a tap pair, stay in L1 over the block) */
          for (int b = 0; b < block; b++) {
            const size_t at = (first_pixel + b) * C + (size_t)g * LANES;
            if (g < full)
              pixel_group(taps[b], g, 0, pairs, groups, x_end, weight, mult, add, activation, vlo, vhi, vinv, vzp, vqlow, vqhigh,
                          vqmin, vqmax, yf ? NULL : y + at, yf ? yf + at : NULL);
            else
              pixel_group(taps[b], g, tail, pairs, groups, x_end, weight, mult, add, activation, vlo, vhi, vinv, vzp, vqlow, vqhigh,
                          vqmin, vqmax, yf ? NULL : y + at, yf ? yf + at : NULL);
          }
      }
    }
  free(zero_row);
  return 0;
}

/* Returns 0, or -1 when a scratch buffer could not be allocated (as the VNNI kernel). */
int qb_dwconv_call(int threads, const dwconv_call_t* c, const uint8_t* x, void* y) {
  return dwconv(threads, c->N, c->H, c->W, c->C, c->window, c->stride_h, c->stride_w, c->pad_h, c->pad_w, c->OH, c->OW, x, c->x_zp,
                c->weight, c->mult, c->add, c->activation, c->lo, c->hi, c->out_inv_scale, c->out_zp, c->qmin, c->qmax,
                c->float_out ? NULL : y, c->float_out ? y : NULL);
}
