/* The int8 multiply-add rate a core can reach, with nothing but the instructions: the bound
 * every int8 conv kernel (oneDNN's, OpenVINO's, qbackend's) runs under on this CPU.
 *
 * AVX2: u8 x s8 products summed by pairs into int16 (vpmaddubsw), widened to int32 (vpmaddwd by
 * ones) and accumulated (vpaddd): 32 multiply-adds per three instructions. AVX512-VNNI (built
 * only where the CPU has it): vpdpbusd, 32 per instruction on ymm. CHAINS independent sums hide
 * the latency; the operands stay in registers, so memory plays no part.
 */
#include <immintrin.h>
#include <omp.h>

#define CHAINS 8

/* Multiply-adds per second over ``threads`` threads, each running ``steps`` steps of CHAINS
 * sums; the sums are returned through ``sink`` so the compiler keeps the work. */
double qb_peak_avx2(int threads, long steps, int* sink) {
  double start = omp_get_wtime();
  int total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const __m256i ones = _mm256_set1_epi16(1), a = _mm256_set1_epi8(3);
    __m256i b[CHAINS], acc[CHAINS];
    for (int c = 0; c < CHAINS; c++) b[c] = _mm256_set1_epi8((char)(c + 1)), acc[c] = _mm256_setzero_si256();
    for (long s = 0; s < steps; s++)
      for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b[c]), ones));
    for (int c = 0; c < CHAINS; c++) total += _mm256_extract_epi32(acc[c], 0);
  }
  *sink = total;
  return (double)threads * steps * CHAINS * 32 / (omp_get_wtime() - start);
}

#ifdef __AVX512VNNI__
double qb_peak_vnni(int threads, long steps, int* sink) {
  double start = omp_get_wtime();
  int total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const __m256i a = _mm256_set1_epi8(3);
    __m256i b[CHAINS], acc[CHAINS];
    for (int c = 0; c < CHAINS; c++) b[c] = _mm256_set1_epi8((char)(c + 1)), acc[c] = _mm256_setzero_si256();
    for (long s = 0; s < steps; s++)
      for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_dpbusd_epi32(acc[c], a, b[c]);
    for (int c = 0; c < CHAINS; c++) total += _mm256_extract_epi32(acc[c], 0);
  }
  *sink = total;
  return (double)threads * steps * CHAINS * 32 / (omp_get_wtime() - start);
}
#endif
