/* Vector math the kernels share (AVX2 + FMA, 8 floats), and their scalar quantize step. */
#ifndef QB_VEC_MATH_H
#define QB_VEC_MATH_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* The activations below work on ``n`` (at most ACTIVATION_LANES) vectors in lockstep, each step over all
 * of them before the next: a single vector's exp is a chain of ~20 dependent operations, and
 * one chain after another left the FMA units idle (SiLU on a 16 -> 96 1x1 conv's outputs took
 * 2.2x its standalone time; measured on an AVX2 Zen 3). Inlined with a constant ``n``, the
 * loops unroll into interleaved chains. */
#ifndef ACTIVATION_LANES
#define ACTIVATION_LANES 4 /* (16 ymm registers; a file built for AVX512VL's 32 may define 8 first) */
#endif
#define EACH_LANE(j) for (int j = 0; j < n; j++)

/* e^x for x in about [-87, 88]: x = k ln2 + r, |r| <= ln2 / 2, e^r by 1 + r + r^2 q(r), q of degree 3
 * minimax for e^r's relative error (1.04e-7 in exact arithmetic; float's steps: 2.2e-7 for |x| < 20,
 * as the degree-6 Taylor polynomial before), times 2^k built in the exponent bits. r in one fused
 * step: float's ln2 is 1.9e-9 off, |k| times that (at most 2.4e-7, where e^x is ~1e-37). Each FMA
 * dropped counts: on Zen 1 an FMA of 8 floats is two of the FMA pipes' 128-bit slots. */
#define EXP_Q {0.00831270218f, 0.0418903381f, 0.166671142f, 0.499992311f} /* q's r^3 .. r^0 */
#define EXP_LN2 0.693147182f /* float's ln2 */
static inline __attribute__((always_inline)) void exp_lanes(__m256* x, int n) {
  __m256 k[ACTIVATION_LANES], r[ACTIVATION_LANES], p[ACTIVATION_LANES];
  EACH_LANE(j) {
    x[j] = _mm256_min_ps(_mm256_max_ps(x[j], _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    k[j] = _mm256_round_ps(_mm256_mul_ps(x[j], _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static const float Q[] = EXP_Q;
  EACH_LANE(j) r[j] = _mm256_fnmadd_ps(k[j], _mm256_set1_ps(EXP_LN2), x[j]);
  EACH_LANE(j) p[j] = _mm256_fmadd_ps(_mm256_set1_ps(Q[0]), r[j], _mm256_set1_ps(Q[1]));
  for (int c = 2; c < 4; c++) EACH_LANE(j) p[j] = _mm256_fmadd_ps(p[j], r[j], _mm256_set1_ps(Q[c]));
  for (int c = 0; c < 2; c++) EACH_LANE(j) p[j] = _mm256_fmadd_ps(p[j], r[j], _mm256_set1_ps(1.0f));
  EACH_LANE(j) {
    const __m256i two_k = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k[j]), _mm256_set1_epi32(127)), 23);
    x[j] = _mm256_mul_ps(p[j], _mm256_castsi256_ps(two_k));
  }
}

static inline __m256 exp256(__m256 x) {
  exp_lanes(&x, 1);
  return x;
}

/* 1 / d: the approximate reciprocal and one Newton step (relative error ~1e-7), cheaper than a division. */
static inline __m256 reciprocal(__m256 d) {
  const __m256 r = _mm256_rcp_ps(d);
  return _mm256_mul_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(2.0f)));
}

/* The unary post-ops the int8 kernels' epilogues apply before their clamp (qbackend/kernels/common.py
 * ACTIVATIONS). */
enum activation { CLAMP_ONLY = 0, GELU_ERF = 1, GELU_TANH = 2, SWISH = 3, HARDSWISH = 4 };

/* x / (1 + e^-x), torch's SiLU, by a reciprocal (a division cost a fifth more on a 16 -> 96 1x1
 * conv). -inf gives NaN as there (-inf / inf) with no test of its own: exp_lanes' clamped range
 * makes e^inf 1.65e38, whose reciprocal rcpps flushes to 0 (a tiny result always is), and -inf * 0
 * is NaN; below x = -87.3 the result is -0 where torch's is a negative denormal or -0. */
static inline __attribute__((always_inline)) void swish_lanes(__m256* x, int n) {
  __m256 e[ACTIVATION_LANES];
  EACH_LANE(j) e[j] = _mm256_sub_ps(_mm256_setzero_ps(), x[j]);
  exp_lanes(e, n);
  EACH_LANE(j) x[j] = _mm256_mul_ps(x[j], reciprocal(_mm256_add_ps(_mm256_set1_ps(1.0f), e[j])));
}

static inline __m256 swish(__m256 x) {
  swish_lanes(&x, 1);
  return x;
}

/* x * min(max(x + 3, 0), 6) / 6, the division as a multiply (an ulp from torch's); a NaN stays
 * (max_ps gives 0 for it, times x). */
static inline __m256 hardswish(__m256 x) {
  const __m256 gate = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(x, _mm256_set1_ps(3.0f)), _mm256_setzero_ps()), _mm256_set1_ps(6.0f));
  return _mm256_mul_ps(_mm256_mul_ps(x, gate), _mm256_set1_ps(1.0f / 6.0f));
}

