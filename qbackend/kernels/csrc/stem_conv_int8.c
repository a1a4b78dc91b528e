/* int8 convolution of inputs with few channels (a network's stem), AVX2: the AVX512-VNNI
 * kernel's plan (stem_conv_int8_vnni.c: no im2col, only each window row's leftover values
 * copied, the input under a piece of an output row copied once with the zero point at the
 * image's edges, an optional fused max pool) on int16 pairs.
 *
 * Why int16: without VNNI, the uint8 x int8 step (vpmaddubsw) adds pairs of products in
 * int16 and saturates with 8-bit weights; vpmaddwd multiplies int16 pairs into int32, exact
 * for any int8 weights, at 16 products per instruction against vpmaddubsw's 32 (which needs
 * a second, vpmaddwd, to reach int32 anyway). The activations are widened as the strip under
 * each piece is copied, which the kernel does in any case: no extra pass.
 *
 * A window row of KW * C values gives F = KW * C / 2 pairs read straight from the strip; the
 * L = KW * C % 2 values left over per row are packed into LQ pairs per pixel: K2 = KH * F + LQ
 * steps (14 for MobileNet's 3x3 stem of 3 channels, 74 for ResNet's 7x7).
 * Weights: int16 [Cout / 8][K2][8][2], the steps in that order (lowering/stem.py packs them).
 * Tiles of up to 6 pixels x 16 outputs (12 ymm sums, 2 weights, a broadcast, a product).
 * Epilogue: acc * mult + add, the activation (vec_math.h: MobileNetV3's hardswish,
 * EfficientNet's SiLU), clamp, scale, round half to even, clamp to [qmin, qmax].
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "call_structs.h"
#include "vec_math.h"

#define PIECE 64        /* output pixels of a row per step (as the VNNI kernel: qbackend/kernels/stem.py) */
#define MAX_LEFTOVER 64 /* leftover values per pixel */
#define MAX_STRIP 16384 /* values of the input under a piece of an output row */
#define MAX_POOL_ROWS 8 /* a fused max pool's kernel height, at most */
#define LANES 8         /* outputs per block: one ymm of int32 sums */

typedef struct {
  int F, L, LQ, K2;  /* full pairs per window row, values left over per row, pairs they make, steps */
  size_t row, pixel; /* values between window rows and between pixels in the strip */
} steps_t;

typedef struct {
  __m256 low, high, inv_scale, zp;
  __m256i qmin, qmax;
  int activation;
} requant_t;

/* f (activated, unclamped) of 8 outputs as uint8 at y. */
static inline void store8(const requant_t* r, __m256 f, uint8_t* y) {
  f = _mm256_min_ps(r->high, _mm256_max_ps(r->low, f)); /* (a NaN stays: the reference's clamp) */
  __m256i q = _mm256_cvtps_epi32(_mm256_fmadd_ps(f, r->inv_scale, r->zp)); /* round half to even, as torch */
  q = _mm256_min_epi32(_mm256_max_epi32(q, r->qmin), r->qmax);              /* (within [0, 255]: the packs are exact) */
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  _mm_storel_epi64((__m128i*)y, _mm_packus_epi16(words, words));
}

/* The sums are named variables, one tile shape per function (as the VNNI kernel: an array of
 * sums went through memory). */
#define SUMS(i) __m256i s##i##0 = zero, s##i##1 = zero;
#define DOT(i, j) if (BLOCKS > j) s##i##j = _mm256_add_epi32(s##i##j, _mm256_madd_epi16(xb, w##j));
#define PIXEL_STEP(i, address)                  \
  if (PIXELS > i) {                             \
    int32_t pair;                               \
    memcpy(&pair, address, 4);                  \
    const __m256i xb = _mm256_set1_epi32(pair); \
    DOT(i, 0) DOT(i, 1)                         \
  }
#define STEP(address_of)                                                                                             \
  {                                                                                                                  \
    WEIGHTS(0) WEIGHTS(1)                                                                                            \
    PIXEL_STEP(0, address_of(0)) PIXEL_STEP(1, address_of(1)) PIXEL_STEP(2, address_of(2))                           \
    PIXEL_STEP(3, address_of(3)) PIXEL_STEP(4, address_of(4)) PIXEL_STEP(5, address_of(5))                           \
    k++;                                                                                                             \
  }
#define WEIGHTS(j) \
  const __m256i w##j = BLOCKS > j ? _mm256_loadu_si256((const __m256i*)(w + ((size_t)j * s.K2 + k) * 2 * LANES)) : zero;
