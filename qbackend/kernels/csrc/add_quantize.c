/* A float32 sum and its quantize in one pass: s = a + b, y = clamp(round(s / scale) + zp, qmin, qmax).
 *
 * Why: ConvNeXt's residual sum is both the next block's residual (float32) and, quantized, the
 * next depthwise conv's input; ATen's add writes the sum and the quantize reads it back. Here
 * one pass reads a and b and writes both. The arithmetic is the reference's: the float32 sum,
 * times the float32 inverse scale, rounded half to even; a NaN lands on qmin.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "call_structs.h"
#include "vec_math.h"

/* a, b, s: n float32 values; y: n uint8 (one memory order for all four). */
void qb_add_quantize(int threads, long n, const float* a, const float* b, float inv_scale, int zp, int qmin, int qmax, float* s,
                     uint8_t* y) {
  const long block = 4096; /* values per step: a thread's share of a small tensor stays whole */
  const long blocks = (n + block - 1) / block;
  const __m256 vinv = _mm256_set1_ps(inv_scale), vzp = _mm256_set1_ps((float)zp), vlo = _mm256_set1_ps((float)qmin),
               vhi = _mm256_set1_ps((float)qmax);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long k = 0; k < blocks; k++) {
    const long end = (k + 1) * block < n ? (k + 1) * block : n;
    long i = k * block;
    for (; i + 8 <= end; i += 8) {
      const __m256 sum = _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i));
      _mm256_storeu_ps(s + i, sum);
      store_quantized8(_mm256_mul_ps(sum, vinv), vzp, vlo, vhi, y + i);
    }
    for (; i < end; i++) {
      s[i] = a[i] + b[i];
      y[i] = round_to_grid(s[i] * inv_scale, zp, qmin, qmax);
    }
  }
}

/* As a step of a kernel chain (qbackend/kernels/kernel_chain.py): s (a itself for add_quantize_) and y. */
int qb_add_quantize_call(int threads, const add_quantize_call_t* c, const float* a, const float* b, float* s, uint8_t* y) {
  qb_add_quantize(threads, c->n, a, b, c->inv_scale, c->zp, c->qmin, c->qmax, s, y);
  return 0;
}
