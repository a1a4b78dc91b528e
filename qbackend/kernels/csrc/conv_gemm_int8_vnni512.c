/* conv_gemm_int8.c built on zmm registers for CPUs with AVX512-VNNI (qb_conv_call_vnni512),
 * and the probe that tells whether this core runs zmm vpdpbusd fast enough to prefer it. */
#define QB_VNNI 1
#define QB_ZMM 1
#include "conv_gemm_int8.c"

#include <time.h>

/* Independent sums in named variables (an array was kept in memory by gcc), enough of them to
 * hide vpdpbusd's latency at 2 per cycle; each starts apart (equal sums, gcc computed once). */
#define PROBE_SUMS(T, set1) T s0 = set1(0), s1 = set1(1), s2 = set1(2), s3 = set1(3), s4 = set1(4), s5 = set1(5), \
                              s6 = set1(6), s7 = set1(7), s8 = set1(8), s9 = set1(9), s10 = set1(10), s11 = set1(11), \
                              s12 = set1(12), s13 = set1(13), s14 = set1(14), s15 = set1(15);
#define PROBE_STEP(dot)                                                                                        \
  s0 = dot(s0, a, b); s1 = dot(s1, a, b); s2 = dot(s2, a, b); s3 = dot(s3, a, b); s4 = dot(s4, a, b);         \
  s5 = dot(s5, a, b); s6 = dot(s6, a, b); s7 = dot(s7, a, b); s8 = dot(s8, a, b); s9 = dot(s9, a, b);         \
  s10 = dot(s10, a, b); s11 = dot(s11, a, b); s12 = dot(s12, a, b); s13 = dot(s13, a, b); s14 = dot(s14, a, b); \
  s15 = dot(s15, a, b);
#define PROBE_FOLD(add) add(add(add(add(s0, s1), add(s2, s3)), add(add(s4, s5), add(s6, s7))), \
                            add(add(add(s8, s9), add(s10, s11)), add(add(s12, s13), add(s14, s15))))

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* time_zmm / time_ymm: n steps of the 16 sums on one register width; ``sink`` keeps them used. */
#define PROBE_TIMER(name, T, set1, dot, add, first_lane)                        \
  static __attribute__((noinline)) double name(long n, int seed, int* sink) {   \
    const T a = set1(seed), b = set1(seed + 1);                                 \
    PROBE_SUMS(T, set1)                                                         \
    const double start = seconds();                                             \
    for (long i = 0; i < n; i++) { PROBE_STEP(dot) }                            \
    const double elapsed = seconds() - start;                                   \
    *sink += first_lane(PROBE_FOLD(add));                                       \
    return elapsed;                                                             \
  }
static inline int first_lane_zmm(__m512i v) { return _mm_cvtsi128_si32(_mm512_castsi512_si128(v)); }
static inline int first_lane_ymm(__m256i v) { return _mm_cvtsi128_si32(_mm256_castsi256_si128(v)); }
PROBE_TIMER(time_zmm, __m512i, _mm512_set1_epi32, _mm512_dpbusd_epi32, _mm512_add_epi32, first_lane_zmm)
PROBE_TIMER(time_ymm, __m256i, _mm256_set1_epi32, _mm256_dpbusd_epi32, _mm256_add_epi32, first_lane_ymm)

/* Products per second on zmm over those on ymm (a zmm vpdpbusd does twice a ymm one's): the
 * best of 5 interleaved rounds of 16 x 20000 instructions each, under 1 ms in all. */
double qb_vnni_zmm_speedup(int seed) {
  double zmm = 1e9, ymm = 1e9;
  int sink = 0;
  volatile long steps = 20000; /* (not a constant: gcc would specialise the loops for it) */
  for (int round = 0; round < 5; round++) {
    const double z = time_zmm(steps, seed, &sink), y = time_ymm(steps, seed, &sink);
    zmm = z < zmm ? z : zmm;
    ymm = y < ymm ? y : ymm;
  }
  return sink == 12345 ? 0.0 : 2.0 * ymm / zmm; /* (the sums are used, so the loops stay) */
}
