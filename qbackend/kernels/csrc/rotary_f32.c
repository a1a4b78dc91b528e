/* Rotary position embedding as Hugging Face's apply_rotary_pos_emb writes it for one tensor:
 * q * cos + rotate_half(q) * sin, rotate_half(q) = cat(-q[D/2:], q[:D/2]). Per element two
 * products and their sum, each rounded (no fused multiply-add), so the values are the graph's
 * bit for bit. q, cos and sin are [B, H, L, D] by strides (0 where cos / sin broadcast), each
 * last dim contiguous; out is dense [B, H, L, D]. One call in place of the graph's 7 ops. */
#include <immintrin.h>

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* geometry: the size [B, H, L, D], then q's, cos's and sin's strides, in elements (16 longs) */
void qb_rotary_f32(int threads, const long* geometry, const float* q, const float* c, const float* s, float* out) {
  const long *size = geometry, *qs = geometry + 4, *cs = geometry + 8, *ss = geometry + 12;
  const long B = size[0], H = size[1], L = size[2], D = size[3], half = D / 2, rows = B * H * L;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 256)
  for (long row = 0; row < rows; row++) {
    const long b = row / (H * L), h = row / L % H, l = row % L;
    const float* x = q + b * qs[0] + h * qs[1] + l * qs[2];
    const float* co = c + b * cs[0] + h * cs[1] + l * cs[2];
    const float* si = s + b * ss[0] + h * ss[1] + l * ss[2];
    float* o = out + row * D;
    long d = 0;
    for (; d + 8 <= half; d += 8) {
      const __m256 lo = _mm256_loadu_ps(x + d), hi = _mm256_loadu_ps(x + half + d);
      const __m256 neg_hi = _mm256_xor_ps(hi, _mm256_set1_ps(-0.0f));
      _mm256_storeu_ps(o + d, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(co + d)),
                                            _mm256_mul_ps(neg_hi, _mm256_loadu_ps(si + d))));
      _mm256_storeu_ps(o + half + d, _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(co + half + d)),
                                                   _mm256_mul_ps(lo, _mm256_loadu_ps(si + half + d))));
    }
    for (; d < half; d++) {
      o[d] = x[d] * co[d] + (-x[half + d]) * si[d];
      o[half + d] = x[half + d] * co[half + d] + x[d] * si[half + d];
    }
  }
}

/* As a step of a kernel chain (qbackend/kernels/kernel_chain.py): the call is the geometry. */
int qb_rotary_call(int threads, const long* geometry, const float* q, const float* c, const float* s, float* out) {
  qb_rotary_f32(threads, geometry, q, c, s, out);
  return 0;
}
