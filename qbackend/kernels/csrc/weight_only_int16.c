/* Weight-only int4 / int8 matmul with int16 activations, for AVX2 CPUs.
 *
 * Why: torch 2.13's packed kernels run their fast path only with bf16 activations and are
 * compute-bound on AVX2 (a 4096x11008 int4 layer: 3.5-4 ms, 4x its memory-bandwidth time).
 * Here the activations are quantized per group to int16 (error ~1e-5 of the group's max,
 * below bf16 rounding), so the inner loop is integer multiply-adds (vpmaddwd, 16 per
 * instruction) on weights unpacked with two ops per 16 values.
 *
 * int4 weights are read in qbackend's neutral storage, uint8 [N][K/2] with u = q + 8 and the
 * even column in the low nibble, so nothing is repacked. Read as 16-bit lanes, lane i of a
 * 64-column block holds columns 4i + j in nibble j: extracting nibble j of all 16 lanes gives
 * columns j, 4 + j, ..., 60 + j, so the activations are quantized into that order
 * (x'[16j + i] = x[4i + j]). The weight is u * scale + offset per (row, group), the offsets as
 * int4_offsets.h reads them: an integer zero point's int8 code c streams 4% fewer bytes per int4
 * g128 decode step than a float32 offset, and gives the weight (u + c) * s exactly as the
 * reference dequantizes it.
 *
 * A row of x holding a NaN or an infinity cannot ride int16 values: it is quantized as zeros
 * and then computed again from the float weights (``float_rows``), so it comes out as the
 * float linear gives it (NaN, +-inf), never finite.
 *
 * Built a second time with AVX512-VNNI (kernel_build.py), int4 groups of 64 or more take
 * ``vpdpbusd``: x = 256 hi + lo (hi int8, lo uint8), so sum(u x) = 256 sum(u hi) + sum(lo u),
 * two byte dot products of the same integers. The weights unpack to bytes in three ops per 64
 * (even and odd columns), and the sums need 4 vpdpbusd per 64 weights where the AVX2 loop
 * needs 6 ops to unpack, 4 vpmaddwd and 4 vpaddd: the same sums, so the same bits, in fewer ops.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <omp.h>

#include "call_structs.h"
#include "int4_offsets.h"

#define BLOCK 64
#define ROW_TILE 4 /* activation rows sharing one unpacked weight block */
/* Weights are read this far ahead (prefetcht0): a decode step streams every weight once, and the
 * hardware prefetcher alone left a core at ~5 GB/s of the ~10 a plain sum reads (a 4-layer
 * Llama step's int4 weights, AVX2 EPYC Zen 3: 25.0 -> 19.1 ms on 1 thread, 14.4-14.5 ->
 * 10.8-11.6 on 2; its int8 weights 20.1 -> 19.0; 256-1024 bytes ahead gained less, 4096-8192
 * no more). A prefetch past the end does not fault. */
#define PREFETCH_BYTES 2048

static inline float sum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_shuffle_ps(a, a, 1));
  return _mm_cvtss_f32(a);
}

static inline __m256i dot4(__m256i w0, __m256i w1, __m256i w2, __m256i w3, const int16_t* x) {
  const __m256i* xv = (const __m256i*)x;
  __m256i a = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(xv)), _mm256_madd_epi16(w1, _mm256_loadu_si256(xv + 1)));
  __m256i b = _mm256_add_epi32(_mm256_madd_epi16(w2, _mm256_loadu_si256(xv + 2)), _mm256_madd_epi16(w3, _mm256_loadu_si256(xv + 3)));
  return _mm256_add_epi32(a, b);
}

