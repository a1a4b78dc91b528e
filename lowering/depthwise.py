"""Depthwise 3x3 int8 convs on CPU: qbackend's own kernel (qbackend/csrc/depthwise_conv_int8.c).

torch 2.13's onednn::qconv_pointwise costs ~50 us per call before any compute and runs
depthwise 3x3 convs at 3-11 GMAC/s on this AVX2 machine: 100 us for a 384-channel 14x14 layer,
320 us for 32 channels at 112x112. The kernel here takes the common MobileNet-style case
(int8 in, int8 out, clamp post-ops); every other conv keeps oneDNN.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from qbackend import native
from qbackend.patterns.base import constant_value

from .base import EmitContext

LANES = 16  # channels per vector step of the kernel
MAX_CHANNELS = 1 << 14  # the kernel keeps a row of zero-point bytes per channel on its stack
CLAMPS = {"none", "relu", "hardtanh"}  # the post-ops the kernel folds (as one clamp)


def is_depthwise_3x3(match) -> bool:
    """A 2-D conv with one input channel per group, multiplier 1, 3x3 kernel, no residual."""
    p, w = match.conv, match.weight
    return (p is not None and w is not None and p.spatial_rank == 2 and match.accum is None and match.accum_float is None
            and p.groups == w.int8.shape[0] and tuple(w.int8.shape[1:]) == (1, 3, 3))


def refusal(ctx: EmitContext, match) -> Optional[str]:
    """Why this conv is not for the depthwise kernel (None if it is)."""
    if not is_depthwise_3x3(match):
        return "not a depthwise 3x3 conv"
    p, w = match.conv, match.weight
    channels = w.int8.shape[0]
    if list(p.dilation) != [1, 1] or any(s not in (1, 2) for s in p.stride) or any(q not in (0, 1) for q in p.padding):
        return f"stride {p.stride}, padding {p.padding}, dilation {p.dilation}: the kernel takes stride 1-2, padding 0-1"
    if channels % LANES or channels > MAX_CHANNELS:
        return f"{channels} channels: the kernel takes a multiple of {LANES} up to {MAX_CHANNELS}"
    if match.x.qparams.dtype != torch.uint8 or match.output_quant is None or match.output_quant.dtype != torch.uint8:
        return "the kernel reads and writes uint8"
    if (match.post_op.name if match.post_op else "none") not in CLAMPS:
        return f"post-op {match.post_op.name}: the kernel folds none / relu / hardtanh"
    if bool(w.zero_points.any()):
        return "asymmetric weights"
    if match.bias is not None and constant_value(ctx.gm, match.bias) is None:
        return "the bias is not a constant"
    return native.available()


def pack(weight: torch.Tensor, w_scale: torch.Tensor, x_scale: float, x_zero_point: int,
         bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int16 weight pairs, per-channel multiplier, per-channel addend) in the kernel's order.

    acc = sum over the 9 taps of x_u8 * w (padding reads the zero point), so
    y = x_scale * w_scale * (acc - x_zero_point * sum(w)) + bias = acc * mult + add."""
    channels = weight.shape[0]
    groups = channels // LANES
    taps = torch.nn.functional.pad(weight.reshape(channels, 9).to(torch.int16), (0, 1))  # a 10th, zero tap
    # channel = 16 g + 8 half + 4 part + i with part 0 -> "lo" sums, 1 -> "hi" (vpunpck order)
    pairs = taps.reshape(groups, 2, 2, 4, 5, 2).permute(4, 0, 2, 1, 3, 5).contiguous()
    mult = x_scale * w_scale.double()
    add = -mult * x_zero_point * weight.reshape(channels, 9).double().sum(1)
    if bias is not None:
        add = add + bias.double()
    order = lambda v: v.float().reshape(groups, 2, 2, 4).permute(0, 2, 1, 3).contiguous().reshape(-1)  # noqa: E731
    return pairs.reshape(-1), order(mult), order(add)


def emit(ctx: EmitContext, match):
    p, x, out = match.conv, match.x.qparams, match.output_quant
    post = match.post_op
    low, high = {"none": (-math.inf, math.inf), "relu": (0.0, math.inf)}.get(post.name if post else "none",
                                                                            tuple(post.scalars) if post else ())
    bias = constant_value(ctx.gm, match.bias) if match.bias is not None else None
    weight, mult, add = pack(match.weight.int8, match.weight.scales, x.scale, x.zero_point, bias)
    op = native.conv_kernel("qconv_dw3x3", traced=ctx.need_meta)
    ctx.kernel = f"{native.NAMESPACE}::qconv_dw3x3.default"
    ctx.notes.append("qbackend's depthwise kernel (oneDNN: ~50 us per call, 3-11 GMAC/s here)")
    return ctx.gm.graph.call_function(op, (
        match.x.node, x.zero_point, ctx.constant(weight, "dw_w"), ctx.constant(mult, "dw_mult"), ctx.constant(add, "dw_add"),
        list(p.stride), list(p.padding), low, high, out.scale, out.zero_point, out.qmin, out.qmax))
