/* vec_math.h's activations on zmm registers (16 floats), for the AVX512 builds: the same
 * polynomials and operation order, 2^k by vscalefps (exact, as the ymm exponent-bits product),
 * 1 / d by vrcp14ps and one Newton step (an ulp from the ymm build at most). Why: a 16 -> 96
 * 1x1 conv's SiLU epilogue on ymm took 5.6x the clamp-only call on one Sapphire Rapids thread
 * (16.3 vs 2.9 ms at batch 8, 112x112), 1.4x oneDNN's whole call. */
#ifndef QB_VEC_MATH512_H
#define QB_VEC_MATH512_H
#include <immintrin.h>
#include <math.h>

#include "vec_math.h" /* enum activation */

#ifndef ACTIVATION_LANES16
#define ACTIVATION_LANES16 8 /* 4 live zmm a lane in exp: 24 of 32, the constants as broadcast operands */
#endif
#define EACH_LANE16(j) for (int j = 0; j < n; j++)

static inline __attribute__((always_inline)) void exp16_lanes(__m512* x, int n) {
  __m512 k[ACTIVATION_LANES16], r[ACTIVATION_LANES16], p[ACTIVATION_LANES16];
  EACH_LANE16(j) {
    x[j] = _mm512_min_ps(_mm512_max_ps(x[j], _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    k[j] = _mm512_roundscale_ps(_mm512_mul_ps(x[j], _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static const float Q[] = EXP_Q;
  EACH_LANE16(j) r[j] = _mm512_fnmadd_ps(k[j], _mm512_set1_ps(EXP_LN2), x[j]);
  EACH_LANE16(j) p[j] = _mm512_fmadd_ps(_mm512_set1_ps(Q[0]), r[j], _mm512_set1_ps(Q[1]));
  for (int c = 2; c < 4; c++) EACH_LANE16(j) p[j] = _mm512_fmadd_ps(p[j], r[j], _mm512_set1_ps(Q[c]));
  for (int c = 0; c < 2; c++) EACH_LANE16(j) p[j] = _mm512_fmadd_ps(p[j], r[j], _mm512_set1_ps(1.0f));
  EACH_LANE16(j) x[j] = _mm512_scalef_ps(p[j], k[j]);
}

static inline __m512 reciprocal16(__m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
}

/* swish_lanes: x / (1 + e^-x); -inf gives NaN as torch's (-inf / inf), by a test here: vrcp14ps
 * keeps the tiny reciprocal of 1 + e^88 that rcpps flushes to 0. */
static inline __attribute__((always_inline)) void swish16_lanes(__m512* x, int n) {
  __m512 e[ACTIVATION_LANES16];
  EACH_LANE16(j) e[j] = _mm512_sub_ps(_mm512_setzero_ps(), x[j]);
  exp16_lanes(e, n);
  EACH_LANE16(j) {
    const __m512 y = _mm512_mul_ps(x[j], reciprocal16(_mm512_add_ps(_mm512_set1_ps(1.0f), e[j])));
    x[j] = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x[j], _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), y, _mm512_set1_ps(NAN));
  }
}

/* gelu_erf_lanes on 16 floats. */
static inline __attribute__((always_inline)) void gelu_erf16_lanes(__m512* x, int n) {
  static const float P[] = {0.0002765672f, 0.0001520143f, 0.0092705272f, 0.0422820123f, 0.0705230784f, 1.0f};
  __m512 z[ACTIVATION_LANES16], p[ACTIVATION_LANES16];
  EACH_LANE16(j) {
    z[j] = _mm512_mul_ps(_mm512_abs_ps(x[j]), _mm512_set1_ps(0.70710678f));
    z[j] = _mm512_min_ps(z[j], _mm512_set1_ps(10.0f));
    p[j] = _mm512_set1_ps(0.0000430638f);
  }
  for (int c = 0; c < 6; c++) EACH_LANE16(j) p[j] = _mm512_fmadd_ps(p[j], z[j], _mm512_set1_ps(P[c]));
  for (int square = 0; square < 4; square++) EACH_LANE16(j) p[j] = _mm512_mul_ps(p[j], p[j]);
  EACH_LANE16(j) {
    const __m512 erfc = reciprocal16(p[j]);
    const __mmask16 negative = _mm512_cmp_ps_mask(x[j], _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 one_plus_erf = _mm512_mask_blend_ps(negative, _mm512_sub_ps(_mm512_set1_ps(2.0f), erfc), erfc);
    x[j] = _mm512_mul_ps(_mm512_mul_ps(x[j], _mm512_set1_ps(0.5f)), one_plus_erf);
  }
}

/* gelu_tanh_lanes on 16 floats. */
static inline __attribute__((always_inline)) void gelu_tanh16_lanes(__m512* x, int n) {
  __m512 u[ACTIVATION_LANES16];
  EACH_LANE16(j) u[j] = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(x[j], x[j]), x[j]), _mm512_set1_ps(0.044715f), x[j]),
                                      _mm512_set1_ps(-1.59576912f));
  exp16_lanes(u, n);
  EACH_LANE16(j) x[j] = _mm512_mul_ps(x[j], reciprocal16(_mm512_add_ps(_mm512_set1_ps(1.0f), u[j])));
}

static inline __m512 hardswish16(__m512 x) {
  const __m512 gate = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(x, _mm512_set1_ps(3.0f)), _mm512_setzero_ps()), _mm512_set1_ps(6.0f));
  return _mm512_mul_ps(_mm512_mul_ps(x, gate), _mm512_set1_ps(1.0f / 6.0f));
}

static inline __attribute__((always_inline)) void activate16_lanes(int activation, __m512* f, int n) {
  if (activation == GELU_ERF) gelu_erf16_lanes(f, n);
  else if (activation == GELU_TANH) gelu_tanh16_lanes(f, n);
  else if (activation == SWISH) swish16_lanes(f, n);
  else if (activation == HARDSWISH) EACH_LANE16(j) f[j] = hardswish16(f[j]);
}

#endif
