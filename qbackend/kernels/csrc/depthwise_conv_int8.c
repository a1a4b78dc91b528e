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
#include "padded_channels.h"
#include "vec_math.h"

#define MAX_KERNEL 7
#define MAX_PAIRS ((MAX_KERNEL * MAX_KERNEL + 1) / 2)
#define LANES 16
#define PIXEL_BLOCK 8 /* output pixels of a row per step */

/* weight: [pairs][C/16][2 (lo, hi)][16] int16, pairs = (K * K + 1) / 2; mult, add: [C/16][2][8] float.
 * f = clamp(activation(acc * mult + add), lo, hi); y = f / out_scale + out_zp, rounded and
 * clamped to [qmin, qmax], or yf = f when yf is not NULL. */
static int dwconv(int threads, int N, int H, int W, int C, int K, int stride_h, int stride_w, int pad_h, int pad_w, int OH, int OW,
                  const uint8_t* x, int x_zp, const int16_t* weight, const float* mult, const float* add, int activation,
                  float lo, float hi, float out_inv_scale, int out_zp, int qmin, int qmax, uint8_t* y, float* yf) {
  const int groups = C / LANES, pairs = (K * K + 1) / 2;
  uint8_t* zero_row = malloc((size_t)C); /* (not on the stack: C is the caller's, up to 2^31) */
  if (!zero_row) return -1;
  memset(zero_row, x_zp, (size_t)C);
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
        for (int g = 0; g < groups; g++) /* (a group's weights, 64 bytes a tap pair, stay in L1 over the block) */
        for (int b = 0; b < block; b++) {
          const size_t pixel = ((size_t)n * OH + oh) * OW + ow0 + b;
          __m256i acc_lo = _mm256_setzero_si256(), acc_hi = _mm256_setzero_si256();
          for (int p = 0; p < pairs; p++) {
            const __m256i even = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(taps[b][2 * p] + g * LANES)));
            const __m256i odd = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(taps[b][2 * p + 1] + g * LANES)));
            const __m256i* w = (const __m256i*)(weight + ((size_t)p * groups + g) * 2 * LANES);
            acc_lo = _mm256_add_epi32(acc_lo, _mm256_madd_epi16(_mm256_unpacklo_epi16(even, odd), _mm256_loadu_si256(w)));
            acc_hi = _mm256_add_epi32(acc_hi, _mm256_madd_epi16(_mm256_unpackhi_epi16(even, odd), _mm256_loadu_si256(w + 1)));
          }
          const float* m = mult + (size_t)g * LANES;
          const float* c = add + (size_t)g * LANES;
          __m256 f[2] = {_mm256_fmadd_ps(_mm256_cvtepi32_ps(acc_lo), _mm256_loadu_ps(m), _mm256_loadu_ps(c)),
                         _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc_hi), _mm256_loadu_ps(m + 8), _mm256_loadu_ps(c + 8))};
          if (activation != CLAMP_ONLY) activate_lanes(activation, f, 2); /* (a group's two vectors in lockstep) */
          __m256 f_lo = f[0], f_hi = f[1];
          /* (max_ps / min_ps return their second operand for a NaN: this order keeps one, as the reference's clamp) */
          f_lo = _mm256_min_ps(vhi, _mm256_max_ps(vlo, f_lo));
          f_hi = _mm256_min_ps(vhi, _mm256_max_ps(vlo, f_hi));
          if (yf) { /* lo holds channels 0-3 and 8-11, hi 4-7 and 12-15 */
            float* out = yf + pixel * C + g * LANES;
            _mm256_storeu_ps(out, _mm256_permute2f128_ps(f_lo, f_hi, 0x20));
            _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(f_lo, f_hi, 0x31));
            continue;
          }
          /* clamped as floats first (a NaN lands on qmin, an infinity on the range's end, as the
           * reference's quantize stores them); round half to even, as torch's quantize does */
          f_lo = _mm256_min_ps(_mm256_max_ps(_mm256_fmadd_ps(f_lo, vinv, vzp), vqlow), vqhigh);
          f_hi = _mm256_min_ps(_mm256_max_ps(_mm256_fmadd_ps(f_hi, vinv, vzp), vqlow), vqhigh);
          const __m256i q16 = _mm256_packs_epi32(_mm256_cvtps_epi32(f_lo), _mm256_cvtps_epi32(f_hi));
          const __m128i q8 = _mm_packus_epi16(_mm256_castsi256_si128(q16), _mm256_extracti128_si256(q16, 1));
          _mm_storeu_si128((__m128i*)(y + pixel * C + g * LANES), _mm_min_epu8(_mm_max_epu8(q8, vqmin), vqmax));
        }
      }
    }
  free(zero_row);
  return 0;
}

static int run(int threads, const void* call, const uint8_t* x, void* y) {
  const dwconv_call_t* c = call;
  return dwconv(threads, c->N, c->H, c->W, c->C, c->window, c->stride_h, c->stride_w, c->pad_h, c->pad_w, c->OH, c->OW, x, c->x_zp,
                   c->weight, c->mult, c->add, c->activation, c->lo, c->hi, c->out_inv_scale, c->out_zp, c->qmin, c->qmax,
                   c->float_out ? NULL : y, c->float_out ? y : NULL);
}

/* Returns 0, or -1 when a scratch buffer could not be allocated (as the VNNI kernel). Channels
 * that are not whole groups of 16 run on padded copies (padded_channels.h). */
int qb_dwconv_call(int threads, const dwconv_call_t* c, const uint8_t* x, void* y) {
  if (c->C % LANES == 0) return run(threads, c, x, y);
  dwconv_call_t padded = *c;
  padded.C = padded_channels(c->C, LANES);
  return run_padded(run, threads, &padded, (size_t)c->N * c->H * c->W, (size_t)c->N * c->OH * c->OW, c->C, padded.C, x, y,
                    c->float_out ? sizeof(float) : 1);
}
