/* Weight-only int4 / int8 linears over a few dozen rows (a short prompt) with AVX512-BF16
 * products: y[M][N] = x[M][K] (bf16) . w[N][K]^T, float32 out, w as qbackend's neutral storage.
 *
 * Why: between a decode step's row and a long prompt's hundreds, neither of the other paths
 * fits. The int16 kernel (weight_only_int16.c) unpacks every weight again for every few rows;
 * the dense slices (qbackend/llm/dense_weight_only.py) write every weight out as bf16 and then pay
 * ATen's matmul at a few dozen rows, where it is far from this CPU's bf16 rate: 32 rows of a
 * 2048 -> 11264 layer took 11.6 and 7.2 ms (Zen 4, 2 threads), where Inductor's bf16 matmul on a
 * ready bf16 weight takes ~5.
 *
 * Here a block of weight rows (TILE_BYTES of bf16) is unpacked once, in K order (int4 by a
 * per-(row, group) table, the dense path's: the same bf16 weights), into a buffer that stays in
 * L2 while every tile of MT activation rows runs over it NT weight rows at a time: MT x NT
 * accumulators of 16 lanes along K, one vdpbf16ps (32 products) per pair of 32-value loads,
 * summed across lanes once at the end of K.
 * The products are exact and summed in float32, so the result differs from the dense path's only
 * by the order of the sums and by not rounding the output to bf16.
 *
 * int4 storage: u = q + 8 as uint8 [N][K/2], the even column in the low nibble; w = u * scale +
 * offset per (row, group), the int16 kernel's constants (int4_offsets.h). int8: int8 [N][K],
 * w = q * scale per row, rounded to bf16 as the dense path rounds it. */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "int4_offsets.h"

#define NT 4 /* weight rows per tile */
#define MT 6 /* activation rows per tile: 24 accumulators, 4 weight vectors and an activation one */
#define TILE_BYTES (256 << 10)

#if defined(__clang__) ? __clang_major__ >= 9 : __GNUC__ >= 10 /* (the first with AVX512-BF16's intrinsics) */
#define BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

int qb_has_avx512_bf16(void) { return __builtin_cpu_supports("avx512bf16"); }

/* A group's 16 possible weights, u * scale + offset for u = 0 .. 15, as bf16 words 0 .. 15 of a
 * zmm (rounded to nearest even, as torch's conversion and the dense path round them). */
static inline BF16 __m512i group_table(float scale, float offset) {
  const __m512 u = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 w = _mm512_fmadd_ps(u, _mm512_set1_ps(scale), _mm512_set1_ps(offset));
  return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(w));
}

/* 32 weights (16 bytes of storage) as bf16 in K order: word 2i the low nibble of byte i, 2i + 1
 * its high one, looked up in ``table``. */
static inline BF16 __m512i unpack32(const uint8_t* bytes, __m512i table) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)bytes));
  const __m512i nibbles = _mm512_and_si512(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), _mm512_set1_epi32(0x000F000F));
  return _mm512_permutexvar_epi16(nibbles, table);
}

/* 32 int8 weights of a row times its scale, as bf16 in K order. */
static inline BF16 __m512i int8_unpack32(const int8_t* q, __m512 scale) {
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
  const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(high, scale), _mm512_mul_ps(low, scale));
}

/* Row n of the weight as bf16 [K]: int4 (``w`` the storage, ``offset`` / ``codes`` as
 * int4_offsets.h) or int8 (``w`` int8, one scale a row). */
static inline BF16 void unpack_row(int bits, size_t n, int K, int group, int codes, const void* w, const float* scale,
                                   const void* offset, uint16_t* row) {
  if (bits == 8) {
    const __m512 s = _mm512_set1_ps(scale[n]);
    for (int k = 0; k < K; k += 32) _mm512_storeu_si512(row + k, int8_unpack32((const int8_t*)w + n * K + k, s));
    return;
  }
  const int groups = K / group;
  for (int g = 0; g < groups; g++) {
    const size_t at = n * groups + g;
    const __m512i table = group_table(scale[at], group_offset(offset, codes, scale, at));
    for (int k = g * group; k < (g + 1) * group; k += 32)
      _mm512_storeu_si512(row + k, unpack32((const uint8_t*)w + n * (K / 2) + k / 2, table));
  }
}

/* The sums of a[0..3]'s lanes, as 4 floats. */
static inline BF16 __m128 sums4(const __m512 a[4]) {
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], 0x44), _mm512_shuffle_f32x4(a[0], a[1], 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], 0x44), _mm512_shuffle_f32x4(a[2], a[3], 0xEE));
  /* (128-bit lane i: a[i]'s four partial sums) */
  __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
  s = _mm512_add_ps(s, _mm512_shuffle_ps(s, s, 0x4E));
  s = _mm512_add_ps(s, _mm512_shuffle_ps(s, s, 0xB1));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), s));
}

