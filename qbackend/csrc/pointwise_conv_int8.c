/* 1x1 int8 convolution (uint8 NHWC activations, per-channel int8 weights), with bias, an
 * optional quantized residual added before the clamp post-op, and requantization to uint8.
 *
 * Why: onednn::qconv_pointwise spends ~50 us per call before computing (MobileNetV2 makes 35
 * 1x1 convs per image). This is a plain AVX2 int8 GEMM: out[p][o] = sum_i x[p][i] * w[o][i].
 * vpmaddubsw multiplies uint8 activations by int8 weights and adds adjacent pairs in int16,
 * which saturates unless the caller checked qmax_x * (|w[o][2j]| + |w[o][2j+1]|) <= 32767
 * (7-bit weights always pass); vpmaddwd by ones then widens to int32.
 *
 * Weights: [Cout / 8][Cin / 4][8 outputs][4 inputs], so one 32-byte load feeds 8 outputs and
 * a broadcast 4-byte load of one pixel's 4 inputs meets it. Tile: 4 pixels x 16 outputs.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define PIXEL_TILE 4

typedef struct {
  const float *mult, *add; /* per output channel: acc * mult + add is the float result */
  const uint8_t* residual; /* NULL, or uint8 [P][Cout] added as residual * residual_scale (+ folded zero point) */
  float* float_out;        /* NULL, or float [P][Cout] written instead of the uint8 output (no requantization) */
  __m256 residual_scale, low, high, out_inv_scale, out_zp;
  __m128i qmin, qmax;
} epilogue_t;

/* ``e`` is a local copy: read through a pointer, its constants would be reloaded after every
 * uint8 store (which may alias them). */
static inline void store8(const epilogue_t e, __m256i acc, int o, int Cout, size_t pixel, uint8_t* restrict y) {
  __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_loadu_ps(e.mult + o), _mm256_loadu_ps(e.add + o));
  if (e.residual) {
    const __m256i r = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(e.residual + pixel * Cout + o)));
    f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(r), e.residual_scale, f);
  }
  f = _mm256_min_ps(_mm256_max_ps(f, e.low), e.high);
  if (e.float_out) {
    _mm256_storeu_ps(e.float_out + pixel * Cout + o, f);
    return;
  }
  f = _mm256_fmadd_ps(f, e.out_inv_scale, e.out_zp);
  const __m256i q32 = _mm256_cvtps_epi32(f); /* round half to even, as torch's quantize does */
  const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q32), _mm256_extracti128_si256(q32, 1));
  const __m128i q8 = _mm_min_epu8(_mm_max_epu8(_mm_packus_epi16(q16, q16), e.qmin), e.qmax);
  _mm_storel_epi64((__m128i*)(y + pixel * Cout + o), q8);
}

/* ``pixels`` (1-4) pixels from ``p`` times ``blocks`` (1-2) blocks of 8 outputs from ``o``. */
static inline void tile(int pixels, int blocks, int Cin, int Cout, size_t p, int o, const uint8_t* restrict x,
                        const int8_t* restrict w, const epilogue_t* shared, uint8_t* restrict y) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[PIXEL_TILE][2];
  for (int i = 0; i < pixels; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
  const int steps = Cin / 4;
  const int8_t* w0 = w + (size_t)(o / 8) * steps * 32;
  for (int k = 0; k < steps; k++) {
    __m256i wv[2];
    for (int b = 0; b < blocks; b++) wv[b] = _mm256_loadu_si256((const __m256i*)(w0 + ((size_t)b * steps + k) * 32));
    for (int i = 0; i < pixels; i++) {
      int32_t four;
      memcpy(&four, x + (p + i) * Cin + 4 * k, 4);
      const __m256i xb = _mm256_set1_epi32(four);
      for (int b = 0; b < blocks; b++)
        acc[i][b] = _mm256_add_epi32(acc[i][b], _mm256_madd_epi16(_mm256_maddubs_epi16(xb, wv[b]), ones));
    }
  }
  const epilogue_t e = *shared; /* copied once the sums are done: no registers taken from the loop above */
  for (int i = 0; i < pixels; i++)
    for (int b = 0; b < blocks; b++) store8(e, acc[i][b], o + 8 * b, Cout, p + i, y);
}

#define TILE_CASES(PIXELS, BLOCKS)                                     \
  switch (PIXELS) {                                                    \
    case 1: tile(1, BLOCKS, Cin, Cout, p, o, x, w, &e, y); break;      \
    case 2: tile(2, BLOCKS, Cin, Cout, p, o, x, w, &e, y); break;      \
    case 3: tile(3, BLOCKS, Cin, Cout, p, o, x, w, &e, y); break;      \
    default: tile(PIXEL_TILE, BLOCKS, Cin, Cout, p, o, x, w, &e, y);   \
  }

/* y[P][Cout] = requantize(x[P][Cin] @ w.T (+ residual)), or the float result into yf when
 * yf is not NULL; Cin % 4 == 0, Cout % 8 == 0. */
void qb_conv1x1(int threads, int P, int Cin, int Cout, const uint8_t* x, const int8_t* w, const float* mult,
                const float* add, const uint8_t* residual, float residual_scale, float low, float high, float out_inv_scale,
                int out_zp, int qmin, int qmax, uint8_t* y, float* yf) {
  const epilogue_t e = {mult, add, residual, yf, _mm256_set1_ps(residual_scale), _mm256_set1_ps(low), _mm256_set1_ps(high),
                        _mm256_set1_ps(out_inv_scale), _mm256_set1_ps((float)out_zp), _mm_set1_epi8((char)qmin),
                        _mm_set1_epi8((char)qmax)};
  const int pixel_tiles = (P + PIXEL_TILE - 1) / PIXEL_TILE, output_tiles = (Cout + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
  for (int ot = 0; ot < output_tiles; ot++)
    for (int pt = 0; pt < pixel_tiles; pt++) {
      const size_t p = (size_t)pt * PIXEL_TILE;
      const int o = ot * 16, pixels = P - (int)p < PIXEL_TILE ? P - (int)p : PIXEL_TILE;
      if (Cout - o >= 16) {
        TILE_CASES(pixels, 2)
      } else {
        TILE_CASES(pixels, 1)
      }
    }
}
