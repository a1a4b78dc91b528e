/* Depthwise 3x3, 5x5 and 7x7 int8 convolution for CPUs with AVX512-VNNI: what
 * depthwise_conv_int8.c does (bias, GELU / SiLU / hardswish, a clamp, uint8 or float32 out), with
 * vpdpbusd (4 uint8 x int8 products added into each int32 lane) on ymm registers.
 *
 * Why: the AVX2 kernel spends ~40 instructions per 16 channels and output pixel widening bytes
 * to int16 and interleaving tap pairs, and ran MobileNetV2's depthwise layers at 30-35 GMAC/s;
 * on ConvNeXt's 96-channel 56x56 7x7 layers it lost to oneDNN (301 vs 246 us, Zen 4).
 * Here each input row is interleaved once into "quads": for every output column ow, kernel
 * column block q and channel, the 4 bytes x[iw + 4q .. iw + 4q + 3] with iw = ow * stride - pad
 * (columns past the window read the zero point against zero weights), so one kernel row of one
 * output is ceil(K / 4) vpdpbusd per 8 channels. An output pixel is K ceil(K / 4) vpdpbusd per
 * 8 channels, read straight from the quads of its K input rows; each thread keeps the quads of
 * the last K input rows it needed (K consecutive rows: distinct slots mod K), so a row is
 * interleaved once for up to K output rows.
 *
 * With a LayerNorm (ConvNeXt: depthwise 7x7 -> LayerNorm over channels -> quantize for the
 * linear after it), each output row's floats stay in a thread's scratch row and only their
 * normalized, quantized bytes are written (layer_norm_rows.h): the float tensor and a pass
 * reading it back are left out.
 *
 * Channels go 32 at a time; a last group of 16 reads with a byte mask, writes 16 channels, and
 * its packed constants are the low halves of the vectors only (so they hold C channels, no
 * padding). Padding columns and rows read the zero point, as in the AVX2 kernel, and ``add``
 * removes x_zp * sum(w) once per channel.
 * Lane order: vpunpck{l,h} work within 128-bit halves, so the 4 vectors of a 32-channel group
 * hold channels {0-3, 16-19}, {4-7, 20-23}, {8-11, 24-27}, {12-15, 28-31}; weights and
 * per-channel constants are packed in that order, and vpackssdw / vpackuswb (uint8 out) or
 * 128-bit permutes (float out) restore the natural one.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "call_structs.h"
#include "layer_norm_rows.h"
#include "padded_channels.h"
#include "vec_math.h"
#include "vnni_dot.h"

#define GROUP 32        /* channels per group */
#define QUAD_BYTES 128  /* a group's quad for one output column: 32 channels x 4 bytes */
#define MAX_WINDOW 7
#define PIXELS 8        /* output pixels a step: 16 accumulators, each weight vector loaded once for them */

static inline int quads_of(int window) { return (window + 3) / 4; }

/* One group's quad for one output column from its 4 input columns (NULL: padding). */
static inline void store_quad(const uint8_t* const in[4], __m256i zp, __mmask32 mask, uint8_t* out) {
  __m256i tap[4];
  for (int t = 0; t < 4; t++) tap[t] = in[t] ? _mm256_maskz_loadu_epi8(mask, in[t]) : zp;
  const __m256i lo01 = _mm256_unpacklo_epi8(tap[0], tap[1]), hi01 = _mm256_unpackhi_epi8(tap[0], tap[1]);
  const __m256i lo23 = _mm256_unpacklo_epi8(tap[2], tap[3]), hi23 = _mm256_unpackhi_epi8(tap[2], tap[3]);
  __m256i* dst = (__m256i*)out;
  _mm256_storeu_si256(dst, _mm256_unpacklo_epi16(lo01, lo23));
  _mm256_storeu_si256(dst + 1, _mm256_unpackhi_epi16(lo01, lo23));
  _mm256_storeu_si256(dst + 2, _mm256_unpacklo_epi16(hi01, hi23));
  _mm256_storeu_si256(dst + 3, _mm256_unpackhi_epi16(hi01, hi23));
}

/* Quads per input row and group: one for each column j = stride m (padded coordinates), m < OW +
 * 4 (Q - 1) / stride; output ow's quad q is quad m = ow + 4 q / stride (stride 1 or 2), so
 * quads are shared between outputs instead of built per output (7x7: 60 instead of 112 a row
 * of 56). Taps past a window's end read the next columns against zero weights. */
static inline int quad_columns(const dwconv_call_t* c) { return c->OW + 4 * (quads_of(c->window) - 1) / c->stride_w; }

