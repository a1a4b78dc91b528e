/* RMSNorm as Hugging Face's LlamaRMSNorm computes it (Mistral's, Qwen2's the same), per row of
 * n floats: out = w * (x * (1 / sqrt(mean(x^2) + eps))). Each step is rounded as the graph's
 * float ops round it but the mean, summed here in 32 lanes rather than in ATen's order. With
 * b, x = a + b is the residual sum before the norm, written to sum as the graph's add writes
 * it. One call in place of the graph's ~8 ops (~21 us of dispatch for a 2048-wide decode row). */
#include <immintrin.h>
#include <math.h>

#include "call_structs.h"

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off") /* (w * (x * r): two products, each rounded) */
#endif

static float sum_of_squares(const float* x, long n) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  long j = 0;
  for (; j + 32 <= n; j += 32)
    for (int k = 0; k < 4; k++) {
      const __m256 v = _mm256_loadu_ps(x + j + 8 * k);
      acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(v, v));
    }
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    acc[0] = _mm256_add_ps(acc[0], _mm256_mul_ps(v, v));
  }
  const __m256 all = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  float lanes[8], total = 0.0f;
  _mm256_storeu_ps(lanes, all);
  for (int k = 0; k < 8; k++) total += lanes[k];
  for (; j < n; j++) total += x[j] * x[j];
  return total;
}

void qb_rms_norm_f32(int threads, long rows, long n, const float* a, const float* b, const float* w, float eps,
                     float* sum, float* out) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 16)
  for (long r = 0; r < rows; r++) {
    const float* x = a + r * n;
    if (b) {
      float* s = sum + r * n;
      const float* y = b + r * n;
      long j = 0;
      for (; j + 8 <= n; j += 8) _mm256_storeu_ps(s + j, _mm256_add_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(y + j)));
      for (; j < n; j++) s[j] = x[j] + y[j];
      x = s;
    }
    const float inverse = 1.0f / sqrtf(sum_of_squares(x, n) / (float)n + eps);
    const __m256 r8 = _mm256_set1_ps(inverse);
    float* o = out + r * n;
    long j = 0;
    for (; j + 8 <= n; j += 8)
      _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(w + j), _mm256_mul_ps(_mm256_loadu_ps(x + j), r8)));
    for (; j < n; j++) o[j] = w[j] * (x[j] * inverse);
  }
}

/* As a step of a kernel chain (qbackend/kernels/kernel_chain.py): b and sum NULL for a plain RMSNorm. */
int qb_rms_norm_call(int threads, const rms_norm_call_t* c, const float* a, const float* b, float* sum, float* out) {
  qb_rms_norm_f32(threads, c->rows, c->n, a, b, c->w, c->eps, sum, out);
  return 0;
}
