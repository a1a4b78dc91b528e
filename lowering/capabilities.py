"""Kernel limits, asked of the kernel rather than assumed.

torch 2.13's CPU int8 conv accepts relu for conv1d/conv2d but not conv3d, and rejects gelu
for every rank; such facts change between releases. Each question runs the real op once on
a tiny input and is cached for the process.
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch

from qbackend.ops import qconv_for_rank, resolve


def _ask(device: str, logical_ops: tuple, run) -> Optional[str]:
    """None if ``run(*ops)`` succeeds, else why not (the op is missing, or the kernel's message)."""
    resolved = [resolve(name, device) for name in logical_ops]
    missing = [r for r in resolved if not r]
    if missing:
        return missing[0].reason
    try:
        run(*(r.op for r in resolved))
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return None


def _tiny_conv(device: str, rank: int):
    """(uint8 input, int8 weight, weight scales, weight zero points) of a 1-channel conv."""
    x = torch.full((1, 1, *[3] * rank), 128, dtype=torch.uint8, device=device)
    w = torch.ones((1, 1, *[1] * rank), dtype=torch.int8, device=device)
    return x, w, torch.ones(1, device=device), torch.zeros(1, dtype=torch.int64, device=device)


def _tiny_linear(device: str):
    x = torch.full((1, 4), 128, dtype=torch.uint8, device=device)
    w = torch.ones((4, 4), dtype=torch.int8, device=device)
    return x, w, torch.ones(4, device=device), torch.zeros(4, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=None)
def conv_post_op_refusal(device: str, spatial_rank: int, attr: str, scalars: tuple, algorithm: str) -> Optional[str]:
    """None if the device's int8 conv runs ``attr`` for this rank, else the kernel's message."""
    x, w, w_scale, w_zp = _tiny_conv(device, spatial_rank)
    ones, zeros = [1] * spatial_rank, [0] * spatial_rank

    def run(qconv, prepack):
        packed = prepack(w, w_scale, 1.0, 0, ones, zeros, ones, 1, None)
        qconv(x, 1.0, 0, packed, w_scale, w_zp, None, ones, zeros, ones, 1, 1.0, 0, None, attr, list(scalars), algorithm)

    return _ask(device, (qconv_for_rank(spatial_rank), "qconv_prepack"), run)


@functools.lru_cache(maxsize=None)
def conv_binary_post_op_refusal(device: str, attr: str, scalars: tuple, algorithm: str) -> Optional[str]:
    """None if the device's int8 conv2d + sum runs unary ``attr`` after the sum."""
    x, w, w_scale, w_zp = _tiny_conv(device, 2)

    def run(qconv_binary, prepack):
        accum = torch.zeros_like(x).contiguous(memory_format=torch.channels_last)
        packed = prepack(w, w_scale, 1.0, 0, [1, 1], [0, 0], [1, 1], 1, None)
        qconv_binary(x, 1.0, 0, packed, w_scale, w_zp, accum, None, [1, 1], [0, 0], [1, 1], 1, 1.0, 0, None,
                     1.0, 0, "sum", 1.0, attr, list(scalars), algorithm)

    return _ask(device, ("qconv_binary", "qconv_prepack"), run)


@functools.lru_cache(maxsize=None)
def linear_post_op_refusal(device: str, attr: str, scalars: tuple, algorithm: str) -> Optional[str]:
    """None if the device's int8 linear runs ``attr``, else the kernel's message."""
    x, w, w_scale, w_zp = _tiny_linear(device)

    def run(qlinear, prepack):
        qlinear(x, 1.0, 0, prepack(w, None), w_scale, w_zp, None, 1.0, 0, None, attr, list(scalars), algorithm)

    return _ask(device, ("qlinear", "qlinear_prepack"), run)


@functools.lru_cache(maxsize=None)
def linear_binary_post_op_refusal(device: str, attr: str, scalars: tuple, algorithm: str,
                                  residual_dtype: torch.dtype = torch.float32,
                                  output_dtype: torch.dtype = torch.float32) -> Optional[str]:
    """None if the device's int8 linear + add runs unary ``attr`` after the add, for these
    residual / output dtypes (without avx512_bf16, oneDNN builds no matmul adding a bf16
    residual)."""
    x, w, w_scale, w_zp = _tiny_linear(device)

    def run(qlinear_binary, prepack):
        other = torch.zeros((1, 4), dtype=residual_dtype, device=device)
        qlinear_binary(x, 1.0, 0, prepack(w, None), w_scale, w_zp, other, None, 1.0, 0, output_dtype,
                       1.0, 0, "add", 1.0, attr, list(scalars), algorithm)

    return _ask(device, ("qlinear_binary", "qlinear_prepack"), run)


@functools.lru_cache(maxsize=None)
def quantized_tensor_pool_refusal(device: str) -> Optional[str]:
    """None if the device average-pools a quantized view of a uint8 tensor.

    The probe also takes torch's once-per-process deprecation warning for quantized tensors,
    which would reach users who never made one (qbackend uses them internally). It goes
    through the Python binding: from an op overload, torch prints that warning straight to
    stderr instead of raising it as a Python warning that can be filtered."""
    def run(to_quantized, int_repr):
        x = torch.full((1, 1, 2, 2), 3, dtype=torch.uint8, device=device)
        torch._make_per_tensor_quantized_tensor(x, 1.0, 0)
        int_repr(torch.ops.aten.avg_pool2d.default(to_quantized(x, 1.0, 0), [2, 2]))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _ask(device, ("to_quantized_tensor", "int_repr"), run)


INT16_MAX = 32767


@functools.lru_cache(maxsize=None)
def int8_pairs_saturate(device: str, kind: str) -> bool:
    """Whether the device's int8 ``kind`` ("conv" / "linear") kernel sums pairs of uint8 x int8
    products in int16 with saturation (x86 without VNNI: vpmaddubsw), asked with 255 x 127 over
    two input channels, whose exact pair sum 64770 does not fit. A missing op: False (nothing
    is lowered through it anyway)."""
    x = torch.full((1, 2, 1, 1) if kind == "conv" else (1, 2), 255, dtype=torch.uint8, device=device)
    w = torch.full((1, 2, 1, 1) if kind == "conv" else (1, 2), 127, dtype=torch.int8, device=device)
    scale, zp = torch.ones(1, device=device), torch.zeros(1, dtype=torch.int64, device=device)
    result = []

    def run_conv(qconv, prepack):
        packed = prepack(w, scale, 1.0, 0, [1, 1], [0, 0], [1, 1], 1, None)
        result.append(qconv(x, 1.0, 0, packed, scale, zp, None, [1, 1], [0, 0], [1, 1], 1, 1.0, 0, torch.float32,
                            "none", [], ""))

    def run_linear(qlinear, prepack):
        result.append(qlinear(x, 1.0, 0, prepack(w, None), scale, zp, None, 1.0, 0, torch.float32, "none", [], ""))

    if kind == "conv":
        _ask(device, (qconv_for_rank(2), "qconv_prepack"), run_conv)
    else:
        _ask(device, ("qlinear", "qlinear_prepack"), run_linear)
    return bool(result) and result[0].flatten()[0].item() != 2 * 255 * 127


@functools.lru_cache(maxsize=None)
def grouped_conv_inexact(device: str, per_group: int) -> bool:
    """Whether the device's int8 conv of 2 groups of ``per_group`` channels (3x3, padding 1, an
    input zero point of 3) misses the exact sums: torch 2.13's oneDNN on an AMX Xeon (family 6
    model 167) is off past the first group at 24 channels a group (probed exact there at 4, 8,
    16, 32-48; exact on Zen 4); where its pair sums saturate in int16 (``int8_pairs_saturate``:
    Zen 3) the probe's full 8-bit weights miss at every width. Unit scales and float32 out: the
    sums are integers below 2^24, exact in float32. A missing op or a refusal: False (nothing
    lowers through it)."""
    channels, zero_point = 2 * per_group, 3
    x = ((torch.arange(channels * 25).reshape(1, channels, 5, 5) * 37) % 256).to(torch.uint8)
    x = x.to(device).contiguous(memory_format=torch.channels_last)
    w = ((torch.arange(channels * per_group * 9).reshape(channels, per_group, 3, 3) * 53) % 255 - 127).to(torch.int8).to(device)
    scale, zp = torch.ones(channels, device=device), torch.zeros(channels, dtype=torch.int64, device=device)
    result = []

    def run(qconv, prepack):
        packed = prepack(w, scale, 1.0, zero_point, [1, 1], [1, 1], [1, 1], 2, x.shape)
        result.append(qconv(x, 1.0, zero_point, packed, scale, zp, None, [1, 1], [1, 1], [1, 1], 2, 1.0, 0, torch.float32,
                            "none", [], ""))

    _ask(device, (qconv_for_rank(2), "qconv_prepack"), run)
    if not result:
        return False
    exact = torch.nn.functional.conv2d(x.double() - zero_point, w.double(), None, 1, 1, 1, 2)
    return bool((result[0].double() - exact).abs().max() > 0.5)