/* The quads of input row ih of image n (or of a padding row): [group][m][QUAD_BYTES]. */
static void build_quads(const dwconv_call_t* c, const uint8_t* x, int n, int ih, uint8_t* out) {
  const int C = c->C, W = c->W, M = quad_columns(c), groups = (C + GROUP - 1) / GROUP;
  const __m256i zp = _mm256_set1_epi8((char)c->x_zp);
  if (ih < 0 || ih >= c->H) {
    memset(out, c->x_zp, (size_t)groups * M * QUAD_BYTES);
    return;
  }
  const uint8_t* row = x + ((size_t)n * c->H + ih) * W * C;
  for (int g = 0; g < groups; g++) {
    const int left = C - g * GROUP;
    const __mmask32 mask = left >= GROUP ? 0xFFFFFFFFu : (1u << left) - 1;
    uint8_t* dst = out + (size_t)g * M * QUAD_BYTES;
    for (int m = 0; m < M; m++) {
      const int iw0 = m * c->stride_w - c->pad_w;
      const uint8_t* in[4];
      for (int t = 0; t < 4; t++) in[t] = iw0 + t < 0 || iw0 + t >= W ? NULL : row + (size_t)(iw0 + t) * C + g * GROUP;
      store_quad(in, zp, mask, dst + (size_t)m * QUAD_BYTES);
    }
  }
}

/* What every pixel's epilogue reads. */
typedef struct {
  __m256 mult[4], add[4], lo, hi, inv, zp, lo_q, hi_q;
  int activation;
} epilogue_t;

/* f = clamp(activation(acc * mult + add), lo, hi) in lane order: stored as float32 in channel
 * order, or y = round(f * inv_scale + out_zp) within [qmin, qmax] — the clamp applied after
 * that map to bounds carried through it (lo_q / hi_q, cut to [qmin, qmax]): the same bytes, as
 * the map is monotone, and no int32 overflow for huge values. */
static inline __attribute__((always_inline)) void finish_pixel(const epilogue_t* e, const __m256i acc[4], int lanes,
                                                                uint8_t* y, float* yf) {
  __m256 f[4];
  for (int v = 0; v < 4; v++) f[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[v]), e->mult[v], e->add[v]);
  activate_lanes(e->activation, f, 4);
  if (yf) { /* vector v: channels 4v.. in its low half, 16 + 4v.. in its high half */
    for (int v = 0; v < 4; v++) f[v] = _mm256_min_ps(e->hi, _mm256_max_ps(e->lo, f[v]));
    _mm256_storeu_ps(yf, _mm256_permute2f128_ps(f[0], f[1], 0x20));
    _mm256_storeu_ps(yf + 8, _mm256_permute2f128_ps(f[2], f[3], 0x20));
    if (lanes == 8) {
      _mm256_storeu_ps(yf + 16, _mm256_permute2f128_ps(f[0], f[1], 0x31));
      _mm256_storeu_ps(yf + 24, _mm256_permute2f128_ps(f[2], f[3], 0x31));
    }
    return;
  }
  __m256i q[4];
  for (int v = 0; v < 4; v++) /* round half to even, as torch */
    q[v] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_fmadd_ps(f[v], e->inv, e->zp), e->lo_q), e->hi_q));
  const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  if (lanes == 8)
    _mm256_storeu_si256((__m256i*)y, bytes);
  else
    _mm_storeu_si128((__m128i*)y, _mm256_castsi256_si128(bytes));
}

/* ``pixels`` consecutive outputs of one group from the quads of their K input rows (each
 * already at the group and the first pixel's column). ``lanes``: 8 per vector (32 channels)
 * or 4 (a last 16); with ``pixels``, ``lanes`` and K constants where this is inlined. */
static inline __attribute__((always_inline)) void output_pixels(
    const epilogue_t* e, const int8_t* weight, size_t weight_row, int lanes, int K, int pixels,
    const uint8_t* const rows[MAX_WINDOW], size_t quad_offset, int C, uint8_t* y, float* yf) {
  const int Q = quads_of(K);
  __m256i acc[PIXELS][4];
  /* one vector (8 lanes) at a time over every tap block: ``pixels`` accumulators in registers */
  for (int v = 0; v < 4; v++) {
    __m256i sum[PIXELS];
    for (int p = 0; p < pixels; p++) sum[p] = _mm256_setzero_si256();
    for (int t = 0; t < K * Q; t++) {
      const int8_t* w = weight + (size_t)t * weight_row;
      const uint8_t* in = rows[t / Q] + (t % Q) * quad_offset + v * 32;
      const __m256i wv = lanes == 8 ? _mm256_loadu_si256((const __m256i*)(w + v * 32))
                                    : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)(w + v * 16)));
      for (int p = 0; p < pixels; p++)
        sum[p] = dot_add(sum[p], _mm256_loadu_si256((const __m256i*)(in + (size_t)p * QUAD_BYTES)), wv);
    }
    for (int p = 0; p < pixels; p++) acc[p][v] = sum[p];
  }
  for (int p = 0; p < pixels; p++)
    finish_pixel(e, acc[p], lanes, y ? y + (size_t)p * C : NULL, yf ? yf + (size_t)p * C : NULL);
}

