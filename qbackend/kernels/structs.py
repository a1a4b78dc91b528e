"""The ctypes mirrors of ``csrc/call_structs.h``: one call site's fixed arguments, filled once and
passed by pointer. Written by hand on both sides, so ``check_layouts`` compares each with the
size, field offsets and field sizes the loaded library reports (``qb_struct_layout``,
``csrc/struct_layout.c``): a field one side lacks disables the library instead of handing a
kernel the wrong bytes."""
from __future__ import annotations

import ctypes

_int, _float, _long, _pointer = ctypes.c_int, ctypes.c_float, ctypes.c_long, ctypes.c_void_p


def _ints(*names: str) -> list:
    return [(name, _int) for name in names]


class ConvCall(ctypes.Structure):
    """conv_gemm_int8.c's GEMM: what one call site fixes, made once per input shape."""

    c_name = "conv_call_t"
    _fields_ = (_ints("N", "H", "W", "Cin", "OH", "OW", "KH", "KW", "stride_h", "stride_w", "pad_h", "pad_w", "dil_h",
                      "dil_w", "Cout", "x_zp")
                + [("w", _pointer), ("mult", _pointer), ("add", _pointer), ("residual_is_float", _int),
                   ("residual_scale", _float), ("activation", _int), ("low", _float), ("high", _float),
                   ("out_inv_scale", _float), ("out_zp", _int), ("qmin", _int), ("qmax", _int)])


class DepthwiseCall(ctypes.Structure):
    """depthwise_conv_int8.c's and depthwise_conv_int8_vnni.c's: what one call site fixes, made
    once per input shape."""

    c_name = "dwconv_call_t"
    _fields_ = (_ints("N", "H", "W", "C", "stride_h", "stride_w", "pad_h", "pad_w", "OH", "OW", "x_zp")
                + [("weight", _pointer), ("mult", _pointer), ("add", _pointer), ("lo", _float), ("hi", _float),
                   ("out_inv_scale", _float)]
                + _ints("out_zp", "qmin", "qmax", "activation", "float_out", "window")
                + [("norm_weight", _pointer), ("norm_bias", _pointer),
                   ("norm_eps", _float)])  # (the LayerNorm: the VNNI kernel's only)


class GroupedCall(ctypes.Structure):
    """grouped_conv_int8.c's."""

    c_name = "grouped_call_t"
    _fields_ = (_ints("N", "H", "W", "C", "Cg", "stride", "OH", "OW", "x_zp")
                + [("weight", _pointer), ("mult", _pointer), ("add", _pointer), ("lo", _float), ("hi", _float),
                   ("out_inv_scale", _float)]
                + _ints("out_zp", "qmin", "qmax", "float_out"))


class StemCall(ctypes.Structure):
    """stem_conv_int8_vnni.c's and stem_conv_int8.c's."""

    c_name = "stem_call_t"
    _fields_ = (_ints("N", "H", "W", "C", "OH", "OW", "KH", "KW", "stride_h", "stride_w", "pad_h", "pad_w", "Cout", "x_zp")
                + [("w", _pointer), ("mult", _pointer), ("add", _pointer), ("low", _float), ("high", _float),
                   ("out_inv_scale", _float)]
                + _ints("out_zp", "qmin", "qmax", "pool_kh", "pool_kw", "pool_sh", "pool_sw", "pool_ph", "pool_pw", "PH", "PW",
                        "activation"))


class MaxPoolCall(ctypes.Structure):
    """max_pool_uint8.c's."""

    c_name = "max_pool_call_t"
    _fields_ = _ints("N", "H", "W", "C", "KH", "KW", "stride_h", "stride_w", "pad_h", "pad_w", "dil_h", "dil_w", "OH", "OW")


class AvgPoolCall(ctypes.Structure):
    """avg_pool_uint8.c's."""

    c_name = "avg_pool_call_t"
    _fields_ = _ints("N", "H", "W", "C", "KH", "KW", "stride_h", "stride_w", "pad_h", "pad_w", "OH", "OW", "count_include_pad",
                     "divisor", "zp", "qmin", "qmax")


class GlobalAvgPoolCall(ctypes.Structure):
    """global_avg_pool_uint8.c's."""

    c_name = "global_avg_pool_call_t"
    _fields_ = [*_ints("N", "HW", "C", "zp", "qmin", "qmax"), ("x_inv_scale", ctypes.c_float),
                *_ints("x_zp", "x_qmin", "x_qmax", "x_nan_as")]


class ScaleQuantizeCall(ctypes.Structure):
    """scale_quantize.c's."""

    c_name = "scale_quantize_call_t"
    _fields_ = (_ints("N", "C") + [("HW", _long), ("channels_last", _int), ("s_batch_stride", _long), ("gate", _int),
                                    ("inv_scale", _float)] + _ints("zp", "qmin", "qmax"))


class QuantizeCall(ctypes.Structure):
    """quantize_dense.c's."""

    c_name = "quantize_call_t"
    _fields_ = [("n", _long), ("inv_scale", _float)] + _ints("zp", "qmin", "qmax", "is_signed", "nan_byte", "wide")