/* y[m0 .. m0 + MR - 1][n0 .. n0 + NT - 1] over all of K: MR activation rows times NT unpacked
 * weight rows (MR a constant in each expansion: no per-row branch in the loop). */
static inline __attribute__((always_inline)) BF16 void tile(const int MR, int K, const uint16_t* x, const uint16_t* w,
                                                            float* y, long y_row, int n_left) {
  __m512 acc[MT][NT];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NT; j++) acc[i][j] = _mm512_setzero_ps();
  for (int k = 0; k < K; k += 32) {
    __m512bh wv[NT];
    for (int j = 0; j < NT; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + (size_t)j * K + k);
    for (int i = 0; i < MR; i++) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (size_t)i * K + k);
      for (int j = 0; j < NT; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < MR; i++) {
    const __m128 s = sums4(acc[i]);
    float* out = y + (size_t)i * y_row;
    if (n_left >= NT) {
      _mm_storeu_ps(out, s);
    } else {
      float lanes[4];
      _mm_storeu_ps(lanes, s);
      for (int j = 0; j < n_left; j++) out[j] = lanes[j];
    }
  }
}

/* y[m][n .. n + rows - 1] for rows m of [0, M): ``rows`` weight rows unpacked in ``w`` (bf16
 * [rows][K]), NT at a time for each tile of MT activation rows (which stay in L1 meanwhile). */
static inline BF16 void rows_times_tile(int M, int K, const uint16_t* x, const uint16_t* w, int rows, float* y, long y_row) {
  for (int m0 = 0; m0 < M; m0 += MT)
    for (int n0 = 0; n0 < rows; n0 += NT) {
      const uint16_t *xm = x + (size_t)m0 * K, *wn = w + (size_t)n0 * K;
      float* ym = y + (size_t)m0 * y_row + n0;
      switch (M - m0 < MT ? M - m0 : MT) {
        case 1: tile(1, K, xm, wn, ym, y_row, rows - n0); break;
        case 2: tile(2, K, xm, wn, ym, y_row, rows - n0); break;
        case 3: tile(3, K, xm, wn, ym, y_row, rows - n0); break;
        case 4: tile(4, K, xm, wn, ym, y_row, rows - n0); break;
        case 5: tile(5, K, xm, wn, ym, y_row, rows - n0); break;
        default: tile(MT, K, xm, wn, ym, y_row, rows - n0);
      }
    }
}

/* y (row stride y_row) = x . w^T for x bf16 [M][K] and an int4 (``bits`` 4: storage [N][K/2],
 * ``scale`` / ``offset`` [N][K / group], group % 32 == 0, K % group == 0) or int8 (int8 [N][K],
 * ``scale`` [N]) weight; K % 32 == 0. 0, or -1 when a thread could not allocate its buffer. */
BF16 int qb_weight_only_bf16_mm(int threads, int bits, int M, int N, int K, int group, int codes, const uint16_t* x,
                                const void* w, const float* scale, const void* offset, float* y, long y_row) {
  /* weight rows unpacked at a time: TILE_BYTES of bf16 (in L2 while every activation row runs
     over them: each activation tile is read once per such block, not once per NT rows) */
  int block = (int)(TILE_BYTES / (2 * (size_t)K)) / NT * NT;
  block = block < NT ? NT : block;
  const int blocks = (N + block - 1) / block;
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    uint16_t* unpacked = aligned_alloc(64, sizeof(uint16_t) * block * (size_t)K);
    if (!unpacked) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static)
    for (int b = 0; b < blocks; b++) {
      if (!unpacked) continue;
      const int n0 = b * block, rows = N - n0 < block ? N - n0 : block;
      for (int j = 0; j < (rows + NT - 1) / NT * NT; j++) {
        uint16_t* row = unpacked + (size_t)j * K;
        if (j < rows) {
          unpack_row(bits, (size_t)n0 + j, K, group, codes, w, scale, offset, row);
        } else { /* (a last tile's missing rows: zero weights, their sums not stored) */
          for (int k = 0; k < K; k += 32) _mm512_storeu_si512(row + k, _mm512_setzero_si512());
        }
      }
      rows_times_tile(M, K, x, unpacked, rows, y + n0, y_row);
    }
    free(unpacked);
  }
  return failed ? -1 : 0;
}
#else
int qb_has_avx512_bf16(void) { return 0; }
int qb_weight_only_bf16_mm(int threads, int bits, int M, int N, int K, int group, int codes, const uint16_t* x,
                           const void* w, const float* scale, const void* offset, float* y, long y_row) {
  return -2; /* (never called: qb_has_avx512_bf16 says 0) */
}
#endif
