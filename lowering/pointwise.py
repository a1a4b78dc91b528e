"""1x1 int8 convs on CPU: qbackend's own kernel (qbackend/csrc/pointwise_conv_int8.c).

torch 2.13's onednn::qconv_pointwise costs ~50 us per call before any compute; a
MobileNetV2 image makes 35 1x1 convs (10 with a residual add). The kernel here is a plain int8
GEMM over NHWC pixels with the requantization, a clamp post-op and an int8 residual fused;
every other conv keeps oneDNN.
"""
from __future__ import annotations

from typing import Optional

import torch

from qbackend import native

from . import own_conv
from .base import EmitContext
from .capabilities import INT16_MAX


def is_1x1(match) -> bool:
    p, w = match.conv, match.weight
    return (p is not None and w is not None and p.spatial_rank == 2 and p.groups == 1 and tuple(w.int8.shape[2:]) == (1, 1)
            and list(p.stride) == [1, 1] and list(p.padding) == [0, 0])


def _largest_adjacent_pair_sum(weight: torch.Tensor) -> int:
    """max |w[o][2j]| + |w[o][2j+1]|: what the kernel's vpmaddubsw adds in int16 per unit of activation."""
    magnitudes = weight.reshape(weight.shape[0], -1, 2).to(torch.int32).abs()
    return int(magnitudes.sum(-1).amax())


def refusal(ctx: EmitContext, match) -> Optional[str]:
    """Why this conv is not for the 1x1 kernel (None if it is)."""
    if not is_1x1(match):
        return "not a 1x1 conv with stride 1 and no padding"
    cout, cin = match.weight.int8.shape[:2]
    if cin % 4 or cout % 8:
        return f"{cin} -> {cout} channels: the kernel takes in_channels % 4 == 0 and out_channels % 8 == 0"
    if match.accum_float is not None:
        return "the kernel adds int8 residuals only"
    bound = match.x.qparams.qmax * _largest_adjacent_pair_sum(match.weight.int8)
    if bound > INT16_MAX:
        return f"its int16 pair sums could reach {bound} > {INT16_MAX} (8-bit weights)"
    residual = (match.accum.qparams,) if match.accum is not None else ()
    return own_conv.refusal(ctx, match, (match.x.qparams, match.output_quant, *residual))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight as [Cout/8][Cin/4][8][4]: one 32-byte load feeds 8 outputs x 4 inputs."""
    cout, cin = weight.shape[:2]
    return weight.reshape(cout // 8, 8, cin // 4, 4).permute(0, 2, 1, 3).contiguous().reshape(-1)


def emit(ctx: EmitContext, match):
    out, residual = match.output_quant, match.accum
    low, high = own_conv.clamp_bounds(match.post_op)
    shift = -residual.qparams.zero_point * residual.qparams.scale if residual is not None else 0.0  # its zero point
    mult, add = own_conv.requantize_constants(ctx, match, shift)
    ctx.kernel = f"{native.NAMESPACE}::qconv1x1.default"
    ctx.notes.append("qbackend's 1x1 conv kernel (oneDNN: ~50 us per call here)")
    return own_conv.call_kernel(ctx, "qconv1x1", (
        match.x.node, ctx.constant(pack(match.weight.int8), "pw_w"), ctx.constant(mult.float(), "pw_mult"),
        ctx.constant(add.float(), "pw_add"), residual.node if residual is not None else None,
        residual.qparams.scale if residual is not None else 0.0, low, high, out.scale, out.zero_point, out.qmin, out.qmax))
