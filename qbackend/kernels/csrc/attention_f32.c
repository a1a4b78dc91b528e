/* Float32 scaled-dot-product attention, softmax(q k^T * scale + mask) v, for each batch and
 * head: torch 2.13's CPU flash attention ran BERT-base's heads (128 x 128, head dim 64) at
 * ~25% of this CPU's float32 FMA rate; a head's keys and one block of query rows fit in L1/L2.
 *
 * Per (batch, head): the keys are packed transposed, [S / 16][D][16] (zero columns past S),
 * so scores for a tile of query rows x 16 keys (a panel) are one vector FMA per row and head-dim
 * step (a broadcast query element, the keys' vector). Each query row's scores then go through the
 * softmax in place (max, e^(s - max), their sum), and the output rows are
 * sum_j p[j] v[j] / sum, a tile of rows x 16-column panels of the head dim at a time. Written as
 * [B][L][H][D] (or [L][B][H][D], out_stride): the layout the head merge after attention
 * (transpose(1, 2).reshape) reads as a view; grouped queries' rows go straight to their
 * query head's place (no copy to reorder them). D % 16 == 0. The output is float32, or
 * uint8 quantized as the reference's quantize of that float32 value (the out-projection's
 * input: one pass less over the output, and no float copy of it). A row reads no key past its
 * causal position nor in its mask's -inf tail (a static cache's unfilled rows): their weights
 * are exactly 0, and what those rows hold (a NaN) cannot reach the output.
 *
 * Built twice: for AVX2 (16 columns = two ymm, tiles of 6 rows: 12 accumulators of 16
 * registers) and, in the AVX-512 library, with one zmm per 16 columns and tiles of 12 rows x
 * 32 columns (24 accumulators of 32: one broadcast per two FMAs; 8 x 16 had one per FMA:
 * vit_b_16's heads at batch 8 7.3 -> 7.0 ms, BERT's at batch 8 3.5 -> 3.3 ms, Zen 4). A
 * decode step's 8 query rows per key / value head (grouped queries) are one tile. Each output
 * element is the same chain of FMAs in both, so the two give the same bits.
 *
 * ``qb_attention_kv_int8`` reads keys and values stored as int8 rows with a float32 scale
 * each (qbackend/llm/kv_int8.py, a KV cache option): each element is widened and multiplied by its
 * row's scale as it is loaded, so the result is attention_f32's on those dequantized values,
 * bit for bit, from a quarter of the bytes. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "call_structs.h"
#include "vec_math.h"

#define KEYS 16        /* key columns per score tile */
#define QUERY_BLOCK 64 /* query rows whose scores one thread holds at a time */
/* Keys and values are read this many rows ahead (prefetcht0): a decode step's caches come from
 * memory, the weights having streamed through the caches since the last step, and the
 * hardware prefetchers alone read them at ~9 GB/s (2 threads, 2048 positions, 4 layers: 1.8 ms
 * from memory, 0.7 from L3). A prefetch past the end does not fault. */
#define PREFETCH_KEYS 32

/* Element ``offset`` of keys / values: float32, or int8 (kv_int8) */
static inline __attribute__((always_inline)) const void* element(const void* p, long offset, int kv_int8) {
  return kv_int8 ? (const void*)((const int8_t*)p + offset) : (const void*)((const float*)p + offset);
}

/* 8 keys / values from ``p``: float32, or int8 times the row's ``scale`` */
static inline __attribute__((always_inline)) __m256 load8(const void* p, const float* scale, int kv_int8) {
  if (!kv_int8) return _mm256_loadu_ps((const float*)p);
  const __m256 widened = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
  return _mm256_mul_ps(widened, _mm256_set1_ps(*scale));
}

/* r[i][j] <- r[j][i] */
static inline __attribute__((always_inline)) void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; i++) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

/* The first PREFETCH_KEYS rows of keys / values at once: the loops prefetch rows that far
 * ahead only, and a short cache's rows (32 positions) all came from memory one after another:
 * 18 -> 16 us per layer of a decode step. */
static inline __attribute__((always_inline)) void prefetch_rows(const void* p, long row, int S, int D, int kv_int8) {
  for (int j = 0; j < PREFETCH_KEYS && j < S; j++)
    for (int d = 0; d < D; d += kv_int8 ? 64 : 16) _mm_prefetch((const char*)element(p, j * row + d, kv_int8), _MM_HINT_T0);
}

