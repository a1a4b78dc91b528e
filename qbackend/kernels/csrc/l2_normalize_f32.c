/* F.normalize(x, p=2, dim=-1, eps): each row of n floats divided by max(||row||, eps), in one
 * pass (qbackend/passes/l2_normalize.py). Swin V2's cosine attention normalizes its queries and keys
 * this way; ATen ran it as a norm, a clamp, an expand and a division (two passes and four
 * dispatches), 24 a call of swin_v2_t, ~2 ms of ~30.
 *
 * Rows are indexed by up to three leading dims with their own strides (a head split of a merged
 * projection: [B, H, L] rows, none evenly strided), the last dim contiguous; the output is
 * dense. The sum of squares is in float32 and each element divided by the clamped norm (ATen's
 * division, the same rounding; the norm within an ulp or two of ATen's reduction). */
#include <immintrin.h>
#include <math.h>

void qb_l2_normalize_f32(int threads, const long* sizes, const long* strides, long n, float eps, const float* x,
                         float* out) {
  const long rows = sizes[0] * sizes[1] * sizes[2];
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 16384)
  for (long r = 0; r < rows; r++) {
    const long i0 = r / (sizes[1] * sizes[2]), i1 = r / sizes[2] % sizes[1], i2 = r % sizes[2];
    const float* row = x + i0 * strides[0] + i1 * strides[1] + i2 * strides[2];
    float* o = out + r * n;
    __m256 squares = _mm256_setzero_ps();
    long j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m256 v = _mm256_loadu_ps(row + j);
      squares = _mm256_fmadd_ps(v, v, squares);
    }
    float lanes[8], total = 0.0f;
    _mm256_storeu_ps(lanes, squares);
    for (int k = 0; k < 8; k++) total += lanes[k];
    for (long k = j; k < n; k++) total += row[k] * row[k];
    const float norm = fmaxf(sqrtf(total), eps); /* (a NaN norm stays NaN: fmaxf would drop it) */
    const float divisor = isnan(total) ? total : norm;
    const __m256 d = _mm256_set1_ps(divisor);
    for (j = 0; j + 8 <= n; j += 8) _mm256_storeu_ps(o + j, _mm256_div_ps(_mm256_loadu_ps(row + j), d));
    for (; j < n; j++) o[j] = row[j] / divisor;
  }
}
