/* Grouped 3x3 int8 convolution (ResNeXt's: 32 groups of 4 to 32 channels, as many outputs as
 * inputs per group) for CPUs with AVX512-VNNI, uint8 in and out after a clamp.
 *
 * Why: oneDNN ran ResNeXt-50's grouped convs at 45-170 GMAC/s on a Zen 4 where a dense 3x3
 * ran at 400 (4 channels a group: 317 us for 128 channels at 56x56).
 * Four input channels of one group are one vpdpbusd word: an output channel's sum is 9 taps x
 * (Cg / 4) dot products of 4 bytes. 8 output channels go in a ymm vector (Zen 4 runs zmm
 * vpdpbusd at a third of ymm's rate); with Cg >= 8 they share a group, so each input word is
 * broadcast; with Cg == 4 they span two groups, and one broadcast 8-byte load gives each lane
 * its group's word (a vpermd there cost more than the vpdpbusd). 8 output pixels a step share each weight vector load. Padding reads a
 * pixel of zero-point bytes; ``add`` removes x_zp * sum(w) once per channel. The result is
 * the reference's arithmetic: f = acc * mult + add, clamped to [lo, hi], then
 * round_half_even(f / scale) + zero point, clamped to [qmin, qmax].
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"
#include "vnni_dot.h"

#define LANES 8  /* output channels per vector */
#define PIXELS 8 /* output pixels a step */
#define TAPS 9

/* One call site's arguments (qbackend/native.py _GroupedCall); weight is
 * [C / 8 blocks][9 taps][Cg / 4 quads][8 lanes][4 bytes], mult and add [C], in lane order (for
 * Cg == 4 a block's channels A0 B0 A1 B1 A2 B2 A3 B3: lowering/grouped.py). */
typedef struct {
  int N, H, W, C, Cg, stride, OH, OW, x_zp;
  const int8_t* weight;
  const float *mult, *add;
  float lo, hi, out_inv_scale;
  int out_zp, qmin, qmax;
} grouped_call_t;

/* Block b's 8 output channels of 8 output pixels (``pixel`` bytes apart in the padded input,
 * whose window corners are at win + tap[t]), summed into acc. Cg == 4: the block spans two
 * groups A and B, and one broadcast 8-byte load gives lanes A0 B0 A1 B1 ... their group's word
 * (the lanes hold channels in that order: weights, mult and add are packed so, and the bytes
 * are put back in channel order when stored); else one group, each word broadcast. */
static inline void sums_of_two_groups(const uint8_t* win, size_t pixel, const size_t tap[TAPS], const int8_t* w,
                                      __m256i acc[PIXELS]) {
  for (int t = 0; t < TAPS; t++) {
    const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + (size_t)t * LANES * 4));
    const uint8_t* in = win + tap[t];
    for (int p = 0; p < PIXELS; p++) {
      int64_t words;
      memcpy(&words, in + p * pixel, 8);
      acc[p] = dot_add(acc[p], _mm256_set1_epi64x(words), wv);
    }
  }
}

static inline void sums_of_one_group(const uint8_t* win, size_t pixel, const size_t tap[TAPS], int quads, const int8_t* w,
                                     __m256i acc[PIXELS]) {
  for (int t = 0; t < TAPS; t++)
    for (int q = 0; q < quads; q++) {
      const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + ((size_t)t * quads + q) * LANES * 4));
      const uint8_t* in = win + tap[t] + 4 * q;
      for (int p = 0; p < PIXELS; p++) {
        int32_t word;
        memcpy(&word, in + p * pixel, 4);
        acc[p] = dot_add(acc[p], _mm256_set1_epi32(word), wv);
      }
    }
}

/* Block b of 8 output pixels from the window corner ``win`` of the first: sums, then the
 * epilogue for the first ``pixels`` of them, stored at out. */
