/* int8 convolution of inputs with few channels (a network's stem: ResNet's 7x7 stride-2 conv
 * of 3 channels, MobileNet's 3x3 one), AVX512-VNNI: uint8 NHWC activations, per-channel int8
 * weights, an activation (GELU, SiLU, hardswish: vec_math512.h), a clamp and requantization to
 * uint8.
 *
 * Why: oneDNN runs ResNet-18's 7x7 stem at ~280 GMAC/s here, against 420-490 for its 3x3
 * layers. With 3 channels a window row has 21 bytes, not a multiple of the 4 that one dot
 * product step takes: padding each row to 24 bytes wastes 12.5%, and copying every window
 * into a buffer first (im2col) took a quarter of the time (a first version of this kernel:
 * 3.3 ms, as oneDNN).
 *
 * Here the sum reads each window row's first 4 * F bytes (F = KW * C / 4) straight from the
 * input, and only the L = KW * C % 4 bytes left over per row are copied, packed into LQ
 * words of 4 bytes per pixel: K4 = KH * F + LQ steps (37 for ResNet's 147 bytes). Each piece
 * of an output row first copies the input under it (KH rows, in L1) with the zero point
 * where it leaves the image, so no window needs a bounds check. (A padded copy of the whole
 * input, made once per call, cost 0.4 ms of ResNet-18's 3.5 ms at batch 8.)
 * Weights: [Cout / 16][K4][16][4], the K4 steps in that order (lowering/stem.py packs them).
 *
 * GEMM: tiles of up to 6 pixels x 64 outputs (24 zmm sums); vpdpbusd adds 4 uint8 x int8
 * products per output into int32, exact. The epilogue is conv_gemm_int8.c's: acc * mult +
 * add, the activation (a block's pixels in lockstep), clamp, scale, round half to even, clamp
 * to [qmin, qmax].
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "call_structs.h"
#include "vec_math512.h"

#define PIECE 64     /* output pixels of a row per step (their leftover bytes: a small buffer) */
#define MAX_LEFTOVER 64 /* leftover bytes per pixel: KH * L <= 3 * KH */
#define MAX_STRIP 16384 /* bytes of the input under a piece of an output row (qb_stem_strip_bytes) */
#define MAX_POOL_ROWS 8 /* a fused max pool's kernel height, at most */

typedef struct {
  int F, L, LQ, K4;      /* full words per window row, bytes left over per row, words they make, steps */
  size_t row, pixel;     /* bytes between window rows and between pixels in the padded input */
} steps_t;

typedef struct {
  __m512 low, high, inv_scale, zp;
  __m512i qmin, qmax;
  int activation;
} requant_t;

/* 16 outputs after the activation: clamped, requantized, stored. */
static inline void store16(const requant_t r, __m512 f, uint8_t* y) {
  f = _mm512_min_ps(_mm512_max_ps(f, r.low), r.high);
  __m512i q = _mm512_cvtps_epi32(_mm512_fmadd_ps(f, r.inv_scale, r.zp)); /* round half to even, as torch */
  q = _mm512_min_epi32(_mm512_max_epi32(q, r.qmin), r.qmax);
  _mm_storeu_si128((__m128i*)y, _mm512_cvtepi32_epi8(q));
}

/* The sums are named variables, not an array, and each tile shape is a function of its own:
 * otherwise gcc kept copies of the 24 zmm sums in memory, stored on every step. */
#define SUMS(i) __m512i s##i##0 = zero, s##i##1 = zero, s##i##2 = zero, s##i##3 = zero;
#define DOT(i, j) if (BLOCKS > j) s##i##j = _mm512_dpbusd_epi32(s##i##j, xb, w##j);
#define PIXEL_STEP(i, address)                                  \
  if (PIXELS > i) {                                             \
    int32_t four;                                               \
    memcpy(&four, address, 4);                                  \
    const __m512i xb = _mm512_set1_epi32(four);                 \
    DOT(i, 0) DOT(i, 1) DOT(i, 2) DOT(i, 3)                     \
  }
