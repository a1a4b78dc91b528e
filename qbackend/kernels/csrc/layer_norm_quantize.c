/* LayerNorm over the last dimension, then quantize to uint8:
 * y = clamp(round(((x - mean) * rstd * w + b) / scale) + zp, qmin, qmax), rstd = 1 / sqrt(var + eps),
 * for float32 rows of C values (mean and biased variance of the row, as torch's layer_norm).
 *
 * Why: ConvNeXt and every BERT / ViT normalize the rows a quantized linear reads. ATen's
 * layer_norm writes the float32 rows and the quantize reads them again, and at ConvNeXt's 96
 * channels ATen spends ~30 ns a row on its own: 97 us for 3136 rows where this kernel's one
 * pass over the row (kept in L1 for the statistics) is a fraction of that. The statistics are
 * two passes over the row: the mean (its sum in float64), then the squared deviations in
 * float32, as ATen's are; the normalized value may differ from ATen's in the last bit, so a
 * value on a rounding tie of the quantize can land one level over (as Inductor's fused
 * LayerNorm can).
 */
#include <stdint.h>

#include "call_structs.h"
#include "layer_norm_rows.h"

/* x: [rows][C] float32, w and b: [C] float32, y: [rows][C] uint8, yf: NULL or [rows][C] float32
 * (all contiguous). Returns how many rows have statistics past UNSAFE_SQUARES (their y is not
 * the reference's). */
long qb_layer_norm_quantize(int threads, long rows, int C, const float* x, const float* w, const float* b, float eps,
                            float inv_scale, int zp, int qmin, int qmax, uint8_t* y, float* yf) {
  const long blocks = (rows + ROWS - 1) / ROWS;
  long unsafe = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : unsafe)
  for (long block = 0; block < blocks; block++) {
    const long first = block * ROWS;
    unsafe += layer_norm_rows(x + first * C, rows - first < ROWS ? rows - first : ROWS, C, w, b, eps, inv_scale, zp, qmin, qmax,
                              y + first * C, yf ? yf + first * C : NULL);
  }
  return unsafe;
}

/* As a step of a kernel chain (qbackend/kernels/kernel_chain.py): y and yf (NULL: none) from x;
 * QB_STEP_REFUSED where a row is past UNSAFE_SQUARES (the chain's nodes then run, ATen deciding it). */
int qb_layer_norm_quantize_call(int threads, const layer_norm_call_t* c, const float* x, uint8_t* y, float* yf,
                                const void* unused) {
  (void)unused;
  return qb_layer_norm_quantize(threads, c->rows, c->C, x, c->w, c->b, c->eps, c->inv_scale, c->zp, c->qmin, c->qmax, y, yf)
             ? QB_STEP_REFUSED
             : 0;
}
