/* Depthwise 3x3, 5x5 and 7x7 int8 convolution (uint8 NHWC activations, per-channel int8 weights), with
 * bias, a post-op (GELU, SiLU or hardswish, then a clamp: none / relu / relu6 / hardtanh) and
 * requantization to uint8, or a float32 output (EfficientNet's and MobileNetV3's
 * squeeze-excitation blocks multiply it in float), for AVX2.
 *
 * Why: torch 2.13's onednn::qconv_pointwise spends ~50 us per call before computing and runs
 * depthwise convs at 3-11 GMAC/s here (MobileNetV2: 2 ms of its 8 ms). This kernel works on
 * 16 channels at a time: the activations of two kernel rows at one column are interleaved as
 * int16 pairs, once per input column of a row block (row_group), and multiplied with the
 * matching weight pairs by vpmaddwd into int32 sums for every output pixel that covers them.
 * Pairing taps within each output pixel's window (until 11-30) widened and interleaved every
 * tap again for each of the K x K / stride^2 pixels sharing it: one Zen 3 thread, batch 8, us:
 * 16 ch 112x112 3x3 1946 -> 1178; 384 ch 14x14 7x7 1600 -> 1085; 72 ch 56x56 3x3 1947 ->
 * 1685; 120 ch 28x28 5x5 float out 1356 -> 1344 (batch 1: 182 -> 152).
 *
 * Padding taps read the zero point, so every output pixel sums all K x K taps and the zero
 * point is removed once per channel: acc - x_zp * sum(w), folded into ``add``.
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
#include "depthwise_kinds.h"
#include "vec_math.h"

#define MAX_KERNEL 7
#define MAX_ROW_PAIRS ((MAX_KERNEL + 1) / 2)
#define LANES 16
#define COLUMN_BLOCK 16 /* output pixels of a row whose input columns are widened once */
#define MAX_SPAN ((COLUMN_BLOCK - 1) * 2 + MAX_KERNEL) /* input columns of a block (stride <= 2) */
#define PIXELS 4 /* output pixels summed at once (8 sums in registers) */

/* One call's parameters and its epilogue's constants. */
typedef struct {
  int H, W, C, OH, OW, stride_h, stride_w, pad_h, pad_w, groups;
  const uint8_t* x;
  const uint8_t* x_end;
  const int16_t* weight;
  const float* mult;
  const float* add;
  uint8_t* y;
  float* yf;
  __m256i x_zp;
  __m256 lo, hi, inv, zp, qlow, qhigh; /* (qlow / qhigh: [qmin, qmax] and [lo, hi] mapped to the output's levels) */
  __m128i qmin, qmax;
} dw_t;

/* 16 activations of a pixel as int16: a load, or for a last group of ``tail`` channels (C % 16)
 * that would read past the end of x, a copy of the tail's bytes (loads elsewhere read the next
 * pixel's channels, which meet zero weights). */
static inline __m256i pixel_lanes(const uint8_t* p, int tail, const uint8_t* x_end) {
  if (tail && (uintptr_t)p + LANES > (uintptr_t)x_end) {
    uint8_t staged[LANES] = {0};
    memcpy(staged, p, (size_t)tail);
    return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)staged));
  }
  return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
}

/* The epilogue of one pixel's 16 channels (the first ``tail`` when tail > 0) at element ``at``
 * of y / yf, from its activated floats ``f``: clamp -> uint8 or float32, as ``kind`` says. */