#define STEP(address_of)                                                                                      \
  {                                                                                                           \
    WEIGHTS(0) WEIGHTS(1) WEIGHTS(2) WEIGHTS(3)                                                               \
    PIXEL_STEP(0, address_of(0)) PIXEL_STEP(1, address_of(1)) PIXEL_STEP(2, address_of(2))                    \
    PIXEL_STEP(3, address_of(3)) PIXEL_STEP(4, address_of(4)) PIXEL_STEP(5, address_of(5))                    \
    k++;                                                                                                      \
  }
#define WEIGHTS(j) const __m512i w##j = BLOCKS > j ? _mm512_loadu_si512(w + ((size_t)j * s.K4 + k) * 64) : zero;
#define SAVE(i, j) _mm512_store_si512(sums + 4 * i + j, s##i##j);
#define PIXEL_SAVE(i) SAVE(i, 0) SAVE(i, 1) SAVE(i, 2) SAVE(i, 3)
#define IN_ROW(i) (row + (size_t)i * s.pixel + 4 * q)
#define LEFTOVER(i) (leftover + (size_t)i * s.LQ * 4 + 4 * q)

/* PIXELS consecutive pixels of an output row (pixel 0's window at x, its leftover words at
 * leftover) x BLOCKS blocks of 16 outputs from block b. */
static inline __attribute__((always_inline)) void tile(int PIXELS, int BLOCKS, const stem_call_t* c, const steps_t s,
                                                       const uint8_t* x, const uint8_t* leftover, int b,
                                                       const requant_t* shared, uint8_t* y) {
  const __m512i zero = _mm512_setzero_si512();
  SUMS(0) SUMS(1) SUMS(2) SUMS(3) SUMS(4) SUMS(5)
  const int8_t* w = (const int8_t*)c->w + (size_t)b * s.K4 * 64;
  int k = 0;
  for (int kh = 0; kh < c->KH; kh++) {
    const uint8_t* row = x + kh * s.row;
    for (int q = 0; q < s.F; q++) STEP(IN_ROW)
  }
  for (int q = 0; q < s.LQ; q++) STEP(LEFTOVER)
  /* The epilogue runs from memory: with the sums still in registers, gcc stored them on
   * every step of the loops above (its register pressure). */
  __m512i sums[24] __attribute__((aligned(64)));
  PIXEL_SAVE(0) PIXEL_SAVE(1) PIXEL_SAVE(2) PIXEL_SAVE(3) PIXEL_SAVE(4) PIXEL_SAVE(5)
  const requant_t r = *shared;
  for (int j = 0; j < BLOCKS; j++) {
    const __m512 mult = _mm512_loadu_ps(c->mult + (b + j) * 16), add = _mm512_loadu_ps(c->add + (b + j) * 16);
    __m512 f[6];
    for (int i = 0; i < PIXELS; i++) f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[4 * i + j]), mult, add);
    if (r.activation != CLAMP_ONLY) activate16_lanes(r.activation, f, PIXELS);
    for (int i = 0; i < PIXELS; i++) store16(r, f[i], y + (size_t)i * c->Cout + (b + j) * 16);
  }
}

typedef void (*tile_function)(const stem_call_t*, steps_t, const uint8_t*, const uint8_t*, int, const requant_t*, uint8_t*);
#define TILE_FUNCTION(P, B)                                                                                       \
  static __attribute__((noinline)) void tile_##P##_##B(const stem_call_t* c, const steps_t s, const uint8_t* x,  \
                                                       const uint8_t* leftover, int b, const requant_t* r,        \
                                                       uint8_t* y) {                                              \
    tile(P, B, c, s, x, leftover, b, r, y);                                                                       \
  }
#define TILE_FUNCTIONS(B) \
  TILE_FUNCTION(1, B) TILE_FUNCTION(2, B) TILE_FUNCTION(3, B) TILE_FUNCTION(4, B) TILE_FUNCTION(5, B) TILE_FUNCTION(6, B)
TILE_FUNCTIONS(1)
TILE_FUNCTIONS(2)
TILE_FUNCTIONS(3)
TILE_FUNCTIONS(4)
#define TILE_ROW(B) {tile_1_##B, tile_2_##B, tile_3_##B, tile_4_##B, tile_5_##B, tile_6_##B}
static const tile_function TILES[4][6] = {TILE_ROW(1), TILE_ROW(2), TILE_ROW(3), TILE_ROW(4)};

