/* 2-D max pooling of a uint8 NHWC tensor (any kernel, stride, padding, dilation; floor mode).
 *
 * Why: torch 2.13's quantized::max_pool2d runs on one thread here: 0.39-0.43 ms for ResNet-18's
 * 8x64x112x112 pool (1 or 2 threads), against 0.1 ms to copy the same 6.4 MB. Max commutes
 * with the dequantize, so on the int8 tensor the result is exactly the reference's; padding
 * positions are skipped (the window is clipped to the image), as max_pool2d's -inf padding.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "call_structs.h"

static inline int first_tap(int start, int dilation) { return start >= 0 ? 0 : (-start + dilation - 1) / dilation; }

static inline int end_tap(int start, int dilation, int kernel, int size) {
  const int end = (size - 1 - start) / dilation + 1; /* taps with start + t * dilation < size */
  return start >= size ? 0 : end < kernel ? end : kernel;
}

/* Returns 0 (one signature with the other kernels). */
int qb_max_pool_u8_call(int threads, const max_pool_call_t* c, const uint8_t* x, uint8_t* y) {
  const int C = c->C, W = c->W, OW = c->OW;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
  for (int n = 0; n < c->N; n++)
    for (int oh = 0; oh < c->OH; oh++) {
      const int h0 = oh * c->stride_h - c->pad_h;
      const int th0 = first_tap(h0, c->dil_h), th1 = end_tap(h0, c->dil_h, c->KH, c->H);
      for (int ow = 0; ow < OW; ow++) {
        const int w0 = ow * c->stride_w - c->pad_w;
        const int tw0 = first_tap(w0, c->dil_w), tw1 = end_tap(w0, c->dil_w, c->KW, W);
        uint8_t* out = y + (((size_t)n * c->OH + oh) * OW + ow) * C;
        const uint8_t* image = x + (size_t)n * c->H * W * C;
        int ch = 0;
        for (; ch + 32 <= C; ch += 32) {
          __m256i m = _mm256_setzero_si256();
          for (int th = th0; th < th1; th++) {
            const uint8_t* row = image + (size_t)(h0 + th * c->dil_h) * W * C + ch;
            for (int tw = tw0; tw < tw1; tw++)
              m = _mm256_max_epu8(m, _mm256_loadu_si256((const __m256i*)(row + (size_t)(w0 + tw * c->dil_w) * C)));
          }
          _mm256_storeu_si256((__m256i*)(out + ch), m);
        }
        for (; ch < C; ch++) {
          uint8_t m = 0;
          for (int th = th0; th < th1; th++)
            for (int tw = tw0; tw < tw1; tw++) {
              const uint8_t v = image[((size_t)(h0 + th * c->dil_h) * W + w0 + tw * c->dil_w) * C + ch];
              m = v > m ? v : m;
            }
          out[ch] = m;
        }
      }
    }
  return 0;
}
