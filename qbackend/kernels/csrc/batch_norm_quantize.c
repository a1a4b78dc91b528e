/* Inference BatchNorm of a dequantized uint8 tensor, an optional ReLU, and the quantize after
 * them, in one pass over channels-last bytes: the norm that DenseNet (and pre-activation nets)
 * put before a conv, on the cat of a block's features. Per element, each step rounded as the
 * reference rounds it (no fused multiply-add): x = (q - zp) * s; y = x * alpha[c] + beta[c]
 * (ATen's inference batch norm: alpha / beta from its formula, qbackend/passes/batch_norm_quantize.py);
 * the ReLU (a NaN stays one); round_half_even(y * (1 / out scale)) + out zero point, clamped (a
 * NaN lands on qmin). The input is the channel-wise concatenation of ``pieces`` tensors, each
 * [N, H, W, C_p] with pixel rows ``strides[p]`` bytes apart, read in place: no cat is made.
 * The output is dense channels-last. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "call_structs.h"
#include "vec_math.h"

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

void qb_batch_norm_quantize(int threads, long pixels, int pieces, const long* channels, const long* strides,
                            const uint8_t* const* inputs, int in_zero_point, float in_scale, const float* alpha,
                            const float* beta, int relu, float out_inv_scale, int out_zero_point, int qmin, int qmax,
                            uint8_t* out) {
  long total = 0;
  for (int i = 0; i < pieces; i++) total += channels[i];
  const __m256i zp_in = _mm256_set1_epi32(in_zero_point);
  const __m256 s = _mm256_set1_ps(in_scale), inv = _mm256_set1_ps(out_inv_scale), zero = _mm256_setzero_ps(),
               zp = _mm256_set1_ps((float)out_zero_point), lo = _mm256_set1_ps((float)qmin), hi = _mm256_set1_ps((float)qmax);
#pragma omp parallel for num_threads(threads) schedule(static) if (pixels * total >= 32768)
  for (long p = 0; p < pixels; p++) {
    uint8_t* o = out + p * total;
    long c0 = 0;
    for (int i = 0; i < pieces; i++) {
      const uint8_t* x = inputs[i] + p * strides[i];
      const float *a = alpha + c0, *b = beta + c0;
      long c = 0;
      for (; c + 8 <= channels[i]; c += 8) {
        const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(x + c)));
        const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, zp_in)), s);
        __m256 y = _mm256_add_ps(_mm256_mul_ps(v, _mm256_loadu_ps(a + c)), _mm256_loadu_ps(b + c));
        if (relu) y = _mm256_max_ps(zero, y); /* (max_ps returns its second operand for a NaN) */
        store_quantized8(_mm256_mul_ps(y, inv), zp, lo, hi, o + c0 + c);
      }
      for (; c < channels[i]; c++) {
        float y = (float)(x[c] - in_zero_point) * in_scale * a[c] + b[c];
        if (relu) y = y < 0.0f ? 0.0f : y;
        o[c0 + c] = round_to_grid(y * out_inv_scale, out_zero_point, qmin, qmax);
      }
      c0 += channels[i];
    }
  }
}

/* As a step of a kernel chain (qbackend/kernels/kernel_chain.py, kind LIST): the pieces' addresses
 * resolved against the chain's ``bases`` at each call (DenseNet's layers read up to ~50 pieces). */
int qb_batch_norm_quantize_call(int threads, const batch_norm_call_t* c, void* const* bases, uint8_t* out) {
  const uint8_t** inputs = malloc((size_t)c->pieces * sizeof(*inputs));
  if (!inputs) return 1;
  for (int i = 0; i < c->pieces; i++) inputs[i] = operand_address(bases, c->inputs[i]);
  qb_batch_norm_quantize(threads, c->pixels, c->pieces, c->channels, c->strides, inputs, c->in_zero_point, c->in_scale,
                         c->alpha, c->beta, c->relu, c->out_inv_scale, c->out_zero_point, c->qmin, c->qmax, out);
  free(inputs);
  return 0;
}
