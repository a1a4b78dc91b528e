/* Grouped 3x3 int8 convolution (ResNeXt's: 32 groups of 4 to 32 channels; RegNet's: groups of
 * 8 to 24), as many outputs as inputs per group, uint8 in, uint8 or float32 (RegNetY's: its
 * squeeze-excitation block reads the float values) out after a clamp. Built twice:
 * here for AVX2 (qb_grouped_conv_avx2: vpmaddubsw adds each pair of products in int16, which
 * saturates unless the weights keep it in range: the lowering checks, lowering/grouped.py) and,
 * through grouped_conv_int8_vnni.c, for AVX512-VNNI (qb_grouped_conv_vnni: vpdpbusd, exact), and
 * through grouped_conv_int8_exact16.c, for AVX2 on int16 pairs (qb_grouped_conv_exact16: exact).
 *
 * Why: oneDNN ran ResNeXt-50's grouped convs at 45-170 GMAC/s on a Zen 4 where a dense 3x3
 * ran at 400 (4 channels a group: 317 us for 128 channels at 56x56).
 * Four input channels of one group are one vpdpbusd word: an output channel's sum is 9 taps x
 * (Cg / 4) dot products of 4 bytes. 8 output channels go in a ymm vector (Zen 4 runs zmm
 * vpdpbusd at a third of ymm's rate), a "block". With Cg >= 8 a block is one group's, so each
 * input word is broadcast (two blocks share them unless they are two groups': 24 or 40 a group); with Cg == 4 it spans two groups A and B, and one broadcast 8-byte
 * load gives lanes A0 B0 A1 B1 ... their group's word (the lanes hold the channels in that
 * order: weights, mult and add are packed so, lowering/grouped.py, and the bytes go back to
 * channel order when stored; a vpermd per word had cost more than the vpdpbusd). Two blocks
 * of 8 output pixels go together: 16 independent sums hide vpdpbusd's latency (8 left it
 * exposed: 1.2-1.6x slower), and blocks of one group share their input words. The input is
 * copied once into rows with a zero-point border, so every tap is a fixed offset; ``add``
 * removes x_zp * sum(w) once per channel. The result is the reference's arithmetic:
 * f = acc * mult + add, clamped to [lo, hi], then round_half_even(f / scale) + zero point,
 * clamped to [qmin, qmax].
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "call_structs.h"
#include "vec_math.h"

#if defined(QB_VNNI)
#include "vnni_dot.h"
#define QB_GROUPED_CALL qb_grouped_conv_vnni
#define QB_GROUPED_SCRATCH qb_grouped_conv_vnni_scratch
#define PIXELS 8 /* output pixels a step: 2 x 8 sums of AVX512VL's 32 ymm registers */
#elif defined(QB_EXACT16)
#define QB_GROUPED_CALL qb_grouped_conv_exact16
#define QB_GROUPED_SCRATCH qb_grouped_conv_exact16_scratch
#define PIXELS 4
/* acc + the int16 pair products of a word per int32 lane (vpmaddwd: exact) */
static inline __m256i dot_add(__m256i acc, __m256i x, __m256i w) { return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w)); }
#else
#define QB_GROUPED_CALL qb_grouped_conv_avx2
#define QB_GROUPED_SCRATCH qb_grouped_conv_avx2_scratch
#define PIXELS 4 /* 2 x 4 sums: AVX2 has 16 ymm registers, and each dot product needs two more */
/* acc + the 4-byte dot products of unsigned x and signed w per int32 lane, pairs added in int16 */
static inline __m256i dot_add(__m256i acc, __m256i x, __m256i w) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x, w), _mm256_set1_epi16(1)));
}
#endif
#define LANES 8 /* output channels per vector: a block */
#define TAPS 9
#if defined(QB_EXACT16)
/* The padded input holds the activations widened to int16, 2 a 4-byte word; with 4 channels a
 * group each block's 8 in the order A0 A1 B0 B1 A2 A3 B2 B3, so that 8 bytes hold both groups'
 * word q (the lanes A0 B0 A1 B1 ... read alternate ones, as the uint8 build's). */