/* The 64 weights of a block of neutral int4 storage as four vectors of 16: u[j] lane i = column 4i + j. */
static inline void nibbles(const uint8_t* block, __m256i u[4]) {
  const __m256i low4 = _mm256_set1_epi16(0x0F), v = _mm256_loadu_si256((const __m256i*)block);
  u[0] = _mm256_and_si256(v, low4);
  u[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  u[2] = _mm256_and_si256(_mm256_srli_epi16(v, 8), low4);
  u[3] = _mm256_srli_epi16(v, 12);
}

/* Where quantize_rows puts column k (of a row of K, 64-column blocks) of the int16 activations. */
enum activation_order {
  ORDER_PLAIN,   /* as x (int8 weights) */
  ORDER_NIBBLES, /* x'[16j + i] = x[4i + j] per block: the AVX2 int4 kernels' nibble order */
  ORDER_BYTES,   /* per block 4 x 32 bytes: low bytes of even columns, of odd ones, high bytes of
                    even, of odd (the VNNI int4 kernel: column 2i + p meets byte i of its weights) */
};

static inline void store_quantized(int16_t* row, int k, enum activation_order order, int32_t q) {
  const int block = k & ~(BLOCK - 1), in_block = k & (BLOCK - 1);
  if (order == ORDER_BYTES) {
    uint8_t* bytes = (uint8_t*)(row + block) + 32 * (in_block & 1) + (in_block >> 1);
    bytes[0] = (uint8_t)(q & 0xFF);
    bytes[2 * 32] = (uint8_t)(q >> 8); /* (arithmetic: the signed high byte) */
  } else {
    row[order == ORDER_NIBBLES ? block + 16 * (k & 3) + (in_block >> 2) : k] = (int16_t)q;
  }
}

/* Per-group int16 quantization of M rows of K floats: xs = group max / 32767, xsum = sum of
 * the quantized values times xs (what the weight offsets multiply), per ``sum_group`` columns,
 * written in ``order``. Vectorised (a decode step's 17 calls spent ~150 us here, one thread,
 * element by element); the same floats and roundings as lrintf(x / scale). Returns how many
 * rows hold a NaN or an infinity (quantized as zeros: FLOAT_ROWS redoes them). */
static int quantize_rows(int M, int K, int group, int sum_group, enum activation_order order, const float* x, int16_t* xq,
                         float* xs, float* xsum) {
  const int G = K / group, S = K / sum_group;
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
  int bad_rows = 0;
  for (int m = 0; m < M; m++) {
    int bad = 0;
    for (int g = 0; g < G; g++) {
      const float* src = x + (size_t)m * K + (size_t)g * group;
      __m256 amax = _mm256_setzero_ps();
      for (int k = 0; k < group; k += 8) {
        const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(src + k));
        const __m256 finite = _mm256_cmp_ps(a, inf, _CMP_LT_OQ);
        amax = _mm256_max_ps(amax, _mm256_and_ps(a, finite));
        bad |= _mm256_movemask_ps(finite) != 0xFF;
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
      const float top = _mm_cvtss_f32(h), scale = top > 0.f ? top / 32767.f : 1.f;
      /* (a group below ~1e-34 has a subnormal scale whose inverse is inf: it counts as zeros) */
      const __m256 inv = _mm256_set1_ps(isfinite(1.f / scale) ? 1.f / scale : 0.f);
      xs[(size_t)m * G + g] = scale;
      for (int part = 0; part < group / sum_group; part++) {
        __m256i sum = _mm256_setzero_si256();
        for (int k0 = part * sum_group; k0 < (part + 1) * sum_group; k0 += 8) {
          const __m256 v = _mm256_loadu_ps(src + k0);
          const __m256 finite = _mm256_cmp_ps(_mm256_andnot_ps(sign, v), inf, _CMP_LT_OQ);
          /* (round to nearest even, as lrintf; a NaN or infinity as 0: the row is redone in float) */
          const __m256i q = _mm256_and_si256(_mm256_cvtps_epi32(_mm256_mul_ps(v, inv)), _mm256_castps_si256(finite));
          sum = _mm256_add_epi32(sum, q);
          int32_t lanes[8];
          _mm256_storeu_si256((__m256i*)lanes, q);
          for (int i = 0; i < 8; i++) store_quantized(xq + (size_t)m * K, g * group + k0 + i, order, lanes[i]);
        }
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        xsum[(size_t)m * S + (size_t)g * (group / sum_group) + part] = (float)_mm_cvtsi128_si32(t) * scale;
      }
    }
    bad_rows += bad;
  }
  return bad_rows;
}

#ifdef __AVX512VNNI__
/* sum(u x) over a block of 64 columns, added to lo / hi: x in ORDER_BYTES, u the block's 32 bytes. */
static inline void bytes_dot(__m256i even, __m256i odd, const uint8_t* xb, __m256i* lo, __m256i* hi) {
  const __m256i* xv = (const __m256i*)xb;
  *lo = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(*lo, _mm256_loadu_si256(xv), even), _mm256_loadu_si256(xv + 1), odd);
  *hi = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(*hi, even, _mm256_loadu_si256(xv + 2)), odd, _mm256_loadu_si256(xv + 3));
}

