/* int8 convolution (kernels up to 3x3, groups 1) and int8 linear, as one GEMM over output
 * pixels / rows: uint8 NHWC activations, per-channel int8 weights, bias, an optional residual
 * (uint8 quantized or float32) added before the post-op (a clamp, GELU, SiLU or hardswish), and requantization
 * to uint8 or a float32 output.
 *
 * Why: onednn::qconv_pointwise / qlinear_pointwise spend ~50 us per call before computing, and
 * their AVX2 int8 kernels ran 1.05-1.3x this one's time on ResNet-18's 3x3 convs and BERT-base's
 * linears at batch 1. out[p][o] = sum over kernel positions t and input channels i of
 * x[p's input at t][i] * w[o][t][i]; vpmaddubsw multiplies uint8 activations by int8 weights
 * and adds adjacent pairs in int16, which saturates unless the caller checked qmax_x times the
 * pair's reach, max(|w[o][2j] + w[o][2j+1]|, |w[o][2j]|, |w[o][2j+1]|), <= 32767 (lowering/gemm.py
 * largest_pair_sums; 7-bit weights always pass); vpmaddwd by ones then widens to int32.
 *
 * On CPUs with AVX512-VNNI, conv_gemm_int8_vnni.c builds this file again as qb_conv_call_vnni with
 * vpdpbusd, which adds each 4 uint8 x int8 products straight into int32: exact for any weights
 * and one instruction instead of three; conv_gemm_int8_vnni512.c builds it a third time on zmm
 * registers (qb_conv_call_vnni512). Which width is faster depends on the core: on a Zen 4 EPYC
 * zmm vpdpbusd ran a third of ymm's instructions per ns (1.6x fewer products), on a Zen 5 EPYC
 * 2 per cycle like ymm (2x the products). qbackend/kernels/isa.py asks qb_vnni_zmm_speedup once.
 * The zmm build runs its activations (GELU, SiLU, hardswish) on zmm too (vec_math512.h).
 *
 * Weights, every build: [ceil(Cout / 16)][KH * KW * ceil(Cin / 4)][16 outputs][4 inputs], Cout
 * and each kernel position's Cin padded with zero weights. A zmm block is one 64-byte row of 16
 * outputs; a ymm block (BLOCK 8) is its half, the same row 32 bytes in. A broadcast 4-byte load of one pixel's 4 inputs
 * meets each. Tiles: AVX2, 4 pixels x 24 outputs (12 accumulators: 4-6% faster than 4 x 16,
 * while 5 or 6 pixels x 16 were slower); VNNI, whose AVX512VL has 32 ymm registers, 8 pixels x
 * 24 outputs; zmm, 8 pixels x 48 outputs.
 * No im2col: each pixel's 9 input rows are pointers into x, or into a row of the zero point
 * where the window leaves the image.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <unistd.h>

#include "call_structs.h"
#include "padded_channels.h"
#if defined(QB_VNNI) || defined(QB_ZMM)
/* 8 pixels' activations in lockstep: GELU's polynomial and squarings are a chain of ~16
 * dependent operations, and 4 chains left the FMA units waiting (32 ymm registers hold 8) */
#define ACTIVATION_LANES 8
#endif
#include "vec_math.h"
#ifdef QB_ZMM
#include "vec_math512.h"
#endif

#define MAX_TAPS 9 /* up to 3x3 kernels */
/* This core's L2 in bytes (glibc reads it from cpuid; 256 KB where unknown): which loop order
 * a layer's tiles take, and the size of a row block (see conv). */
static size_t l2_bytes(void) {
  static size_t bytes = 0; /* (threads racing here store the same value) */
  if (!bytes) {
    long l2 = -1;
#ifdef _SC_LEVEL2_CACHE_SIZE
    l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    bytes = l2 > 0 ? (size_t)l2 : 256 * 1024;
  }
  return bytes;
}

/* Weights up to this many bytes stream past pixel tiles whose inputs stay in L1 (see conv).
 * Convs: 4x the L2; a fixed 256 KB, tuned on another CPU, sent a Zen 4's (1 MB L2) 432 KB -
 * 2.3 MB weights to row blocks, 10-48% slower there (128x384->1152 178 vs 160 us; 1568x384->1536
 * 3364 vs 2479; a 3x3 512->512 conv at 7x7 batch 8 4483 vs 2317). 1x1 convs and linears: the
 * L2; weights beyond it came from L3 for every pixel tile, and row blocks (of L2 / 4 bytes of
 * inputs) took 0.85-1.01x the time on Zen 5 (geomean 0.93, 768 <-> 3072 linears of 49-1576 rows;
 * docs/design/gemm.md, 2026-12-02). */
static size_t weights_streamed(int pointwise) { return pointwise ? l2_bytes() : 4 * l2_bytes(); }

/* A block: BLOCK output channels x 4 input channels of packed weights, one vector of int32 sums. */
#define PACKED 16 /* output channels per row of the packed weights */
#ifdef QB_ZMM
#define BLOCK 16
typedef __m512i block_t;
static inline block_t block_zero(void) { return _mm512_setzero_si512(); }
static inline block_t block_load(const int8_t* w) { return _mm512_loadu_si512(w); }
static inline block_t block_broadcast(int32_t four) { return _mm512_set1_epi32(four); }
#else
#define BLOCK 8
typedef __m256i block_t;
static inline block_t block_zero(void) { return _mm256_setzero_si256(); }
static inline block_t block_load(const int8_t* w) { return _mm256_loadu_si256((const __m256i*)w); }
static inline block_t block_broadcast(int32_t four) { return _mm256_set1_epi32(four); }
#endif
#if defined(QB_ZMM)
#ifdef QB_AMX
#define QB_CONV_CALL qb_conv_call_amx /* (its 1x1 convs and linears on tiles, the rest as the zmm build) */
#else
#define QB_CONV_CALL qb_conv_call_vnni512
#endif
#define PIXEL_TILE 8 /* 8 x 3 accumulators of AVX512's 32 registers */
#define WIDE_PIXELS 6 /* or 6 x 4, where Cout is a multiple of 64 (4 weight loads and 6 broadcasts per 24 sums) */
static inline block_t dot4_accumulate(block_t acc, block_t x, block_t w) { return _mm512_dpbusd_epi32(acc, x, w); }
#elif defined(QB_VNNI)
#define QB_CONV_CALL qb_conv_call_vnni
#define PIXEL_TILE 8 /* 8 x 3 accumulators of AVX512VL's 32 ymm registers */
static inline block_t dot4_accumulate(block_t acc, block_t x, block_t w) { return _mm256_dpbusd_epi32(acc, x, w); }
#elif defined(QB_EXACT16)
#define QB_CONV_CALL qb_conv_call_exact16
#define PIXEL_TILE 4
/* x and w here are int16 pairs (this build's 4-byte words): vpmaddwd's int32 sums are exact */
static inline block_t dot4_accumulate(block_t acc, block_t x, block_t w) { return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w)); }
#else
#define QB_CONV_CALL qb_conv_call
#define PIXEL_TILE 4
static inline block_t dot4_accumulate(block_t acc, block_t x, block_t w) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x, w), _mm256_set1_epi16(1)));
}

/* Whether this CPU runs qb_conv_call_vnni: every AVX512 extension its build flags name (it is built
 * in a file of its own, with those flags; this one must not need them). */
int qb_has_avx512_vnni(void) {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
#endif

/* The packed weights of the BLOCK outputs from o (a multiple of BLOCK), at step 0; a step is
 * one PACKED-wide row further on. */
static inline const int8_t* block_weights(const int8_t* w, int o, int total) {
  return w + ((size_t)(o / PACKED) * total * PACKED + o % PACKED) * 4;
}

typedef struct {
  const float *mult, *add; /* per output channel: acc * mult + add is the float result */
  const uint8_t* residual; /* NULL, or uint8 [P][Cout] added as residual * residual_scale (+ folded zero point) */
  const float* residual_f; /* NULL, or float [P][Cout] added as residual * residual_scale */
  float* float_out;        /* NULL, or float [P][Cout] written instead of the uint8 output (no requantization) */
  int activation;          /* enum activation, applied before the clamp */
  __m256 residual_scale, low, high, out_inv_scale, out_zp;
  __m256 qlow, qhigh; /* qmin, qmax as floats: the grid's clamp before the integer conversion (no byte clamp after it) */
  /* NULL, or per output channel acc * grid_mult + grid_add lands on the output grid directly:
   * set (in conv) where the post-op is a clamp or hardswish, the output uint8 and any residual
   * uint8 (hardswish: the grid without its zero point, added after the gate) */
  const float *grid_mult, *grid_add;
  __m256 grid_residual_scale, grid_low, grid_high;
  int grid_floor; /* 0 where grid_low is 0 = qmin: the byte packs' saturation clamps there (on_grid8) */
  __m256 grid_gate_scale; /* hardswish: its gate clamp(f / 6 + 1/2, 0, 1) is clamp(u * grid_gate_scale + 1/2, 0, 1) of u = f / scale */
} epilogue_t;

/* The float result of 8 outputs before the post-op: acc * mult + add (+ residual). */
static inline __m256 pre_activation_at(const epilogue_t* e, __m256i acc, __m256 mult, __m256 add, size_t at) {
  __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), mult, add);
  if (e->residual) {
    const __m256i r = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(e->residual + at)));
    f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(r), e->residual_scale, f);
  } else if (e->residual_f) {
    f = _mm256_fmadd_ps(_mm256_loadu_ps(e->residual_f + at), e->residual_scale, f);
  }
  return f;
}

