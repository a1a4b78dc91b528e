/* grouped_conv_int8.c built again for AVX2 CPUs without VNNI, exact for any int8 weights:
 * qb_grouped_conv_exact16 widens the activations to int16 as it copies them into its padded
 * input and multiplies int16 pairs with vpmaddwd (int32 sums), where qb_grouped_conv_avx2's
 * vpmaddubsw adds uint8 x int8 pairs in int16 and saturates past 32767 (8-bit weights). Its
 * weights are the same packing with int16 values and 2 inputs a word (lowering/grouped.py). */
#define QB_EXACT16 1
#include "grouped_conv_int8.c"
