/* Each call_structs.h struct's size and its fields' offsets and sizes, for the check Python makes when it loads
 * a library (qbackend/kernels/structs.py): its ctypes mirrors are written by hand, and a field
 * one side lacks would otherwise be a kernel reading the wrong bytes. Built into every library. */
#include <stddef.h>
#include <string.h>

#include "call_structs.h"

#define AT(type, field) (long)offsetof(type, field), (long)sizeof(((type*)0)->field)
#define LAYOUT(type, ...) {#type, (const long[]){sizeof(type), __VA_ARGS__}, sizeof((const long[]){sizeof(type), __VA_ARGS__}) / sizeof(long)}
#define C(f) AT(conv_call_t, f)
#define D(f) AT(dwconv_call_t, f)
#define G(f) AT(grouped_call_t, f)
#define S(f) AT(stem_call_t, f)
#define M(f) AT(max_pool_call_t, f)
#define P(f) AT(global_avg_pool_call_t, f)
#define V(f) AT(avg_pool_call_t, f)
#define A(f) AT(attention_call_t, f)
#define W(f) AT(weight_only_call_t, f)
#define O(f) AT(operand_t, f)
#define T(f) AT(chain_step_t, f)
#define K(f) AT(kv_append_call_t, f)
#define R(f) AT(rms_norm_call_t, f)
#define U(f) AT(silu_mul_call_t, f)
#define Q(f) AT(scale_quantize_call_t, f)
#define Z(f) AT(quantize_call_t, f)
#define H(f) AT(shuffle_call_t, f)
#define N(f) AT(layer_norm_call_t, f)
#define B(f) AT(add_quantize_call_t, f)
#define Y(f) AT(batch_norm_call_t, f)

static const struct {
  const char* name;
  const long* layout; /* sizeof, then each field's offsetof and sizeof in declaration order */
  int count;
} LAYOUTS[] = {
    LAYOUT(conv_call_t, C(N), C(H), C(W), C(Cin), C(OH), C(OW), C(KH), C(KW), C(stride_h), C(stride_w), C(pad_h), C(pad_w),
           C(dil_h), C(dil_w), C(Cout), C(x_zp), C(w), C(mult), C(add), C(residual_is_float), C(residual_scale),
           C(activation), C(low), C(high), C(out_inv_scale), C(out_zp), C(qmin), C(qmax)),
    LAYOUT(dwconv_call_t, D(N), D(H), D(W), D(C), D(stride_h), D(stride_w), D(pad_h), D(pad_w), D(OH), D(OW), D(x_zp),
           D(weight), D(mult), D(add), D(lo), D(hi), D(out_inv_scale), D(out_zp), D(qmin), D(qmax), D(activation),
           D(float_out), D(window), D(norm_weight), D(norm_bias), D(norm_eps)),
    LAYOUT(grouped_call_t, G(N), G(H), G(W), G(C), G(Cg), G(stride), G(OH), G(OW), G(x_zp), G(weight), G(mult), G(add),
           G(lo), G(hi), G(out_inv_scale), G(out_zp), G(qmin), G(qmax), G(float_out)),
    LAYOUT(stem_call_t, S(N), S(H), S(W), S(C), S(OH), S(OW), S(KH), S(KW), S(stride_h), S(stride_w), S(pad_h), S(pad_w),
           S(Cout), S(x_zp), S(w), S(mult), S(add), S(low), S(high), S(out_inv_scale), S(out_zp), S(qmin), S(qmax),
           S(pool_kh), S(pool_kw), S(pool_sh), S(pool_sw), S(pool_ph), S(pool_pw), S(PH), S(PW), S(activation)),
    LAYOUT(max_pool_call_t, M(N), M(H), M(W), M(C), M(KH), M(KW), M(stride_h), M(stride_w), M(pad_h), M(pad_w), M(dil_h),
           M(dil_w), M(OH), M(OW)),
    LAYOUT(avg_pool_call_t, V(N), V(H), V(W), V(C), V(KH), V(KW), V(stride_h), V(stride_w), V(pad_h), V(pad_w), V(OH),
           V(OW), V(count_include_pad), V(divisor), V(zp), V(qmin), V(qmax)),
    LAYOUT(global_avg_pool_call_t, P(N), P(HW), P(C), P(zp), P(qmin), P(qmax), P(x_inv_scale), P(x_zp), P(x_qmin),
           P(x_qmax), P(x_nan_as)),
    LAYOUT(attention_call_t, A(B), A(H), A(L), A(S), A(D), A(q_stride), A(k_stride), A(v_stride), A(mask_stride),
           A(out_stride), A(scale), A(quantized), A(out_inv_scale), A(out_zero_point), A(out_qmin), A(out_qmax),
           A(causal_rows), A(k_scale_stride), A(v_scale_stride)),
    LAYOUT(weight_only_call_t, W(bits), W(M), W(N), W(K), W(group), W(codes), W(w), W(scale), W(offset), W(scales_at),
           W(sums_at)),
    LAYOUT(operand_t, O(base), O(offset)),
    LAYOUT(chain_step_t, T(kind), T(function), T(call), T(a), T(b), T(c), T(d), T(e), T(f)),
    LAYOUT(kv_append_call_t, K(batch), K(heads), K(added), K(row_bytes), K(new_stride), K(past_stride)),
    LAYOUT(rms_norm_call_t, R(rows), R(n), R(w), R(eps)),
    LAYOUT(silu_mul_call_t, U(rows), U(n), U(a_row), U(b_row)),
    LAYOUT(layer_norm_call_t, N(rows), N(C), N(w), N(b), N(eps), N(inv_scale), N(zp), N(qmin), N(qmax)),
    LAYOUT(add_quantize_call_t, B(n), B(inv_scale), B(zp), B(qmin), B(qmax)),
    LAYOUT(batch_norm_call_t, Y(pixels), Y(pieces), Y(in_zero_point), Y(in_scale), Y(relu), Y(out_inv_scale),
           Y(out_zero_point), Y(qmin), Y(qmax), Y(channels), Y(strides), Y(inputs), Y(alpha), Y(beta)),
    LAYOUT(scale_quantize_call_t, Q(N), Q(C), Q(HW), Q(channels_last), Q(s_batch_stride), Q(gate), Q(inv_scale), Q(zp),
           Q(qmin), Q(qmax)),
    LAYOUT(quantize_call_t, Z(n), Z(inv_scale), Z(zp), Z(qmin), Z(qmax), Z(is_signed), Z(nan_byte), Z(wide)),
    LAYOUT(shuffle_call_t, H(pixels), H(a_stride), H(b_stride), H(half), H(halves), H(in_u8), H(in_scale), H(in_zp),
           H(out_u8), H(inv_scale), H(zero_point), H(qmin), H(qmax)),
};

/* Struct ``name``'s layout (*count values), or NULL for a name not here. */
const long* qb_struct_layout(const char* name, int* count) {
  for (size_t i = 0; i < sizeof(LAYOUTS) / sizeof(LAYOUTS[0]); i++)
    if (!strcmp(LAYOUTS[i].name, name)) {
      *count = LAYOUTS[i].count;
      return LAYOUTS[i].layout;
    }
  return NULL;
}