static inline void block_step(const grouped_call_t* c, const uint8_t* win, size_t pixel, const size_t tap[TAPS], int b,
                              int pixels, uint8_t* out) {
  const int Cg = c->Cg, quads = Cg / 4, ch0 = Cg == 4 ? LANES * b : LANES * b / Cg * Cg;
  const int8_t* w = c->weight + (size_t)b * TAPS * quads * LANES * 4;
  __m256i acc[PIXELS];
  for (int p = 0; p < PIXELS; p++) acc[p] = _mm256_setzero_si256();
  if (Cg == 4) sums_of_two_groups(win + ch0, pixel, tap, w, acc);
  else sums_of_one_group(win + ch0, pixel, tap, quads, w, acc);
  const __m256 mult = _mm256_loadu_ps(c->mult + LANES * b), add = _mm256_loadu_ps(c->add + LANES * b);
  const __m256 lo = _mm256_set1_ps(c->lo), hi = _mm256_set1_ps(c->hi), inv = _mm256_set1_ps(c->out_inv_scale);
  const __m256 zp = _mm256_set1_ps((float)c->out_zp), qmin = _mm256_set1_ps((float)c->qmin),
               qmax = _mm256_set1_ps((float)c->qmax);
  /* bytes from lanes A0 B0 A1 B1 ... back to channel order A0-A3 B0-B3 (Cg == 4), else as they are */
  const __m128i order = Cg == 4 ? _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                                : _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int p = 0; p < pixels; p++) {
    const __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[p]), mult, add);
    const __m256i ints = quantize_scaled8(_mm256_mul_ps(_mm256_min_ps(_mm256_max_ps(f, lo), hi), inv), zp, qmin, qmax);
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1));
    _mm_storel_epi64((__m128i*)(out + (size_t)p * c->C + LANES * b), _mm_shuffle_epi8(_mm_packus_epi16(words, words), order));
  }
}

/* 0, or -1 when the padded input could not be allocated. The input is copied once into rows
 * with a zero-point border (and columns for at least 8 output pixels), so every tap of every
 * pixel is a fixed offset from its window's corner. */
int qb_grouped_conv_vnni(int threads, const grouped_call_t* c, const uint8_t* x, uint8_t* y) {
  const int s = c->stride, PH = c->H + 2, min_width = (PIXELS - 1) * s + 3;
  const int PW = c->W + 2 > min_width ? c->W + 2 : min_width;
  const size_t C = (size_t)c->C, pixel = (size_t)s * C;
  uint8_t* padded = malloc((size_t)c->N * PH * PW * C + 8); /* (+8: the last 8-byte load) */
  if (!padded) return -1;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int r = 0; r < c->N * PH; r++) {
      const int iy = r % PH - 1, n = r / PH;
      uint8_t* dst = padded + (size_t)r * PW * C;
      if (iy < 0 || iy >= c->H) {
        memset(dst, c->x_zp, PW * C);
        continue;
      }
      memset(dst, c->x_zp, C);
      memcpy(dst + C, x + ((size_t)n * c->H + iy) * c->W * C, c->W * C);
      memset(dst + (c->W + 1) * C, c->x_zp, (PW - c->W - 1) * C);
    }
    size_t tap[TAPS];
    for (int t = 0; t < TAPS; t++) tap[t] = ((size_t)(t / 3) * PW + t % 3) * C;
#pragma omp for schedule(static)
    for (int row = 0; row < c->N * c->OH; row++) {
      const int n = row / c->OH, oy = row % c->OH;
      const uint8_t* corner_row = padded + ((size_t)n * PH + (size_t)oy * s) * PW * C;
      for (int ox0 = 0; ox0 < c->OW; ox0 += PIXELS) {
        /* a last tile of fewer pixels moves left over pixels already written (the same values) */
        const int start = ox0 + PIXELS <= c->OW || c->OW < PIXELS ? ox0 : c->OW - PIXELS;
        const int pixels = c->OW - start < PIXELS ? c->OW - start : PIXELS;
        uint8_t* out = y + (((size_t)n * c->OH + oy) * c->OW + start) * C;
        for (int b = 0; b < c->C / LANES; b++) block_step(c, corner_row + start * pixel, pixel, tap, b, pixels, out);
      }
    }
  }
  free(padded);
  return 0;
}
