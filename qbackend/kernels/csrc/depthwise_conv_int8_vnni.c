/* Depthwise 3x3, 5x5 and 7x7 int8 convolution for CPUs with AVX512-VNNI: what
 * depthwise_conv_int8.c does (bias, GELU / SiLU / hardswish, a clamp, uint8 or float32 out), with
 * vpdpbusd (4 uint8 x int8 products added into each int32 lane) on ymm or zmm registers.
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
 * Channels go 32 (ymm) or 64 (zmm) at a time; a last group of fewer reads and writes its own
 * channels only (masked loads and stores), and its packed constants are padded to 16 channels
 * only: a packing group of 32 channels or a last one of 16, the low halves of its vectors.
 * Padding columns and rows read the zero point, as in the AVX2 kernel, and ``add`` removes
 * x_zp sum(w) once per channel.
 * Lane order: vpunpck{l,h} work within 128-bit lanes, so vector v (of 4) holds channels 16 L +
 * 4 v .. 16 L + 4 v + 3 in lane L: for a 32-channel group {0-3, 16-19}, {4-7, 20-23}, {8-11,
 * 24-27}, {12-15, 28-31}; weights and per-channel constants are packed in that order, and
 * vpackssdw / vpackuswb (uint8 out) or 128-bit lane permutes (float out) restore the natural one.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "call_structs.h"
#include "depthwise_kinds.h"
#include "layer_norm_rows.h"
#include "padded_channels.h"
#include "vec_math.h"
#include "vec_math512.h"
#include "vnni_dot.h"

/* The register width: ymm (qb_dwconv_vnni_call), or zmm where depthwise_conv_int8_vnni512.c
 * defines QB_ZMM (qb_dwconv_vnni512_call; a core that runs zmm vpdpbusd at full rate: the same
 * vpunpck steps then interleave 64 channels, each 128-bit lane 16 of them). A step's channels are
 * QUARTERS lanes of 16; the packing's 32-channel groups (their vectors' halves) are what a ymm
 * step reads, and a zmm step reads two of them, one to each 256-bit half (the same packed
 * weights and constants on both widths). */
#ifdef QB_ZMM
#define QUARTERS 4
typedef __m512i ivec;
typedef __m512 fvec;
typedef __mmask64 byte_mask;
#define DW_CALL qb_dwconv_vnni512_call
#define LOAD_BYTES(mask, p) _mm512_maskz_loadu_epi8(mask, p)
#define SET1_BYTES _mm512_set1_epi8
#define UNPACKLO8 _mm512_unpacklo_epi8
#define UNPACKHI8 _mm512_unpackhi_epi8
#define UNPACKLO16 _mm512_unpacklo_epi16
#define UNPACKHI16 _mm512_unpackhi_epi16
#define STORE_I _mm512_storeu_si512
#define LOAD_I(p) _mm512_loadu_si512(p)
#define ZERO_I _mm512_setzero_si512
#define SET1_F _mm512_set1_ps
#define FMADD _mm512_fmadd_ps
#define CVT_F _mm512_cvtepi32_ps
#define CVT_I _mm512_cvtps_epi32
#define MIN_F _mm512_min_ps
#define MAX_F _mm512_max_ps
#define PACKS32 _mm512_packs_epi32
#define PACKUS16 _mm512_packus_epi16
#define ACTIVATE activate16_lanes
static inline __m512i dot_step(__m512i acc, __m512i x, __m512i w) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "vm"(w)); /* (in place: vnni_dot.h) */
  return acc;
}
#else
#define QUARTERS 2
typedef __m256i ivec;
typedef __m256 fvec;
typedef __mmask32 byte_mask;
#define DW_CALL qb_dwconv_vnni_call
#define LOAD_BYTES(mask, p) _mm256_maskz_loadu_epi8(mask, p)
#define SET1_BYTES _mm256_set1_epi8
#define UNPACKLO8 _mm256_unpacklo_epi8
#define UNPACKHI8 _mm256_unpackhi_epi8
#define UNPACKLO16 _mm256_unpacklo_epi16
#define UNPACKHI16 _mm256_unpackhi_epi16
#define STORE_I(p, v) _mm256_storeu_si256((__m256i*)(p), v)
#define LOAD_I(p) _mm256_loadu_si256((const __m256i*)(p))
#define ZERO_I _mm256_setzero_si256
#define SET1_F _mm256_set1_ps
#define FMADD _mm256_fmadd_ps
#define CVT_F _mm256_cvtepi32_ps
#define CVT_I _mm256_cvtps_epi32
#define MIN_F _mm256_min_ps
#define MAX_F _mm256_max_ps
#define PACKS32 _mm256_packs_epi32
#define PACKUS16 _mm256_packus_epi16
#define ACTIVATE activate_lanes
#define dot_step dot_add
#endif