#define SAVE(i, j) _mm256_store_si256(sums + 2 * i + j, s##i##j);
#define PIXEL_SAVE(i) SAVE(i, 0) SAVE(i, 1)
#define IN_ROW(i) (row + (size_t)i * s.pixel + 2 * q)
#define LEFTOVER(i) (leftover + (size_t)i * s.LQ * 2 + 2 * q)

/* PIXELS consecutive pixels of an output row (pixel 0's window at x, its leftover pairs at
 * leftover) x BLOCKS blocks of 8 outputs from block b. */
static inline __attribute__((always_inline)) void tile(int PIXELS, int BLOCKS, const stem_call_t* c, const steps_t s,
                                                       const int16_t* x, const int16_t* leftover, int b,
                                                       const requant_t* r, uint8_t* y) {
  const __m256i zero = _mm256_setzero_si256();
  SUMS(0) SUMS(1) SUMS(2) SUMS(3) SUMS(4) SUMS(5)
  const int16_t* w = (const int16_t*)c->w + (size_t)b * s.K2 * 2 * LANES;
  int k = 0;
  for (int kh = 0; kh < c->KH; kh++) {
    const int16_t* row = x + kh * s.row;
    for (int q = 0; q < s.F; q++) STEP(IN_ROW)
  }
  for (int q = 0; q < s.LQ; q++) STEP(LEFTOVER)
  __m256i sums[12] __attribute__((aligned(32)));
  PIXEL_SAVE(0) PIXEL_SAVE(1) PIXEL_SAVE(2) PIXEL_SAVE(3) PIXEL_SAVE(4) PIXEL_SAVE(5)
  __m256 mult[2], add[2];
  for (int j = 0; j < BLOCKS; j++) mult[j] = _mm256_loadu_ps(c->mult + (b + j) * LANES), add[j] = _mm256_loadu_ps(c->add + (b + j) * LANES);
  for (int i = 0; i < PIXELS; i++) {
    __m256 f[2];
    for (int j = 0; j < BLOCKS; j++) f[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[2 * i + j]), mult[j], add[j]);
    if (r->activation != CLAMP_ONLY) activate_lanes(r->activation, f, BLOCKS); /* (a pixel's blocks in lockstep) */
    for (int j = 0; j < BLOCKS; j++) store8(r, f[j], y + (size_t)i * c->Cout + (b + j) * LANES);
  }
}

typedef void (*tile_function)(const stem_call_t*, steps_t, const int16_t*, const int16_t*, int, const requant_t*, uint8_t*);
#define TILE_FUNCTION(P, B)                                                                                      \
  static __attribute__((noinline)) void tile_##P##_##B(const stem_call_t* c, const steps_t s, const int16_t* x, \
                                                       const int16_t* leftover, int b, const requant_t* r,       \
                                                       uint8_t* y) {                                             \
    tile(P, B, c, s, x, leftover, b, r, y);                                                                      \
  }
#define TILE_FUNCTIONS(B) \
  TILE_FUNCTION(1, B) TILE_FUNCTION(2, B) TILE_FUNCTION(3, B) TILE_FUNCTION(4, B) TILE_FUNCTION(5, B) TILE_FUNCTION(6, B)
TILE_FUNCTIONS(1)
TILE_FUNCTIONS(2)
#define TILE_ROW(B) {tile_1_##B, tile_2_##B, tile_3_##B, tile_4_##B, tile_5_##B, tile_6_##B}
static const tile_function TILES[2][6] = {TILE_ROW(1), TILE_ROW(2)};

/* The input under output pixels (n, oh, ow0 ...) as int16: KH rows of ``span`` columns from
 * column ow0 * stride_w - pad_w, the zero point where they leave the image, rows ``row``
 * values apart. */
static void copy_strip(const stem_call_t* c, const uint8_t* x, int n, int oh, int ow0, int span, size_t row, int16_t* strip) {
  const int C = c->C, iw0 = ow0 * c->stride_w - c->pad_w;
  const int lo = iw0 < 0 ? -iw0 : 0, hi = iw0 + span > c->W ? c->W - iw0 : span; /* columns inside: [lo, hi) */
  for (int kh = 0; kh < c->KH; kh++, strip += row) {
    const int ih = oh * c->stride_h - c->pad_h + kh;
    const int inside = ih < 0 || ih >= c->H || hi <= lo ? 0 : (hi - lo) * C, before = inside ? lo * C : span * C;
    for (int i = 0; i < before; i++) strip[i] = (int16_t)c->x_zp;
    if (inside) {
      const uint8_t* from = x + (((size_t)n * c->H + ih) * c->W + iw0 + lo) * C;
      for (int i = 0; i < inside; i++) strip[before + i] = from[i];
    }
    for (int i = before + inside; i < span * C; i++) strip[i] = (int16_t)c->x_zp;
  }
}