static inline __attribute__((always_inline)) void finish(const dw_t* d, const __m256* f, int tail, size_t at, const int kind) {
  if (kind & FLOAT_OUT) { /* lo holds channels 0-3 and 8-11, hi 4-7 and 12-15 */
    /* (max_ps / min_ps return their second operand for a NaN: this order keeps one, as the reference's clamp) */
    const __m256 f_lo = _mm256_min_ps(d->hi, _mm256_max_ps(d->lo, f[0])), f_hi = _mm256_min_ps(d->hi, _mm256_max_ps(d->lo, f[1]));
    const __m256 first = _mm256_permute2f128_ps(f_lo, f_hi, 0x20), second = _mm256_permute2f128_ps(f_lo, f_hi, 0x31);
    float* out = d->yf + at;
    if (!tail) {
      _mm256_storeu_ps(out, first);
      _mm256_storeu_ps(out + 8, second);
    } else { /* (the next pixel's channels follow: only the tail's are written) */
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      _mm256_maskstore_ps(out, _mm256_cmpgt_epi32(_mm256_set1_epi32(tail), lane), first);
      _mm256_maskstore_ps(out + 8, _mm256_cmpgt_epi32(_mm256_set1_epi32(tail - 8), lane), second);
    }
    return;
  }
  /* The clamp to [lo, hi] after the requantizing map (monotone: the same bytes, as the VNNI
   * kernel's). A NaN stays one (max_ps / min_ps return their second operand), converts to
   * INT_MIN and lands on qmin, as the reference's quantize stores it; round half to even. */
  __m256 q_lo = _mm256_fmadd_ps(f[0], d->inv, d->zp), q_hi = _mm256_fmadd_ps(f[1], d->inv, d->zp);
  if (!(kind & PACKS_CLAMP)) q_lo = _mm256_max_ps(d->qlow, q_lo), q_hi = _mm256_max_ps(d->qlow, q_hi);
  q_lo = _mm256_min_ps(d->qhigh, q_lo), q_hi = _mm256_min_ps(d->qhigh, q_hi);
  const __m256i q16 = _mm256_packs_epi32(_mm256_cvtps_epi32(q_lo), _mm256_cvtps_epi32(q_hi));
  __m128i q8 = _mm_packus_epi16(_mm256_castsi256_si128(q16), _mm256_extracti128_si256(q16, 1));
  if (!(kind & PACKS_CLAMP)) q8 = _mm_min_epu8(_mm_max_epu8(q8, d->qmin), d->qmax);
  uint8_t* out = d->y + at;
  if (!tail) {
    _mm_storeu_si128((__m128i*)out, q8);
  } else { /* the tail's bytes in 8 / 4 / 2 / 1-byte pieces (no library call a pixel) */
    __m128i rest = q8;
    if (tail & 8) {
      _mm_storel_epi64((__m128i*)out, rest);
      out += 8, rest = _mm_srli_si128(rest, 8);
    }
    const uint32_t low = (uint32_t)_mm_cvtsi128_si32(rest);
    if (tail & 4) memcpy(out, &low, 4), out += 4;
    const uint32_t next = tail & 4 ? (uint32_t)_mm_extract_epi32(rest, 1) : low;
    if (tail & 2) memcpy(out, &next, 2), out += 2;
    if (tail & 1) *out = (uint8_t)(tail & 2 ? next >> 16 : next);
  }
}

/* ``count`` (PIXELS or 1, a constant where inlined) output pixels of a block, from its pixel
 * ``b0``: their sums over the window's (row pair, column) taps in ``pairs`` (row_group), then
 * their epilogues; ``at``: the block's first pixel's element of channel group ``g`` in y. */
static inline __attribute__((always_inline)) void block_pixels(const dw_t* d, const int K, const int count,
                                                               __m256i pairs[MAX_ROW_PAIRS][MAX_SPAN][2], int g, int tail, int b0,
                                                               const __m256* m, const __m256* c, size_t at, const int kind) {
  const int R = (K + 1) / 2, S = d->stride_w;
  __m256i acc[PIXELS][2];
  for (int i = 0; i < count; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 1 /* (unrolled taps kept more values live than registers: the sums spilled) */
  for (int rp = 0; rp < R; rp++)
#pragma GCC unroll 1
    for (int col = 0; col < K; col++) {
      const __m256i* w = (const __m256i*)(d->weight + ((size_t)(rp * K + col) * d->groups + g) * 2 * LANES);
      const __m256i w_lo = _mm256_loadu_si256(w), w_hi = _mm256_loadu_si256(w + 1);
      for (int i = 0; i < count; i++) {
        const __m256i* v = pairs[rp][(b0 + i) * S + col];
        acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(v[0], w_lo));
        acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(v[1], w_hi));
      }
    }
  /* sums -> float -> activation, two pixels' vectors in lockstep where there are two: four
   * independent exp chains (Zen 1 SiLU: 22 instead of 28 cycles a vector) */
  for (int i = 0; i < count; i += 2) {
    const int both = i + 1 < count;
    __m256 f[4];
    for (int j = 0; j < 2 + 2 * both; j++) f[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i + j / 2][j % 2]), m[j % 2], c[j % 2]);
    if (both) activate_lanes(kind % FLOAT_OUT, f, 4);
    else activate_lanes(kind % FLOAT_OUT, f, 2);
    for (int j = 0; j <= both; j++) finish(d, f + 2 * j, tail, at + (size_t)(b0 + i + j) * d->C, kind);
  }
}

