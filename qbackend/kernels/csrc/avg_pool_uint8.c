/* 2-D average pooling of a uint8 NHWC tensor whose output keeps the input's scale and zero
 * point, as PT2E quantizes avg_pool2d (DenseNet's transitions): any kernel, stride and padding,
 * ceil mode, count_include_pad, a divisor override.
 *
 * Why: torch pools int8 only as a quantized tensor (a quantized-tensor copy, its pool, int_repr:
 * three ops a pool), and as an own kernel the pool joins the kernel chain around it (DenseNet's
 * chain was split at each of its 3 transitions). Each output is, as global_avg_pool_uint8.c's,
 * round((sum - size * zp) / divisor) + zp: the window's sum less its zero points exact in int32,
 * one float division, round half to even (torch's quantized pool rounds its float quotient too);
 * within one step of the reference, which averages the dequantized floats. The window and its
 * divisor are torch's: clipped to the padded image (count_include_pad) or to the image.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "call_structs.h"
#include "vec_math.h"

static inline int min_int(int a, int b) { return a < b ? a : b; }
static inline int max_int(int a, int b) { return a > b ? a : b; }

/* Returns 0 (one signature with the other kernels). */
int qb_avg_pool_u8_call(int threads, const avg_pool_call_t* c, const uint8_t* x, uint8_t* y) {
  const int C = c->C, W = c->W, OW = c->OW, vectors = C / 8;
  const __m256 zp = _mm256_set1_ps((float)c->zp), lo = _mm256_set1_ps((float)c->qmin), hi = _mm256_set1_ps((float)c->qmax);
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
  for (int n = 0; n < c->N; n++)
    for (int oh = 0; oh < c->OH; oh++) {
      const int top = oh * c->stride_h - c->pad_h, bottom = min_int(top + c->KH, c->H + c->pad_h);
      const int h0 = max_int(top, 0), h1 = min_int(bottom, c->H);
      const uint8_t* image = x + (size_t)n * c->H * W * C;
      for (int ow = 0; ow < OW; ow++) {
        const int left = ow * c->stride_w - c->pad_w, right = min_int(left + c->KW, W + c->pad_w);
        const int w0 = max_int(left, 0), w1 = min_int(right, W);
        /* (Python checks padding <= kernel / 2: every window holds an image pixel, size >= 1) */
        const int size = (h1 - h0) * (w1 - w0);
        const int divisor = c->divisor ? c->divisor : c->count_include_pad ? (bottom - top) * (right - left) : size;
        const int offset = size * c->zp; /* the window's zero points: its sum's part that is 0.0 */
        const __m256 divisor8 = _mm256_set1_ps((float)divisor);
        uint8_t* out = y + (((size_t)n * c->OH + oh) * OW + ow) * C;
        for (int v = 0; v < vectors; v++) {
          __m256i sum = _mm256_set1_epi32(-offset);
          for (int h = h0; h < h1; h++) {
            const uint8_t* row = image + ((size_t)h * W) * C + 8 * v;
            for (int w = w0; w < w1; w++)
              sum = _mm256_add_epi32(sum, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(row + (size_t)w * C))));
          }
          store_quantized8(_mm256_div_ps(_mm256_cvtepi32_ps(sum), divisor8), zp, lo, hi, out + 8 * v);
        }
        for (int ch = 8 * vectors; ch < C; ch++) {
          int sum = -offset;
          for (int h = h0; h < h1; h++)
            for (int w = w0; w < w1; w++) sum += image[((size_t)h * W + w) * C + ch];
          out[ch] = round_to_grid((float)sum / (float)divisor, c->zp, c->qmin, c->qmax);
        }
      }
    }
  return 0;
}