static inline void even_odd(const uint8_t* block, __m256i* even, __m256i* odd) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), v = _mm256_loadu_si256((const __m256i*)block);
  *even = _mm256_and_si256(v, low4);
  *odd = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
}

#endif

/* A group's float sum from its low and high bytes' int32 sums: 256 hi + lo. */
static inline __m256 group_sum(__m256i lo, __m256i hi) {
  return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(hi, 8), lo));
}

/* int4, group >= 64: one integer sum per (row, group), then one float multiply-add. ``bytes``
 * (the VNNI build, x in ORDER_BYTES): the sums as vpdpbusd pairs, else vpmaddwd on nibbles. */
static inline __attribute__((always_inline)) void int4_row(int mt, int N, int K, int group, int n, const uint8_t* w,
                                                           const float* scale, const void* offset, int codes,
                                                           const int16_t* xq, const float* xs, const float* xsum, float* y,
                                                           int bytes) {
  const int G = K / group, blocks = group / BLOCK;
  const uint8_t* wn = w + (size_t)n * (K / 2);
  __m256 acc[ROW_TILE];
  float tail[ROW_TILE];
  for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps(), tail[i] = 0.f;
  for (int g = 0; g < G; g++) {
    __m256i isum[ROW_TILE], hi[ROW_TILE]; /* (hi: the high bytes' sums, ``bytes`` only) */
    for (int i = 0; i < mt; i++) isum[i] = hi[i] = _mm256_setzero_si256();
    for (int b = g * blocks; b < (g + 1) * blocks; b++) {
      _mm_prefetch((const char*)(wn + (size_t)b * 32 + PREFETCH_BYTES), _MM_HINT_T0);
#ifdef __AVX512VNNI__
      if (bytes) {
        __m256i even, odd;
        even_odd(wn + (size_t)b * 32, &even, &odd);
        for (int i = 0; i < mt; i++) bytes_dot(even, odd, (const uint8_t*)(xq + (size_t)i * K + (size_t)b * BLOCK), &isum[i], &hi[i]);
        continue;
      }
#endif
      __m256i u[4];
      nibbles(wn + (size_t)b * 32, u);
      for (int i = 0; i < mt; i++)
        isum[i] = _mm256_add_epi32(isum[i], dot4(u[0], u[1], u[2], u[3], xq + (size_t)i * K + (size_t)b * BLOCK));
    }
    const float s = scale[(size_t)n * G + g], o = group_offset(offset, codes, scale, (size_t)n * G + g);
    for (int i = 0; i < mt; i++) {
      const __m256 sum = bytes ? group_sum(isum[i], hi[i]) : _mm256_cvtepi32_ps(isum[i]);
      acc[i] = _mm256_fmadd_ps(sum, _mm256_set1_ps(s * xs[(size_t)i * G + g]), acc[i]);
      tail[i] = fmaf(o, xsum[(size_t)i * G + g], tail[i]);
    }
  }
  for (int i = 0; i < mt; i++) y[(size_t)i * N + n] = sum8(acc[i]) + tail[i];
}

#ifdef __AVX512VNNI__
/* One activation row (decode): weight rows a and b side by side share each activation load
 * (5 loads per 64 weights -> 3). a and b are far apart, each read front to back: two streams
 * the prefetchers follow. Rows a and a + 1 interleaved read memory at 0.85x the rate. */
