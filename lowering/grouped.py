"""Grouped 3x3 int8 convs (ResNeXt's, RegNet's): qbackend's own kernel
(qbackend/kernels/csrc/grouped_conv_int8.c), timed against oneDNN per layer (lowering/choice.py).
Its AVX2 build adds product pairs in int16, which saturates for 8-bit weights: where they could,
it is packed for the exact build on int16 pairs (grouped_conv_int8_exact16.c), as the GEMM is.

oneDNN ran ResNeXt-50's grouped convs at 45-170 GMAC/s on a Zen 4 where a dense 3x3 ran at 400:
4 channels a group, 128 channels at 56x56, took 317 us a call. The kernel takes groups of 4
channels or a multiple of 8, as many outputs as inputs per group, stride 1 or 2, padding 1,
uint8 in, uint8 or float32 out (RegNetY's grouped convs feed a squeeze-excitation block in float)
after a clamp post-op.
"""
from __future__ import annotations

from typing import Optional

import torch

from qbackend.kernels import depthwise, grouped, registry

from . import gemm, own_conv
from .base import EmitContext


def is_grouped(match) -> bool:
    """A 2-D 3x3 conv of 2 or more groups that is not depthwise, no residual."""
    p, w = match.conv, match.weight
    return (p is not None and w is not None and p.spatial_rank == 2 and match.accum is None and match.accum_float is None
            and 1 < p.groups < w.int8.shape[0] and tuple(w.int8.shape[2:]) == (3, 3))


def refusal(ctx: EmitContext, match) -> Optional[str]:
    """Why this grouped conv is not for the kernel (None if it is)."""
    p, w = match.conv, match.weight
    channels, per_group = w.int8.shape[0], w.int8.shape[1]
    if channels != per_group * p.groups:
        return f"{per_group * p.groups} input channels for {channels} outputs: the kernel keeps the channel count"
    reason = grouped.grouped_refusal(channels, p.groups)
    if reason is not None:
        return reason
    if list(p.dilation) != [1, 1] or list(p.padding) != [1, 1] or p.stride[0] != p.stride[1] \
            or p.stride[0] not in depthwise.DEPTHWISE_STRIDES:
        return f"stride {p.stride}, padding {p.padding}, dilation {p.dilation}: the kernel takes stride 1-2, padding 1"
    if match.output_quant is None and match.float_dtype != torch.float32:
        return f"the kernel writes uint8 or float32, not {match.float_dtype}"
    int8_values = (match.x.qparams,) + ((match.output_quant,) if match.output_quant else ())
    return own_conv.refusal(ctx, match, int8_values)


def lane_order(channels: int, per_group: int) -> torch.Tensor:
    """The kernel's channel order: with 4 channels a group, a vector of 8 holds two groups
    interleaved (A0 B0 A1 B1 ...); else the natural order."""
    order = torch.arange(channels)
    return order.reshape(-1, 2, 4).transpose(1, 2).reshape(-1) if per_group == 4 else order


def pack(weight: torch.Tensor, mult: torch.Tensor, add: torch.Tensor,
         exact16: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[C, Cg, 3, 3] int8 -> [C / 8][9 taps][Cg / 4 quads][8 lanes][4 bytes]; ``exact16``: int16,
    [C / 8][9][Cg / 2 pairs][8][2]; mult, add in lane order."""
    channels, per_group = weight.shape[:2]
    order, word = lane_order(channels, per_group), 2 if exact16 else 4
    lanes = grouped.GROUPED_LANES
    packed = weight[order].reshape(channels // lanes, lanes, per_group // word, word, 9).permute(0, 4, 2, 1, 3)
    packed = packed.contiguous().reshape(-1)
    return packed.to(torch.int16) if exact16 else packed, mult[order].float().contiguous(), add[order].float().contiguous()


def emit(ctx: EmitContext, match):
    p, out = match.conv, match.output_quant
    low, high = own_conv.clamp_bounds(match.post_op)
    ctx.kernel = f"{registry.NAMESPACE}::qconv_grouped.default"
    ctx.notes.append("qbackend's grouped conv kernel")
    exact16 = gemm.exact16_build(ctx, match)
    weight, mult, add = pack(match.weight.int8, *own_conv.requantize_constants(ctx, match), exact16=exact16)
    requantize = (out.scale, out.zero_point, out.qmin, out.qmax) if out is not None else (1.0, 0, 0, 255, True)
    return own_conv.call_kernel(ctx, "qconv_grouped", (
        match.x.node, match.x.qparams.zero_point, ctx.constant(weight, "grouped_w"), ctx.constant(mult, "grouped_mult"),
        ctx.constant(add, "grouped_add"), p.groups, p.stride[0], low, high, *requantize))


KERNEL = own_conv.OwnKernel("grouped conv", is_grouped, refusal, emit, prior=lambda match: None)