static inline __m256 pre_activation8(const epilogue_t* e, __m256i acc, int o, int Cout, size_t pixel) {
  return pre_activation_at(e, acc, _mm256_loadu_ps(e->mult + o), _mm256_loadu_ps(e->add + o), pixel * Cout + o);
}

/* The post-op's clamp. (max_ps / min_ps return their second operand for a NaN: this order
 * keeps a NaN, as the reference's clamp does; a float residual may hold one, or an infinity) */
static inline __m256 clamped8(const epilogue_t* e, __m256 f) { return _mm256_min_ps(e->high, _mm256_max_ps(e->low, f)); }

/* A clamped result requantized, as int32 within [qmin, qmax]: clamped as floats first (an
 * infinity converts to INT_MIN; a NaN lands on qmin, the 0 the reference's integer conversion
 * stores: qmin is 0 in every uint8 flow), rounded half to even, as torch's quantize does. */
static inline __m256i quantized8(const epilogue_t* e, __m256 f) {
  return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_fmadd_ps(f, e->out_inv_scale, e->out_zp), e->qlow), e->qhigh));
}

/* 8 outputs after the post-op: clamped, then stored as floats or requantized to uint8. */
static inline void finish8(const epilogue_t* e, __m256 f, int o, int Cout, size_t pixel, uint8_t* restrict y) {
  f = clamped8(e, f);
  if (e->float_out) {
    _mm256_storeu_ps(e->float_out + pixel * Cout + o, f);
    return;
  }
  const __m256i q32 = quantized8(e, f);
  const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q32), _mm256_extracti128_si256(q32, 1));
  _mm_storel_epi64((__m128i*)(y + pixel * Cout + o), _mm_packus_epi16(q16, q16));
}

/* 4 pixels' int32 results for the same 8 outputs (within [0, 255]) stored as bytes: one pack of
 * all four (bytes: lane 0 holds each pixel's outputs 0-3, lane 1 its 4-7; a dword permute makes
 * each pixel's 8 bytes one qword) instead of four narrowing sequences. */
static inline void store4x8_bytes(const __m256i q[4], int Cout, uint8_t* restrict out) {
  const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  const __m256i pixels = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  const __m128i low = _mm256_castsi256_si128(pixels), high = _mm256_extracti128_si256(pixels, 1);
  _mm_storel_epi64((__m128i*)out, low);
  _mm_storeh_pd((double*)(out + Cout), _mm_castsi128_pd(low));
  _mm_storel_epi64((__m128i*)(out + 2 * (size_t)Cout), high);
  _mm_storeh_pd((double*)(out + 3 * (size_t)Cout), _mm_castsi128_pd(high));
}

/* finish8 for the same 8 outputs of 4 consecutive pixels, uint8 out. */
static inline void finish4x8(const epilogue_t* e, const __m256 f[4], int o, int Cout, size_t pixel, uint8_t* restrict y) {
  __m256i q[4];
  for (int j = 0; j < 4; j++) q[j] = quantized8(e, clamped8(e, f[j]));
  store4x8_bytes(q, Cout, y + pixel * Cout + o);
}

/* 8 outputs of a clamp-only or hardswish epilogue on the output grid (e->grid_mult set), as
 * int32 within [qmin, qmax]: one multiply-add (and the uint8 residual's), hardswish's gate and
 * product with it (3 multiply-adds and a clamp where the float route took 9 operations), one clamp. */
static inline __attribute__((always_inline)) __m256i on_grid8(const epilogue_t* e, __m256i acc, __m256 mult, __m256 add,
                                                              const uint8_t* residual, int hardswish, int floor) {
  __m256 q = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), mult, add);
  if (residual) q = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)residual))),
                                    e->grid_residual_scale, q);
  if (hardswish) {
    const __m256 gate = _mm256_fmadd_ps(q, e->grid_gate_scale, _mm256_set1_ps(0.5f));
    q = _mm256_fmadd_ps(q, _mm256_min_ps(_mm256_max_ps(gate, _mm256_setzero_ps()), _mm256_set1_ps(1.0f)), e->out_zp);
  }
  /* floor 0: a negative result (INT_MIN for -inf or NaN, which min_ps(high, q) keeps) packs to 0 = qmin
   * (small-K 1x1 convs 2-4% faster, one Zen 3 thread: 16 -> 96 channels at 112x112 617 -> 593 us) */
  if (!floor) return _mm256_cvtps_epi32(_mm256_min_ps(e->grid_high, q));
  return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(q, e->grid_low), e->grid_high));
}

/* 8 outputs of a clamp-only epilogue off the grid (a float output or residual). ``e`` is a local
 * copy: read through a pointer, its constants would be reloaded after every uint8 store (which
 * may alias them). */
static inline void store8(const epilogue_t e, __m256i acc, int o, int Cout, size_t pixel, uint8_t* restrict y) {
  finish8(&e, pre_activation8(&e, acc, o, Cout, pixel), o, Cout, pixel, y);
}

/* 8 of a block's sums: half 0 or 1 of a zmm block, a whole ymm block. */
static inline __m256i block_half(block_t acc, int half) {
#ifdef QB_ZMM
  return half ? _mm512_extracti64x4_epi64(acc, 1) : _mm512_castsi512_si256(acc);
#else
  (void)half;
  return acc;
#endif
}

/* A whole tile's clamp-only or hardswish epilogue on the output grid: each 8 outputs' constants loaded once
 * for the tile's pixels, 4 pixels' bytes packed and stored together (8 at a time, reloading the
 * constants and storing 8 bytes, it took half a small-K conv's cycles: a 25088 x 24 -> 144 1x1
 * conv on one Zen 4 thread 1262 -> 1159 us; oneDNN 847). */
static inline __attribute__((always_inline)) void store_tile_on_grid(const epilogue_t* e, block_t acc[PIXEL_TILE][4], int pixels,
                                                                     int blocks, int o, int Cout, size_t p, uint8_t* restrict y,
                                                                     int hardswish, int floor) {
#pragma GCC unroll 4
  for (int b = 0; b < blocks; b++)
#pragma GCC unroll 2
    for (int half = 0; half < BLOCK / 8 && o + BLOCK * b + 8 * half < Cout; half++) {
      const int o8 = o + BLOCK * b + 8 * half;
      const __m256 mult = _mm256_loadu_ps(e->grid_mult + o8), add = _mm256_loadu_ps(e->grid_add + o8);
      int i = 0;
#pragma GCC unroll 2
      for (; i + 4 <= pixels; i += 4) {
        __m256i q[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
          q[j] = on_grid8(e, block_half(acc[i + j][b], half), mult, add, e->residual ? e->residual + (p + i + j) * Cout + o8 : NULL,
                          hardswish, floor);
        store4x8_bytes(q, Cout, y + (p + i) * Cout + o8);
      }
#pragma GCC unroll 4
      for (; i < pixels; i++) {
        const __m256i q32 = on_grid8(e, block_half(acc[i][b], half), mult, add, e->residual ? e->residual + (p + i) * Cout + o8 : NULL,
                                        hardswish, floor);
        const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q32), _mm256_extracti128_si256(q32, 1));
        _mm_storel_epi64((__m128i*)(y + (p + i) * Cout + o8), _mm_packus_epi16(q16, q16));
      }
    }
}

/* store_tile_on_grid's float32 counterpart: a tile's clamp-only float results (a conv before
 * float ops: a squeeze-excitation's scale, a shuffle), each 8 outputs' constants loaded once
 * for the tile's pixels. */
static inline __attribute__((always_inline)) void store_tile_float(const epilogue_t* e, block_t acc[PIXEL_TILE][4], int pixels,
                                                                   int blocks, int o, int Cout, size_t p) {
#pragma GCC unroll 4
  for (int b = 0; b < blocks; b++)
#pragma GCC unroll 2
    for (int half = 0; half < BLOCK / 8 && o + BLOCK * b + 8 * half < Cout; half++) {
      const int o8 = o + BLOCK * b + 8 * half;
      const __m256 mult = _mm256_loadu_ps(e->mult + o8), add = _mm256_loadu_ps(e->add + o8);
#pragma GCC unroll 8
      for (int i = 0; i < pixels; i++) {
        const size_t at = (p + i) * Cout + o8;
        _mm256_storeu_ps(e->float_out + at, clamped8(e, pre_activation_at(e, block_half(acc[i][b], half), mult, add, at)));
      }
    }
}