typedef int16_t value_t;
#else
typedef uint8_t value_t; /* 4 a word */
#endif
#define WORD_VALUES (4 / (int)sizeof(value_t))

/* one word broadcast (a block of one group), or two groups' words in alternate lanes (Cg == 4) */
static inline __m256i word(const uint8_t* at) {
  int32_t v;
  memcpy(&v, at, 4);
  return _mm256_set1_epi32(v);
}
static inline __m256i two_words(const uint8_t* at) {
  int64_t v;
  memcpy(&v, at, 8);
  return _mm256_set1_epi64x(v);
}

/* the first channel a block's lanes read */
static inline int block_channel(int Cg, int b) { return Cg == 4 ? LANES * b : LANES * b / Cg * Cg; }

/* Block b's sums for the first ``pixels`` pixels -> out (pixel p's channels at out + p * C elements:
 * bytes, or float32 where c->float_out) */
static inline void store_block(const grouped_call_t* c, const __m256i acc[PIXELS], int b, int pixels, char* out) {
  const __m256 lo = _mm256_set1_ps(c->lo), hi = _mm256_set1_ps(c->hi), inv = _mm256_set1_ps(c->out_inv_scale);
  const __m256 zp = _mm256_set1_ps((float)c->out_zp), qmin = _mm256_set1_ps((float)c->qmin),
               qmax = _mm256_set1_ps((float)c->qmax);
  const __m256 mult = _mm256_loadu_ps(c->mult + LANES * b), add = _mm256_loadu_ps(c->add + LANES * b);
  /* lanes A0 B0 A1 B1 ... back to channel order A0-A3 B0-B3 (Cg == 4), else as they are */
  const __m128i order = c->Cg == 4 ? _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                                   : _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m256i float_order = c->Cg == 4 ? _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7) : _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int p = 0; p < pixels; p++) {
    const __m256 f = _mm256_min_ps(_mm256_max_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[p]), mult, add), lo), hi);
    if (c->float_out) {
      _mm256_storeu_ps((float*)out + (size_t)p * c->C + LANES * b, _mm256_permutevar8x32_ps(f, float_order));
      continue;
    }
    const __m256i ints = quantize_scaled8(_mm256_mul_ps(f, inv), zp, qmin, qmax);
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1));
    _mm_storel_epi64((__m128i*)(out + (size_t)p * c->C + LANES * b), _mm_shuffle_epi8(_mm_packus_epi16(words, words), order));
  }
}

/* Sums of blocks b and b + 1 over every tap and word: LOAD0 / LOAD1 the lane words at ``at``
 * (pixel p's input at the tap, word and the pair's first channel; words ``STRIDE`` bytes apart) */
#define PAIR_SUMS(QUADS, STRIDE, LOAD0, LOAD1)                                                       \
  for (int t = 0; t < TAPS; t++)                                                                     \
    for (int q = 0; q < (QUADS); q++) {                                                              \
      const size_t step = ((size_t)t * (QUADS) + q) * LANES * 4;                                     \
      const __m256i w0 = _mm256_loadu_si256((const __m256i*)(w + step));                            \
      const __m256i w1 = _mm256_loadu_si256((const __m256i*)(w + block_bytes + step));              \
      for (int p = 0; p < PIXELS; p++) {                                                             \
        const uint8_t* at = win + tap[t] + (STRIDE) * q + p * pixel;                                 \
        const __m256i x0 = LOAD0;                                                                    \
        acc0[p] = dot_add(acc0[p], x0, w0);                                                          \
        acc1[p] = dot_add(acc1[p], LOAD1, w1);                                                       \
      }                                                                                              \
    }

/* Blocks b and b + 1 for 8 output pixels (``pixel`` bytes apart in the padded input; a
 * window's taps at win + tap[t] from its corner), stored for the first ``pixels``. */