class AttentionCall(ctypes.Structure):
    """attention_f32.c's."""

    c_name = "attention_call_t"
    _fields_ = (_ints("B", "H", "L", "S", "D")
                + [(name, _long * 3) for name in ("q_stride", "k_stride", "v_stride")]
                + [("mask_stride", _long * 4), ("out_stride", _long * 3), ("scale", _float), ("quantized", _int),
                   ("out_inv_scale", _float)]
                + _ints("out_zero_point", "out_qmin", "out_qmax", "causal_rows")
                + [(name, _long * 2) for name in ("k_scale_stride", "v_scale_stride")])


class WeightOnlyCall(ctypes.Structure):
    """weight_only_int16.c's, a kernel chain step."""

    c_name = "weight_only_call_t"
    _fields_ = (_ints("bits", "M", "N", "K", "group", "codes") + [(name, _pointer) for name in ("w", "scale", "offset")]
                + [("scales_at", _long), ("sums_at", _long)])


class Operand(ctypes.Structure):
    """kernel_chain.c's address of a step's operand."""

    c_name = "operand_t"
    _fields_ = [("base", _int), ("offset", _long)]


class ChainStep(ctypes.Structure):
    """kernel_chain.c's step."""

    c_name = "chain_step_t"
    _fields_ = [("kind", _int), ("function", _pointer), ("call", _pointer)] + [(name, Operand) for name in "abcdef"]


class KvAppendCall(ctypes.Structure):
    """kv_append.c's, a kernel chain step."""

    c_name = "kv_append_call_t"
    _fields_ = [(name, _long) for name in ("batch", "heads", "added", "row_bytes")] + [
        (name, _long * 3) for name in ("new_stride", "past_stride")]


class RmsNormCall(ctypes.Structure):
    """rms_norm_f32.c's, a kernel chain step."""

    c_name = "rms_norm_call_t"
    _fields_ = [("rows", _long), ("n", _long), ("w", _pointer), ("eps", _float)]


class LayerNormCall(ctypes.Structure):
    """layer_norm_quantize.c's, a kernel chain step."""

    c_name = "layer_norm_call_t"
    _fields_ = [("rows", _long), ("C", _int), ("w", _pointer), ("b", _pointer), ("eps", _float), ("inv_scale", _float)] + _ints(
        "zp", "qmin", "qmax")


class AddQuantizeCall(ctypes.Structure):
    """add_quantize.c's, a kernel chain step."""

    c_name = "add_quantize_call_t"
    _fields_ = [("n", _long), ("inv_scale", _float)] + _ints("zp", "qmin", "qmax")


class BatchNormCall(ctypes.Structure):
    """batch_norm_quantize.c's, a kernel chain step (its pieces' operands listed in ``inputs``)."""

    c_name = "batch_norm_call_t"
    _fields_ = ([("pixels", _long)] + _ints("pieces", "in_zero_point") + [("in_scale", _float), ("relu", _int),
                                                                         ("out_inv_scale", _float)]
                + _ints("out_zero_point", "qmin", "qmax") + [(name, _pointer) for name in ("channels", "strides", "inputs",
                                                                                         "alpha", "beta")])


class SiluMulCall(ctypes.Structure):
    """silu_mul.c's, a kernel chain step."""

    c_name = "silu_mul_call_t"
    _fields_ = [(name, _long) for name in ("rows", "n", "a_row", "b_row")]


class ShuffleCall(ctypes.Structure):
    """channel_shuffle.c's (eager, or a kernel chain step)."""

    c_name = "shuffle_call_t"
    _fields_ = ([(name, _long) for name in ("pixels", "a_stride", "b_stride")] + _ints("half", "halves", "in_u8")
                + [("in_scale", _float)] + _ints("in_zp", "out_u8") + [("inv_scale", _float)] + _ints("zero_point", "qmin", "qmax"))


STRUCTS = (ConvCall, DepthwiseCall, GroupedCall, StemCall, MaxPoolCall, AvgPoolCall, GlobalAvgPoolCall, ScaleQuantizeCall,
           QuantizeCall, AttentionCall, WeightOnlyCall, Operand, ChainStep, KvAppendCall, RmsNormCall, SiluMulCall, ShuffleCall,
           LayerNormCall, AddQuantizeCall, BatchNormCall)


def layout(struct) -> list[int]:
    """``struct``'s size, then each field's offset and size in order: what ``qb_struct_layout`` gives."""
    fields = [getattr(struct, name) for name, *_ in struct._fields_]
    return [ctypes.sizeof(struct)] + [number for field in fields for number in (field.offset, field.size)]


def check_layouts(lib: ctypes.CDLL) -> None:
    """RuntimeError naming the first of ``STRUCTS`` whose layout differs from its C struct's in
    ``lib`` (a field's type is not compared, only its size: a float where C has an int passes)."""
    function = lib.qb_struct_layout
    function.argtypes, function.restype = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)], ctypes.POINTER(ctypes.c_long)
    for struct in STRUCTS:
        count = ctypes.c_int(0)
        values = function(struct.c_name.encode(), ctypes.byref(count))
        theirs = values[:count.value] if values else None
        if theirs != layout(struct):
            raise RuntimeError(f"the C struct {struct.c_name} (size, field offsets and sizes {theirs}) differs from its "
                               f"ctypes mirror {struct.__name__} ({layout(struct)}): csrc/call_structs.h and "
                               "qbackend/kernels/structs.py must change together")
