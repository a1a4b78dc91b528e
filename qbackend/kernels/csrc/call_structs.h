/* The structs Python fills with ctypes (qbackend/kernels/structs.py), each written once here for
 * every C file that reads it. A call site's fixed arguments travel in one of these by pointer
 * instead of ~20-30 arguments ctypes would convert on every call (~8 us of a small conv's ~13).
 * struct_layout.c lists each one's fields (a field added here goes there too) and exports their
 * offsets and sizes, which Python compares with its mirror when it loads a library: a mirror
 * that differs disables the library. */
#ifndef QB_CALL_STRUCTS_H
#define QB_CALL_STRUCTS_H

#include <stdint.h>

/* conv_gemm_int8.c: geometry, constants, epilogue of one call site and input shape. */
typedef struct {
  int N, H, W, Cin, OH, OW, KH, KW, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, Cout, x_zp;
  const int8_t* w;
  const float *mult, *add;
  int residual_is_float;
  float residual_scale;
  int activation;
  float low, high, out_inv_scale;
  int out_zp, qmin, qmax;
} conv_call_t;

/* depthwise_conv_int8.c (weight int16) and depthwise_conv_int8_vnni.c (weight int8:
 * [K kernel rows][Q quads][groups][4 vectors][8 lanes (4 in a 16-channel group)][4 bytes];
 * mult, add [groups][4 vectors][8 lanes (4 in a 16-channel group)]). */
typedef struct {
  int N, H, W, C, stride_h, stride_w, pad_h, pad_w, OH, OW, x_zp;
  const void* weight;
  const float *mult, *add;
  float lo, hi, out_inv_scale;
  int out_zp, qmin, qmax;
  int activation, float_out, window;
  /* VNNI kernel only (the AVX2 one ignores them): NULL, or (with float_out) each output pixel's C
   * float values are layer-normalized with these and quantized with out_inv_scale .. qmax
   * (ConvNeXt's depthwise conv -> LayerNorm -> quantize): the output is uint8 and the float rows
   * stay in a thread's scratch row */
  const float *norm_weight, *norm_bias;
  float norm_eps;
} dwconv_call_t;

/* grouped_conv_int8_vnni.c; weight is [C / 8 blocks][9 taps][Cg / 4 quads][8 lanes][4 bytes],
 * mult and add [C], in lane order. */
typedef struct {
  int N, H, W, C, Cg, stride, OH, OW, x_zp;
  const int8_t* weight;
  const float *mult, *add;
  float lo, hi, out_inv_scale;
  int out_zp, qmin, qmax;
  int float_out; /* 1: y is float32, the clamped float result (a squeeze-excitation block reads it) */
} grouped_call_t;

/* stem_conv_int8_vnni.c (int8 weights), stem_conv_int8.c (int16) */
typedef struct {
  int N, H, W, C, OH, OW, KH, KW, stride_h, stride_w, pad_h, pad_w, Cout, x_zp;
  const void* w;
  const float *mult, *add;
  float low, high, out_inv_scale;
  int out_zp, qmin, qmax;
  /* A max pool of the conv's output, fused (pool_kh 0: none): y is then the pool's PH x PW output. */
  int pool_kh, pool_kw, pool_sh, pool_sw, pool_ph, pool_pw, PH, PW;
  int activation; /* vec_math.h's, before the clamp */
} stem_call_t;

/* max_pool_uint8.c */
typedef struct {
  int N, H, W, C, KH, KW, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, OH, OW;
} max_pool_call_t;

/* avg_pool_uint8.c: torch's avg_pool2d arguments (divisor 0: none), the zero point the output keeps */
typedef struct {
  int N, H, W, C, KH, KW, stride_h, stride_w, pad_h, pad_w, OH, OW, count_include_pad, divisor, zp, qmin, qmax;
} avg_pool_call_t;

/* global_avg_pool_uint8.c: the pool's zero point and levels; for a float32 input (the pool of
 * its quantized values) the quantize's: 1 / scale, zero point, levels, a NaN's value */
typedef struct {
  int N, HW, C, zp, qmin, qmax;
  float x_inv_scale;
  int x_zp, x_qmin, x_qmax, x_nan_as;
} global_avg_pool_call_t;

/* scale_quantize.c: y = quantize(x * gate(s)), x float32 [N][C][HW] or [N][HW][C]. */
typedef struct {
  int N, C;
  long HW;
  int channels_last;
  long s_batch_stride; /* C: one factor per image and channel; 0: one per channel for the batch */
  int gate;            /* enum gate: the factors as given, or their sigmoid / hard sigmoid */
  float inv_scale;
  int zp, qmin, qmax;
} scale_quantize_call_t;

/* quantize_dense.c: n float32 values to uint8 / int8 in their memory order (a kernel chain step). */
typedef struct {
  long n;
  float inv_scale;
  int zp, qmin, qmax, is_signed, nan_byte, wide;
} quantize_call_t;

/* attention_f32.c. Strides in elements, the last dim contiguous; a mask stride of 0 broadcasts
 * that dim. */
