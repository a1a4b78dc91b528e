"""Every registered ``qbackend::`` op refuses bad arguments with a clear ValueError before any
pointer reaches C (#20): one table, every op, never a signal."""
import pytest
import torch

from qbackend.kernels import registry
from qbackend.lowering import depthwise, gemm, grouped
from qbackend.lowering.own_conv import scale_and_offset
from qbackend.weight_only.weight_quant import quantize as quantize_weight

from tests.helpers import needs_own_kernels
from tests.kernels.test_own_conv_kernels import _needs_vnni_library
from tests.kernels.test_stem_kernel import SHAPES, _case as stem_case

U8 = torch.uint8


def _uint8(*shape):
    return torch.zeros(*shape, dtype=U8).contiguous(memory_format=torch.channels_last)


def int4_args():
    weight = quantize_weight(torch.randn(32, 128), 4, 64)
    scale = weight.scale.float().contiguous()
    return [torch.randn(2, 128), weight.nibble_storage(), scale, (weight.float_offset() - 8 * scale).contiguous(), 64]


def int8_args():
    return [torch.randn(2, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8)]


def qconv_args():
    w = torch.zeros(16, 8, 3, 3, dtype=torch.int8)
    mult, add = (t.float() for t in scale_and_offset(w, torch.ones(16), 0.1, 0))
    # x, weight, mult, add, residual, residual_scale, low, high, out_scale, out_zp, qmin, qmax, float_out, activation,
    # kernel_size, stride, padding, dilation, x_zero_point
    return [_uint8(1, 8, 6, 6), gemm.pack(w), mult, add, None, 0.0, 0.0, 6.0, 0.1, 0, 0, 255, False, "none",
            [3, 3], [1, 1], [1, 1], [1, 1], 0]


def dw_args():
    w = torch.zeros(16, 1, 3, 3, dtype=torch.int8)
    weight, mult, add = depthwise.pack(w, *scale_and_offset(w, torch.ones(16), 0.1, 0), depthwise.vnni_built())
    # x, x_zero_point, weight, mult, add, stride, padding, low, high, out_scale, out_zp, qmin, qmax
    return [_uint8(1, 16, 6, 6), 0, weight, mult, add, [1, 1], [1, 1], 0.0, 6.0, 0.1, 0, 0, 255]


def dw_norm_args():
    _needs_vnni_library()
    # x, x_zero_point, weight, mult, add, stride, padding, low, high, activation, window, norm_weight, norm_bias, eps,
    # scale, zero_point, qmin, qmax
    return dw_args()[:9] + ["none", 3, torch.randn(16), torch.randn(16), 1e-6, 0.1, 3, 0, 255]


def avx2_depthwise_weight():
    w = torch.zeros(16, 1, 3, 3, dtype=torch.int8)
    return depthwise.pack(w, *scale_and_offset(w, torch.ones(16), 0.1, 0), False)[0]


def stem_args():
    return list(stem_case(SHAPES["MobileNet 3x3 s2"], "relu", "avx2")[0])


def grouped_args():
    _needs_vnni_library()
    w = torch.zeros(32, 4, 3, 3, dtype=torch.int8)
    # x, x_zero_point, weight, mult, add, groups, stride, low, high, out_scale, out_zp, qmin, qmax
    return [_uint8(1, 32, 6, 6), 0, *grouped.pack(w, *scale_and_offset(w, torch.ones(32), 0.1, 0)), 8, 1, 0.0, 6.0, 0.1, 0,
            0, 255]


def attention_args():
    return [torch.randn(1, 2, 4, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16), None, 0.25]


def replaced(args, index, value):
    return args[:index] + [value] + args[index + 1:]