static void pair_step(const grouped_call_t* c, const uint8_t* corner, size_t pixel, const size_t tap[TAPS], int b,
                      int pixels, char* out) {
  const int Cg = c->Cg, words = Cg / WORD_VALUES;
  const size_t block_bytes = (size_t)TAPS * words * LANES * 4, next_block = LANES * sizeof(value_t);
  const int8_t* w = c->weight + (size_t)b * block_bytes;
  const uint8_t* win = corner + block_channel(Cg, b) * sizeof(value_t);
  __m256i acc0[PIXELS], acc1[PIXELS];
  for (int p = 0; p < PIXELS; p++) acc0[p] = acc1[p] = _mm256_setzero_si256();
  if (Cg == 4) {
    PAIR_SUMS(words, 8, two_words(at), two_words(at + next_block)) /* (the next block: the next two groups) */
  } else if (Cg == 8) {
    PAIR_SUMS(words, 4, word(at), word(at + next_block)) /* (the next block: the next group) */
  } else if (block_channel(Cg, b + 1) == block_channel(Cg, b)) {
    PAIR_SUMS(words, 4, word(at), x0) /* (the next block: the same group, the same words) */
  } else { /* (an odd number of blocks a group, 24 or 40 channels: the next block starts the next group) */
    const size_t next = (size_t)(block_channel(Cg, b + 1) - block_channel(Cg, b)) * sizeof(value_t);
    PAIR_SUMS(words, 4, word(at), word(at + next))
  }
  store_block(c, acc0, b, pixels, out);
  store_block(c, acc1, b + 1, pixels, out);
}

/* A last, odd block: pair_step's sums for one block */
static void single_step(const grouped_call_t* c, const uint8_t* corner, size_t pixel, const size_t tap[TAPS], int b,
                        int pixels, char* out) {
  const int Cg = c->Cg, words = Cg / WORD_VALUES, stride = Cg == 4 ? 8 : 4;
  const int8_t* w = c->weight + (size_t)b * TAPS * words * LANES * 4;
  const uint8_t* win = corner + block_channel(Cg, b) * sizeof(value_t);
  __m256i acc[PIXELS];
  for (int p = 0; p < PIXELS; p++) acc[p] = _mm256_setzero_si256();
  for (int t = 0; t < TAPS; t++)
    for (int q = 0; q < words; q++) {
      const __m256i w0 = _mm256_loadu_si256((const __m256i*)(w + ((size_t)t * words + q) * LANES * 4));
      for (int p = 0; p < PIXELS; p++) {
        const uint8_t* at = win + tap[t] + stride * q + p * pixel;
        acc[p] = dot_add(acc[p], Cg == 4 ? two_words(at) : word(at), w0);
      }
    }
  store_block(c, acc, b, pixels, out);
}

/* Every block of one tile: ``pixels`` (of PIXELS computed) output pixels from ``out``, their
 * windows' corners ``pixel`` bytes apart from ``corner``, a window's taps at ``tap``. */
static void tile_blocks(const grouped_call_t* c, const uint8_t* corner, size_t pixel, const size_t tap[TAPS], int pixels,
                        char* out) {
  const int blocks = c->C / LANES;
  int b = 0;
  for (; b + 2 <= blocks; b += 2) pair_step(c, corner, pixel, tap, b, pixels, out);
  if (b < blocks) single_step(c, corner, pixel, tap, b, pixels, out);
}

/* The first pixel of the tile from ``ox0`` on an output row (a last tile of fewer pixels moves
 * left over pixels already written, the same values). */
static inline int tile_start(const grouped_call_t* c, int ox0) { return ox0 + PIXELS <= c->OW || c->OW < PIXELS ? ox0 : c->OW - PIXELS; }

/* Pixels a tile's windows span along a row. */
#define TILE_SPAN(s) ((PIXELS - 1) * (s) + 3)