static inline void int4_two_rows_vnni(int K, int group, int a, int b, const uint8_t* w, const float* scale,
                                      const void* offset, int codes, const int16_t* xq, const float* xs, const float* xsum,
                                      float* y) {
  const int G = K / group, blocks = group / BLOCK;
  const uint8_t *wa = w + (size_t)a * (K / 2), *wb = w + (size_t)b * (K / 2);
  __m256 acc_a = _mm256_setzero_ps(), acc_b = _mm256_setzero_ps();
  float tail_a = 0.f, tail_b = 0.f;
  for (int g = 0; g < G; g++) {
    __m256i lo_a = _mm256_setzero_si256(), hi_a = lo_a, lo_b = lo_a, hi_b = lo_a;
    for (int block = g * blocks; block < (g + 1) * blocks; block++) {
      __m256i even_a, odd_a, even_b, odd_b;
      _mm_prefetch((const char*)(wa + (size_t)block * 32 + PREFETCH_BYTES), _MM_HINT_T0);
      _mm_prefetch((const char*)(wb + (size_t)block * 32 + PREFETCH_BYTES), _MM_HINT_T0);
      even_odd(wa + (size_t)block * 32, &even_a, &odd_a);
      even_odd(wb + (size_t)block * 32, &even_b, &odd_b);
      const uint8_t* xb = (const uint8_t*)(xq + (size_t)block * BLOCK);
      bytes_dot(even_a, odd_a, xb, &lo_a, &hi_a);
      bytes_dot(even_b, odd_b, xb, &lo_b, &hi_b);
    }
    const size_t ga = (size_t)a * G + g, gb = (size_t)b * G + g;
    acc_a = _mm256_fmadd_ps(group_sum(lo_a, hi_a), _mm256_set1_ps(scale[ga] * xs[g]), acc_a);
    acc_b = _mm256_fmadd_ps(group_sum(lo_b, hi_b), _mm256_set1_ps(scale[gb] * xs[g]), acc_b);
    tail_a = fmaf(group_offset(offset, codes, scale, ga), xsum[g], tail_a);
    tail_b = fmaf(group_offset(offset, codes, scale, gb), xsum[g], tail_b);
  }
  y[a] = sum8(acc_a) + tail_a;
  y[b] = sum8(acc_b) + tail_b;
}

/* One row of x: each thread's share of the weight rows in two halves read side by side. */
static void int4_one_row_vnni(int threads, int N, int K, int group, const uint8_t* w, const float* scale,
                              const void* offset, int codes, const int16_t* xq, const float* xs, const float* xsum, float* y) {
#pragma omp parallel num_threads(threads)
  {
    const int T = omp_get_num_threads(), t = omp_get_thread_num();
    const int begin = (int)((long)N * t / T), end = (int)((long)N * (t + 1) / T), half = (end - begin) / 2;
    for (int i = 0; i < half; i++)
      int4_two_rows_vnni(K, group, begin + i, begin + half + i, w, scale, offset, codes, xq, xs, xsum, y);
    if ((end - begin) & 1) int4_row(1, N, K, group, end - 1, w, scale, offset, codes, xq, xs, xsum, y, 1);
  }
}
#endif

/* int4, group 32: the block's lanes 0-7 hold the first group, 8-15 the second, so the int32
 * sums carry one group in each 128-bit half (activations share one scale per block). */
static inline void int4_row_g32(int mt, int N, int K, int n, const uint8_t* w, const float* scale, const void* offset,
                                int codes, const int16_t* xq, const float* xs, const float* xsum, float* y) {
  const int G = K / 32, B = K / BLOCK;
  const uint8_t* wn = w + (size_t)n * (K / 2);
  __m256 acc[ROW_TILE];
  float tail[ROW_TILE];
  for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps(), tail[i] = 0.f;
  for (int b = 0; b < B; b++) {
    __m256i u[4];
    _mm_prefetch((const char*)(wn + (size_t)b * 32 + PREFETCH_BYTES), _MM_HINT_T0);
    nibbles(wn + (size_t)b * 32, u);
    const float* s = scale + (size_t)n * G + 2 * b;
    const float o[2] = {group_offset(offset, codes, scale, (size_t)n * G + 2 * b),
                        group_offset(offset, codes, scale, (size_t)n * G + 2 * b + 1)};
    for (int i = 0; i < mt; i++) {
      const float x_scale = xs[(size_t)i * B + b];
      const __m256 both = _mm256_set_m128(_mm_set1_ps(s[1] * x_scale), _mm_set1_ps(s[0] * x_scale));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot4(u[0], u[1], u[2], u[3], xq + (size_t)i * K + (size_t)b * BLOCK)), both, acc[i]);
      tail[i] = fmaf(o[1], xsum[(size_t)i * G + 2 * b + 1], fmaf(o[0], xsum[(size_t)i * G + 2 * b], tail[i]));
    }
  }
  for (int i = 0; i < mt; i++) y[(size_t)i * N + n] = sum8(acc[i]) + tail[i];
}