#ifdef QB_ZMM
/* The dword order that makes each of 4 packed vectors' 16 bytes one lane: the packs work per
 * 128-bit lane, so dword 4 L + j holds vector j's elements 4 L .. 4 L + 3. */
static inline __m512i pack_order(void) { return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15); }

/* 4 vectors of int32 as 64 bytes, lane j vector j's (saturating: below 0 packs to 0). */
static inline __m512i packed4(const __m512i q[4], __m512i order) {
  return _mm512_permutexvar_epi32(order, _mm512_packus_epi16(_mm512_packs_epi32(q[0], q[1]), _mm512_packs_epi32(q[2], q[3])));
}

/* store8's constants broadcast to zmm (once per tile where a tile's pixels share them). */
typedef struct {
  __m512 residual_scale, low, high, inv_scale, zp;
  __m512i order;
  __m512 qlow, qhigh;
} wide_epilogue_t;

static inline wide_epilogue_t wide_epilogue(const epilogue_t* e) {
  const wide_epilogue_t w = {_mm512_broadcast_f32x8(e->residual_scale), _mm512_broadcast_f32x8(e->low),
                             _mm512_broadcast_f32x8(e->high), _mm512_broadcast_f32x8(e->out_inv_scale),
                             _mm512_broadcast_f32x8(e->out_zp),
                             pack_order(),
                             _mm512_broadcast_f32x8(e->qlow), _mm512_broadcast_f32x8(e->qhigh)};
  return w;
}

/* 16 outputs' acc * mult + add (+ the residual at element ``at``) before the post-op
 * (pre_activation_at on zmm); ``real`` masks the residual's outputs past Cout. */
static inline __m512 pre_activation16(const epilogue_t* e, const wide_epilogue_t* w, __m512i acc, __m512 mult, __m512 add,
                                      size_t at, __mmask16 real) {
  __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), mult, add);
  if (e->residual)
    f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(real, e->residual + at))), w->residual_scale, f);
  else if (e->residual_f)
    f = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(real, e->residual_f + at), w->residual_scale, f);
  return f;
}

/* clamped8 on 16 outputs (its operand order: a NaN stays). */
static inline __m512 clamped16(const wide_epilogue_t* w, __m512 f) { return _mm512_min_ps(w->high, _mm512_max_ps(w->low, f)); }

/* 16 channels' float result: acc * mult + add (+ residual), clamped (store8's arithmetic). */
static inline __m512 float_result(const epilogue_t* e, const wide_epilogue_t* w, __m512i acc, __m512 mult, __m512 add,
                                  int o, int Cout, size_t pixel) {
  return clamped16(w, pre_activation16(e, w, acc, mult, add, pixel * Cout + o, 0xffff));
}

static inline __m512i quantized(const wide_epilogue_t* w, __m512 f) {
  /* round half to even, clamped as floats first (store8) */
  return _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_fmadd_ps(f, w->inv_scale, w->zp), w->qlow), w->qhigh));
}

/* The outputs of the 16 from ob that are below Cout (a last block may be half padding). */
static inline __mmask16 block_mask(int ob, int Cout) { return ob + 16 <= Cout ? 0xffff : (__mmask16)((1u << (Cout - ob)) - 1); }

/* store8 on 16 channels, for a clamp-only epilogue. */
static inline void store16(const epilogue_t e, __m512i acc, int o, int Cout, size_t pixel, uint8_t* restrict y) {
  const wide_epilogue_t w = wide_epilogue(&e);
  const __m512 f = float_result(&e, &w, acc, _mm512_loadu_ps(e.mult + o), _mm512_loadu_ps(e.add + o), o, Cout, pixel);
  if (e.float_out) {
    _mm512_storeu_ps(e.float_out + pixel * Cout + o, f);
    return;
  }
  _mm_storeu_si128((__m128i*)(y + pixel * Cout + o), _mm512_cvtepi32_epi8(quantized(&w, f))); /* (within [qmin, qmax]) */
}

/* One pixel's 64 outputs from o (4 zmm blocks, clamp-only, uint8 out): float_result per block,
 * then one saturating pack of all four to bytes (store8's: the same bytes) instead of four
 * narrowing stores; the constants broadcast once per tile. */
static inline void store64(const epilogue_t* e, const wide_epilogue_t* w, const __m512i acc[4], const __m512 mult[4],
                           const __m512 add[4], int o, int Cout, size_t pixel, uint8_t* restrict y) {
  __m512i q[4];
  for (int b = 0; b < 4; b++) q[b] = quantized(w, float_result(e, w, acc[b], mult[b], add[b], o + 16 * b, Cout, pixel));
  _mm512_storeu_si512(y + pixel * Cout + o, packed4(q, w->order));
}

/* 16 outputs' clamped float result at element ``at`` of the float output. */
static inline void store_float16(const epilogue_t* e, const wide_epilogue_t* w, __m512i acc, __m512 mult, __m512 add, size_t at,
                                 __mmask16 real) {
  _mm512_mask_storeu_ps(e->float_out + at, real, clamped16(w, pre_activation16(e, w, acc, mult, add, at, real)));
}

/* store_tile_float on zmm: 16 outputs a step, a block's constants loaded once for the tile's
 * pixels, a block past Cout masked; store_tile_float's arithmetic in its order (the same
 * floats). Its ymm halves had cost float-out linears ~10% (1024 x 768 -> 2304, 2 Zen 5 threads:
 * 2897 -> 2556 us). */
static inline __attribute__((always_inline)) void store_tile_float16(const epilogue_t* e, block_t acc[PIXEL_TILE][4], int pixels,
                                                                     int blocks, int o, int Cout, size_t p) {
  const wide_epilogue_t w = wide_epilogue(e);
#pragma GCC unroll 4
  for (int b = 0; b < blocks; b++) {
    const int ob = o + BLOCK * b;
    const __mmask16 real = block_mask(ob, Cout);
    const __m512 mult = _mm512_maskz_loadu_ps(real, e->mult + ob), add = _mm512_maskz_loadu_ps(real, e->add + ob);
#pragma GCC unroll 8
    for (int i = 0; i < pixels; i++) store_float16(e, &w, acc[i][b], mult, add, (p + i) * Cout + ob, real);
  }
}

/* on_grid8 on 16 outputs (``real`` masks a uint8 residual's outputs past Cout). */
static inline __attribute__((always_inline)) __m512i on_grid16(const epilogue_t* e, __m512i acc, __m512 mult, __m512 add,
                                                               __m512 low, __m512 high, const uint8_t* residual, __mmask16 real,
                                                               int hardswish, int floor) {
  __m512 q = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), mult, add);
  if (residual)
    q = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(real, residual))),
                        _mm512_broadcast_f32x8(e->grid_residual_scale), q);
  if (hardswish) {
    const __m512 gate = _mm512_fmadd_ps(q, _mm512_broadcast_f32x8(e->grid_gate_scale), _mm512_set1_ps(0.5f));
    q = _mm512_fmadd_ps(q, _mm512_min_ps(_mm512_max_ps(gate, _mm512_setzero_ps()), _mm512_set1_ps(1.0f)),
                        _mm512_broadcast_f32x8(e->out_zp));
  }
  if (!floor) return _mm512_cvtps_epi32(_mm512_min_ps(high, q)); /* (on_grid8's: below 0 packs to 0) */
  return _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(q, low), high));
}

/* 4 pixels' int32 results for the same 16 outputs stored as bytes: one pack of all four, 4 stores. */
static inline void store4x16_bytes(const __m512i q[4], __m512i order, int Cout, uint8_t* restrict out) {
  const __m512i bytes = packed4(q, order);
  _mm_storeu_si128((__m128i*)out, _mm512_castsi512_si128(bytes));
  _mm_storeu_si128((__m128i*)(out + Cout), _mm512_extracti32x4_epi32(bytes, 1));
  _mm_storeu_si128((__m128i*)(out + 2 * (size_t)Cout), _mm512_extracti32x4_epi32(bytes, 2));
  _mm_storeu_si128((__m128i*)(out + 3 * (size_t)Cout), _mm512_extracti32x4_epi32(bytes, 3));
}

/* store_tile_on_grid on zmm: 16 outputs a step, half its operations (the ymm halves and the
 * float route of store64 had left small-K 1x1 convs at batch 8 to oneDNN on a Zen 5). */