/* A window's taps as byte offsets from its corner, in rows of ``row_pixels`` pixels of ``pixel_bytes``. */
static inline void tap_offsets(size_t tap[TAPS], size_t row_pixels, size_t pixel_bytes) {
  for (int t = 0; t < TAPS; t++) tap[t] = ((size_t)(t / 3) * row_pixels + t % 3) * pixel_bytes;
}

/* Where the tile from ``start`` on output row ``oy`` of image ``n`` stores. */
static inline char* tile_out(const grouped_call_t* c, void* y, int n, int oy, int start) {
  return (char*)y + (((size_t)n * c->OH + oy) * c->OW + start) * c->C * (c->float_out ? sizeof(float) : 1);
}

#if defined(QB_EXACT16)
/* ``count`` values of the zero point at dst */
static inline void fill_zero_point(const grouped_call_t* c, value_t* dst, size_t count) {
  for (size_t i = 0; i < count; i++) dst[i] = (value_t)c->x_zp;
}

/* ``count`` channels of a row of x at dst, widened, and with 4 channels a group in the word
 * order above */
static inline void copy_pixels(const grouped_call_t* c, value_t* dst, const uint8_t* src, size_t count) {
  if (c->Cg == 4) {
    static const int order[LANES] = {0, 1, 4, 5, 2, 3, 6, 7};
    for (size_t i = 0; i < count; i += LANES)
      for (int j = 0; j < LANES; j++) dst[i + j] = src[i + order[j]];
  } else
    for (size_t i = 0; i < count; i++) dst[i] = src[i];
}

/* The padded input's row width in pixels: the image's and its border, at least one tile of PIXELS outputs wide. */
static int padded_width(const grouped_call_t* c) {
  return c->W + 2 > TILE_SPAN(c->stride) ? c->W + 2 : TILE_SPAN(c->stride);
}

/* Bytes of the padded input QB_GROUPED_CALL copies x into: the scratch its caller may pass. */
size_t QB_GROUPED_SCRATCH(const grouped_call_t* c) {
  return (size_t)c->N * (c->H + 2) * padded_width(c) * c->C * sizeof(value_t) + 8; /* (+8: the last 8-byte load) */
}

/* 0, or -1 when the padded input could not be allocated. The input is copied once, widened (and
 * reordered, copy_pixels), into rows with a zero-point border (and columns for at least one
 * tile), so every tap of every pixel is a fixed offset from its window's corner. ``scratch``:
 * QB_GROUPED_SCRATCH(c) bytes for that copy (a kernel chain's arena, a thread's buffer kept
 * between calls), or NULL: the call allocates and frees it (past glibc's mmap threshold, a
 * fresh mapping whose every page faults in, zeroed, at every call). */
int QB_GROUPED_CALL(int threads, const grouped_call_t* c, const uint8_t* x, void* y, void* scratch, void* unused) {
  (void)unused;
  const int s = c->stride, PH = c->H + 2, PW = padded_width(c);
  const size_t C = (size_t)c->C, pixel = (size_t)s * C * sizeof(value_t);
  value_t* padded = scratch ? scratch : malloc(QB_GROUPED_SCRATCH(c));
  if (!padded) return -1;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int r = 0; r < c->N * PH; r++) {
      const int iy = r % PH - 1, n = r / PH;
      value_t* dst = padded + (size_t)r * PW * C;
      if (iy < 0 || iy >= c->H) {
        fill_zero_point(c, dst, PW * C);
        continue;
      }
      fill_zero_point(c, dst, C);
      copy_pixels(c, dst + C, x + ((size_t)n * c->H + iy) * c->W * C, c->W * C);
      fill_zero_point(c, dst + (c->W + 1) * C, (PW - c->W - 1) * C);
    }
    size_t tap[TAPS];
    tap_offsets(tap, PW, C * sizeof(value_t));