/* One group of one output row; y / yf at the group's first channel of the row's first pixel. */
static inline __attribute__((always_inline)) void output_group(
    const dwconv_call_t* c, const epilogue_t* row_epilogue, const int8_t* weight, const float* mult, const float* add,
    int lanes, int K, const uint8_t* const group_rows[MAX_WINDOW], uint8_t* y, float* yf) {
  const int C = c->C, OW = c->OW;
  const size_t quad_offset = (size_t)4 / c->stride_w * QUAD_BYTES; /* from a quad to the next of the same output */
  epilogue_t local = *row_epilogue, *e = &local; /* (a local: the byte stores may alias the caller's, so GCC reloaded it) */
  for (int v = 0; v < 4; v++) {
    e->mult[v] = lanes == 8 ? _mm256_loadu_ps(mult + v * 8) : _mm256_zextps128_ps256(_mm_loadu_ps(mult + v * 4));
    e->add[v] = lanes == 8 ? _mm256_loadu_ps(add + v * 8) : _mm256_zextps128_ps256(_mm_loadu_ps(add + v * 4));
  }
  const size_t weight_row = (size_t)C * 4; /* bytes between (kernel row, quad) blocks */
  for (int ow = 0; ow < OW;) {
    const uint8_t* rows[MAX_WINDOW];
    for (int r = 0; r < K; r++) rows[r] = group_rows[r] + (size_t)ow * QUAD_BYTES;
    uint8_t* yp = y ? y + (size_t)ow * C : NULL;
    float* yfp = yf ? yf + (size_t)ow * C : NULL;
    const int pixels = OW - ow >= PIXELS ? PIXELS : OW - ow >= 4 ? 4 : 1;
    if (pixels == PIXELS) output_pixels(e, weight, weight_row, lanes, K, PIXELS, rows, quad_offset, C, yp, yfp);
    else if (pixels == 4) output_pixels(e, weight, weight_row, lanes, K, 4, rows, quad_offset, C, yp, yfp);
    else output_pixels(e, weight, weight_row, lanes, K, 1, rows, quad_offset, C, yp, yfp);
    ow += pixels;
  }
}

/* output_group with its window and lane count as constants (each its own unrolled copy). */
static void output_group_for(const dwconv_call_t* c, const epilogue_t* e, const int8_t* weight, const float* mult,
                             const float* add, int full, const uint8_t* const group_rows[MAX_WINDOW], uint8_t* y, float* yf) {
#define GROUP_CASE(K)                                                                  \
  case K:                                                                              \
    if (full) output_group(c, e, weight, mult, add, 8, K, group_rows, y, yf);          \
    else output_group(c, e, weight, mult, add, 4, K, group_rows, y, yf);               \
    return;
  switch (c->window) {
    GROUP_CASE(3)
    GROUP_CASE(5)
    GROUP_CASE(7)
  }
#undef GROUP_CASE
}

/* One output row from the quads of its K input rows, its first pixel ``pixel`` pixels into out. */
static void output_row(const dwconv_call_t* c, const uint8_t* const rows[MAX_WINDOW], size_t pixel, void* out) {
  const int C = c->C, OW = c->OW, K = c->window, groups = (C + GROUP - 1) / GROUP;
  epilogue_t e;
  e.inv = _mm256_set1_ps(c->out_inv_scale), e.zp = _mm256_set1_ps((float)c->out_zp);
  e.lo = _mm256_set1_ps(c->lo), e.hi = _mm256_set1_ps(c->hi);
  e.lo_q = _mm256_max_ps(_mm256_set1_ps((float)c->qmin), _mm256_fmadd_ps(e.lo, e.inv, e.zp));
  e.hi_q = _mm256_min_ps(_mm256_set1_ps((float)c->qmax), _mm256_fmadd_ps(e.hi, e.inv, e.zp));
  e.activation = c->activation;
  for (int g = 0; g < groups; g++) {
    const size_t offset = (size_t)g * quad_columns(c) * QUAD_BYTES;
    const uint8_t* group_rows[MAX_WINDOW];
    for (int r = 0; r < K; r++) group_rows[r] = rows[r] + offset;
    uint8_t* y = c->float_out ? NULL : (uint8_t*)out + pixel * C + g * GROUP;
    float* yf = c->float_out ? (float*)out + pixel * C + g * GROUP : NULL;
    output_group_for(c, &e, (const int8_t*)c->weight + (size_t)g * GROUP * 4, c->mult + (size_t)g * GROUP, c->add + (size_t)g * GROUP,
                     C - g * GROUP >= GROUP, group_rows, y, yf);
  }
}