static inline __attribute__((always_inline)) void store_tile_on_grid16(const epilogue_t* e, block_t acc[PIXEL_TILE][4], int pixels,
                                                                       int blocks, int o, int Cout, size_t p, uint8_t* restrict y,
                                                                       int hardswish, int floor) {
  const __m512 low = _mm512_broadcast_f32x8(e->grid_low), high = _mm512_broadcast_f32x8(e->grid_high);
  const __m512i order = pack_order();
  if (blocks == 4 && o + 64 <= Cout) { /* pixel by pixel, as store64: each pixel's 4 sums free after it */
    __m512 mult[4], add[4];
    for (int b = 0; b < 4; b++) mult[b] = _mm512_loadu_ps(e->grid_mult + o + 16 * b), add[b] = _mm512_loadu_ps(e->grid_add + o + 16 * b);
    for (int i = 0; i < pixels; i++) {
      const size_t at = (p + i) * Cout + o;
      __m512i q[4];
      for (int b = 0; b < 4; b++)
        q[b] = on_grid16(e, acc[i][b], mult[b], add[b], low, high, e->residual ? e->residual + at + 16 * b : NULL, 0xffff, hardswish,
                         floor);
      _mm512_storeu_si512(y + at, packed4(q, order));
    }
    return;
  }
#pragma GCC unroll 4
  for (int b = 0; b < blocks && o + BLOCK * b < Cout; b++) {
    const int ob = o + BLOCK * b;
    const __mmask16 real = block_mask(ob, Cout);
    const __m512 mult = _mm512_maskz_loadu_ps(real, e->grid_mult + ob), add = _mm512_maskz_loadu_ps(real, e->grid_add + ob);
    int i = 0;
    if (real == 0xffff)
#pragma GCC unroll 2
      for (; i + 4 <= pixels; i += 4) {
        __m512i q[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
          q[j] = on_grid16(e, acc[i + j][b], mult, add, low, high, e->residual ? e->residual + (p + i + j) * Cout + ob : NULL, real,
                           hardswish, floor);
        store4x16_bytes(q, order, Cout, y + (p + i) * Cout + ob);
      }
#pragma GCC unroll 4
    for (; i < pixels; i++) {
      const size_t at = (p + i) * Cout + ob;
      const __m512i q = on_grid16(e, acc[i][b], mult, add, low, high, e->residual ? e->residual + at : NULL, real, hardswish, floor);
      /* (within [qmin, qmax], or below 0 where floor is 0: the truncating store needs it at 0) */
      _mm512_mask_cvtepi32_storeu_epi8(y + at, real, floor ? q : _mm512_max_epi32(q, _mm512_setzero_si512()));
    }
  }
}
#endif

/* One block's sums for one pixel, clamp-only epilogue. A zmm block: store16 when its 16
 * channels are real, else two 8-channel halves, skipping the half past Cout (the packing's zero weights). */
static inline void store_block(const epilogue_t e, block_t acc, int o, int Cout, size_t pixel, uint8_t* restrict y) {
#ifdef QB_ZMM
  if (o + 16 <= Cout) {
    store16(e, acc, o, Cout, pixel, y);
    return;
  }
  store8(e, _mm512_castsi512_si256(acc), o, Cout, pixel, y);
  if (o + 8 < Cout) store8(e, _mm512_extracti64x4_epi64(acc, 1), o + 8, Cout, pixel, y);
#else
  store8(e, acc, o, Cout, pixel, y);
#endif
}

#ifndef QB_ZMM /* (store_activated16 below) */
/* The epilogue of a tile whose post-op is an activation (GELU, SiLU, hardswish): 8 outputs of
 * ACTIVATION_LANES pixels at a time, in lockstep (vec_math.h). One copy of this code, called once per
 * tile; a short last group of pixels repeats its first pixel's sums and stores only its own. */
static __attribute__((noinline)) void store_activated(const epilogue_t* shared, block_t acc[PIXEL_TILE][4], int pixels,
                                                      int blocks, int o, int Cout, size_t p, uint8_t* restrict y) {
  const epilogue_t e = *shared; /* (local: see store8) */
  for (int b = 0; b < blocks; b++)
    for (int half = 0; half < BLOCK / 8 && o + BLOCK * b + 8 * half < Cout; half++) {
      const int o8 = o + BLOCK * b + 8 * half;
      for (int first = 0; first < pixels; first += ACTIVATION_LANES) {
        __m256 f[ACTIVATION_LANES];
        for (int j = 0; j < ACTIVATION_LANES; j++) {
          const int i = first + j < pixels ? first + j : first;
          f[j] = pre_activation8(&e, block_half(acc[i][b], half), o8, Cout, p + i);
        }
        activate_lanes(e.activation, f, ACTIVATION_LANES);
        for (int j0 = 0; j0 < ACTIVATION_LANES; j0 += 4) {
          if (!e.float_out && first + j0 + 4 <= pixels)
            finish4x8(&e, f + j0, o8, Cout, p + first + j0, y);
          else
            for (int j = j0; j < j0 + 4 && first + j < pixels; j++) finish8(&e, f[j], o8, Cout, p + first + j, y);
        }
      }
    }
}

#else
/* store_activated on zmm: 16 outputs of ACTIVATION_LANES16 pixels at a time (vec_math512.h), a
 * block past Cout's last 16 masked. */
static __attribute__((noinline)) void store_activated16(const epilogue_t* shared, block_t acc[PIXEL_TILE][4], int pixels,
                                                        int blocks, int o, int Cout, size_t p, uint8_t* restrict y) {
  const epilogue_t e = *shared; /* (local: see store8) */
  const wide_epilogue_t w = wide_epilogue(&e);
  for (int b = 0; b < blocks; b++) {
    const int ob = o + BLOCK * b;
    const __mmask16 real = block_mask(ob, Cout);
    const __m512 mult = _mm512_maskz_loadu_ps(real, e.mult + ob), add = _mm512_maskz_loadu_ps(real, e.add + ob);
    for (int first = 0; first < pixels; first += ACTIVATION_LANES16) {
      __m512 f[ACTIVATION_LANES16];
      for (int j = 0; j < ACTIVATION_LANES16; j++) {
        const int i = first + j < pixels ? first + j : first;
        f[j] = pre_activation16(&e, &w, acc[i][b], mult, add, (p + i) * Cout + ob, real);
      }
      activate16_lanes(e.activation, f, ACTIVATION_LANES16);
      for (int j = 0; j < ACTIVATION_LANES16 && first + j < pixels; j++) {
        const size_t at = (p + first + j) * Cout + ob;
        const __m512 clamped = clamped16(&w, f[j]);
        if (e.float_out)
          _mm512_mask_storeu_ps(e.float_out + at, real, clamped);
        else
          _mm512_mask_cvtepi32_storeu_epi8(y + at, real, quantized(&w, clamped));
      }
    }
  }
}
#endif

#ifndef WIDE_PIXELS
#define WIDE_PIXELS 0 /* (no 4-block tiles) */
#endif

/* The epilogue of a tile's sums: ``pixels`` output pixels from p times ``blocks`` blocks of
 * BLOCK outputs from o. */
static inline __attribute__((always_inline)) void finish_tile(const epilogue_t* shared, block_t acc[PIXEL_TILE][4], int pixels,
                                                              int blocks, int o, int Cout, size_t p, uint8_t* restrict y) {
  const epilogue_t e = *shared; /* copied once the sums are done: no registers taken from the loop above */
#ifdef QB_ZMM
#define STORE_TILE_ON_GRID store_tile_on_grid16
#else
#define STORE_TILE_ON_GRID store_tile_on_grid
#endif
  if (e.grid_mult) { /* (a constant ``hardswish`` each: the clamp-only code keeps no branch) */
    if (e.activation == HARDSWISH)
      STORE_TILE_ON_GRID(&e, acc, pixels, blocks, o, Cout, p, y, 1, 1);
    else if (e.grid_floor)
      STORE_TILE_ON_GRID(&e, acc, pixels, blocks, o, Cout, p, y, 0, 1);
    else
      STORE_TILE_ON_GRID(&e, acc, pixels, blocks, o, Cout, p, y, 0, 0);
    return;
  }
#undef STORE_TILE_ON_GRID
#ifdef QB_ZMM
  /* (off the grid: a float residual into uint8) */
  if (blocks == 4 && e.activation == CLAMP_ONLY && !e.float_out && o + 64 <= Cout) {
    const wide_epilogue_t wide = wide_epilogue(&e);
    __m512 mult[4], add[4];
    for (int b = 0; b < 4; b++) mult[b] = _mm512_loadu_ps(e.mult + o + 16 * b), add[b] = _mm512_loadu_ps(e.add + o + 16 * b);
    for (int i = 0; i < pixels; i++) store64(&e, &wide, acc[i], mult, add, o, Cout, p + i, y);
    return;
  }
#endif
  if (e.float_out && e.activation == CLAMP_ONLY) {
#ifdef QB_ZMM
    store_tile_float16(&e, acc, pixels, blocks, o, Cout, p);
#else
    store_tile_float(&e, acc, pixels, blocks, o, Cout, p);
#endif
    return;
  }
  if (e.activation != CLAMP_ONLY) { /* (``shared``: a pointer to ``e`` would make its copy a memcpy per tile) */
#ifdef QB_ZMM
    store_activated16(shared, acc, pixels, blocks, o, Cout, p, y);
#else
    store_activated(shared, acc, pixels, blocks, o, Cout, p, y);
#endif
    return;
  }
  for (int i = 0; i < pixels; i++)
    for (int b = 0; b < blocks; b++) store_block(e, acc[i][b], o + BLOCK * b, Cout, p + i, y);
}

/* ``pixels`` (1 to PIXEL_TILE) output pixels times ``blocks`` (1-4) blocks of BLOCK outputs
 * from ``o``; the sum runs over ``taps`` kernel positions, pixel i's input for tap t at rows[i][t]. */
static inline __attribute__((always_inline)) void tile(int pixels, int blocks, int taps, int Cin, int Cout, size_t p, int o,
                        const uint8_t* const rows[PIXEL_TILE][MAX_TAPS], const int8_t* restrict w,
                        const epilogue_t* shared, uint8_t* restrict y) {
  block_t acc[PIXEL_TILE][4];
  for (int i = 0; i < pixels; i++)
    for (int b = 0; b < blocks; b++) acc[i][b] = block_zero();
  const int steps = Cin / 4, total = taps * steps;
  const int8_t* wb[4];
  for (int b = 0; b < blocks; b++) wb[b] = block_weights(w, o + BLOCK * b, total);
  for (int t = 0; t < taps; t++) {
    for (int k = 0; k < steps; k++) {
      const size_t step = ((size_t)t * steps + k) * 4 * PACKED;
      block_t wv[4];
      for (int b = 0; b < blocks; b++) wv[b] = block_load(wb[b] + step);
      for (int i = 0; i < pixels; i++) {
        int32_t four;
        memcpy(&four, rows[i][t] + 4 * k, 4);
        const block_t xb = block_broadcast(four);
        for (int b = 0; b < blocks; b++)
          acc[i][b] = dot4_accumulate(acc[i][b], xb, wv[b]);
      }
    }
  }
  finish_tile(shared, acc, pixels, blocks, o, Cout, p, y);
}

/* tile() with constant sizes, so that its loops unroll and its sums stay in registers */
#define TILE_CASE(PIXELS, BLOCKS) \
  case PIXELS: tile(PIXELS, BLOCKS, taps, g.Cin, Cout, p, o, rows, w, &e, y); break;
#if PIXEL_TILE == 8
#define TILE_CASES(PIXELS, BLOCKS)                                                               \
  switch (PIXELS) {                                                                              \
    TILE_CASE(1, BLOCKS) TILE_CASE(2, BLOCKS) TILE_CASE(3, BLOCKS) TILE_CASE(4, BLOCKS)          \
    TILE_CASE(5, BLOCKS) TILE_CASE(6, BLOCKS) TILE_CASE(7, BLOCKS)                               \
    default: tile(PIXEL_TILE, BLOCKS, taps, g.Cin, Cout, p, o, rows, w, &e, y);                  \
  }
#else
#define TILE_CASES(PIXELS, BLOCKS)                                                               \
  switch (PIXELS) {                                                                              \
    TILE_CASE(1, BLOCKS) TILE_CASE(2, BLOCKS) TILE_CASE(3, BLOCKS)                               \
    default: tile(PIXEL_TILE, BLOCKS, taps, g.Cin, Cout, p, o, rows, w, &e, y);                  \
  }
#endif
#define WIDE_TILE_CASES(PIXELS)                                                                  \
  switch (PIXELS) {                                                                              \
    TILE_CASE(1, 4) TILE_CASE(2, 4) TILE_CASE(3, 4) TILE_CASE(4, 4) TILE_CASE(5, 4)              \
    default: tile(WIDE_PIXELS, 4, taps, g.Cin, Cout, p, o, rows, w, &e, y);                      \
  }

/* The first block of output tile ``ot``: tiles are 3 blocks wide, but the last 4 of 3k + 1
 * blocks go as 2 + 2 (a 1-block tile costs as many input loads as a 3-block one). */
static inline int tile_start(int ot, int blocks) {
  const int full = blocks % 3 == 1 && blocks > 1 ? blocks / 3 - 1 : blocks / 3;
  return ot <= full ? 3 * ot : 3 * full + 2 * (ot - full);
}

#ifdef QB_AMX
/* (a compiler without AMX intrinsics, e.g. GCC 8, still builds the rest of the VNNI library:
 * qb_amx_ready then says no) */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define QB_AMX_TILES 1
#endif
#endif

#ifdef QB_AMX_TILES
/* AMX-INT8: 1x1 convs of stride 1 and linears (a GEMM over rows of Cin bytes) on tile
 * registers. Tiles: C = 16 pixels x 16 outputs of int32 sums (4: 32 x 32), A = 16 pixels x 64
 * input bytes (2), B = 16 steps of 4 inputs x 16 outputs (2): the packed weights' rows as they
 * are ([16 outputs][4 inputs] a row: TDPBUSD's layout), so every build takes the same packing. */
#include <cpuid.h>
#include <sys/syscall.h>
#define AMX_TARGET __attribute__((target("amx-tile,amx-int8")))
#define ARCH_REQ_XCOMP_PERM 0x1023 /* (Linux: a process asks once for the tile registers' state) */
#define XFEATURE_XTILEDATA 18
#define AMX_PIXELS 32
#define AMX_STEP 64 /* input bytes per tile step */
#define AMX_TILE_BYTES 1024
/* fewer rows run on zmm: a tile of 32 rows for 1 (a classifier's 2048 -> 1000) took 92 us, zmm 67 */
#define AMX_MIN_ROWS 16


typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} amx_config_t;

