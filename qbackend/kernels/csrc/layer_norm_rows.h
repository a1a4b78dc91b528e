/* LayerNorm rows and their quantize, shared by layer_norm_quantize.c and the depthwise conv
 * that normalizes its own output rows (depthwise_conv_int8_vnni.c): the statistics of a block
 * of rows, then each row normalized, scaled, shifted and quantized (see layer_norm_quantize.c
 * for the arithmetic and why). */
#ifndef QB_LAYER_NORM_ROWS_H
#define QB_LAYER_NORM_ROWS_H

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "vec_math.h"

static inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#define ROWS 4 /* rows whose statistics are summed together: independent chains, not one row's latency */
/* Squared deviations past this (or NaN, or infinite values) overflow ATen's float32 running
 * variance one way or another (infinite, NaN: it depends on the value's place in its vector):
 * such rows are left to the caller, which runs ATen on the tensor instead. */
#define UNSAFE_SQUARES 1e30f

static inline double sum4d(__m256d v) {
  const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

/* The mean and 1 / sqrt(var + eps) of ``count`` (<= ROWS) rows of C values, ``stride`` apart.
 * The sum in float64: float32 values near its largest (3.4e38) have a finite mean, as in ATen's
 * running mean, where a float32 sum would be infinite and the row NaN. */
static inline __attribute__((always_inline)) int row_statistics(const float* x, int count, long stride, int C, float eps,
                                                                float mean[ROWS], float rstd[ROWS]) {
  int unsafe = 0;
  __m256d sums[ROWS];
  __m256 acc[ROWS];
  float tail[ROWS];
  for (int r = 0; r < count; r++) sums[r] = _mm256_setzero_pd();
  int i = 0;
  for (; i + 8 <= C; i += 8)
#pragma GCC unroll 4
    for (int r = 0; r < count; r++) {
      const __m256 v = _mm256_loadu_ps(x + r * stride + i);
      sums[r] = _mm256_add_pd(sums[r], _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)),
                                                     _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))));
    }
  for (int r = 0; r < count; r++) {
    double sum = sum4d(sums[r]);
    for (int j = i; j < C; j++) sum += x[r * stride + j];
    mean[r] = (float)(sum / C);
    acc[r] = _mm256_setzero_ps(), tail[r] = 0.0f;
  }
  for (i = 0; i + 8 <= C; i += 8)
#pragma GCC unroll 4
    for (int r = 0; r < count; r++) {
      const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + r * stride + i), _mm256_set1_ps(mean[r]));
      acc[r] = _mm256_fmadd_ps(d, d, acc[r]);
    }
  for (int r = 0; r < count; r++) {
    for (int j = i; j < C; j++) tail[r] += (x[r * stride + j] - mean[r]) * (x[r * stride + j] - mean[r]);
    const float squares = sum8(acc[r]) + tail[r];
    unsafe += !(squares < UNSAFE_SQUARES);
    rstd[r] = 1.0f / sqrtf(squares / (float)C + eps);
  }
  return unsafe;
}

/* yf: the float32 rows too where not NULL (a post-LN transformer's residual reads them). */
static inline void normalize_row(const float* x, int C, float mean, float rstd, const float* w, const float* b, float inv_scale,
                          int zp, int qmin, int qmax, uint8_t* y, float* yf) {
  const __m256 vmean = _mm256_set1_ps(mean), vrstd = _mm256_set1_ps(rstd), vinv = _mm256_set1_ps(inv_scale);
  const __m256 vzp = _mm256_set1_ps((float)zp), vlo = _mm256_set1_ps((float)qmin), vhi = _mm256_set1_ps((float)qmax);
  int i = 0;
  /* 32 values a step: one pack of four vectors and one 32-byte store (8-byte stores and their
   * narrowing had been a third of the kernel's time at ConvNeXt's 96 channels) */
  for (; i + 32 <= C; i += 32) {
    __m256i q[4];
    for (int v = 0; v < 4; v++) {
      const __m256 normed = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8 * v), vmean), vrstd);
      const __m256 f = _mm256_fmadd_ps(normed, _mm256_loadu_ps(w + i + 8 * v), _mm256_loadu_ps(b + i + 8 * v));
      if (yf) _mm256_storeu_ps(yf + i + 8 * v, f);
      q[v] = quantize_scaled8(_mm256_mul_ps(f, vinv), vzp, vlo, vhi);
    }
    /* (within [qmin, qmax]: the packs saturate nothing; they interleave 4-value pieces per lane) */
    const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i*)(y + i), _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
  for (; i + 8 <= C; i += 8) {
    const __m256 normed = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmean), vrstd);
    const __m256 f = _mm256_fmadd_ps(normed, _mm256_loadu_ps(w + i), _mm256_loadu_ps(b + i));
    if (yf) _mm256_storeu_ps(yf + i, f);
    store_quantized8(_mm256_mul_ps(f, vinv), vzp, vlo, vhi, y + i);
  }
  for (; i < C; i++) {
    const float f = ((x[i] - mean) * rstd) * w[i] + b[i];
    if (yf) yf[i] = f;
    y[i] = round_to_grid(f * inv_scale, zp, qmin, qmax);
  }
}

/* Rows [0, rows) of x ([rows][C], contiguous) normalized and quantized into y ([rows][C]),
 * and into yf (float32) where not NULL; returns how many rows are past UNSAFE_SQUARES. */
static inline long layer_norm_rows(const float* x, long rows, int C, const float* w, const float* b, float eps,
                                   float inv_scale, int zp, int qmin, int qmax, uint8_t* y, float* yf) {
  long unsafe = 0;
  for (long first = 0; first < rows; first += ROWS) {
    const int count = rows - first < ROWS ? (int)(rows - first) : ROWS;
    float mean[ROWS], rstd[ROWS];
    if (count == ROWS)
      unsafe += row_statistics(x + first * C, ROWS, C, C, eps, mean, rstd); /* (a constant count: the sums stay in registers) */
    else
      for (int r = 0; r < count; r++) unsafe += row_statistics(x + (first + r) * C, 1, C, C, eps, mean + r, rstd + r);
    for (int r = 0; r < count; r++)
      normalize_row(x + (first + r) * C, C, mean[r], rstd[r], w, b, inv_scale, zp, qmin, qmax, y + (first + r) * C,
                    yf ? yf + (first + r) * C : NULL);
  }
  return unsafe;
}

#endif
