/* SwiGLU's gate as Llama's MLP computes it, silu(a) * b (act_fn(gate_proj(x)) * up_proj(x)), in
 * one pass: rows of n floats, a and b each with their own row stride (slices of one merged
 * gate / up output), into dense out. SiLU is the own kernels' (vec_math.h swish, within 2 ulp
 * of torch's), then one rounded product. One call in place of two ops and their two passes.
 * The bf16 variant (a prefill's dense MLP, qbackend/dense_swiglu.py) computes the same in
 * float32 from bf16 operands and rounds the product as torch's conversion to bf16 does. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "vec_math.h"

void qb_silu_mul_f32(int threads, long rows, long n, const float* a, long a_row, const float* b, long b_row, float* out) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 16)
  for (long r = 0; r < rows; r++) {
    const float *x = a + r * a_row, *y = b + r * b_row;
    float* o = out + r * n;
    long j = 0;
    for (; j + 32 <= n; j += 32) {
      __m256 v[4];
      for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(x + j + 8 * k);
      swish_lanes(v, 4);
      for (int k = 0; k < 4; k++) _mm256_storeu_ps(o + j + 8 * k, _mm256_mul_ps(v[k], _mm256_loadu_ps(y + j + 8 * k)));
    }
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(o + j, _mm256_mul_ps(swish(_mm256_loadu_ps(x + j)), _mm256_loadu_ps(y + j)));
    if (j < n) { /* (the tail through a vector of its own) */
      float xs[8] = {0}, ys[8] = {0}, os[8];
      for (long k = j; k < n; k++) xs[k - j] = x[k], ys[k - j] = y[k];
      _mm256_storeu_ps(os, _mm256_mul_ps(swish(_mm256_loadu_ps(xs)), _mm256_loadu_ps(ys)));
      for (long k = j; k < n; k++) o[k] = os[k - j];
    }
  }
}

/* As a step of a kernel chain (qbackend/kernel_chain.py). */
typedef struct {
  long rows, n, a_row, b_row;
} silu_mul_call_t;

int qb_silu_mul_call(int threads, const silu_mul_call_t* c, const float* a, const float* b, float* out, void* unused) {
  (void)unused;
  qb_silu_mul_f32(threads, c->rows, c->n, a, c->a_row, b, c->b_row, out);
  return 0;
}

/* Rows of n bf16 values: a, b and out each with their own row stride (out: columns of a wider
 * activation, the next linear's input). */
void qb_silu_mul_bf16(int threads, long rows, long n, const uint16_t* a, long a_row, const uint16_t* b, long b_row,
                      uint16_t* out, long out_row) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 16)
  for (long r = 0; r < rows; r++) {
    const uint16_t *x = a + r * a_row, *y = b + r * b_row;
    uint16_t* o = out + r * out_row;
    long j = 0;
    for (; j + 32 <= n; j += 32) {
      __m256 v[4];
      for (int k = 0; k < 4; k++) v[k] = f32x8(x + j + 8 * k);
      swish_lanes(v, 4);
      for (int k = 0; k < 4; k++) _mm_storeu_si128((__m128i*)(o + j + 8 * k), bf16x8(_mm256_mul_ps(v[k], f32x8(y + j + 8 * k))));
    }
    if (j < n) { /* (the rest through vectors of their own) */
      uint16_t xs[32] = {0}, ys[32] = {0}, os[32];
      for (long k = j; k < n; k++) xs[k - j] = x[k], ys[k - j] = y[k];
      for (int k = 0; k < 32; k += 8) _mm_storeu_si128((__m128i*)(os + k), bf16x8(_mm256_mul_ps(swish(f32x8(xs + k)), f32x8(ys + k))));
      for (long k = j; k < n; k++) o[k] = os[k - j];
    }
  }
}