/* Whole tiles by 8 x 8 transposes: a decode step's few query rows read each packed key once,
 * so packing element by element had cost more than the scores (2048 keys: 3/4 of the call). */
static inline __attribute__((always_inline)) void pack_keys(const void* k, const float* k_scales, long row, int S, int D,
                                                            int S16, float* kt, int kv_int8) {
  int j0 = 0;
  prefetch_rows(k, row, S, D, kv_int8); /* (the rows the loop's prefetches do not reach) */
  for (; j0 + KEYS <= S; j0 += KEYS) {
    for (int j = j0 + PREFETCH_KEYS; j < j0 + PREFETCH_KEYS + KEYS && j < S; j++)
      for (int d = 0; d < D; d += kv_int8 ? 64 : 16) /* (one prefetch a 64-byte line) */
        _mm_prefetch((const char*)element(k, j * row + d, kv_int8), _MM_HINT_T0);
    for (int half = 0; half < KEYS; half += 8)
      for (int d0 = 0; d0 < D; d0 += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; i++) {
          const int j = j0 + half + i;
          r[i] = load8(element(k, j * row + d0, kv_int8), k_scales + j, kv_int8);
        }
        transpose8(r);
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(kt + (size_t)j0 * D + (d0 + i) * KEYS + half, r[i]);
      }
  }
  for (; j0 < S16; j0 += KEYS)
    for (int d = 0; d < D; d++)
      for (int j = 0; j < KEYS; j++) {
        const long at = (long)(j0 + j) * row + d;
        kt[((size_t)j0 * D) + d * KEYS + j] =
            j0 + j >= S ? 0.0f : kv_int8 ? (float)((const int8_t*)k)[at] * k_scales[j0 + j] : ((const float*)k)[at];
      }
}

/* 16 floats: one zmm, or two ymm */
#ifdef __AVX512F__
#define ROWS 12  /* query rows per tile */
#define PANELS 2 /* 16-column panels per tile: 24 accumulators, 2 loads and a broadcast of 32 registers */
#define MORE_ROW_CASES(CALL, P)      \
  case 6: CALL(6, P); break;         \
  case 7: CALL(7, P); break;         \
  case 8: CALL(8, P); break;         \
  case 9: CALL(9, P); break;         \
  case 10: CALL(10, P); break;       \
  case 11: CALL(11, P); break;