# (op, good arguments, [(position, bad value, what the error says)])
TABLE = [
    ("int4_mm_int16", int4_args, [(0, torch.randn(2, 128).double(), "takes float32 CPU activations"),
                                  (0, torch.randn(2, 96), "takes float32 CPU activations"),
                                  (2, torch.ones(32, 1), "expected a contiguous CPU torch.float32 constant"),
                                  (4, 48, "group size 48")]),
    ("int8_mm_int16", int8_args, [(0, torch.randn(2, 2, 64), "takes float32 CPU activations"),
                                  (1, torch.zeros(8, 64, dtype=torch.int16), "expected a contiguous CPU torch.int8 constant"),
                                  (2, torch.ones(7), "expected a contiguous CPU torch.float32 constant")]),
    ("qconv", qconv_args, [(0, torch.zeros(1, 8, 6, 6), "takes uint8 CPU activations"),
                           (0, _uint8(1, 4, 6, 6), "packed weights are not 4 -> 16 channels"),
                           (2, torch.ones(16).double(), "expected a contiguous CPU torch.float32 constant"),
                           (4, _uint8(1, 16, 2, 2), "residual"),
                           (13, "silu", "activation 'silu'"),
                           (14, [-1, -3], "kernel_size"), (15, [0, 1], "stride"), (16, [-1, 0], "padding"),
                           (17, [-1, -1], "dilation"), (17, [9, 9], "no output"), (18, 256, "zero points")]),
    ("qconv_depthwise", dw_args, [(0, torch.zeros(1, 16, 6, 6), "takes uint8 CPU activations"),
                              (0, _uint8(1, 32, 6, 6), "activations of 32 channels for constants packed for 16"),
                              (1, -1, "zero points"), (5, [-1, -1], "stride"), (5, [1, 3], r"stride \[1, 3\]; the kernels take \(1, 2\)"),
                              (6, [1], "padding"),
                              (12, 300, "zero points")]),
    ("qconv_depthwise_layer_norm", dw_norm_args,
     [(0, torch.zeros(1, 16, 6, 6), "takes uint8 CPU activations"), (0, _uint8(1, 24, 6, 6), "whole groups of 16 channels"),
      (2, avx2_depthwise_weight(), "AVX512-VNNI depthwise kernel only"), (11, torch.randn(8), r"weight .*float32 \[16\]"),
      (12, None, "bias None"), (13, -1.0, "eps -1.0"), (14, 0.0, "scale 0.0"), (17, 300, "uint8 range")]),
    ("qconv_stem", stem_args, [(0, torch.zeros(2, 3, 32, 32), "takes uint8 CPU activations"),
                               (6, [-1, -1], "stride"), (7, [-2, 0], "padding"), (11, 999, "zero points"),
                               (2, torch.zeros(7, dtype=torch.int32), "expected a contiguous CPU torch.int16 constant")]),
    ("qconv_grouped", grouped_args, [(0, torch.zeros(1, 32, 6, 6), "takes uint8 CPU activations"),
                                     (2, torch.zeros(7, dtype=torch.int8), "expected a contiguous CPU torch.int8 constant"),
                                     (2, torch.zeros(7, dtype=torch.int16), "expected a contiguous CPU torch.int16 constant"),
                                     (5, 16, "32 channels in 16 groups"), (6, 3, "stride 3"), (9, 0.0, "out scale 0.0"),
                                     (10, 300, "zero points")]),
    ("attention_f32", attention_args, [(0, torch.randn(1, 2, 4, 16).double(), "float32 CPU"),
                                       (1, torch.randn(1, 2, 5, 32), "differ in batch, heads or head dim"),
                                       (3, torch.zeros(1, 1, 4, 6, dtype=torch.bool), "not an additive float32 one")]),
    ("attention_quantize", lambda: attention_args() + [0.1, 128, 0, 255],
     [(0, torch.randn(1, 2, 4, 16).double(), "float32 CPU"), (1, torch.randn(1, 2, 5, 32), "differ in batch, heads or head dim"),
      (5, 0.0, "scale 0.0"), (6, 300, "uint8 range")]),
    ("max_pool_u8", lambda: [_uint8(1, 8, 4, 4), [2, 2], [2, 2], [0, 0], [1, 1]],
     [(0, torch.zeros(1, 8, 4, 4), "takes uint8 CPU activations"), (4, [0, 0], "dilation"), (2, [0, -1], "stride"),
      (3, [2, 2], "padding"), (1, [9, 9], "no output")]),
    ("avg_pool_u8", lambda: [_uint8(1, 8, 4, 4), [2, 2], [2, 2], [0, 0], False, True, 0, 3, 0, 255],
     [(0, torch.zeros(1, 8, 4, 4), "takes uint8 CPU activations"), (2, [0, -1], "stride"), (3, [2, 2], "padding over half"),
      (1, [9, 9], "no output"), (6, -1, "divisor -1"), (6, 1 << 17, "divisor 131072"), (7, 256, "zero points")]),
    ("global_avg_pool_u8", lambda: [_uint8(1, 8, 4, 4), 3, 0, 255],
     [(0, torch.zeros(1, 8, 4, 4), "takes uint8 CPU activations"), (1, 256, "zero points"), (3, 300, "zero points")]),
    ("global_avg_pool_quantize", lambda: [torch.randn(1, 8, 4, 4), 0.1, 3, 0, 255, 0, 3, 0, 255],
     [(0, _uint8(1, 8, 4, 4), "takes float32 CPU activations"), (1, float("nan"), "scale nan"), (1, 0.0, "scale 0.0"),
      (2, 256, "zero points"), (5, 256, "a NaN's value 256"), (8, 300, "zero points")]),
    ("scale_quantize", lambda: [torch.randn(1, 8, 4, 4), torch.rand(1, 8, 1, 1), 0.1, 3, 0, 255],
     [(0, torch.randn(8, 4, 4), "float32 CPU"), (1, torch.rand(1, 4, 1, 1), "factors"), (2, float("nan"), "scale nan"),
      (3, 300, "uint8 range")]),
] + [(op, lambda: [torch.randn(2, 5, 16), torch.randn(16), torch.randn(16), 1e-5, 0.1, 3, 0, 255],
       [(0, torch.randn(2, 5, 16).double(), "float32 CPU"), (1, torch.randn(8), r"weight .*float32 \[16\]"),
        (2, None, "bias None"), (3, -1.0, "eps -1.0"), (4, 0.0, "scale 0.0"), (7, 256, "uint8 range")])
      for op in ("layer_norm_quantize", "layer_norm_and_quantize")] + [
] + [(op, lambda: [torch.randn(2, 8, 4, 4), torch.randn(2, 8, 4, 4), 0.1, 3, 0, 255],
       [(0, torch.randn(2, 8, 4, 4).double(), "float32 CPU"), (1, torch.randn(2, 8, 1, 1), "no broadcasting"),
        (2, float("inf"), "scale inf"), (4, 9, "uint8 range")]) for op in ("add_quantize", "add_quantize_")]


def test_the_table_covers_every_registered_op():
    assert sorted(op for op, _, _ in TABLE) == sorted(registry.OPS)


@needs_own_kernels
@pytest.mark.parametrize("op, good, bad", TABLE, ids=[row[0] for row in TABLE])
def test_bad_arguments_get_a_clear_error(op, good, bad):
    args = good()
    registry.op(op)(*args)  # (the good call runs)
    for index, value, message in bad:
        with pytest.raises(ValueError, match=message):
            registry.op(op)(*replaced(args, index, value))
