/* conv_gemm_int8.c built again for AVX2 CPUs without VNNI, exact for any int8 weights:
 * qb_conv_call_exact16 widens the activations to int16 and multiplies int16 pairs with
 * vpmaddwd (int32 sums), where qb_conv_call's vpmaddubsw adds uint8 x int8 pairs in int16
 * and saturates past 32767 (255 x |w_a + w_b| for a pair of one sign: 8-bit weights). Its weights are
 * the same packing with int16 values and 2 inputs a word (lowering/gemm.py). */
#define QB_EXACT16 1
#include "conv_gemm_int8.c"