/* 0, -1 when a thread could not allocate its scratch (y is then incomplete), or with a
 * LayerNorm the count of pixels whose statistics are past UNSAFE_SQUARES (their bytes are not
 * the reference's: the caller runs those layers another way). */
static int run(int threads, const void* call, const uint8_t* x, void* y) {
  const dwconv_call_t* c = call;
  const int K = c->window, normed = c->norm_weight != NULL;
  if (K != 3 && K != 5 && K != 7) return -1;
  if (normed && (!c->float_out || c->C % 16)) return -1; /* (float rows to normalize, no padding channels) */
  const size_t row_bytes = (size_t)((c->C + GROUP - 1) / GROUP) * quad_columns(c) * QUAD_BYTES;
  const size_t slots_bytes = (K * row_bytes + 63) / 64 * 64; /* (the float row after them stays aligned) */
  const size_t float_row_bytes = normed ? ((size_t)c->OW * c->C * sizeof(float) + 63) / 64 * 64 : 0;
  const int rows = c->N * c->OH;
  int failed = 0;
  long unsafe = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed) reduction(+ : unsafe)
  {
    /* K slots of quads (kernel rows are consecutive input rows: distinct slots mod K), then with
     * a LayerNorm one row of float outputs */
    uint8_t* slots = aligned_alloc(64, slots_bytes + float_row_bytes);
    float* float_row = normed && slots ? (float*)(slots + slots_bytes) : NULL;
    int built[MAX_WINDOW][2]; /* (n, ih) each slot holds */
    for (int s = 0; s < MAX_WINDOW; s++) built[s][0] = -1, built[s][1] = -2;
    const int team = omp_get_num_threads(), me = omp_get_thread_num();
    const int first = (int)((long)rows * me / team), last = (int)((long)rows * (me + 1) / team);
    failed = slots == NULL;
    for (int index = first; slots && index < last; index++) {
      const int n = index / c->OH, oh = index % c->OH;
      const uint8_t* kernel_rows[MAX_WINDOW];
      for (int r = 0; r < K; r++) {
        const int ih = oh * c->stride_h - c->pad_h + r, slot = ((ih % K) + K) % K;
        uint8_t* quads = slots + slot * row_bytes;
        if (built[slot][0] != n || built[slot][1] != ih) {
          build_quads(c, x, n, ih, quads);
          built[slot][0] = n;
          built[slot][1] = ih;
        }
        kernel_rows[r] = quads;
      }
      const size_t pixel = (size_t)index * c->OW;
      if (!normed) {
        output_row(c, kernel_rows, pixel, y);
        continue;
      }
      output_row(c, kernel_rows, 0, float_row);
      unsafe += layer_norm_rows(float_row, c->OW, c->C, c->norm_weight, c->norm_bias, c->norm_eps, c->out_inv_scale,
                                c->out_zp, c->qmin, c->qmax, (uint8_t*)y + pixel * c->C, NULL);
    }
    free(slots);
  }
  return failed ? -1 : (int)(unsafe < 0x7fffffff ? unsafe : 0x7fffffff);
}

/* Channels that are not whole groups of 16 run on padded copies (padded_channels.h). */
int qb_dwconv_vnni_call(int threads, const dwconv_call_t* c, const uint8_t* x, void* y) {
  if (c->C % 16 == 0) return run(threads, c, x, y);
  if (c->norm_weight) return -1; /* (padding channels would enter the statistics) */
  dwconv_call_t padded = *c;
  padded.C = padded_channels(c->C, 16);
  return run_padded(run, threads, &padded, (size_t)c->N * c->H * c->W, (size_t)c->N * c->OH * c->OW, c->C, padded.C, x, y,
                    c->float_out ? sizeof(float) : 1);
}