/* int8 symmetric per output channel: w int8 [N][K], w = q * scale[n]. */
static inline void int8_row(int mt, int N, int K, int n, const int8_t* w, const float* scale, const int16_t* xq,
                            const float* xs, float* y) {
  const int B = K / BLOCK;
  const int8_t* wn = w + (size_t)n * K;
  __m256 acc[ROW_TILE];
  for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
  for (int b = 0; b < B; b++) {
    _mm_prefetch((const char*)(wn + (size_t)b * BLOCK + PREFETCH_BYTES), _MM_HINT_T0);
    const __m128i* src = (const __m128i*)(wn + (size_t)b * BLOCK);
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(src)), w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(src + 1));
    const __m256i w2 = _mm256_cvtepi8_epi16(_mm_loadu_si128(src + 2)), w3 = _mm256_cvtepi8_epi16(_mm_loadu_si128(src + 3));
    for (int i = 0; i < mt; i++)
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot4(w0, w1, w2, w3, xq + (size_t)i * K + (size_t)b * BLOCK)),
                               _mm256_set1_ps(xs[(size_t)i * B + b]), acc[i]);
  }
  for (int i = 0; i < mt; i++) y[(size_t)i * N + n] = sum8(acc[i]) * scale[n];
}

/* The rows of x holding a NaN or an infinity, computed from the float weights: w(n, k) is
 * ``weight(n, k)`` (scalar; such rows are rare and the result must be IEEE's, not fast). */
#define FLOAT_ROWS(M, N, K, x, y, weight)                                  \
  for (int m = 0; m < (M); m++) {                                          \
    const float* xm = (x) + (size_t)m * (K);                               \
    int finite = 1;                                                        \
    for (int k = 0; k < (K) && finite; k++) finite = isfinite(xm[k]);      \
    if (finite) continue;                                                  \
    for (int n = 0; n < (N); n++) {                                        \
      float sum = 0.f;                                                     \
      for (int k = 0; k < (K); k++) sum += xm[k] * (weight);              \
      (y)[(size_t)m * (N) + n] = sum;                                      \
    }                                                                      \
  }

/* The float weight as the reference dequantizes it: with an integer zero point (codes, or an
 * offset of -z s), (u - z) * s, so a weight on the zero point is exactly 0 (inf * 0 must give
 * NaN, as in the reference, not inf * 1e-9); with a float zero point, u * s + offset. */
static inline float int4_weight(const uint8_t* w, const float* scale, const void* offset_, int codes, int K, int group,
                                int n, int k) {
  const int u = (w[(size_t)n * (K / 2) + k / 2] >> (4 * (k & 1))) & 0x0F;
  const size_t g = (size_t)n * (K / group) + k / group;
  if (codes) return (float)(u + ((const int8_t*)offset_)[g]) * scale[g];
  const float* offset = (const float*)offset_;
  const float zero = -offset[g] / scale[g], nearest = nearbyintf(zero);
  if (fabsf(zero - nearest) < 1e-3f) return ((float)u - nearest) * scale[g];
  return (float)u * scale[g] + offset[g];
}

/* The ROW_TILE cases are spelled out so the compiler keeps each tile's sums in registers. */
#define FOR_ROW_TILES(END, CALL)                    \
  for (int m0 = mb; m0 < (END); m0 += ROW_TILE) {   \
    const int rest = (END) - m0;                    \
    switch (rest < ROW_TILE ? rest : ROW_TILE) {    \
      case 1: CALL(1); break;                       \
      case 2: CALL(2); break;                       \
      case 3: CALL(3); break;                       \
      default: CALL(ROW_TILE); break;               \
    }                                               \
  }

/* Every weight row meets the quantized activations X_ROWS rows at a time: a block of them stays
 * in L2 (64 rows of 5632 int16 are 720 KB) while the weights stream past, where all M rows per
 * weight row re-read the whole activation (2-6 MB at 512 rows) from L3 for every weight row: a
 * 512-token prefill of a 2048 -> 11264 int4 layer 292 -> 262 ms on an AVX2 EPYC. */
