"""Depthwise 3x3 / 5x5 / 7x7 int8 convs (``csrc/depthwise_conv_int8.c``, AVX2, int16 packed
weights; ``csrc/depthwise_conv_int8_vnni.c``, AVX512-VNNI, int8): ``qbackend::qconv_depthwise``,
and ``qbackend::qconv_depthwise_layer_norm`` (ConvNeXt's depthwise conv, the LayerNorm over its
channels and the quantize after it, in the VNNI kernel). onednn::qconv_pointwise runs depthwise
convs at 3-11 GMAC/s here and spends ~50 us per call before computing.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from qbackend.kernels import isa
from qbackend.kernels.chain_step import X_TO_Y
from qbackend.kernels.common import (ACTIVATIONS, X_TO_Y_SIGNATURE, Kernel, Prepared, cached_prepared, channels_last_like,
                                     check_constants, check_levels, check_nchw_uint8, checked_window, make_prepared,
                                     output_hw, prepared_chain_call, run_x_to_y, uint8_grid_refusal)
from qbackend.kernels.layer_norm_quantize import layer_norm_quantize, norm_parameters_refusal
from qbackend.kernels.structs import DepthwiseCall

SCHEMAS = {
    "qconv_depthwise": "qconv_depthwise(Tensor x, int x_zero_point, Tensor weight, Tensor mult, Tensor add, int[] stride, "
                   "int[] padding, float low, float high, float out_scale, int out_zero_point, int qmin, int qmax, "
                   "bool float_out=False, str activation='none', int window=3) -> Tensor",
    # (ConvNeXt's depthwise conv, the LayerNorm over its channels and the quantize after it: uint8
    # [N, OH, OW, C], what layer_norm_quantize gives for the conv's float result seen as NHWC)
    "qconv_depthwise_layer_norm": "qconv_depthwise_layer_norm(Tensor x, int x_zero_point, Tensor weight, Tensor mult, "
                                  "Tensor add, int[] stride, int[] padding, float low, float high, str activation, "
                                  "int window, Tensor norm_weight, Tensor norm_bias, float eps, float scale, "
                                  "int zero_point, int qmin, int qmax) -> Tensor",
}


DEPTHWISE_VNNI_GROUP = 32  # channels per group of the VNNI kernel's packing (a last one may be 16): a ymm step


# Channels above which the VNNI kernel runs its zmm build where the GEMM does (64 channels a
# step): at 32 and fewer half a zmm step's lanes are empty and ymm ran faster (Sapphire Rapids,
# one thread, batch 8, SiLU, 32 channels at 112 x 112: ymm 6194 us, zmm 7092; 144 at 56 x 56:
# 6442 / 5074).
DEPTHWISE_ZMM_MIN_CHANNELS = 33


DEPTHWISE_WINDOWS = (3, 5, 7)  # square windows the kernels take


DEPTHWISE_STRIDES = (1, 2)


def _prepare_dwconv(x, x_zero_point, weight, mult, add, stride, padding, low, high, out_scale, out_zero_point,
                    qmin, qmax, float_out=False, activation="none", window=3) -> Prepared:
    """The AVX2 kernel for int16 packed weights, the VNNI one for int8 (``lowering/depthwise.py``)."""
    check_nchw_uint8(x, None, "qconv_depthwise")
    n, c, h, w = x.shape
    packed = -(-c // 16) * 16  # (the packing pads the channels with zeros)
    if activation not in ACTIVATIONS:
        raise ValueError(f"qbackend::qconv_depthwise: activation {activation!r} is not one of {list(ACTIVATIONS)}")
    if window not in DEPTHWISE_WINDOWS:
        raise ValueError(f"qbackend::qconv_depthwise: a {window}x{window} window; the kernel takes {DEPTHWISE_WINDOWS}")
    if weight.dtype == torch.int8:
        name = "qb_dwconv_vnni512_call" if isa.on_zmm() and c >= DEPTHWISE_ZMM_MIN_CHANNELS else "qb_dwconv_vnni_call"
        vnni = isa.vnni_function(name, X_TO_Y_SIGNATURE, ctypes.c_int)
        if vnni is None:
            raise ValueError(f"qbackend::qconv_depthwise: int8 weights are packed for AVX512-VNNI: {isa.vnni_unavailable()}")
        function, dtype, taps = vnni, torch.int8, window * -(-window // 4) * 4  # rows of 4-byte quads
    else:
        function = isa.c_function("qb_dwconv_call", X_TO_Y_SIGNATURE, ctypes.c_int)
        dtype, taps = torch.int16, -(-window // 2) * 2 * window  # kernel rows in pairs (a last zero one), int16
    if mult.numel() != packed:
        raise ValueError(f"qbackend::qconv_depthwise: activations of {c} channels for constants packed for {mult.numel()} "
                         f"({c} channels pack as {packed})")
    check_constants("qconv_depthwise", (weight, dtype, taps * packed), (mult, torch.float32, packed), (add, torch.float32, packed))
    oh, ow = checked_window("qconv_depthwise", h, w, (window, window), stride, padding)
    if any(s not in DEPTHWISE_STRIDES for s in stride):  # (the VNNI kernel shares a row's quads: 4 / stride columns apart)
        raise ValueError(f"qbackend::qconv_depthwise: stride {list(stride)}; the kernels take {DEPTHWISE_STRIDES}")
    check_levels("qconv_depthwise", x_zero_point, out_zero_point, qmin, qmax)
    call = DepthwiseCall(n, h, w, c, *stride, *padding, oh, ow, x_zero_point, weight.data_ptr(), mult.data_ptr(),
                         add.data_ptr(), low, high, 1.0 / out_scale, out_zero_point, qmin, qmax, ACTIVATIONS[activation],
                         bool(float_out), window)
    return make_prepared(call, (n, c, oh, ow), torch.float32 if float_out else torch.uint8, function, (mult, add))


def _dwconv_prepared(x, x_zero_point, weight, mult, add, stride, padding, low, high, out_scale, out_zero_point,
                     qmin, qmax, float_out=False, activation="none", window=3, *, trusted=False) -> Prepared:
    args = (x_zero_point, mult, add, stride, padding, low, high, out_scale, out_zero_point, qmin, qmax, float_out, activation,
            window)
    return cached_prepared(weight, trusted, x, args, lambda: _prepare_dwconv(x, x_zero_point, weight, *args[1:]))


def dwconv_layer_norm_refusal(x, weight, norm_weight, norm_bias, eps) -> Optional[str]:
    """Why qconv_depthwise_layer_norm cannot take these (tensors or fake values), None if it can."""
    if weight.dtype != torch.int8:
        return "the LayerNorm is fused into the AVX512-VNNI depthwise kernel only (int8 packed weights)"
    if x.dim() != 4 or x.shape[1] % 16:
        return f"input of shape {tuple(x.shape)}: the fused LayerNorm takes NCHW with whole groups of 16 channels"
    return norm_parameters_refusal(x.shape[1], norm_weight, norm_bias, eps)


def _dwconv_layer_norm(x, x_zero_point, weight, mult, add, stride, padding, low, high, activation, window, norm_weight,
                       norm_bias, eps, scale, zero_point, qmin, qmax, *, trusted=False):
    reason = dwconv_layer_norm_refusal(x, weight, norm_weight, norm_bias, eps) or uint8_grid_refusal(scale, zero_point, qmin, qmax)
    if reason is not None:
        raise ValueError(f"qbackend::qconv_depthwise_layer_norm: {reason}")
    norm_weight, norm_bias = norm_weight.contiguous(), norm_bias.contiguous()
    args = (x_zero_point, mult, add, stride, padding, low, high, scale, zero_point, qmin, qmax, True, activation, window)

    def prepare():
        prepared = _prepare_dwconv(x, x_zero_point, weight, *args[1:])
        prepared.struct.norm_weight, prepared.struct.norm_bias = norm_weight.data_ptr(), norm_bias.data_ptr()
        prepared.struct.norm_eps = eps
        return prepared._replace(constants=prepared.constants + (norm_weight, norm_bias))

    prepared = cached_prepared(weight, trusted, x, args + (norm_weight, norm_bias, eps), prepare)
    x = x.contiguous(memory_format=torch.channels_last)
    n, c, oh, ow = prepared.shape
    y = x.new_empty((n, oh, ow, c))
    status = prepared.function(torch.get_num_threads(), prepared.address, x.data_ptr(), y.data_ptr())
    if status < 0:
        raise MemoryError("qbackend::qconv_depthwise_layer_norm: a thread could not allocate its scratch")
    if status:  # pixels of huge, infinite or NaN values: the conv's floats, then layer_norm_quantize (ATen's statistics)
        floats = _dwconv(x, x_zero_point, weight, *args[1:], trusted=trusted)
        y = layer_norm_quantize(floats.permute(0, 2, 3, 1), norm_weight, norm_bias, eps, scale, zero_point, qmin, qmax)
    return y


def _dwconv_layer_norm_fake(x, x_zero_point, weight, mult, add, stride, padding, low, high, activation, window, *args):
    n, c, h, w = x.shape
    return x.new_empty((n, *output_hw(h, w, (window, window), stride, padding), c), dtype=torch.uint8)


def _dwconv(x, *args, trusted=False):
    return run_x_to_y(_dwconv_prepared(x, *args, trusted=trusted), x, "qconv_depthwise")


def _dwconv_fake(x, x_zero_point, weight, mult, add, stride, padding, low, high, out_scale, out_zero_point, qmin, qmax,
                 float_out=False, activation="none", window=3):
    n, c, h, w = x.shape
    shape = (n, c, *output_hw(h, w, (window, window), stride, padding))
    return channels_last_like(x, shape, torch.float32 if float_out else torch.uint8)


def qconv_depthwise(*args):
    """``qbackend::qconv_depthwise`` without the dispatcher round trip (~8 us per call, ~40% of a
    small conv's): what graphs that run eagerly call. Traced graphs need the op. Its constants
    are the lowering's own packing, so their checks (~4 us) are skipped; the activation's stay."""
    return _dwconv(*args, trusted=True)


def qconv_depthwise_layer_norm(*args):
    """``qbackend::qconv_depthwise_layer_norm`` without the dispatcher round trip (as ``qconv_depthwise``)."""
    return _dwconv_layer_norm(*args, trusted=True)


chain_call = prepared_chain_call(_dwconv_prepared, X_TO_Y)  # (qconv_depthwise's: the LayerNorm form is no step)
KERNELS = {
    "qconv_depthwise": Kernel(SCHEMAS["qconv_depthwise"], _dwconv, _dwconv_fake, qconv_depthwise),
    "qconv_depthwise_layer_norm": Kernel(SCHEMAS["qconv_depthwise_layer_norm"], _dwconv_layer_norm, _dwconv_layer_norm_fake,
                                         qconv_depthwise_layer_norm),
}
qconv_depthwise.fresh_output = qconv_depthwise_layer_norm.fresh_output = True  # (patterns/inplace.py)