typedef __m512 vec16;
static inline __attribute__((always_inline)) vec16 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __attribute__((always_inline)) vec16 load16_int8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline __attribute__((always_inline)) vec16 zero16(void) { return _mm512_setzero_ps(); }
static inline __attribute__((always_inline)) vec16 fmadd16(const float* x, vec16 a, vec16 acc) {
  return _mm512_fmadd_ps(_mm512_set1_ps(*x), a, acc);
}
static inline __attribute__((always_inline)) vec16 mul16(vec16 a, float x) { return _mm512_mul_ps(a, _mm512_set1_ps(x)); }
static inline __attribute__((always_inline)) void store16(float* p, vec16 a) { _mm512_storeu_ps(p, a); }
static inline __attribute__((always_inline)) __m256 low8(vec16 a) { return _mm512_castps512_ps256(a); }
static inline __attribute__((always_inline)) __m256 high8(vec16 a) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
}
#else
#define ROWS 6   /* query rows per tile */
#define PANELS 1 /* 16-column panels per tile: 12 accumulators, 2 loads and a broadcast of 16 registers */
#define MORE_ROW_CASES(CALL, P)
typedef struct {
  __m256 lo, hi;
} vec16;
static inline __attribute__((always_inline)) vec16 load16(const float* p) {
  return (vec16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
static inline __attribute__((always_inline)) vec16 load16_int8(const int8_t* p) {
  return (vec16){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))),
                 _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))))};
}
static inline __attribute__((always_inline)) vec16 zero16(void) { return (vec16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline __attribute__((always_inline)) vec16 fmadd16(const float* x, vec16 a, vec16 acc) {
  const __m256 b = _mm256_broadcast_ss(x);
  return (vec16){_mm256_fmadd_ps(b, a.lo, acc.lo), _mm256_fmadd_ps(b, a.hi, acc.hi)};
}
static inline __attribute__((always_inline)) vec16 mul16(vec16 a, float x) {
  const __m256 b = _mm256_set1_ps(x);
  return (vec16){_mm256_mul_ps(a.lo, b), _mm256_mul_ps(a.hi, b)};
}
static inline __attribute__((always_inline)) void store16(float* p, vec16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
static inline __attribute__((always_inline)) __m256 low8(vec16 a) { return a.lo; }
static inline __attribute__((always_inline)) __m256 high8(vec16 a) { return a.hi; }
#endif

/* scores[r][j0 .. j0 + 16 * panels - 1] = scale * q[r] . k[j] for ``rows`` query rows: each
 * panel is a packed 16-key tile, each query element broadcast once for all of them */
static inline __attribute__((always_inline)) void score_tile(int rows, int panels, int D, const float* q, long q_row,
                                                             const float* kt, float scale, float* scores, int S16) {
  vec16 acc[ROWS][PANELS];
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < panels; c++) acc[r][c] = zero16();
  for (int d = 0; d < D; d++) {
    vec16 keys[PANELS];
    for (int c = 0; c < panels; c++) keys[c] = load16(kt + (size_t)c * KEYS * D + d * KEYS);
    for (int r = 0; r < rows; r++)
      for (int c = 0; c < panels; c++) acc[r][c] = fmadd16(q + r * q_row + d, keys[c], acc[r][c]);
  }
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < panels; c++) store16(scores + (size_t)r * S16 + c * KEYS, mul16(acc[r][c], scale));
}

/* out[r][c .. c + 16 * panels - 1] = sum over j < S of p[r][j] v[j][c ..] * inv_sum[r]; ``out``
 * is float32, or uint8 where a->quantized. Each row ``span`` values from v are prefetched
 * ahead: the first call of a block whole rows, so the later passes read them from L2 (each
 * pass had read every row's next line from memory again: a decode step's attention over 2048
 * cached positions 450-585 -> 340-410 us per layer). */
static inline __attribute__((always_inline)) void output_tile(int rows, int panels, int S, const float* p, int S16,
                                                              const void* v, const float* v_scales, long v_row,
                                                              const float* inv_sum, const attention_call_t* a, void* out,
                                                              long out_row, int kv_int8, int span) {
  vec16 acc[ROWS][PANELS];
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < panels; c++) acc[r][c] = zero16();
  for (int j = 0; j < S; j++) {
    for (int d = 0; d < span; d += kv_int8 ? 64 : 16) /* (one prefetch a 64-byte line) */
      _mm_prefetch((const char*)element(v, (j + PREFETCH_KEYS) * v_row + d, kv_int8), _MM_HINT_T0);
    vec16 values[PANELS];
    for (int c = 0; c < panels; c++)
      values[c] = kv_int8 ? mul16(load16_int8((const int8_t*)v + j * v_row + c * 16), v_scales[j])
                          : load16((const float*)v + j * v_row + c * 16);
    for (int r = 0; r < rows; r++)
      for (int c = 0; c < panels; c++) acc[r][c] = fmadd16(p + (size_t)r * S16 + j, values[c], acc[r][c]);
  }
  if (a->quantized) {
    const __m256 scale = _mm256_set1_ps(a->out_inv_scale), zp = _mm256_set1_ps((float)a->out_zero_point),
                 lo = _mm256_set1_ps((float)a->out_qmin), hi = _mm256_set1_ps((float)a->out_qmax);
    for (int r = 0; r < rows; r++) /* (the float32 value first, then its quantize: the reference's two roundings) */
      for (int c = 0; c < panels; c++) {
        const vec16 o = mul16(acc[r][c], inv_sum[r]);
        uint8_t* y = (uint8_t*)out + r * out_row + c * 16;
        store_quantized8(_mm256_mul_ps(low8(o), scale), zp, lo, hi, y);
        store_quantized8(_mm256_mul_ps(high8(o), scale), zp, lo, hi, y + 8);
      }
    return;
  }
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < panels; c++) store16((float*)out + r * out_row + c * 16, mul16(acc[r][c], inv_sum[r]));
}

#define ROW_CASES(ROWS_LEFT, CALL, P)                                                                \
  switch (ROWS_LEFT) {                                                                               \
    case 1: CALL(1, P); break;                                                                       \
    case 2: CALL(2, P); break;                                                                       \
    case 3: CALL(3, P); break;                                                                       \
    case 4: CALL(4, P); break;                                                                       \
    case 5: CALL(5, P); break;                                                                       \
    MORE_ROW_CASES(CALL, P)                                                                          \
    default: CALL(ROWS, P);                                                                          \
  }

