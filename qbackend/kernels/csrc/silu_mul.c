/* SwiGLU's gate as Llama's MLP computes it, silu(a) * b (act_fn(gate_proj(x)) * up_proj(x)), in
 * one pass: rows of n floats, a and b each with their own row stride (slices of one merged
 * gate / up output), into dense out. SiLU is the own kernels' (vec_math.h swish, within 2 ulp
 * of torch's), then one rounded product. One call in place of two ops and their two passes.
 * The bf16 variant (a prefill's dense MLP, qbackend/llm/dense_swiglu.py) computes the same in
 * float32 from bf16 operands and rounds the product as torch's conversion to bf16 does. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "call_structs.h"
#include "vec_math.h"

/* 8 values at p, float32 or bf16, as floats; and back. */
static inline __attribute__((always_inline)) __m256 load8(const void* p, long i, int bf16) {
  return bf16 ? f32x8((const uint16_t*)p + i) : _mm256_loadu_ps((const float*)p + i);
}
static inline __attribute__((always_inline)) void store8(void* p, long i, __m256 v, int bf16) {
  if (bf16) _mm_storeu_si128((__m128i*)((uint16_t*)p + i), bf16x8(v));
  else _mm256_storeu_ps((float*)p + i, v);
}

/* Rows of n values (float32, or bf16 computed in float32 and rounded once), each operand with its
 * own row stride. */
static inline __attribute__((always_inline)) void silu_mul_rows(int threads, long rows, long n, const void* a, long a_row,
                                                                const void* b, long b_row, void* out, long out_row, int bf16) {
  const size_t size = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 16)
  for (long r = 0; r < rows; r++) {
    const char *x = (const char*)a + r * a_row * size, *y = (const char*)b + r * b_row * size;
    char* o = (char*)out + r * out_row * size;
    long j = 0;
    for (; j + 32 <= n; j += 32) {
      __m256 v[4];
      for (int k = 0; k < 4; k++) v[k] = load8(x, j + 8 * k, bf16);
      swish_lanes(v, 4);
      for (int k = 0; k < 4; k++) store8(o, j + 8 * k, _mm256_mul_ps(v[k], load8(y, j + 8 * k, bf16)), bf16);
    }
    for (; j + 8 <= n; j += 8) store8(o, j, _mm256_mul_ps(swish(load8(x, j, bf16)), load8(y, j, bf16)), bf16);
    if (j < n) { /* (the tail through a vector of its own, in the operands' dtype) */
      char xs[32] = {0}, ys[32] = {0}, os[32];
      memcpy(xs, x + j * size, (n - j) * size);
      memcpy(ys, y + j * size, (n - j) * size);
      store8(os, 0, _mm256_mul_ps(swish(load8(xs, 0, bf16)), load8(ys, 0, bf16)), bf16);
      memcpy(o + j * size, os, (n - j) * size);
    }
  }
}

void qb_silu_mul_f32(int threads, long rows, long n, const float* a, long a_row, const float* b, long b_row, float* out) {
  silu_mul_rows(threads, rows, n, a, a_row, b, b_row, out, n, 0);
}

/* As a step of a kernel chain (qbackend/kernels/kernel_chain.py). */
int qb_silu_mul_call(int threads, const silu_mul_call_t* c, const float* a, const float* b, float* out, void* unused) {
  (void)unused;
  qb_silu_mul_f32(threads, c->rows, c->n, a, c->a_row, b, c->b_row, out);
  return 0;
}

/* Rows of n bf16 values: a, b and out each with their own row stride (out: columns of a wider
 * activation, the next linear's input). */
void qb_silu_mul_bf16(int threads, long rows, long n, const uint16_t* a, long a_row, const uint16_t* b, long b_row,
                      uint16_t* out, long out_row) {
  silu_mul_rows(threads, rows, n, a, a_row, b, b_row, out, out_row, 1);
}