/* x * Phi(x) = x * (1 + erf(x / sqrt 2)) / 2, with erfc(z) = 1 / P(z)^16 for z >= 0
 * (Abramowitz & Stegun 7.1.28, absolute error < 3e-7): 1 + erf(z) is erfc(-z) for x < 0,
 * which keeps the negative tail accurate, and 2 - erfc(z) otherwise. |z| is capped at 10,
 * where erf is 1 in float and P^16 (~1e31) is still finite. */
static inline __attribute__((always_inline)) void gelu_erf_lanes(__m256* x, int n) {
  static const float P[] = {0.0002765672f, 0.0001520143f, 0.0092705272f, 0.0422820123f, 0.0705230784f, 1.0f};
  __m256 z[ACTIVATION_LANES], p[ACTIVATION_LANES];
  EACH_LANE(j) {
    z[j] = _mm256_mul_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x[j]), _mm256_set1_ps(0.70710678f));
    z[j] = _mm256_min_ps(z[j], _mm256_set1_ps(10.0f));
    p[j] = _mm256_set1_ps(0.0000430638f);
  }
  for (int c = 0; c < 6; c++) EACH_LANE(j) p[j] = _mm256_fmadd_ps(p[j], z[j], _mm256_set1_ps(P[c]));
  for (int square = 0; square < 4; square++) EACH_LANE(j) p[j] = _mm256_mul_ps(p[j], p[j]);
  EACH_LANE(j) {
    const __m256 erfc = reciprocal(p[j]);
    const __m256 negative = _mm256_cmp_ps(x[j], _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 one_plus_erf = _mm256_blendv_ps(_mm256_sub_ps(_mm256_set1_ps(2.0f), erfc), erfc, negative);
    x[j] = _mm256_mul_ps(_mm256_mul_ps(x[j], _mm256_set1_ps(0.5f)), one_plus_erf);
  }
}

/* x (1 + tanh u) / 2 = x / (1 + e^(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3). */
static inline __attribute__((always_inline)) void gelu_tanh_lanes(__m256* x, int n) {
  __m256 u[ACTIVATION_LANES];
  EACH_LANE(j) u[j] = _mm256_mul_ps(_mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(x[j], x[j]), x[j]), _mm256_set1_ps(0.044715f), x[j]),
                                    _mm256_set1_ps(-1.59576912f)); /* -2 sqrt(2 / pi) */
  exp_lanes(u, n);
  EACH_LANE(j) x[j] = _mm256_mul_ps(x[j], reciprocal(_mm256_add_ps(_mm256_set1_ps(1.0f), u[j])));
}

static inline __attribute__((always_inline)) void activate_lanes(int activation, __m256* f, int n) {
  if (activation == GELU_ERF) gelu_erf_lanes(f, n);
  else if (activation == GELU_TANH) gelu_tanh_lanes(f, n);
  else if (activation == SWISH) swish_lanes(f, n);
  else if (activation == HARDSWISH) EACH_LANE(j) f[j] = hardswish(f[j]);
}

/* The quantized byte of a value already divided by its scale: round half to even (as torch),
 * plus the zero point, clamped to [qmin, qmax]; a NaN lands on qmin (as quantize_scaled8). */
static inline uint8_t round_to_grid(float scaled, int zero_point, int qmin, int qmax) {
  float q = _mm_cvtss_f32(_mm_round_ss(_mm_setzero_ps(), _mm_set_ss(scaled), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  q += (float)zero_point;
  return (uint8_t)(q > (float)qmin ? (q < (float)qmax ? q : (float)qmax) : (float)qmin);
}

/* round_to_grid for 8 values at once, as int32 (the zero point and bounds as floats); a NaN
 * lands on lo (max_ps returns its second operand for one). */
static inline __m256i quantize_scaled8(__m256 scaled, __m256 zp, __m256 lo, __m256 hi) {
  const __m256 q = _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, zp), lo), hi));
}

/* The 8 floats at ``in`` quantized: their int32 grid values (quantize_scaled8 of in * inv); a NaN
 * (when ``check_nan``) -> ``nan_value``. Without the check a NaN lands on lo (max_ps returns its
 * second operand), right where nan_value is lo. */
static inline __m256i quantize8_or_nan(const float* in, __m256 inv, __m256 zp, __m256 lo, __m256 hi, __m256i nan_value,
                                       int check_nan) {
  const __m256 v = _mm256_loadu_ps(in);
  const __m256i q = quantize_scaled8(_mm256_mul_ps(v, inv), zp, lo, hi);
  return check_nan ? _mm256_blendv_epi8(q, nan_value, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) : q;
}

/* quantize8_or_nan for one value: round_to_grid(v * inv_scale), a NaN -> nan_value. */
static inline int grid_value_or_nan(float v, float inv_scale, int zero_point, int qmin, int qmax, int nan_value) {
  return v != v ? nan_value : round_to_grid(v * inv_scale, zero_point, qmin, qmax);
}

/* quantize_scaled8, stored as 8 bytes at y. */
static inline void store_quantized8(__m256 scaled, __m256 zp, __m256 lo, __m256 hi, uint8_t* y) {
  const __m256i ints = quantize_scaled8(scaled, zp, lo, hi);
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1));
  _mm_storel_epi64((__m128i*)y, _mm_packus_epi16(words, words));
}

#endif
