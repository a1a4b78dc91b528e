/* Depthwise 3x3 int8 convolution for CPUs with AVX512-VNNI: what depthwise_conv_int8.c does,
 * with vpdpbusd (4 uint8 x int8 products added into each int32 lane) on ymm registers.
 *
 * Why: the AVX2 kernel spends ~40 instructions per 16 channels and output pixel widening bytes
 * to int16 and interleaving tap pairs, and ran MobileNetV2's depthwise layers at 30-35 GMAC/s.
 * Here each input row is interleaved once into "row triples": for every output column ow and
 * channel, the 4 bytes (x[iw], x[iw + 1], x[iw + 2], x[iw + 2]) with iw = ow * stride - pad,
 * so one kernel row of one output is one vpdpbusd per 8 channels against its 3 weights and a
 * zero (the 4th byte is a spare copy). An output pixel is then 3 vpdpbusd per 8 channels, read
 * straight from the triples of its 3 input rows; each thread keeps the triples of the last 3
 * input rows it needed (consecutive rows are 3 consecutive indices: distinct slots mod 3).
 *
 * Channels go 32 at a time; a last group of 16 reads with a byte mask, writes 16 bytes, and its
 * packed constants are the low halves of the vectors only (so they hold C channels, no padding).
 * Padding columns and rows read the zero point, as in the AVX2 kernel, and ``add`` removes
 * x_zp * sum(w) once per channel.
 * Lane order: vpunpck{l,h} work within 128-bit halves, so the 4 vectors of a 32-channel group
 * hold channels {0-3, 16-19}, {4-7, 20-23}, {8-11, 24-27}, {12-15, 28-31}; weights and
 * per-channel constants are packed in that order, and vpackssdw / vpackuswb restore the
 * natural one.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "padded_channels.h"

#define GROUP 32       /* channels per group */
#define GROUP_BYTES 128 /* a group's triples for one output column: 32 channels x 4 bytes */

typedef struct {
  int N, H, W, C, stride_h, stride_w, pad_h, pad_w, OH, OW, x_zp;
  const int8_t* weight; /* [3 kernel rows][groups][4 vectors][8 lanes (4 in a 16-channel group)][4 bytes] */
  const float *mult, *add; /* [groups][4 vectors][8 lanes (4 in a 16-channel group)] */
  float lo, hi, out_inv_scale;
  int out_zp, qmin, qmax;
} dwconv_vnni_call_t;

/* The triples of one output column's group from its 3 input columns (NULL: padding). */
static inline void store_triples(const uint8_t* const in[3], __m256i zp, __mmask32 mask, uint8_t* out) {
  __m256i tap[3];
  for (int t = 0; t < 3; t++) tap[t] = in[t] ? _mm256_maskz_loadu_epi8(mask, in[t]) : zp;
  const __m256i lo01 = _mm256_unpacklo_epi8(tap[0], tap[1]), hi01 = _mm256_unpackhi_epi8(tap[0], tap[1]);
  const __m256i lo22 = _mm256_unpacklo_epi8(tap[2], tap[2]), hi22 = _mm256_unpackhi_epi8(tap[2], tap[2]);
  __m256i* dst = (__m256i*)out;
  _mm256_storeu_si256(dst, _mm256_unpacklo_epi16(lo01, lo22));
  _mm256_storeu_si256(dst + 1, _mm256_unpackhi_epi16(lo01, lo22));
  _mm256_storeu_si256(dst + 2, _mm256_unpacklo_epi16(hi01, hi22));
  _mm256_storeu_si256(dst + 3, _mm256_unpackhi_epi16(hi01, hi22));
}

/* The triples of input row ih of image n (or of a padding row) for every output column. */
static void build_triples(const dwconv_vnni_call_t* c, const uint8_t* x, int n, int ih, uint8_t* out) {
  const int C = c->C, W = c->W, OW = c->OW, stride = c->stride_w, pad = c->pad_w, groups = (C + GROUP - 1) / GROUP;
  const __m256i zp = _mm256_set1_epi8((char)c->x_zp);
  if (ih < 0 || ih >= c->H) {
    memset(out, c->x_zp, (size_t)groups * OW * GROUP_BYTES);
    return;
  }
  const uint8_t* row = x + ((size_t)n * c->H + ih) * W * C;
  for (int g = 0; g < groups; g++) {
    const int left = C - g * GROUP;
    const __mmask32 mask = left >= GROUP ? 0xFFFFFFFFu : (1u << left) - 1;
    uint8_t* dst = out + (size_t)g * OW * GROUP_BYTES;
    for (int ow = 0; ow < OW; ow++) {
      const int iw = ow * stride - pad;
      const uint8_t* in[3];
      for (int t = 0; t < 3; t++) in[t] = iw + t < 0 || iw + t >= W ? NULL : row + (size_t)(iw + t) * C + g * GROUP;
      store_triples(in, zp, mask, dst + (size_t)ow * GROUP_BYTES);
    }
  }
}

/* One group of one output row. ``lanes``: 8 per vector (32 channels) or 4 (a last 16), a
 * constant where this is inlined, so full groups load and store unmasked.
 * y = round(clamp((acc * mult + add) * inv_scale + out_zp, lo_q, hi_q)), where lo_q / hi_q are
 * the clamp post-op's bounds carried through the same map and cut to [qmin, qmax]: the same
 * bytes as clamping before the map (it is monotone), and no int32 overflow for huge values. */