/* C tiles 0-3, A tiles 4-5, B tiles 6-7: all 16 rows of 64 bytes. */
static AMX_TARGET void amx_configure(void) {
  amx_config_t config;
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; t++) config.colsb[t] = 64, config.rows[t] = 16;
  /* (asm with the struct as its operand: GCC 12 -O3 dropped the stores before _tile_loadconfig,
   * whose memory read it does not see, and the first tile instruction faulted) */
  __asm__ volatile("ldtilecfg %0" : : "m"(config));
}

/* on_grid16 on a row of a C tile's sums, stored as bytes (clamp-only or hardswish, uint8 out, no
 * residual or a uint8 one). ``real`` masks the outputs past Cout. */
static inline __attribute__((always_inline)) void amx_grid_row(const epilogue_t* e, const int32_t* sums, __m512 mult, __m512 add,
                                                               __m512 low, __m512 high, const uint8_t* residual, int hardswish,
                                                               __mmask16 real, uint8_t* y) {
  const __m512i bytes = on_grid16(e, _mm512_load_si512(sums), mult, add, low, high, residual, real, hardswish, 1);
  if (real == 0xffff)
    _mm_storeu_si128((__m128i*)y, _mm512_cvtepi32_epi8(bytes));
  else
    _mm512_mask_cvtepi32_storeu_epi8(y, real, bytes);
}

/* A 32 x 32 (or 32 x 16) tile's sums on the output grid, a block's constants loaded once: the
 * tile-wide finish_tile (8 pixels' acc reloaded, then ymm) had taken 64 -> 256 1x1 convs at
 * 25088 pixels 1.8x oneDNN's time. */
static void amx_finish_on_grid(const epilogue_t* e, const int32_t sums[4][16][16], int pixels, int two, int o, int Cout,
                               size_t p, uint8_t* restrict y, int hardswish) {
  const __m512 low = _mm512_broadcast_f32x8(e->grid_low), high = _mm512_broadcast_f32x8(e->grid_high);
  for (int b = 0; b <= two; b++) {
    const int ob = o + 16 * b;
    const __mmask16 real = block_mask(ob, Cout);
    const __m512 mult = _mm512_maskz_loadu_ps(real, e->grid_mult + ob), add = _mm512_maskz_loadu_ps(real, e->grid_add + ob);
    for (int i = 0; i < pixels; i++) {
      const size_t at = (p + i) * Cout + ob;
      amx_grid_row(e, sums[2 * (i / 16) + b][i % 16], mult, add, low, high, e->residual ? e->residual + at : NULL, hardswish,
                   real, y + at);
    }
  }
}