/* A tile of all PANELS panels where ``COLUMNS_LEFT`` (a multiple of 16) has them, else of one */
#define PANEL_CASES(COLUMNS_LEFT, ROWS_LEFT, CALL) \
  if ((COLUMNS_LEFT) >= PANELS * 16) {             \
    ROW_CASES(ROWS_LEFT, CALL, PANELS)             \
  } else {                                         \
    ROW_CASES(ROWS_LEFT, CALL, 1)                  \
  }

/* One row of scores (with its mask) -> e^(s - max) in place; returns 1 / their sum. A NaN
 * score (max would skip it) or a +inf one (inf - inf) makes the row NaN, as softmax does; a
 * row masked whole (-inf everywhere) gives 0, as torch's CPU attention does (not 0 * inf). */
static float softmax_row(float* s, int S, int S16, const float* mask, long mask_col) {
  if (mask && mask_col == 1) { /* (a padding mask's row: the common case, vectorised) */
    int j = 0;
    for (; j + 8 <= S; j += 8) _mm256_storeu_ps(s + j, _mm256_add_ps(_mm256_loadu_ps(s + j), _mm256_loadu_ps(mask + j)));
    for (; j < S; j++) s[j] += mask[j];
  } else if (mask) {
    for (int j = 0; j < S; j++) s[j] += mask[j * mask_col];
  }
  for (int j = S; j < S16; j++) s[j] = -INFINITY;
  __m256 m = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  for (int j = 0; j < S16; j += 8) {
    const __m256 x = _mm256_loadu_ps(s + j);
    m = _mm256_max_ps(m, x);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4e));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xb1));
  if (_mm256_movemask_ps(nan) || _mm256_cvtss_f32(m) == INFINITY) return NAN;
  __m256 sum = _mm256_setzero_ps();
  for (int j = 0; j < S16; j += 8) {
    const __m256 x = _mm256_loadu_ps(s + j); /* -inf (a padding column, or masked): exactly 0, where exp256 gives 1e-38 */
    const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(x, m)), _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  float lanes[8], total = 0.0f;
  _mm256_storeu_ps(lanes, sum);
  for (int i = 0; i < 8; i++) total += lanes[i];
  return total > 0.0f ? 1.0f / total : 0.0f;
}

/* Row ``row`` of the mask for batch ``b``, head ``h``, or NULL without a mask */
static inline const float* mask_row(const attention_call_t* a, const float* mask, int b, int h, int row) {
  return mask ? mask + b * a->mask_stride[0] + h * a->mask_stride[1] + row * a->mask_stride[2] : NULL;
}

/* 0, or -1 when a thread could not allocate its packed keys and scores (the output is then
 * incomplete: the caller raises) */