/* The input under output pixels (n, oh, ow0 ...): KH rows of ``span`` columns from column
 * ow0 * stride_w - pad_w, the zero point where they leave the image, rows ``row`` bytes apart. */
static void copy_strip(const stem_call_t* c, const uint8_t* x, int n, int oh, int ow0, int span, size_t row, uint8_t* strip) {
  const int C = c->C, iw0 = ow0 * c->stride_w - c->pad_w;
  const int lo = iw0 < 0 ? -iw0 : 0, hi = iw0 + span > c->W ? c->W - iw0 : span; /* columns inside: [lo, hi) */
  for (int kh = 0; kh < c->KH; kh++, strip += row) {
    const int ih = oh * c->stride_h - c->pad_h + kh;
    if (ih < 0 || ih >= c->H || hi <= lo) {
      memset(strip, c->x_zp, (size_t)span * C);
      continue;
    }
    memset(strip, c->x_zp, (size_t)lo * C);
    memcpy(strip + (size_t)lo * C, x + (((size_t)n * c->H + ih) * c->W + iw0 + lo) * C, (size_t)(hi - lo) * C);
    memset(strip + (size_t)hi * C, c->x_zp, (size_t)(span - hi) * C);
  }
}

/* One output row (n, oh) of the conv into out (OW x Cout), piece by piece: the input under a
 * piece into ``window``, its rows' leftover bytes into ``leftover``, then the tiles. */
static void stem_row(const stem_call_t* c, const steps_t s, const requant_t* r, const uint8_t* x, int n, int oh,
                     int piece, uint8_t* window, uint8_t* leftover, uint8_t* out) {
  const int blocks = c->Cout / 16;
  for (int ow0 = 0; ow0 < c->OW; ow0 += piece) {
    const int count = c->OW - ow0 < piece ? c->OW - ow0 : piece;
    copy_strip(c, x, n, oh, ow0, (count - 1) * c->stride_w + c->KW, s.row, window);
    if (s.L == 1) /* (3 channels and an odd kernel width: ResNet's and MobileNet's stems) */
      for (int i = 0; i < count; i++) {
        const uint8_t* from = window + i * s.pixel + 4 * s.F;
        uint8_t* to = leftover + (size_t)i * s.LQ * 4;
#pragma GCC unroll 8
        for (int kh = 0; kh < c->KH; kh++) to[kh] = from[kh * s.row];
      }
    else
      for (int kh = 0; kh < c->KH && s.L; kh++) { /* row by row: the loads of a row are near */
        const uint8_t* from = window + kh * s.row + 4 * s.F;
        uint8_t* to = leftover + kh * s.L;
        for (int i = 0; i < count; i++)
          for (int l = 0; l < s.L; l++) to[(size_t)i * s.LQ * 4 + l] = from[i * s.pixel + l];
      }
    uint8_t* at = out + (size_t)ow0 * c->Cout;
    for (int b = 0; b < blocks; b += 4) {
      const tile_function* shapes = TILES[(blocks - b < 4 ? blocks - b : 4) - 1];
      for (int i = 0; i < count; i += 6)
        shapes[(count - i < 6 ? count - i : 6) - 1](c, s, window + i * s.pixel, leftover + (size_t)i * s.LQ * 4, b, r,
                                                     at + (size_t)i * c->Cout);
    }
  }
}

/* Pooled row (n, ph) from the conv rows it covers, kept in ``ring`` (conv row oh in slot
 * oh % pool_kh, which rows ``held`` records), computing the rows not yet there. Padding is
 * skipped (the window clipped to the conv output), as max_pool2d's -inf. */