/* Output row ``oh`` of image ``n``, channel group ``g`` (``tail`` channels of it, 0: all 16), for
 * a K x K window (a constant where it is inlined). Kernel rows are taken in pairs (2 rp,
 * 2 rp + 1; an odd K's last row with a zero-weight partner): for each input column of a block
 * of output pixels, the pair's two pixels are widened and interleaved once, and every output
 * pixel whose window covers the column multiplies them by its column's weight pair
 * (vpmaddwd), PIXELS pixels at a time. Out-of-image rows and columns read the zero point. */
static inline __attribute__((always_inline)) void row_group(const dw_t* d, const int K, int n, int oh, int g, int tail,
                                                            const int kind) {
  const int R = (K + 1) / 2, S = d->stride_w;
  __m256i pairs[MAX_ROW_PAIRS][MAX_SPAN][2]; /* [row pair][input column of the block][lo, hi] */
  const uint8_t* rows[2 * MAX_ROW_PAIRS];
  for (int r = 0; r < 2 * R; r++) {
    const int ih = oh * d->stride_h - d->pad_h + r;
    rows[r] = r < K && ih >= 0 && ih < d->H ? d->x + ((size_t)n * d->H + ih) * d->W * d->C + (size_t)g * LANES : NULL;
  }
  const __m256 m[2] = {_mm256_loadu_ps(d->mult + (size_t)g * LANES), _mm256_loadu_ps(d->mult + (size_t)g * LANES + 8)};
  const __m256 c[2] = {_mm256_loadu_ps(d->add + (size_t)g * LANES), _mm256_loadu_ps(d->add + (size_t)g * LANES + 8)};
  const size_t row_start = ((size_t)n * d->OH + oh) * d->OW;
  for (int ow0 = 0; ow0 < d->OW; ow0 += COLUMN_BLOCK) {
    const int block = d->OW - ow0 < COLUMN_BLOCK ? d->OW - ow0 : COLUMN_BLOCK;
    const int span = (block - 1) * S + K, first_column = ow0 * S - d->pad_w;
    for (int j = 0; j < span; j++) {
      const int iw = first_column + j;
      const int inside = iw >= 0 && iw < d->W;
      for (int rp = 0; rp < R; rp++) {
        const uint8_t *top = rows[2 * rp], *bottom = rows[2 * rp + 1];
        const __m256i a = inside && top ? pixel_lanes(top + (size_t)iw * d->C, tail, d->x_end) : d->x_zp;
        const __m256i b = inside && bottom ? pixel_lanes(bottom + (size_t)iw * d->C, tail, d->x_end) : d->x_zp;
        pairs[rp][j][0] = _mm256_unpacklo_epi16(a, b);
        pairs[rp][j][1] = _mm256_unpackhi_epi16(a, b);
      }
    }
    const size_t at = (row_start + ow0) * d->C + (size_t)g * LANES;
    int b0 = 0;
    for (; b0 + PIXELS <= block; b0 += PIXELS) block_pixels(d, K, PIXELS, pairs, g, tail, b0, m, c, at, kind);
    for (; b0 < block; b0++) block_pixels(d, K, 1, pairs, g, tail, b0, m, c, at, kind);
  }
}

/* Every channel group of one output row: whole groups with tail 0 (their loads and stores
 * compile without the tail's checks), then a last partial one. */
static inline __attribute__((always_inline)) void output_row(const dw_t* call, const int K, int n, int oh, const int kind) {
  /* (a local copy: the uint8 stores could alias the caller's struct, so its fields were loaded
   * again after every pixel's store) */
  const dw_t copy = *call, *d = &copy;
  const int full = d->C / LANES, tail = d->C % LANES;
  for (int g = 0; g < full; g++) row_group(d, K, n, oh, g, 0, kind);
  if (tail) row_group(d, K, n, oh, full, tail, kind);
}