typedef struct {
  int B, H, L, S, D;
  long q_stride[3], k_stride[3], v_stride[3]; /* batch, head, row */
  long mask_stride[4];                        /* batch, head, row, column */
  long out_stride[3];                         /* batch, row, head (grouped queries: the query heads' layout) */
  float scale;
  int quantized;       /* 0: float32 out; 1: uint8 out, round_half_even(o * out_inv_scale) + zero point, clamped */
  float out_inv_scale; /* (a NaN lands on qmin: the caller asks for qmin == the reference's NaN byte, 0) */
  int out_zero_point, out_qmin, out_qmax;
  int causal_rows; /* 0; else causal (torch's is_causal: row i sees keys j <= i), row r at position r % causal_rows
                      (grouped queries: each query head's positions one after another) */
  long k_scale_stride[2], v_scale_stride[2]; /* batch, head (rows 1 apart): qb_attention_kv_int8's scales */
} attention_call_t;

/* weight_only_int16.c: one weight-only call as a step of a kernel chain: the weight and the
 * sizes fixed per call site, x [M][K] and y [M][N] dense; the int16 activations, their scales
 * and sums at the given byte offsets of scratch (the chain's arena). */
typedef struct {
  int bits, M, N, K, group, codes; /* (codes: int4's offsets are int8 codes) */
  const void* w;
  const float* scale;
  const void* offset; /* int4 only */
  long scales_at, sums_at;
} weight_only_call_t;

/* kernel_chain.c: an address: bases[base] + offset bytes. A size, given per call (a decode step's
 * KV cache length), sits in bases as a number: the operand is then that size + offset. With base
 * -1 the operand is offset itself (0: no operand; else a size the program fixed). */
typedef struct {
  int base;    /* index into bases (the arena, the chain's inputs, its outputs, the call's sizes); -1: none */
  long offset; /* bytes from it (a size: added to it) */
} operand_t;

/* Operand ``o``'s address: ``bases[o.base] + o.offset``, or the number ``o.offset`` where base is -1. */
static inline void* operand_address(void* const* bases, operand_t o) {
  return o.base < 0 ? (void*)o.offset : (char*)bases[o.base] + o.offset;
}

/* What a chain step returns where its kernel does not compute this call's values as the reference
 * does (a LayerNorm row past the float32 statistics' range): the chain's nodes then run one by one. */
#define QB_STEP_REFUSED 2

/* kernel_chain.c: one step (kind: its enum kind). */
typedef struct {
  int kind;
  const void* function; /* FOUR: qb_conv_call(_vnni) (x, residual, y, float y), qb_weight_only_call, qb_rms_norm_call,
                           qb_rotary_call, qb_silu_mul_call, qb_kv_append_call,
                           qb_layer_norm_quantize_call, qb_add_quantize_call; X_TO_Y: qb_dwconv(_vnni)_call,
                           qb_stem_conv_vnni_call, the pools, qb_quantize_dense_call;
                           FOUR also qb_scale_quantize_call (x, factors, y); SIX: qb_attention_call;
                           LIST: qb_batch_norm_quantize_call (its inputs as operands of its call, y = a) */
  const void* call;           /* its prepared arguments */
  operand_t a, b, c, d, e, f; /* X_TO_Y: x = a, y = b */
} chain_step_t;

/* kv_append.c: the new rows of [B, H, rows, D] keys or values copied into the room kept after
 * the cache's ``rows`` rows. */
typedef struct {
  long batch, heads, added, row_bytes; /* added rows of row_bytes each, per (batch, head) */
  long new_stride[3], past_stride[3];  /* batch, head, row; bytes */
} kv_append_call_t;

/* rms_norm_f32.c, as a step of a kernel chain. */
typedef struct {
  long rows, n;
  const float* w;
  float eps;
} rms_norm_call_t;

/* layer_norm_quantize.c, as a step of a kernel chain. */
typedef struct {
  long rows;
  int C;
  const float *w, *b;
  float eps, inv_scale;
  int zp, qmin, qmax;
} layer_norm_call_t;

/* batch_norm_quantize.c, as a step of a kernel chain: its input is the channel-wise cat of
 * ``pieces`` tensors, each an operand (resolved against the chain's bases at every call). */
typedef struct {
  long pixels;
  int pieces, in_zero_point;
  float in_scale;
  int relu;
  float out_inv_scale;
  int out_zero_point, qmin, qmax;
  const long *channels, *strides; /* per piece: its channels, its pixel rows' distance in bytes */
  const operand_t* inputs;        /* per piece */
  const float *alpha, *beta;
} batch_norm_call_t;

/* add_quantize.c, as a step of a kernel chain. */
typedef struct {
  long n;
  float inv_scale;
  int zp, qmin, qmax;
} add_quantize_call_t;

/* channel_shuffle.c's call (eager, or a step of a kernel chain). */
typedef struct {
  long pixels, a_stride, b_stride; /* pixel rows; a's and b's row strides in elements */
  int half, halves;                /* channels of a and of b; write the two halves (else the whole) */
  int in_u8;                       /* a and b uint8, read as (q - in_zp) * in_scale */
  float in_scale;
  int in_zp;
  int out_u8; /* the whole shuffle, or the second half, quantized to uint8 */
  float inv_scale;
  int zero_point, qmin, qmax;
} shuffle_call_t;

/* silu_mul.c, as a step of a kernel chain. */
typedef struct {
  long rows, n, a_row, b_row;
} silu_mul_call_t;

#endif