/* One output row (n, oh) of the conv into out (OW x Cout), piece by piece: the input under a
 * piece into ``window``, its rows' leftover values into ``leftover``, then the tiles. */
static void stem_row(const stem_call_t* c, const steps_t s, const requant_t* r, const uint8_t* x, int n, int oh,
                     int piece, int16_t* window, int16_t* leftover, uint8_t* out) {
  const int blocks = c->Cout / LANES;
  for (int ow0 = 0; ow0 < c->OW; ow0 += piece) {
    const int count = c->OW - ow0 < piece ? c->OW - ow0 : piece;
    copy_strip(c, x, n, oh, ow0, (count - 1) * c->stride_w + c->KW, s.row, window);
    if (s.L) /* (one value per row: an odd run, e.g. 3 channels and an odd kernel width) */
      for (int i = 0; i < count; i++) {
        const int16_t* from = window + i * s.pixel + 2 * s.F;
        int16_t* to = leftover + (size_t)i * s.LQ * 2;
        for (int kh = 0; kh < c->KH; kh++) to[kh] = from[kh * s.row];
      }
    uint8_t* at = out + (size_t)ow0 * c->Cout;
    for (int b = 0; b < blocks; b += 2) {
      const tile_function* shapes = TILES[(blocks - b < 2 ? blocks - b : 2) - 1];
      for (int i = 0; i < count; i += 6)
        shapes[(count - i < 6 ? count - i : 6) - 1](c, s, window + i * s.pixel, leftover + (size_t)i * s.LQ * 2, b, r,
                                                     at + (size_t)i * c->Cout);
    }
  }
}

/* The bytewise max of ``count`` bytes at ``row`` into ``m`` (count a multiple of 16). */
static inline void max_into(uint8_t* m, const uint8_t* row, int count) {
  int ch = 0;
  for (; ch + 32 <= count; ch += 32)
    _mm256_storeu_si256((__m256i*)(m + ch), _mm256_max_epu8(_mm256_loadu_si256((const __m256i*)(m + ch)),
                                                            _mm256_loadu_si256((const __m256i*)(row + ch))));
  for (; ch < count; ch += 16)
    _mm_storeu_si128((__m128i*)(m + ch), _mm_max_epu8(_mm_loadu_si128((const __m128i*)(m + ch)),
                                                      _mm_loadu_si128((const __m128i*)(row + ch))));
}

/* Pooled row (n, ph) from the conv rows it covers, kept in ``ring`` (conv row oh in slot
 * oh % pool_kh, which rows ``held`` records), computing the rows not yet there. Padding is
 * skipped (the window clipped to the conv output), as max_pool2d's -inf. */
static void pooled_row(const stem_call_t* c, const steps_t s, const requant_t* r, const uint8_t* x, int n, int ph,
                       int piece, int16_t* window, int16_t* leftover, uint8_t* ring, long* held, uint8_t* y) {
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
    uint8_t* m = out + (size_t)pw * c->Cout;
    memset(m, 0, c->Cout);
    for (int oh = first; oh < end; oh++)
      for (int ow = left; ow < right; ow++) max_into(m, ring + (oh % c->pool_kh) * row_bytes + (size_t)ow * c->Cout, c->Cout);
  }
}

/* Returns 0, or -1 where a thread's buffer for the pooled rows could not be allocated. The
 * limits of the VNNI kernel (qbackend/kernels/stem.py checks them), Cout % 16 == 0. */
int qb_stem_conv_call(int threads, const stem_call_t* c, const uint8_t* x, uint8_t* y) {
  const int run = c->KW * c->C, pieces = (c->OW + PIECE - 1) / PIECE, piece = (c->OW + pieces - 1) / pieces;
  const int span = (piece - 1) * c->stride_w + c->KW;
  steps_t s = {run / 2, run % 2, (c->KH * (run % 2) + 1) / 2, 0, (size_t)span * c->C, (size_t)c->stride_w * c->C};
  s.K2 = c->KH * s.F + s.LQ;
  const requant_t r = {_mm256_set1_ps(c->low), _mm256_set1_ps(c->high), _mm256_set1_ps(c->out_inv_scale),
                       _mm256_set1_ps((float)c->out_zp), _mm256_set1_epi32(c->qmin), _mm256_set1_epi32(c->qmax),
                       c->activation};
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    int16_t leftover[PIECE * MAX_LEFTOVER] __attribute__((aligned(32))), window[MAX_STRIP] __attribute__((aligned(32)));
    memset(leftover, 0, sizeof leftover); /* the values past the leftovers meet zero weights */
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