static inline __attribute__((always_inline)) void output_group(
    const int8_t* weight, size_t row_stride, const float* mult_p, const float* add_p, int lanes,
    const uint8_t* const rows[3], int OW, int C, __m256 inv, __m256 zp, __m256 lo, __m256 hi, uint8_t* y) {
  __m256i w[3][4];
  __m256 mult[4], add[4];
  for (int v = 0; v < 4; v++) {
    for (int r = 0; r < 3; r++) {
      const int8_t* p = weight + r * row_stride + v * lanes * 4;
      w[r][v] = lanes == 8 ? _mm256_loadu_si256((const __m256i*)p) : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)p));
    }
    mult[v] = lanes == 8 ? _mm256_loadu_ps(mult_p + v * 8) : _mm256_zextps128_ps256(_mm_loadu_ps(mult_p + v * 4));
    add[v] = lanes == 8 ? _mm256_loadu_ps(add_p + v * 8) : _mm256_zextps128_ps256(_mm_loadu_ps(add_p + v * 4));
  }
  for (int ow = 0; ow < OW; ow++) {
    __m256i q[4];
    for (int v = 0; v < 4; v++) {
      __m256i acc = _mm256_setzero_si256();
      for (int r = 0; r < 3; r++)
        acc = _mm256_dpbusd_epi32(acc, _mm256_loadu_si256((const __m256i*)(rows[r] + (size_t)ow * GROUP_BYTES) + v), w[r][v]);
      const __m256 f = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), mult[v], add[v]), inv, zp);
      q[v] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(f, lo), hi)); /* round half to even, as torch */
    }
    const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    if (lanes == 8)
      _mm256_storeu_si256((__m256i*)(y + (size_t)ow * C), bytes);
    else
      _mm_storeu_si128((__m128i*)(y + (size_t)ow * C), _mm256_castsi256_si128(bytes));
  }
}

/* One output row from the triples of its 3 input rows. */
static void output_row(const dwconv_vnni_call_t* c, const uint8_t* const rows[3], uint8_t* y) {
  const int C = c->C, OW = c->OW, groups = (C + GROUP - 1) / GROUP;
  const __m256 inv = _mm256_set1_ps(c->out_inv_scale), zp = _mm256_set1_ps((float)c->out_zp);
  const __m256 lo = _mm256_max_ps(_mm256_set1_ps((float)c->qmin), _mm256_fmadd_ps(_mm256_set1_ps(c->lo), inv, zp));
  const __m256 hi = _mm256_min_ps(_mm256_set1_ps((float)c->qmax), _mm256_fmadd_ps(_mm256_set1_ps(c->hi), inv, zp));
  for (int g = 0; g < groups; g++) {
    const size_t offset = (size_t)g * OW * GROUP_BYTES;
    const uint8_t* const group_rows[3] = {rows[0] + offset, rows[1] + offset, rows[2] + offset};
    const int8_t* weight = c->weight + (size_t)g * GROUP * 4;
    const float *mult = c->mult + (size_t)g * GROUP, *add = c->add + (size_t)g * GROUP;
    if (C - g * GROUP >= GROUP)
      output_group(weight, (size_t)C * 4, mult, add, 8, group_rows, OW, C, inv, zp, lo, hi, y + g * GROUP);
    else
      output_group(weight, (size_t)C * 4, mult, add, 4, group_rows, OW, C, inv, zp, lo, hi, y + g * GROUP);
  }
}

/* 0, or -1 when a thread could not allocate its triples (y is then incomplete). */
static int run(int threads, const void* call, const uint8_t* x, void* y) {
  const dwconv_vnni_call_t* c = call;
  const size_t row_bytes = (size_t)((c->C + GROUP - 1) / GROUP) * c->OW * GROUP_BYTES;
  const int rows = c->N * c->OH;
  int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
  {
    /* 3 slots of triples (kernel rows are consecutive input rows: distinct slots mod 3) */
    uint8_t* slots = aligned_alloc(64, (3 * row_bytes + 63) / 64 * 64);
    int built[3][2] = {{-1, -2}, {-1, -2}, {-1, -2}}; /* (n, ih) each slot holds */
    const int team = omp_get_num_threads(), me = omp_get_thread_num();
    const int first = (int)((long)rows * me / team), last = (int)((long)rows * (me + 1) / team);
    failed = slots == NULL;
    for (int index = first; slots && index < last; index++) {
      const int n = index / c->OH, oh = index % c->OH;
      const uint8_t* kernel_rows[3];
      for (int r = 0; r < 3; r++) {
        const int ih = oh * c->stride_h - c->pad_h + r, slot = ((ih % 3) + 3) % 3;
        uint8_t* triples = slots + slot * row_bytes;
        if (built[slot][0] != n || built[slot][1] != ih) {
          build_triples(c, x, n, ih, triples);
          built[slot][0] = n;
          built[slot][1] = ih;
        }
        kernel_rows[r] = triples;
      }
      output_row(c, kernel_rows, y + (size_t)index * c->OW * c->C);
    }
    free(slots);
  }
  return failed ? -1 : 0;
}

/* Channels that are not whole groups of 16 run on padded copies (padded_channels.h). */
int qb_dwconv_vnni_call(int threads, const dwconv_vnni_call_t* c, const uint8_t* x, uint8_t* y) {
  if (c->C % 16 == 0) return run(threads, c, x, y);
  dwconv_vnni_call_t padded = *c;
  padded.C = padded_channels(c->C, 16);
  return run_padded(run, threads, &padded, (size_t)c->N * c->H * c->W, (size_t)c->N * c->OH * c->OW, c->C, padded.C, x, y, 1);
}
