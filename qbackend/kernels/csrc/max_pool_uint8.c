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

/* Loads and stores of 32, 16, 8 and 1 channels, for WINDOW_MAX. */
static inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline void store32(uint8_t* p, __m256i v) { _mm256_storeu_si256((__m256i*)p, v); }
static inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128((const __m128i*)p); }
static inline void store16(uint8_t* p, __m128i v) { _mm_storeu_si128((__m128i*)p, v); }
static inline __m128i load8(const uint8_t* p) { return _mm_loadl_epi64((const __m128i*)p); }
static inline void store8(uint8_t* p, __m128i v) { _mm_storel_epi64((__m128i*)p, v); }
static inline uint8_t load1(const uint8_t* p) { return *p; }
static inline void store1(uint8_t* p, uint8_t v) { *p = v; }
static inline uint8_t max1(uint8_t a, uint8_t b) { return a > b ? a : b; }

/* out[ch..] = the max over the window of the channels from ch, ``LOAD`` / ``STORE`` wide: past
 * a multiple of 32, channels go 16, 8, then 1 at a time (all one at a time, ShuffleNet's
 * 24-channel pool had taken 17x a 32-channel one's time) */
#define WINDOW_MAX(TYPE, ZERO, LOAD, MAX, STORE)                                                    \
  {                                                                                                 \
    TYPE m = ZERO;                                                                                  \
    for (int th = th0; th < th1; th++) {                                                            \
      const uint8_t* row = image + (size_t)(h0 + th * c->dil_h) * W * C + ch;                      \
      for (int tw = tw0; tw < tw1; tw++) m = MAX(m, LOAD(row + (size_t)(w0 + tw * c->dil_w) * C)); \
    }                                                                                               \
    STORE(out + ch, m);                                                                             \
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
        for (; ch + 32 <= C; ch += 32) WINDOW_MAX(__m256i, _mm256_setzero_si256(), load32, _mm256_max_epu8, store32)
        for (; ch + 16 <= C; ch += 16) WINDOW_MAX(__m128i, _mm_setzero_si128(), load16, _mm_max_epu8, store16)
        for (; ch + 8 <= C; ch += 8) WINDOW_MAX(__m128i, _mm_setzero_si128(), load8, _mm_max_epu8, store8)
        for (; ch < C; ch++) WINDOW_MAX(uint8_t, 0, load1, max1, store1)
      }
    }
  return 0;
}