#define GROUP (16 * QUARTERS)         /* channels per step */
#define QUAD_BYTES (4 * GROUP)        /* a group's quad for one output column: GROUP channels x 4 bytes */
#define PACK_GROUP 32                 /* channels of a group of the packing (the last may be 16) */
#define MAX_WINDOW 7
#define PIXELS 8 /* output pixels a step: their sums in registers, each weight vector loaded once for them */

static inline int quads_of(int window) { return (window + 3) / 4; }

/* Vector v (of 4) of a packing group's 4-byte taps (``quarters`` 2: 8 lanes of [4][32] bytes; 1: a
 * last group of 16, [4][16] bytes) or of its float constants ([4][8] / [4][4]). */
static inline __m256i packed_bytes(const int8_t* w, int v, int quarters) {
  return quarters == 2 ? _mm256_loadu_si256((const __m256i*)(w + v * 32)) : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)(w + v * 16)));
}
static inline __m256 packed_floats(const float* f, int v, int quarters) {
  return quarters == 2 ? _mm256_loadu_ps(f + v * 8) : _mm256_zextps128_ps256(_mm_loadu_ps(f + v * 4));
}

/* Vector v of a step of ``quarters`` 16-channel lanes from its first packing group on (channels
 * past them zero). */
static inline ivec step_bytes(const int8_t* w, int v, int quarters) {
#ifdef QB_ZMM
  const __m512i low = _mm512_zextsi256_si512(packed_bytes(w, v, quarters < 2 ? quarters : 2));
  return quarters > 2 ? _mm512_inserti64x4(low, packed_bytes(w + 4 * PACK_GROUP, v, quarters - 2), 1) : low;
#else
  return packed_bytes(w, v, quarters);
#endif
}
static inline fvec step_floats(const float* f, int v, int quarters) {
#ifdef QB_ZMM
  const __m512 low = _mm512_zextps256_ps512(packed_floats(f, v, quarters < 2 ? quarters : 2));
  return quarters > 2 ? _mm512_insertf32x8(low, packed_floats(f + PACK_GROUP, v, quarters - 2), 1) : low;
#else
  return packed_floats(f, v, quarters);
#endif
}

/* One group's quad for one output column from its 4 input columns (NULL: padding). */
static inline void store_quad(const uint8_t* const in[4], ivec zp, byte_mask mask, uint8_t* out) {
  ivec tap[4];
  for (int t = 0; t < 4; t++) tap[t] = in[t] ? LOAD_BYTES(mask, in[t]) : zp;
  const ivec lo01 = UNPACKLO8(tap[0], tap[1]), hi01 = UNPACKHI8(tap[0], tap[1]);
  const ivec lo23 = UNPACKLO8(tap[2], tap[3]), hi23 = UNPACKHI8(tap[2], tap[3]);
  const size_t step = sizeof(ivec);
  STORE_I(out, UNPACKLO16(lo01, lo23));
  STORE_I(out + step, UNPACKHI16(lo01, lo23));
  STORE_I(out + 2 * step, UNPACKLO16(hi01, hi23));
  STORE_I(out + 3 * step, UNPACKHI16(hi01, hi23));
}

/* Quads per input row and group: one for each column j = stride m (padded coordinates), m < OW +
 * 4 (Q - 1) / stride; output ow's quad q is quad m = ow + 4 q / stride (stride 1 or 2), so
 * quads are shared between outputs instead of built per output (7x7: 60 instead of 112 a row
 * of 56). Taps past a window's end read the next columns against zero weights. */
static inline int quad_columns(const dwconv_call_t* c) { return c->OW + 4 * (quads_of(c->window) - 1) / c->stride_w; }