#define X_ROWS 64
#define FOR_ROW_BLOCKS(M, N, CALL)                                      \
  _Pragma("omp parallel num_threads(threads)")                          \
  for (int mb = 0; mb < (M); mb += X_ROWS) {                            \
    const int end = (M) - mb < X_ROWS ? (M) : mb + X_ROWS;              \
    _Pragma("omp for schedule(static)")                                 \
    for (int n = 0; n < (N); n++) FOR_ROW_TILES(end, CALL)              \
  }

/* y[M][N] = x[M][K] @ dequantized(w).T; xq / xs / xsum are scratch for the quantized x. */
void qb_int4_mm(int threads, int M, int N, int K, int group, int codes, const float* x, const uint8_t* w,
                const float* scale, const void* offset, int16_t* xq, float* xs, float* xsum, float* y) {
  const int xgroup = group < BLOCK ? BLOCK : group, G = K / group, XG = K / xgroup;
#ifdef __AVX512VNNI__
  if (group >= BLOCK) {
    const int bad_rows = quantize_rows(M, K, group, group, ORDER_BYTES, x, xq, xs, xsum);
    if (M == 1) {
      int4_one_row_vnni(threads, N, K, group, w, scale, offset, codes, xq, xs, xsum, y);
    } else {
#define INT4_VNNI_CALL(T) int4_row(T, N, K, group, n, w, scale, offset, codes, xq + (size_t)m0 * K, xs + (size_t)m0 * G, xsum + (size_t)m0 * G, y + (size_t)m0 * N, 1)
      FOR_ROW_BLOCKS(M, N, INT4_VNNI_CALL)
    }
    if (bad_rows) FLOAT_ROWS(M, N, K, x, y, int4_weight(w, scale, offset, codes, K, group, n, k))
    return;
  }
#endif
  const int bad_rows = quantize_rows(M, K, xgroup, group, ORDER_NIBBLES, x, xq, xs, xsum);
#define INT4_CALL(T)                                                                                                  \
  if (group < BLOCK)                                                                                                  \
    int4_row_g32(T, N, K, n, w, scale, offset, codes, xq + (size_t)m0 * K, xs + (size_t)m0 * XG, xsum + (size_t)m0 * G, y + (size_t)m0 * N); \
  else                                                                                                                \
    int4_row(T, N, K, group, n, w, scale, offset, codes, xq + (size_t)m0 * K, xs + (size_t)m0 * G, xsum + (size_t)m0 * G, y + (size_t)m0 * N, 0)
  FOR_ROW_BLOCKS(M, N, INT4_CALL)
  if (bad_rows) FLOAT_ROWS(M, N, K, x, y, int4_weight(w, scale, offset, codes, K, group, n, k))
}

void qb_int8_mm(int threads, int M, int N, int K, const float* x, const int8_t* w, const float* scale, int16_t* xq,
                float* xs, float* xsum, float* y) {
  const int B = K / BLOCK;
  const int bad_rows = quantize_rows(M, K, BLOCK, BLOCK, ORDER_PLAIN, x, xq, xs, xsum);
#define INT8_CALL(T) int8_row(T, N, K, n, w, scale, xq + (size_t)m0 * K, xs + (size_t)m0 * B, y + (size_t)m0 * N)
  FOR_ROW_BLOCKS(M, N, INT8_CALL)
  if (bad_rows) FLOAT_ROWS(M, N, K, x, y, (float)w[(size_t)n * K + k] * scale[n])
}

int qb_weight_only_call(int threads, const weight_only_call_t* c, const float* x, char* scratch, float* y, void* unused) {
  (void)unused;
  int16_t* xq = (int16_t*)scratch;
  float *xs = (float*)(scratch + c->scales_at), *xsum = (float*)(scratch + c->sums_at);
  if (c->bits == 4)
    qb_int4_mm(threads, c->M, c->N, c->K, c->group, c->codes, x, (const uint8_t*)c->w, c->scale, c->offset, xq, xs, xsum, y);
  else
    qb_int8_mm(threads, c->M, c->N, c->K, x, (const int8_t*)c->w, c->scale, xq, xs, xsum, y);
  return 0;
}