/* A 32 x 32 (or 32 x 16) tile's sums as clamped float32 (clamp-only, float out: attention's
 * projections), store_tile_float's arithmetic on 16 outputs a step, a block's constants loaded
 * once: through finish_tile (8 pixels' sums reloaded, then ymm) vit_b_16's 197-row in_proj, 768
 * -> 2304 with float out, took 1.27x oneDNN's time, its out_proj 1.43x (2 threads). */
static void amx_finish_float(const epilogue_t* e, const int32_t sums[4][16][16], int pixels, int two, int o, int Cout,
                             size_t p) {
  const wide_epilogue_t w = wide_epilogue(e);
  for (int b = 0; b <= two; b++) {
    const int ob = o + 16 * b;
    const __mmask16 real = block_mask(ob, Cout);
    const __m512 mult = _mm512_maskz_loadu_ps(real, e->mult + ob), add = _mm512_maskz_loadu_ps(real, e->add + ob);
    for (int i = 0; i < pixels; i++)
      store_float16(e, &w, _mm512_load_si512(sums[2 * (i / 16) + b][i % 16]), mult, add, (p + i) * Cout + ob, real);
  }
}

/* The epilogue of one 32 x 32 (or 32 x 16: ``two`` 0) tile of sums, 8 pixels at a time. */
static void amx_finish(const epilogue_t* e, const int32_t sums[4][16][16], int pixels, int two, int o, int Cout, size_t p,
                       uint8_t* restrict y) {
  if (e->grid_mult) {
    if (e->activation == HARDSWISH)
      amx_finish_on_grid(e, sums, pixels, two, o, Cout, p, y, 1);
    else
      amx_finish_on_grid(e, sums, pixels, two, o, Cout, p, y, 0);
    return;
  }
  if (e->float_out && e->activation == CLAMP_ONLY) {
    amx_finish_float(e, sums, pixels, two, o, Cout, p);
    return;
  }
  for (int first = 0; first < pixels; first += PIXEL_TILE) {
    block_t acc[PIXEL_TILE][4];
    const int n = pixels - first < PIXEL_TILE ? pixels - first : PIXEL_TILE;
    for (int i = 0; i < n; i++) {
      const int row = first + i, half = row / 16;
      acc[i][0] = _mm512_load_si512(sums[2 * half][row % 16]);
      acc[i][1] = _mm512_load_si512(sums[2 * half + 1][row % 16]);
    }
    if (n == PIXEL_TILE && two)
      finish_tile(e, acc, PIXEL_TILE, 2, o, Cout, p + first, y);
    else
      finish_tile(e, acc, n, 1 + two, o, Cout, p + first, y);
  }
}

/* One 32-pixel x 32-output tile: A rows at a (``stride`` bytes apart), weights of blocks b0 and
 * b0 + 1 (``two``); the K tail's weights from ``tail_w`` (16 rows a block, zero past the real ones). */
static inline AMX_TARGET void amx_tile(const uint8_t* a, size_t stride, const int8_t* w, const int8_t* tail_w, int total,
                                       int full, int tail, int b0, int two, int32_t sums[4][16][16]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int8_t* w0 = w + (size_t)b0 * total * 64;
  const int8_t* w1 = w0 + (size_t)total * 64;
  for (int k = 0; k < full; k++) {
    _tile_loadd(4, a + k * AMX_STEP, stride);
    _tile_loadd(5, a + 16 * stride + k * AMX_STEP, stride);
    _tile_loadd(6, w0 + k * AMX_TILE_BYTES, 64);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(2, 5, 6);
    if (two) {
      _tile_loadd(7, w1 + k * AMX_TILE_BYTES, 64);
      _tile_dpbusd(1, 4, 7);
      _tile_dpbusd(3, 5, 7);
    }
  }
  if (tail) { /* A's bytes past Cin (the next row's) meet the zero rows of tail_w */
    _tile_loadd(4, a + full * AMX_STEP, stride);
    _tile_loadd(5, a + 16 * stride + full * AMX_STEP, stride);
    _tile_loadd(6, tail_w + (size_t)b0 * AMX_TILE_BYTES, 64);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(2, 5, 6);
    if (two) {
      _tile_loadd(7, tail_w + (size_t)(b0 + 1) * AMX_TILE_BYTES, 64);
      _tile_dpbusd(1, 4, 7);
      _tile_dpbusd(3, 5, 7);
    }
  }
  _tile_stored(0, sums[0], 64);
  _tile_stored(2, sums[2], 64);
  if (two) {
    _tile_stored(1, sums[1], 64);
    _tile_stored(3, sums[3], 64);
  }
}

static AMX_TARGET void amx_release(void) { _tile_release(); }

/* y[P][Cout] from x[P][Cin] (Cin % 4 == 0, Cout % 8 == 0) on AMX tiles, e's epilogue; 0, or -1
 * where a buffer could not be allocated. The operand read again for every tile of the other is
 * the smaller one, so it comes from cache: the weights where Cout <= P (each thread's pixel
 * tiles, A rows in L1 while the weights stream past), else the rows (each thread's share of the
 * weights read once: 197-row linears of 1.7-2.4 MB weights had taken 1.2-1.4x oneDNN's time
 * streaming all of them per pixel tile). The last pixel tile reads a zero-padded copy of its
 * rows (its tiles would read past x); the K tail's weights are copied into whole zero-padded tiles. */
static int amx_rows(int threads, int P, int Cin, int Cout, const uint8_t* x, const int8_t* w, const epilogue_t* e, uint8_t* y) {
  const int total = Cin / 4, full = total / 16, tail = total % 16, blocks = (Cout + 15) / 16;
  const int pixel_tiles = (P + AMX_PIXELS - 1) / AMX_PIXELS, output_tiles = (blocks + 1) / 2;
  const size_t padded = (size_t)(full + (tail > 0)) * AMX_STEP, last = (size_t)(pixel_tiles - 1) * AMX_PIXELS;
  const int pixels_outer = Cout <= P;
  int8_t* tail_w = tail ? aligned_alloc(64, (size_t)blocks * AMX_TILE_BYTES) : NULL;
  uint8_t* last_rows = aligned_alloc(64, AMX_PIXELS * padded);
  if ((tail && !tail_w) || !last_rows) {
    free(tail_w);
    free(last_rows);
    return -1;
  }
  if (tail) {
    memset(tail_w, 0, (size_t)blocks * AMX_TILE_BYTES);
    for (int b = 0; b < blocks; b++) memcpy(tail_w + (size_t)b * AMX_TILE_BYTES, w + ((size_t)b * total + full * 16) * 64, (size_t)tail * 64);
  }
  memset(last_rows, 0, AMX_PIXELS * padded);
  copy_rows(last_rows, x + last * Cin, P - last, Cin, padded, 1);
#pragma omp parallel num_threads(threads)
  {
    amx_configure();
    int32_t sums[4][16][16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
    for (int tile = 0; tile < pixel_tiles * output_tiles; tile++) {
      const int pt = pixels_outer ? tile / output_tiles : tile % pixel_tiles;
      const int ot = pixels_outer ? tile % output_tiles : tile / pixel_tiles;
      const size_t p = (size_t)pt * AMX_PIXELS;
      const int final = pt == pixel_tiles - 1, pixels = final ? P - (int)p : AMX_PIXELS, b0 = 2 * ot, two = b0 + 1 < blocks;
      amx_tile(final ? last_rows : x + p * Cin, final ? padded : (size_t)Cin, w, tail_w, total, full, tail, b0, two, sums);
      amx_finish(e, (const int32_t(*)[16][16])sums, pixels, two, b0 * 16, Cout, p, y);
    }
    amx_release();
  }
  free(tail_w);
  free(last_rows);
  return 0;
}
#endif

#ifdef QB_AMX
/* 1 where this CPU has AMX-TILE and AMX-INT8 and Linux lets this process use them (asked once,
 * as oneDNN asks), else 0. */
int qb_amx_ready(void) {
  static int ready = -1; /* (threads racing here store the same value) */
  if (ready < 0) {
#ifdef QB_AMX_TILES
    unsigned a, b, c, d;
    const int has = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1);
    ready = has && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    ready = 0;
#endif
  }
  return ready;
}
#endif

/* How conv's threads share the tiles. Each thread owns a contiguous share, the one a static
 * split gives it, so it computes the same pixels in every layer and reads what its own core
 * wrote (tiles handed out in chunks cost mobilenet_v2_like b1 12%); it takes its tiles from the
 * front, and when done takes the far ends of the others' shares, so a core slowed by another
 * process or the hypervisor does not hold the layer up (docs/design/gemm.md, 2026-12-02). A
 * share is [first, end) in one 64-bit word on a cache line of its own, changed by compare-and-swap. */
#define STEAL_PARTS 16 /* a take is ~1/STEAL_PARTS of a share */
typedef struct {
  uint64_t range; /* first | end << 32 */
  char pad[56];
} share_t;