static void pooled_row(const stem_call_t* c, const steps_t s, const requant_t* r, const uint8_t* x, int n, int ph,
                       int piece, uint8_t* window, uint8_t* leftover, uint8_t* ring, long* held, uint8_t* y) {
  const size_t row_bytes = (size_t)c->OW * c->Cout;
  const int h0 = ph * c->pool_sh - c->pool_ph;
  const int first = h0 < 0 ? 0 : h0, end = h0 + c->pool_kh < c->OH ? h0 + c->pool_kh : c->OH;
  for (int oh = first; oh < end; oh++) {
    const long key = (long)n * c->OH + oh;
    if (held[oh % c->pool_kh] != key) {
      stem_row(c, s, r, x, n, oh, piece, window, leftover, ring + (oh % c->pool_kh) * row_bytes);
      held[oh % c->pool_kh] = key;
    }
  }
  uint8_t* out = y + ((size_t)n * c->PH + ph) * c->PW * c->Cout;
  for (int pw = 0; pw < c->PW; pw++) {
    const int w0 = pw * c->pool_sw - c->pool_pw;
    const int left = w0 < 0 ? 0 : w0, right = w0 + c->pool_kw < c->OW ? w0 + c->pool_kw : c->OW;
    for (int ch = 0; ch < c->Cout; ch += 64) {
      const __mmask64 lanes = c->Cout - ch >= 64 ? ~0ULL : (1ULL << (c->Cout - ch)) - 1;
      __m512i m = _mm512_setzero_si512();
      for (int oh = first; oh < end; oh++) {
        const uint8_t* row = ring + (oh % c->pool_kh) * row_bytes + ch;
        for (int ow = left; ow < right; ow++) m = _mm512_max_epu8(m, _mm512_maskz_loadu_epi8(lanes, row + (size_t)ow * c->Cout));
      }
      _mm512_mask_storeu_epi8(out + (size_t)pw * c->Cout + ch, lanes, m);
    }
  }
}

/* Returns 0, or -1 where a thread's buffer for the pooled rows could not be allocated.
 * Cout % 16 == 0, KH * (KW * C % 4) <= MAX_LEFTOVER and qb_stem_strip_bytes <= MAX_STRIP
 * (qbackend/kernels/stem.py checks). With a pool: each thread computes its range of pooled rows,
 * each conv row it needs once (rows shared by two ranges twice): the conv output, 6.4 MB for
 * ResNet-18 at batch 8, is never written out and read back. */
int qb_stem_conv_vnni_call(int threads, const stem_call_t* c, const uint8_t* x, uint8_t* y) {
  const int run = c->KW * c->C, pieces = (c->OW + PIECE - 1) / PIECE, piece = (c->OW + pieces - 1) / pieces;
  const int span = (piece - 1) * c->stride_w + c->KW;
  steps_t s = {run / 4, run % 4, (c->KH * (run % 4) + 3) / 4, 0, (size_t)span * c->C, (size_t)c->stride_w * c->C};
  s.K4 = c->KH * s.F + s.LQ;
  const requant_t r = {_mm512_set1_ps(c->low), _mm512_set1_ps(c->high), _mm512_set1_ps(c->out_inv_scale),
                       _mm512_set1_ps((float)c->out_zp), _mm512_set1_epi32(c->qmin), _mm512_set1_epi32(c->qmax),
                       c->activation};
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    uint8_t leftover[PIECE * MAX_LEFTOVER] __attribute__((aligned(64))), window[MAX_STRIP] __attribute__((aligned(64)));
    memset(leftover, 0, sizeof leftover); /* the bytes past the leftovers meet zero weights */
    if (c->pool_kh == 0) {
#pragma omp for schedule(static) collapse(2)
      for (int n = 0; n < c->N; n++)
        for (int oh = 0; oh < c->OH; oh++)
          stem_row(c, s, &r, x, n, oh, piece, window, leftover, y + ((size_t)n * c->OH + oh) * c->OW * c->Cout);
    } else {
      uint8_t* ring = malloc((size_t)c->pool_kh * c->OW * c->Cout);
      long held[MAX_POOL_ROWS];
      for (int i = 0; i < MAX_POOL_ROWS; i++) held[i] = -1;
      if (ring == NULL) {
#pragma omp atomic write
        failed = 1;
      }
#pragma omp for schedule(static)
      for (int row = 0; row < c->N * c->PH; row++)
        if (ring != NULL) pooled_row(c, s, &r, x, row / c->PH, row % c->PH, piece, window, leftover, ring, held, y);
      free(ring);
    }
  }
  return failed ? -1 : 0;
}