/* The quads of input row ih of image n (or of a padding row): [group][m][QUAD_BYTES]. */
static void build_quads(const dwconv_call_t* c, const uint8_t* x, int n, int ih, uint8_t* out) {
  const int C = c->C, W = c->W, M = quad_columns(c), groups = (C + GROUP - 1) / GROUP;
  const ivec zp = SET1_BYTES((char)c->x_zp);
  if (ih < 0 || ih >= c->H) {
    memset(out, c->x_zp, (size_t)groups * M * QUAD_BYTES);
    return;
  }
  const uint8_t* row = x + ((size_t)n * c->H + ih) * W * C;
  for (int g = 0; g < groups; g++) {
    const int left = C - g * GROUP;
    const byte_mask mask = left >= GROUP ? (byte_mask)-1 : ((byte_mask)1 << left) - 1;
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
  fvec mult[4], add[4], lo, hi, inv, zp, lo_q, hi_q;
  int channels; /* (of the group being run, GROUP but in a last one) */
} epilogue_t;

/* ``count`` (1 .. a vector's lanes) floats of a vector: a store, or a masked one for the last
 * channels of a call whose channel count is not a whole number of vectors. */
static inline void store_float_chunk(float* out, fvec chunk, int count) {
#ifdef QB_ZMM
  if (count >= 16) _mm512_storeu_ps(out, chunk);
  else _mm512_mask_storeu_ps(out, (__mmask16)((1u << count) - 1), chunk);
#else
  if (count >= 8) _mm256_storeu_ps(out, chunk);
  else _mm256_mask_storeu_ps(out, (__mmask8)((1u << count) - 1), chunk);
#endif
}

/* The float results of a group's first ``channels`` channels in channel order: vector v's lane
 * L holds channels 16 L + 4 v .. 16 L + 4 v + 3, so lane L of the 4 vectors is channels 16 L ..
 * 16 L + 15. */
static inline __attribute__((always_inline)) void store_floats(const fvec f[4], int channels, float* yf) {
  const int lanes = sizeof(fvec) / sizeof(float);
#ifdef QB_ZMM
  const __m512 f01_low = _mm512_shuffle_f32x4(f[0], f[1], 0x44), f23_low = _mm512_shuffle_f32x4(f[2], f[3], 0x44);
  const __m512 f01_high = _mm512_shuffle_f32x4(f[0], f[1], 0xEE), f23_high = _mm512_shuffle_f32x4(f[2], f[3], 0xEE);
  const __m512 chunk[4] = {_mm512_shuffle_f32x4(f01_low, f23_low, 0x88), _mm512_shuffle_f32x4(f01_low, f23_low, 0xDD),
                           _mm512_shuffle_f32x4(f01_high, f23_high, 0x88), _mm512_shuffle_f32x4(f01_high, f23_high, 0xDD)};
#else
  const __m256 chunk[4] = {_mm256_permute2f128_ps(f[0], f[1], 0x20), _mm256_permute2f128_ps(f[2], f[3], 0x20),
                           _mm256_permute2f128_ps(f[0], f[1], 0x31), _mm256_permute2f128_ps(f[2], f[3], 0x31)};
#endif
  for (int i = 0; i < 4 && i * lanes < channels; i++) store_float_chunk(yf + i * lanes, chunk[i], channels - i * lanes);
}

/* vpackssdw / vpackuswb work within 128-bit lanes: each lane's 16 bytes come out in channel
 * order; the first ``channels`` are stored. */
static inline __attribute__((always_inline)) void store_bytes(ivec bytes, int channels, uint8_t* y) {
#ifdef QB_ZMM
  _mm512_mask_storeu_epi8(y, channels >= 64 ? ~0ull : (1ull << channels) - 1, bytes);
#else
  if (channels >= 32) _mm256_storeu_si256((__m256i*)y, bytes);
  else _mm256_mask_storeu_epi8(y, (1u << channels) - 1, bytes);
#endif
}

/* f = clamp(activation(acc * mult + add), lo, hi) in lane order: stored as float32 in channel
 * order, or y = round(f * inv_scale + out_zp) within [qmin, qmax] — the clamp applied after
 * that map to bounds carried through it (lo_q / hi_q, cut to [qmin, qmax]): the same bytes, as
 * the map is monotone, and no int32 overflow for huge values. ``kind`` (depthwise_kinds.h), a
 * constant where inlined: with PACKS_CLAMP the packs' saturation at 0 is the low clamp. */
static inline __attribute__((always_inline)) void finish_pixel(const epilogue_t* e, const ivec acc[4], uint8_t* y, float* yf,
                                                               const int kind) {
  fvec f[4];
  for (int v = 0; v < 4; v++) f[v] = FMADD(CVT_F(acc[v]), e->mult[v], e->add[v]);
  ACTIVATE(kind % FLOAT_OUT, f, 4);
  if (kind & FLOAT_OUT) {
    for (int v = 0; v < 4; v++) f[v] = MIN_F(e->hi, MAX_F(e->lo, f[v]));
    store_floats(f, e->channels, yf);
    return;
  }
  ivec q[4];
  for (int v = 0; v < 4; v++) { /* round half to even, as torch; a NaN lands on qmin (INT_MIN packs to 0) */
    const fvec level = FMADD(f[v], e->inv, e->zp);
    q[v] = CVT_I(kind & PACKS_CLAMP ? MIN_F(e->hi_q, level) : MIN_F(MAX_F(level, e->lo_q), e->hi_q));
  }
  store_bytes(PACKUS16(PACKS32(q[0], q[1]), PACKS32(q[2], q[3])), e->channels, y);
}

/* ``pixels`` consecutive outputs of one group from the quads of their K input rows (each
 * already at the group and the first pixel's column); with ``pixels``, ``quarters`` and K
 * constants where this is inlined. */
static inline __attribute__((always_inline)) void output_pixels(
    const epilogue_t* e, const int8_t* weight, size_t weight_row, int quarters, int K, int pixels,
    const uint8_t* const rows[MAX_WINDOW], size_t quad_offset, int C, uint8_t* y, float* yf, const int kind) {
  const int Q = quads_of(K);
  ivec acc[PIXELS][4];
  /* one vector at a time over every tap block: ``pixels`` accumulators in registers */
  for (int v = 0; v < 4; v++) {
    ivec sum[PIXELS];
    for (int p = 0; p < pixels; p++) sum[p] = ZERO_I();
    for (int t = 0; t < K * Q; t++) {
      const uint8_t* in = rows[t / Q] + (t % Q) * quad_offset + v * sizeof(ivec);
      const ivec wv = step_bytes(weight + (size_t)t * weight_row, v, quarters);
      for (int p = 0; p < pixels; p++) sum[p] = dot_step(sum[p], LOAD_I(in + (size_t)p * QUAD_BYTES), wv);
    }
    for (int p = 0; p < pixels; p++) acc[p][v] = sum[p];
  }
  for (int p = 0; p < pixels; p++)
    finish_pixel(e, acc[p], y ? y + (size_t)p * C : NULL, yf ? yf + (size_t)p * C : NULL, kind);
}

/* One group of one output row; y / yf at the group's first channel of the row's first pixel. */
static inline __attribute__((always_inline)) void output_group(
    const dwconv_call_t* c, const epilogue_t* row_epilogue, const int8_t* weight, const float* mult, const float* add,
    int quarters, int channels, int K, const uint8_t* const group_rows[MAX_WINDOW], uint8_t* y, float* yf, const int kind) {
  const int C = c->C, OW = c->OW;
  const size_t quad_offset = (size_t)4 / c->stride_w * QUAD_BYTES; /* from a quad to the next of the same output */
  epilogue_t local = *row_epilogue, *e = &local; /* (a local: the byte stores may alias the caller's, so GCC reloaded it) */
  e->channels = channels;
  for (int v = 0; v < 4; v++) e->mult[v] = step_floats(mult, v, quarters), e->add[v] = step_floats(add, v, quarters);
  const size_t weight_row = (size_t)padded_channels(C, 16) * 4; /* bytes between (kernel row, quad) blocks */
  for (int ow = 0; ow < OW;) {
    const uint8_t* rows[MAX_WINDOW];
    for (int r = 0; r < K; r++) rows[r] = group_rows[r] + (size_t)ow * QUAD_BYTES;
    uint8_t* yp = y ? y + (size_t)ow * C : NULL;
    float* yfp = yf ? yf + (size_t)ow * C : NULL;
    const int pixels = OW - ow >= PIXELS ? PIXELS : OW - ow >= 4 ? 4 : 1;
    if (pixels == PIXELS) output_pixels(e, weight, weight_row, quarters, K, PIXELS, rows, quad_offset, C, yp, yfp, kind);
    else if (pixels == 4) output_pixels(e, weight, weight_row, quarters, K, 4, rows, quad_offset, C, yp, yfp, kind);
    else output_pixels(e, weight, weight_row, quarters, K, 1, rows, quad_offset, C, yp, yfp, kind);
    ow += pixels;
  }
}

/* output_group with its window and width as constants (each its own unrolled copy): whole
 * groups, or a last one of ``channels``, in 16-channel lanes. */
static inline __attribute__((always_inline)) void output_group_for(
    const dwconv_call_t* c, const epilogue_t* e, const int8_t* weight, const float* mult, const float* add, int channels,
    const uint8_t* const group_rows[MAX_WINDOW], uint8_t* y, float* yf, const int kind) {
  const int quarters = (channels + 15) / 16;
#define WIDTH_CASE(K, q) \
  case q: output_group(c, e, weight, mult, add, q, channels, K, group_rows, y, yf, kind); return;
#ifdef QB_ZMM
#define WINDOW_CASE(K) \
  case K: switch (quarters) { WIDTH_CASE(K, 4) WIDTH_CASE(K, 3) WIDTH_CASE(K, 2) WIDTH_CASE(K, 1) } return;
#else
#define WINDOW_CASE(K) \
  case K: switch (quarters) { WIDTH_CASE(K, 2) WIDTH_CASE(K, 1) } return;
#endif
  switch (c->window) {
    WINDOW_CASE(3)
    WINDOW_CASE(5)
    WINDOW_CASE(7)
  }
#undef WINDOW_CASE
#undef WIDTH_CASE
}

/* One output row from the quads of its K input rows, its first pixel ``pixel`` pixels into out. */
static inline __attribute__((always_inline)) void output_row(const dwconv_call_t* c, const uint8_t* const rows[MAX_WINDOW],
                                                             size_t pixel, void* out, const int kind) {
  const int C = c->C, K = c->window, groups = (C + GROUP - 1) / GROUP;
  epilogue_t e;
  e.inv = SET1_F(c->out_inv_scale), e.zp = SET1_F((float)c->out_zp);
  e.lo = SET1_F(c->lo), e.hi = SET1_F(c->hi);
  e.lo_q = MAX_F(SET1_F((float)c->qmin), FMADD(e.lo, e.inv, e.zp));
  e.hi_q = MIN_F(SET1_F((float)c->qmax), FMADD(e.hi, e.inv, e.zp));
  for (int g = 0; g < groups; g++) {
    const size_t offset = (size_t)g * quad_columns(c) * QUAD_BYTES;
    const uint8_t* group_rows[MAX_WINDOW];
    for (int r = 0; r < K; r++) group_rows[r] = rows[r] + offset;
    uint8_t* y = kind & FLOAT_OUT ? NULL : (uint8_t*)out + pixel * C + g * GROUP;
    float* yf = kind & FLOAT_OUT ? (float*)out + pixel * C + g * GROUP : NULL;
    const int left = C - g * GROUP;
    output_group_for(c, &e, (const int8_t*)c->weight + (size_t)g * GROUP * 4, c->mult + (size_t)g * GROUP, c->add + (size_t)g * GROUP,
                     left < GROUP ? left : GROUP, group_rows, y, yf, kind);
  }
}

/* output_row compiled for each epilogue kind */
typedef void (*row_fn)(const dwconv_call_t*, const uint8_t* const[MAX_WINDOW], size_t, void*);
#define ROW(KIND)                                                                                    \
  static void row_##KIND(const dwconv_call_t* c, const uint8_t* const rows[MAX_WINDOW], size_t pixel, void* out) { \
    output_row(c, rows, pixel, out, KIND);                                                          \
  }