#pragma omp for schedule(static)
    for (int row = 0; row < c->N * c->OH; row++) {
      const int n = row / c->OH, oy = row % c->OH;
      const uint8_t* corner_row = (const uint8_t*)(padded + ((size_t)n * PH + (size_t)oy * s) * PW * C);
      for (int ox0 = 0; ox0 < c->OW; ox0 += PIXELS) {
        const int start = tile_start(c, ox0), pixels = c->OW - start < PIXELS ? c->OW - start : PIXELS;
        tile_blocks(c, corner_row + start * pixel, pixel, tap, pixels, tile_out(c, y, n, oy, start));
      }
    }
  }
  if (!scratch) free(padded);
  return 0;
}
#else
/* The uint8 builds read x itself: no scratch (their windows inside the image read it in place). */
size_t QB_GROUPED_SCRATCH(const grouped_call_t* c) {
  (void)c;
  return 0;
}

/* Whether every window of the tile from ``start`` on output row ``oy`` lies inside the image. */
static inline int inside(const grouped_call_t* c, int oy, int start) {
  const int s = c->stride;
  return oy * s >= 1 && oy * s + 1 < c->H && start * s >= 1 && (start + PIXELS - 1) * s + 1 < c->W;
}

/* A border tile's 3 input rows (from oy * s - 1) of TILE_SPAN pixels (from start * s - 1)
 * into ``copy``, the zero point where they leave the image. */
static void copy_border_tile(const grouped_call_t* c, const uint8_t* x, int n, int oy, int start, uint8_t* copy) {
  const int s = c->stride, width = TILE_SPAN(s), ix0 = start * s - 1;
  const int first = ix0 < 0 ? -ix0 : 0, end = c->W - ix0 < width ? c->W - ix0 : width; /* columns in the image: [first, end) */
  const size_t C = (size_t)c->C;
  for (int r = 0; r < 3; r++) {
    const int iy = oy * s - 1 + r;
    uint8_t* dst = copy + (size_t)r * width * C;
    if (iy < 0 || iy >= c->H || end <= first) {
      memset(dst, c->x_zp, width * C);
      continue;
    }
    memset(dst, c->x_zp, first * C);
    memcpy(dst + first * C, x + (((size_t)n * c->H + iy) * c->W + ix0 + first) * C, (end - first) * C);
    memset(dst + end * C, c->x_zp, (width - end) * C);
  }
}

/* 0, or -1 when a thread could not allocate its border copy. A tile whose windows lie inside the
 * image reads x in place (its taps fixed offsets from the window's corner); a tile on the border
 * reads a copy of its 3 x TILE_SPAN pixels with the zero point outside the image. (A padded
 * copy of the whole input, as the int16 build makes, had cost a pass over it and its bytes in
 * the cache: regnet_y_400mf's 48-channel conv at 112x112, stride 2, batch 8, on 4.8 MB.) */
int QB_GROUPED_CALL(int threads, const grouped_call_t* c, const uint8_t* x, void* y, void* scratch, void* unused) {
  (void)scratch, (void)unused;
  const int s = c->stride, width = TILE_SPAN(s);
  const size_t C = (size_t)c->C, pixel = (size_t)s * C;
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    uint8_t* copy = malloc(3 * (size_t)width * C);
    size_t in_place[TAPS], in_copy[TAPS];
    tap_offsets(in_place, c->W, C);
    tap_offsets(in_copy, width, C);
    if (!copy) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static)
    for (int row = 0; row < c->N * c->OH; row++) {
      const int n = row / c->OH, oy = row % c->OH;
      for (int ox0 = 0; copy && ox0 < c->OW; ox0 += PIXELS) {
        const int start = tile_start(c, ox0), pixels = c->OW - start < PIXELS ? c->OW - start : PIXELS;
        char* out = tile_out(c, y, n, oy, start);
        if (inside(c, oy, start)) {
          tile_blocks(c, x + (((size_t)n * c->H + oy * s - 1) * c->W + start * s - 1) * C, pixel, in_place, pixels, out);
        } else {
          copy_border_tile(c, x, n, oy, start, copy);
          tile_blocks(c, copy, pixel, in_copy, pixels, out);
        }
      }
    }
    free(copy);
  }
  return failed ? -1 : 0;
}
#endif