/* output_row compiled for each window and epilogue kind */
typedef void (*row_fn)(const dw_t*, int, int);
#define ROW(K, KIND) \
  static void row_##K##_##KIND(const dw_t* d, int n, int oh) { output_row(d, K, n, oh, KIND); }
#define ROW3(KIND) ROW(3, KIND)
#define ROW5(KIND) ROW(5, KIND)
#define ROW7(KIND) ROW(7, KIND)
EPILOGUE_KINDS(ROW3)
EPILOGUE_KINDS(ROW5)
EPILOGUE_KINDS(ROW7)
#define ENTRY3(KIND) [KIND] = row_3_##KIND,
#define ENTRY5(KIND) [KIND] = row_5_##KIND,
#define ENTRY7(KIND) [KIND] = row_7_##KIND,
static const row_fn ROW_TABLE[3][PACKS_CLAMP + 1] = {{EPILOGUE_KINDS(ENTRY3)}, {EPILOGUE_KINDS(ENTRY5)}, {EPILOGUE_KINDS(ENTRY7)}};

/* weight: [R K][G][2 (lo, hi)][16] int16 pairs (kernel rows 2 rp and 2 rp + 1 at one column;
 * R = (K + 1) / 2, a last zero row for an odd K), G = ceil(C / 16) (channels past C zero);
 * mult, add: [G][2][8] float. f = clamp(activation(acc * mult + add), lo, hi);
 * y = f / out_scale + out_zp, rounded and clamped to [qmin, qmax], or yf = f when yf is not NULL.
 * Pixels are C channels apart in x and y: a last partial group runs in place; padded copies of
 * the whole tensors had cost such layers 15-50% (Zen 3, batch 8, best of 4 alternated processes:
 * 72 channels at 56x56 1573 -> 1023 us, 120 at 28x28 5x5 1125 -> 972). */
static int dwconv(int threads, int N, int H, int W, int C, int K, int stride_h, int stride_w, int pad_h, int pad_w, int OH, int OW,
                  const uint8_t* x, int x_zp, const int16_t* weight, const float* mult, const float* add, int activation,
                  float lo, float hi, float out_inv_scale, int out_zp, int qmin, int qmax, uint8_t* y, float* yf) {
  /* (the caller checks both; the row buffer holds the columns of strides up to 2) */
  const int kind = epilogue_kind(activation, yf != NULL, lo, out_inv_scale, out_zp, qmin, qmax);
  if ((K != 3 && K != 5 && K != 7) || stride_w < 1 || stride_w > 2 || kind < 0) return -1;
  const __m256 vinv = _mm256_set1_ps(out_inv_scale), vzp = _mm256_set1_ps((float)out_zp);
  const dw_t d = {
      H, W, C, OH, OW, stride_h, stride_w, pad_h, pad_w, (C + LANES - 1) / LANES, x, x + (size_t)N * H * W * C, weight,
      mult, add, y, yf, _mm256_set1_epi16((short)x_zp), _mm256_set1_ps(lo), _mm256_set1_ps(hi), vinv, vzp,
      _mm256_max_ps(_mm256_set1_ps((float)qmin), _mm256_fmadd_ps(_mm256_set1_ps(lo), vinv, vzp)),
      _mm256_min_ps(_mm256_set1_ps((float)qmax), _mm256_fmadd_ps(_mm256_set1_ps(hi), vinv, vzp)),
      _mm_set1_epi8((char)qmin), _mm_set1_epi8((char)qmax)};
  const row_fn row = ROW_TABLE[K / 2 - 1][kind];
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
  for (int n = 0; n < N; n++)
    for (int oh = 0; oh < OH; oh++) row(&d, n, oh);
  return 0;
}

/* Returns 0, or -1 for a window or stride the kernel does not take (the VNNI kernel: -1 when a
 * scratch buffer could not be allocated). */
int qb_dwconv_call(int threads, const dwconv_call_t* c, const uint8_t* x, void* y) {
  return dwconv(threads, c->N, c->H, c->W, c->C, c->window, c->stride_h, c->stride_w, c->pad_h, c->pad_w, c->OH, c->OW, x, c->x_zp,
                c->weight, c->mult, c->add, c->activation, c->lo, c->hi, c->out_inv_scale, c->out_zp, c->qmin, c->qmax,
                c->float_out ? NULL : y, c->float_out ? y : NULL);
}