EPILOGUE_KINDS(ROW)
#define ENTRY(KIND) [KIND] = row_##KIND,
static const row_fn ROW_TABLE[PACKS_CLAMP + 1] = {EPILOGUE_KINDS(ENTRY)};

/* 0, -1 when a thread could not allocate its scratch (y is then incomplete), or with a
 * LayerNorm the count of pixels whose statistics are past UNSAFE_SQUARES (their bytes are not
 * the reference's: the caller runs those layers another way). */
static int run(int threads, const void* call, const uint8_t* x, void* y) {
  const dwconv_call_t* c = call;
  const int K = c->window, normed = c->norm_weight != NULL;
  const int kind = epilogue_kind(c->activation, c->float_out, c->lo, c->out_inv_scale, c->out_zp, c->qmin, c->qmax);
  if ((K != 3 && K != 5 && K != 7) || kind < 0) return -1;
  const row_fn output_row_of_kind = ROW_TABLE[kind];
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
        output_row_of_kind(c, kernel_rows, pixel, y);
        continue;
      }
      output_row_of_kind(c, kernel_rows, 0, float_row);
      unsafe += layer_norm_rows(float_row, c->OW, c->C, c->norm_weight, c->norm_bias, c->norm_eps, c->out_inv_scale,
                                c->out_zp, c->qmin, c->qmax, (uint8_t*)y + pixel * c->C, NULL);
    }
    free(slots);
  }
  return failed ? -1 : (int)(unsafe < 0x7fffffff ? unsafe : 0x7fffffff);
}

/* Channels that are not whole groups run in place: a last group's loads and stores are masked
 * to its channels (padded copies of the tensors had cost MobileNetV3's 72-channel 56x56 layer
 * half its time). */
int DW_CALL(int threads, const dwconv_call_t* c, const uint8_t* x, void* y) { return run(threads, c, x, y); }
