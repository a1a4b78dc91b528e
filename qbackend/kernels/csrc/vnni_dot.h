/* The AVX512-VNNI kernels' dot product step (compiled into qbackend_vnni only). */
#ifndef QB_VNNI_DOT_H
#define QB_VNNI_DOT_H

#include <immintrin.h>

/* acc + 4-byte dot products of unsigned x and signed w per int32 lane, in place: GCC 12 moved
 * the intrinsic's accumulator between registers around every vpdpbusd of the depthwise
 * kernel's loops (half the instructions of the hot loop, 96-channel 7x7 layer 1.3x slower). */
static inline __m256i dot_add(__m256i acc, __m256i x, __m256i w) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "vm"(w));
  return acc;
}

#endif
