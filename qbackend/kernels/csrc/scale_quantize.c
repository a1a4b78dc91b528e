/* Channel scale then quantize: y = clamp(round(x * s[n][c] / scale) + zp, qmin, qmax), uint8,
 * for a float32 [N, C, H, W] tensor stored contiguous or channels-last (y in x's layout).
 *
 * Why: squeeze-excitation (EfficientNet, MobileNetV3) multiplies a feature map by one factor
 * per image and channel and quantizes the product for the next conv. ATen writes the float32
 * product, then reads it again to quantize; here one pass reads the floats and writes bytes
 * (both memory-bound: 109 vs 123 us at 1x96x112x112). The arithmetic is the reference's: the
 * float32 product, times the float32 inverse scale, rounded half to even. A NaN lands on qmin
 * and +-inf on the range's ends (the clamp before the integer conversion).
 *
 * The gate that makes the factors (squeeze-excitation's sigmoid or hard sigmoid) runs here too,
 * on the N x C factors: with it, the block's float tail between the expand conv and the project
 * conv is one kernel, and a kernel chain runs the whole block without leaving C.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "call_structs.h"
#include "vec_math.h"

/* n_values floats of x times s (s_step 0: one factor for all, 1: one per value) into y. */
static void scale_row(const float* x, const float* s, int s_step, long n_values, float inv_scale, int zp, int qmin,
                      int qmax, uint8_t* y) {
  const __m256 vinv = _mm256_set1_ps(inv_scale), vzp = _mm256_set1_ps((float)zp), vlo = _mm256_set1_ps((float)qmin),
               vhi = _mm256_set1_ps((float)qmax);
  long i = 0;
  for (; i + 8 <= n_values; i += 8) {
    __m256 factor = s_step ? _mm256_loadu_ps(s + i) : _mm256_set1_ps(s[0]);
    __m256 product = _mm256_mul_ps(_mm256_loadu_ps(x + i), factor);
    store_quantized8(_mm256_mul_ps(product, vinv), vzp, vlo, vhi, y + i);
  }
  for (; i < n_values; i++) y[i] = round_to_grid((x[i] * s[s_step ? i : 0]) * inv_scale, zp, qmin, qmax);
}

/* The factors after their gate (enum gate), NaN kept (the reference's product is then NaN):
 * sigmoid as torch's 1 / (1 + e^-s) with vec_math.h's e^x (within 2e-7), hard sigmoid in torch's
 * order, min(max(s + 3, 0), 6) / 6, exact. */
enum gate { GATE_NONE = 0, GATE_SIGMOID = 1, GATE_HARDSIGMOID = 2 };

static __m256 gated8(int gate, __m256 s) {
  __m256 g;
  if (gate == GATE_SIGMOID)
    g = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), s))));
  else
    g = _mm256_div_ps(_mm256_min_ps(_mm256_max_ps(_mm256_add_ps(s, _mm256_set1_ps(3.0f)), _mm256_setzero_ps()), _mm256_set1_ps(6.0f)),
                      _mm256_set1_ps(6.0f));
  return _mm256_blendv_ps(g, s, _mm256_cmp_ps(s, s, _CMP_UNORD_Q));
}

/* 0, or -1 when the gated factors' buffer could not be allocated. s: [N or 1][C] (the call's
 * s_batch_stride C or 0); channels_last: x is [N][HW][C], else [N][C][HW]. */
int qb_scale_quantize_call(int threads, const scale_quantize_call_t* c, const float* x, const float* s, uint8_t* y,
                           void* unused) {
  (void)unused;
  const int N = c->N, C = c->C;
  const long HW = c->HW, stride = c->s_batch_stride;
  float* gated = NULL;
  if (c->gate != GATE_NONE) {
    const long count = (stride ? (long)N : 1) * C, padded = (count + 7) / 8 * 8;
    gated = malloc(padded * sizeof(float));
    if (!gated) return -1;
    memcpy(gated, s, count * sizeof(float));
    memset(gated + count, 0, (padded - count) * sizeof(float));
    for (long i = 0; i < padded; i += 8) _mm256_storeu_ps(gated + i, gated8(c->gate, _mm256_loadu_ps(gated + i)));
    s = gated;
  }
  if (c->channels_last) {
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int n = 0; n < N; n++)
      for (long p = 0; p < HW; p++) {
        size_t at = ((size_t)n * HW + p) * C;
        scale_row(x + at, s + n * stride, 1, C, c->inv_scale, c->zp, c->qmin, c->qmax, y + at);
      }
  } else {
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int n = 0; n < N; n++)
      for (int ch = 0; ch < C; ch++) {
        size_t at = ((size_t)n * C + ch) * HW;
        scale_row(x + at, s + n * stride + ch, 0, HW, c->inv_scale, c->zp, c->qmin, c->qmax, y + at);
      }
  }
  free(gated);
  return 0;
}