static void init_share(share_t* share, long first, long end) {
  __atomic_store_n(&share->range, (uint64_t)first | (uint64_t)end << 32, __ATOMIC_RELAXED);
}

/* Up to ``chunk`` units of ``share``, from its front or (``back``) its end, into [*first, *last);
 * 0 once it is empty. */
static int take_tiles(share_t* share, int chunk, int back, long* first, long* last) {
  uint64_t seen = __atomic_load_n(&share->range, __ATOMIC_ACQUIRE);
  for (;;) {
    const uint32_t lo = (uint32_t)seen, hi = (uint32_t)(seen >> 32);
    if (lo >= hi) return 0;
    const uint32_t n = hi - lo < (uint32_t)chunk ? hi - lo : (uint32_t)chunk;
    const uint64_t rest = back ? (uint64_t)lo | (uint64_t)(hi - n) << 32 : (uint64_t)(lo + n) | (uint64_t)hi << 32;
    if (__atomic_compare_exchange_n(&share->range, &seen, rest, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
      *first = back ? hi - n : lo, *last = back ? hi : lo + n;
      return 1;
    }
  }
}

typedef struct {
  int N, H, W, Cin, OH, OW, KH, KW, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w;
} geometry_t;

/* The tile after (block, outer, inner): inner runs fastest. */
static inline void next_tile(int* block, int* outer, int* inner, long outer_tiles, long inner_tiles) {
  if (++*inner == inner_tiles) {
    *inner = 0;
    if (++*outer == outer_tiles) *outer = 0, ++*block;
  }
}

/* rows[i][t]: the input row (Cin bytes) under tap t of output pixel p + i, or ``padding`` (the
 * zero point) where the window leaves the image. One division for the tile's first pixel, then
 * a walk along the output rows; a window inside the image is its first row plus tap_offsets
 * (per-pixel divisions and per-tap checks had cost ~15% of a 64-channel 3x3 conv). */
static void window_rows(const geometry_t* g, const uint8_t* x, const uint8_t* padding, const ptrdiff_t* tap_offsets,
                        int p, int pixels, const uint8_t* rows[][MAX_TAPS]) {
  int n = p / (g->OH * g->OW), oh = p / g->OW % g->OH, ow = p % g->OW;
  const int taps = g->KH * g->KW, last_h = (g->KH - 1) * g->dil_h, last_w = (g->KW - 1) * g->dil_w;
  for (int i = 0; i < pixels; i++) {
    const int ih0 = oh * g->stride_h - g->pad_h, iw0 = ow * g->stride_w - g->pad_w;
    if (ih0 >= 0 && ih0 + last_h < g->H && iw0 >= 0 && iw0 + last_w < g->W) {
      const uint8_t* first = x + (((size_t)n * g->H + ih0) * g->W + iw0) * g->Cin;
      for (int t = 0; t < taps; t++) rows[i][t] = first + tap_offsets[t];
    } else {
      for (int kh = 0; kh < g->KH; kh++)
        for (int kw = 0; kw < g->KW; kw++) {
          const int ih = ih0 + kh * g->dil_h, iw = iw0 + kw * g->dil_w;
          rows[i][kh * g->KW + kw] = ih < 0 || ih >= g->H || iw < 0 || iw >= g->W
                                         ? padding
                                         : x + (((size_t)n * g->H + ih) * g->W + iw) * g->Cin;
        }
    }
    if (++ow == g->OW) {
      ow = 0;
      if (++oh == g->OH) oh = 0, n++;
    }
  }
}

/* y[P][Cout] = requantize(post_op(conv(x, w) (+ residual))) over NHWC uint8 x, or the float
 * result into yf when yf is not NULL; the residual is float32 when residual_is_float, else
 * uint8. Weights: [ceil(Cout / 16)][KH * KW * Cin / 4][16][4] (kernel position, then input
 * channel); padding reads x_zp.
 * Cin % 4 == 0, Cout % 8 == 0 (QB_CONV_CALL pads other counts), KH * KW <= MAX_TAPS. */
static int conv(int threads, int N, int H, int W, int Cin, int OH, int OW, int KH, int KW, int stride_h, int stride_w,
             int pad_h, int pad_w, int dil_h, int dil_w, int Cout, int x_zp, const uint8_t* x, const int8_t* w,
             const float* mult, const float* add, const void* residual, int residual_is_float, float residual_scale,
             int activation, float low, float high, float out_inv_scale, int out_zp, int qmin, int qmax, uint8_t* y,
             float* yf) {
  const geometry_t g = {N, H, W, Cin, OH, OW, KH, KW, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w};
  /* each output pixel reads its own input row: AMX's tile rows, no window_rows (below), the 1x1 streaming limit */
  const int pointwise = KH == 1 && KW == 1 && stride_h == 1 && stride_w == 1 && pad_h == 0 && pad_w == 0;
  epilogue_t e = {mult, add, residual_is_float ? NULL : residual, residual_is_float ? residual : NULL, yf, activation,
                  _mm256_set1_ps(residual_scale), _mm256_set1_ps(low), _mm256_set1_ps(high),
                  _mm256_set1_ps(out_inv_scale), _mm256_set1_ps((float)out_zp), _mm256_set1_ps((float)qmin),
                  _mm256_set1_ps((float)qmax)};
  float* grid = NULL;
  const int hardswish = activation == HARDSWISH;
  if ((activation == CLAMP_ONLY || hardswish) && !yf && !residual_is_float && out_inv_scale > 0) {
    /* On the output grid, the float result's clamp and requantization are one multiply-add and
     * one clamp (a third of the epilogue's work, which is what a 1x1 conv of 64 inputs waits on);
     * rounding the folded constants moves a result by at most a float ulp before its rounding. */
    grid = malloc(2 * (size_t)Cout * sizeof(float));
    if (!grid) return -1;
    for (int o = 0; o < Cout; o++)
      grid[o] = mult[o] * out_inv_scale, grid[Cout + o] = add[o] * out_inv_scale + (hardswish ? 0.0f : (float)out_zp);
    e.grid_gate_scale = _mm256_set1_ps(1.0f / (6.0f * out_inv_scale));
    e.grid_mult = grid, e.grid_add = grid + Cout;
    e.grid_residual_scale = _mm256_set1_ps(residual_scale * out_inv_scale);
    const float grid_low = low * out_inv_scale + out_zp, grid_high = high * out_inv_scale + out_zp;
    e.grid_low = _mm256_set1_ps(grid_low > qmin ? grid_low : (float)qmin);
    e.grid_floor = qmin != 0 || grid_low > 0;
    e.grid_high = _mm256_set1_ps(grid_high < qmax ? grid_high : (float)qmax);
  }
#ifdef QB_AMX_TILES
  if (pointwise && N * OH * OW >= AMX_MIN_ROWS && qb_amx_ready()) {
    const int status = amx_rows(threads, N * OH * OW, Cin, Cout, x, w, &e, y);
    free(grid);
    return status;
  }
#endif
  uint8_t* padding = malloc((size_t)g.Cin);
  if (!padding) {
    free(grid);
    return -1;
  }
#ifdef QB_EXACT16
  for (int i = 0; i < g.Cin / 2; i++) ((uint16_t*)padding)[i] = (uint16_t)x_zp;
#else
  memset(padding, x_zp, (size_t)g.Cin);
#endif
  const int taps = g.KH * g.KW, P = g.N * g.OH * g.OW;
  const int blocks = (Cout + BLOCK - 1) / BLOCK; /* (zmm: the last may be half padding) */
  const int wide = WIDE_PIXELS && blocks % 4 == 0, tile_pixels = wide ? WIDE_PIXELS : PIXEL_TILE;
  const int output_tiles = wide ? blocks / 4 : blocks % 3 == 1 && blocks > 1 ? blocks / 3 + 1 : (blocks + 2) / 3;
  const int pixel_tiles = (P + tile_pixels - 1) / tile_pixels;
  /* A pixel tile's inputs stay in L1 while every output tile's weights stream past them (from
   * L2, or L3 beyond it) when the weights are not too large (weights_streamed). Else the output tiles go round
   * each block of pixel tiles whose inputs fit a quarter of the L2, so that block stays there: blocks
   * of equal size, as many for each thread (the static schedule gives each thread whole blocks;
   * a short last one left a thread 40% idle on ResNet's layer3 / 4 convs at batch 8). One block
   * (every input fits) stays one, the threads splitting its output tiles and each streaming its
   * share of the weights: split by pixels, ResNet's 512 -> 512 3x3 conv at 7x7, batch 1, gave the
   * threads 28 and 21 pixels (2 threads on Zen 3: 780 -> 724 us).
   * A 1x1 conv of stride 1 and no padding reads each output pixel's own input row: window_rows'
   * divisions and bounds checks per pixel tile had cost small-K convs up to a third of their
   * time (one Zen 3 thread: 32 -> 16 channels at 112x112 209 -> 143 us, 16 -> 64 442 -> 374). */
  const int pixels_outer = (size_t)taps * g.Cin * Cout <= weights_streamed(pointwise);
  int row_blocks = 1;
  if (!pixels_outer) {
    const size_t row_block_bytes = l2_bytes() / 4, tile_bytes = (size_t)tile_pixels * g.Cin;
    const int fit = row_block_bytes / tile_bytes < 1 ? 1 : (int)(row_block_bytes / tile_bytes);
    row_blocks = (pixel_tiles + fit - 1) / fit;
    if (row_blocks > 1) row_blocks = (row_blocks + threads - 1) / threads * threads;
    row_blocks = row_blocks > pixel_tiles ? pixel_tiles : row_blocks;
  }
  const int block_tiles = (pixel_tiles + row_blocks - 1) / row_blocks;
  ptrdiff_t tap_offsets[MAX_TAPS]; /* from a window's first input row, for windows inside the image */
  for (int kh = 0; kh < g.KH; kh++)
    for (int kw = 0; kw < g.KW; kw++) tap_offsets[kh * g.KW + kw] = ((ptrdiff_t)kh * g.dil_h * g.W + kw * g.dil_w) * g.Cin;
  const long outer_tiles = pixels_outer ? block_tiles : output_tiles, inner_tiles = pixels_outer ? output_tiles : block_tiles;
  const long tiles = row_blocks * outer_tiles * inner_tiles;
  const long unit = tiles / UINT32_MAX + 1, units = (tiles + unit - 1) / unit; /* (a share counts units of tiles in 32 bits) */
  share_t* shares = aligned_alloc(64, (size_t)threads * sizeof(share_t));
  if (!shares) {
    free(padding);
    free(grid);
    return -1;
  }
#pragma omp parallel num_threads(threads)
  {
    /* a pixel tile's input rows, kept while this thread's next tiles are the same pixels' */
    const uint8_t* rows[PIXEL_TILE][MAX_TAPS];
    int rows_of = -1;
    const int team = omp_get_num_threads(), me = omp_get_thread_num();
    init_share(&shares[me], units * me / team, units * (me + 1) / team);
#pragma omp barrier
    const int chunk = units / team / STEAL_PARTS > 1 ? (int)(units / team / STEAL_PARTS) : 1;
    long first, last;
    for (int k = 0; k < team; k++) /* this thread's own share from its front, then the others' from their ends */
      while (take_tiles(&shares[(me + k) % team], chunk, k > 0, &first, &last)) {
        const long end = last * unit < tiles ? last * unit : tiles;
        /* (counted up from the take's first tile: three 64-bit divisions a tile had cost small-K convs ~1%) */
        int block = (int)(first * unit / (outer_tiles * inner_tiles)), outer = (int)(first * unit / inner_tiles % outer_tiles),
            inner = (int)(first * unit % inner_tiles);
        for (long tile_index = first * unit; tile_index < end; tile_index++, next_tile(&block, &outer, &inner, outer_tiles, inner_tiles)) {
          const int pt = block * block_tiles + (pixels_outer ? outer : inner), ot = pixels_outer ? inner : outer;
          if (pt >= pixel_tiles) continue;
          const size_t p = (size_t)pt * tile_pixels;
          const int b0 = wide ? 4 * ot : tile_start(ot, blocks);
          const int width = wide ? 4 : (ot + 1 < output_tiles ? tile_start(ot + 1, blocks) : blocks) - b0;
          const int o = b0 * BLOCK;
          const int pixels = P - (int)p < tile_pixels ? P - (int)p : tile_pixels;
          if (rows_of != pt) {
            if (pointwise)
              for (int i = 0; i < pixels; i++) rows[i][0] = x + (p + i) * g.Cin;
            else
              window_rows(&g, x, padding, tap_offsets, (int)p, pixels, rows);
          }
          rows_of = pt;
          if (width == 4) {
            WIDE_TILE_CASES(pixels)
          } else if (width == 3) {
            TILE_CASES(pixels, 3)
          } else if (width == 2) {
            TILE_CASES(pixels, 2)
          } else {
            TILE_CASES(pixels, 1)
          }
        }
      }
  }
  free(shares);
  free(padding);
  free(grid);
  return 0;
}

static int run(int threads, const conv_call_t* c, int Cin, int Cout, const float* mult, const float* add, const uint8_t* x,
               const void* residual, uint8_t* y, float* yf) {
  return conv(threads, c->N, c->H, c->W, Cin, c->OH, c->OW, c->KH, c->KW, c->stride_h, c->stride_w, c->pad_h, c->pad_w, c->dil_h,
       c->dil_w, Cout, c->x_zp, x, c->w, mult, add, residual, c->residual_is_float, c->residual_scale, c->activation, c->low,
       c->high, c->out_inv_scale, c->out_zp, c->qmin, c->qmax, y, yf);
}

#ifdef QB_EXACT16
/* x (pixels x C uint8) as int16 (pixels x Cin: the channels from C on zero), each thread its
 * share of the pixels. */
static void widened(int threads, const uint8_t* x, size_t pixels, int C, int Cin, uint16_t* x16) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (size_t p = 0; p < pixels; p++) {
    const uint8_t* from = x + p * C;
    uint16_t* to = x16 + p * Cin;
    int i = 0;
    for (; i + 16 <= C; i += 16)
      _mm256_storeu_si256((__m256i*)(to + i), _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(from + i))));
    for (; i < C; i++) to[i] = from[i];
    for (; i < Cin; i++) to[i] = 0;
  }
}
#endif