static inline __attribute__((always_inline)) int attention(int threads, const attention_call_t* a, const float* q,
                                                           const void* k, const void* v, const float* k_scales,
                                                           const float* v_scales, const float* mask, void* out,
                                                           int kv_int8) {
  const int S16 = (a->S + KEYS - 1) / KEYS * KEYS, blocks = (a->L + QUERY_BLOCK - 1) / QUERY_BLOCK;
  const long out_row = a->out_stride[1];
  const size_t out_bytes = a->quantized ? 1 : sizeof(float);
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    float* kt = malloc(sizeof(float) * S16 * a->D);
    float* scores = malloc(sizeof(float) * QUERY_BLOCK * S16);
    float inv_sum[QUERY_BLOCK];
    int packed = -1;
    if (!kt || !scores) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static) collapse(2)
    for (int bh = 0; bh < a->B * a->H; bh++)
      for (int block = 0; block < blocks; block++) {
        if (!kt || !scores) continue;
        const int b = bh / a->H, h = bh % a->H, l0 = block * QUERY_BLOCK;
        const int n = a->L - l0 < QUERY_BLOCK ? a->L - l0 : QUERY_BLOCK;
        const float* qb = q + b * a->q_stride[0] + h * a->q_stride[1] + l0 * a->q_stride[2];
        const void* vb = element(v, b * a->v_stride[0] + h * a->v_stride[1], kv_int8);
        const float* vs = kv_int8 ? v_scales + b * a->v_scale_stride[0] + h * a->v_scale_stride[1] : NULL;
        if (packed != bh) {
          prefetch_rows(vb, a->v_stride[2], a->S, a->D, kv_int8);
          pack_keys(element(k, b * a->k_stride[0] + h * a->k_stride[1], kv_int8),
                    kv_int8 ? k_scales + b * a->k_scale_stride[0] + h * a->k_scale_stride[1] : NULL, a->k_stride[2], a->S,
                    a->D, S16, kt, kv_int8);
          packed = bh;
        }
        /* keys each row sees: all, or (causal) up to its position, and not a mask's -inf tail (a
           static cache's rows not yet filled); past them its scores are -inf, exactly 0 after the
           softmax. The block reads keys up to the furthest any row sees. */
        int visible[QUERY_BLOCK], seen = 0;
        for (int i = 0; i < n; i++) {
          const float* m = mask_row(a, mask, b, h, l0 + i);
          int end = a->causal_rows && (l0 + i) % a->causal_rows + 1 < a->S ? (l0 + i) % a->causal_rows + 1 : a->S;
          while (m && a->mask_stride[3] && end > 0 && m[(long)(end - 1) * a->mask_stride[3]] == -INFINITY) end--;
          visible[i] = end;
          seen = end > seen ? end : seen;
        }
        const int seen16 = (seen + KEYS - 1) / KEYS * KEYS;
        /* ...and a tile of rows only up to the furthest its rows see (causal rows: a triangle) */
        int tile_seen[(QUERY_BLOCK + ROWS - 1) / ROWS];
        for (int i = 0; i < n; i += ROWS) {
          tile_seen[i / ROWS] = 0;
          for (int r = i; r < n && r < i + ROWS; r++) tile_seen[i / ROWS] = visible[r] > tile_seen[i / ROWS] ? visible[r] : tile_seen[i / ROWS];
          const int tile16 = (tile_seen[i / ROWS] + KEYS - 1) / KEYS * KEYS;
          for (int j0 = 0; j0 < tile16; j0 += PANELS * KEYS) {
#define SCORES(R, P) score_tile(R, P, a->D, qb + i * a->q_stride[2], a->q_stride[2], kt + (size_t)j0 * a->D, a->scale, scores + (size_t)i * S16 + j0, S16)
            PANEL_CASES(tile16 - j0, n - i, SCORES)
          }
        }
        for (int i = 0; i < n; i++) {
          const float* m = mask_row(a, mask, b, h, l0 + i);
          inv_sum[i] = softmax_row(scores + (size_t)i * S16, visible[i], seen16, m, a->mask_stride[3]);
        }
        char* ob = (char*)out + ((size_t)b * a->out_stride[0] + (size_t)l0 * out_row + (size_t)h * a->out_stride[2]) * out_bytes;
        for (int c = 0; c < a->D; c += PANELS * 16) /* (a slice of v's columns stays in L1 across the row tiles) */
          for (int i = 0; i < n; i += ROWS) {
#define OUTPUTS(R, P) output_tile(R, P, tile_seen[i / ROWS], scores + (size_t)i * S16, S16, element(vb, c, kv_int8), vs, a->v_stride[2], inv_sum + i, a, ob + (i * out_row + c) * out_bytes, out_row, kv_int8, c == 0 && i == 0 ? a->D : 1)
            PANEL_CASES(a->D - c, n - i, OUTPUTS)
          }
      }
    free(kt);
    free(scores);
  }
  return failed ? -1 : 0;
}

int qb_attention_f32(int threads, const attention_call_t* a, const float* q, const float* k, const float* v,
                     const float* mask, void* out) {
  return attention(threads, a, q, k, v, NULL, NULL, mask, out, 0);
}

/* As a step of a kernel chain (qbackend/kernels/kernel_chain.py): ``s`` is the key length, given per
 * call (a decode step's keys grow by one row a step; the call fixes all else). */
int qb_attention_call(int threads, const attention_call_t* call, const float* q, const float* k, const float* v,
                      const float* mask, void* out, const void* s) {
  attention_call_t a = *call;
  a.S = (int)(intptr_t)s;
  return attention(threads, &a, q, k, v, NULL, NULL, mask, out, 0);
}

int qb_attention_kv_int8(int threads, const attention_call_t* a, const float* q, const int8_t* k, const int8_t* v,
                         const float* k_scales, const float* v_scales, const float* mask, void* out) {
  return attention(threads, a, q, k, v, k_scales, v_scales, mask, out, 1);
}