/* 0, or -1 when a scratch buffer could not be allocated. Cin % 4 or Cout % 8 run on copies
 * padded to whole 4-input groups and 8-output blocks (padded_channels.h), a residual and the
 * constants (zero there) with them. The int16 build runs on x widened to int16 (the channels
 * padded there too), as 2 * Cin bytes a pixel: its 4-byte words are pairs of inputs. */
int QB_CONV_CALL(int threads, const conv_call_t* c, const uint8_t* x, const void* residual, uint8_t* y, float* yf) {
  const int Cout = padded_channels(c->Cout, 8);
#ifdef QB_EXACT16
  const int Cin = 2 * padded_channels(c->Cin, 4), pad_in = 1;
#else
  const int Cin = padded_channels(c->Cin, 4), pad_in = Cin != c->Cin;
#endif
  const int pad_out = Cout != c->Cout;
  if (!pad_in && !pad_out) return run(threads, c, Cin, Cout, c->mult, c->add, x, residual, y, yf);
  const size_t in_pixels = (size_t)c->N * c->H * c->W, out_pixels = (size_t)c->N * c->OH * c->OW;
  const size_t out_item = yf ? sizeof(float) : 1, residual_item = c->residual_is_float ? sizeof(float) : 1;
#ifdef QB_EXACT16
  uint8_t* x_padded = malloc(in_pixels * Cin);
  if (x_padded) widened(threads, x, in_pixels, c->Cin, Cin / 2, (uint16_t*)x_padded);
#else
  uint8_t* x_padded = pad_in ? calloc(in_pixels * Cin, 1) : NULL;
#endif
  float* constants = pad_out ? calloc(2 * (size_t)Cout, sizeof(float)) : NULL;
  void* residual_padded = pad_out && residual ? calloc(out_pixels * Cout, residual_item) : NULL;
  void* out_padded = pad_out ? malloc(out_pixels * Cout * out_item) : NULL;
  void* out = yf ? (void*)yf : (void*)y;
  int status = -1;
  if ((!pad_in || x_padded) && (!pad_out || (constants && out_padded && (!residual || residual_padded)))) {
#ifndef QB_EXACT16
    if (pad_in) copy_rows(x_padded, x, in_pixels, c->Cin, Cin, 1);
#endif
    if (pad_out) {
      memcpy(constants, c->mult, c->Cout * sizeof(float));
      memcpy(constants + Cout, c->add, c->Cout * sizeof(float));
      if (residual) copy_rows(residual_padded, residual, out_pixels, c->Cout, Cout, residual_item);
    }
    void* target = pad_out ? out_padded : out;
    status = run(threads, c, Cin, Cout, pad_out ? constants : c->mult, pad_out ? constants + Cout : c->add,
                 pad_in ? x_padded : x, pad_out ? residual_padded : residual, yf ? NULL : target, yf ? target : NULL);
    if (pad_out && !status) copy_rows(out, out_padded, out_pixels, Cout, c->Cout, out_item);
  }
  free(x_padded);
  free(constants);
  free(residual_padded);
  free(out_padded);
  return status;
}
