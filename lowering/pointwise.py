"""1x1 int8 convs and int8 linears on CPU: qbackend's own int8 GEMM kernel
(qbackend/csrc/pointwise_conv_int8.c).

torch 2.13's onednn::qconv_pointwise / qlinear_pointwise cost ~50 us per call before any
compute; a MobileNetV2 image makes 35 1x1 convs (10 with a residual add) and a 1280 -> 1000
classifier linear that takes 290 us for 1.3M multiply-adds; at BERT-base sizes (128 rows) the
kernel takes 0.80-0.85x oneDNN's time (MAX_ROWS). The kernel is a plain int8 GEMM over NHWC pixels (or linear rows)
with the requantization, a clamp or GELU post-op and a uint8 or float32 residual fused; every
other conv / linear keeps oneDNN.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.fx import Node

from qbackend import native
from qbackend.patterns.base import fake_value

from . import own_conv
from .base import EmitContext
from .capabilities import INT16_MAX
from .common import mark_sibling, record_fake_value, static_shape

aten = torch.ops.aten
# Linears with at most this many rows take the kernel. Measured against oneDNN's qlinear at
# BERT-base sizes: 0.80-0.95x its time at 128-256 rows, 1.03x at 512, 1.04-1.07x at 1024 (its
# per-call cost fades and its blocking does better).
MAX_ROWS = 256
# GELU runs in the kernel's epilogue (an AVX2 erf / tanh, error < 2e-7): post-op algorithm ->
# the kernel's activation (native.ACTIVATIONS)
GELU = {"none": "gelu", "tanh": "gelu_tanh"}


def is_1x1(match) -> bool:
    p, w = match.conv, match.weight
    return (p is not None and w is not None and p.spatial_rank == 2 and p.groups == 1 and tuple(w.int8.shape[2:]) == (1, 1)
            and list(p.stride) == [1, 1] and list(p.padding) == [0, 0])


def _largest_adjacent_pair_sum(weight: torch.Tensor) -> int:
    """max |w[o][2j]| + |w[o][2j+1]|: what the kernel's vpmaddubsw adds in int16 per unit of activation."""
    magnitudes = weight.reshape(weight.shape[0], -1, 2).to(torch.int32).abs()
    return int(magnitudes.sum(-1).amax())


def _gemm_refusal(ctx: EmitContext, match, cout: int, cin: int, int8_values) -> Optional[str]:
    if cin % 4 or cout % 8:
        return f"{cin} -> {cout} channels: the kernel takes in_channels % 4 == 0 and out_channels % 8 == 0"
    bound = match.x.qparams.qmax * _largest_adjacent_pair_sum(match.weight.int8)
    if bound > INT16_MAX:
        return f"its int16 pair sums could reach {bound} > {INT16_MAX} (8-bit weights)"
    return own_conv.refusal(ctx, match, int8_values, activations=("gelu",))


def refusal(ctx: EmitContext, match) -> Optional[str]:
    """Why this conv is not for the 1x1 kernel (None if it is)."""
    if not is_1x1(match):
        return "not a 1x1 conv with stride 1 and no padding"
    if match.accum_float is not None:
        return "the kernel adds int8 residuals only"
    residual = (match.accum.qparams,) if match.accum is not None else ()
    return _gemm_refusal(ctx, match, *match.weight.int8.shape[:2], (match.x.qparams, match.output_quant, *residual))


def is_linear(match) -> bool:
    """An int8 linear whose static input has at most MAX_ROWS rows."""
    if match.conv is not None or match.weight is None or match.weight.int8.dim() != 2:
        return False
    shape = static_shape(match.x.node)
    return shape is not None and math.prod(shape[:-1]) <= MAX_ROWS


def linear_refusal(ctx: EmitContext, match) -> Optional[str]:
    """Why this linear is not for the kernel (None if it is)."""
    if match.output_quant is None and match.float_dtype != torch.float32:
        return f"the kernel writes uint8 or float32, not {match.float_dtype}"
    if match.accum_float is not None:
        residual = fake_value(match.accum_float)
        if residual is None or residual.dtype != torch.float32:
            return f"the kernel adds uint8 or float32 residuals, not {getattr(residual, 'dtype', 'an unknown dtype')}"
        if list(residual.shape) != [*static_shape(match.x.node)[:-1], match.weight.int8.shape[0]]:
            return f"the residual's shape {list(residual.shape)} is not the output's"
    int8_values = (match.x.qparams,) + tuple(q for q in (match.output_quant, match.accum and match.accum.qparams) if q)
    return _gemm_refusal(ctx, match, *match.weight.int8.shape, int8_values)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight as [Cout/8][Cin/4][8][4]: one 32-byte load feeds 8 outputs x 4 inputs."""
    cout, cin = weight.shape[:2]
    return weight.reshape(cout // 8, 8, cin // 4, 4).permute(0, 2, 1, 3).contiguous().reshape(-1)


def _call(ctx: EmitContext, match, x: Node, residual: Optional[Node] = None, residual_scale: float = 0.0,
          shift: float = 0.0) -> Node:
    """The kernel call; ``shift`` is what a residual's zero point adds to every output."""
    out, post = match.output_quant, match.post_op
    gelu = post is not None and post.name == "gelu"
    low, high = own_conv.clamp_bounds(None if gelu else post)
    mult, add = own_conv.requantize_constants(ctx, match, shift)
    ctx.kernel = f"{native.NAMESPACE}::qconv1x1.default"
    requantize = (out.scale, out.zero_point, out.qmin, out.qmax) if out is not None else (1.0, 0, 0, 255)
    return own_conv.call_kernel(ctx, "qconv1x1", (
        x, ctx.constant(pack(match.weight.int8), "pw_w"), ctx.constant(mult.float(), "pw_mult"),
        ctx.constant(add.float(), "pw_add"), residual, residual_scale, low, high, *requantize, out is None,
        GELU[post.algorithm] if gelu else "none"))


def _int8_residual(match) -> dict:
    r = match.accum
    if r is None:
        return {}
    return dict(residual_scale=r.qparams.scale, shift=-r.qparams.zero_point * r.qparams.scale)


def emit(ctx: EmitContext, match):
    ctx.notes.append("qbackend's 1x1 conv kernel (oneDNN: ~50 us per call here)")
    return _call(ctx, match, match.x.node, match.accum and match.accum.node, **_int8_residual(match))


def emit_linear(ctx: EmitContext, match):
    """rows x in_features -> [rows, in_features, 1, 1], a 1x1 conv, and back. The output is a
    new tensor: a residual is read, never written."""
    shape, (cout, cin) = static_shape(match.x.node), match.weight.int8.shape
    rows = math.prod(shape[:-1])
    graph = ctx.gm.graph

    def as_pixels(node: Node, channels: int) -> Node:
        return record_fake_value(graph.call_function(aten.reshape.default, (node, [rows, channels, 1, 1])))

    ctx.notes.append(f"qbackend's int8 GEMM kernel ({rows} rows)")
    if match.accum_float is not None:
        residual = dict(residual=as_pixels(match.accum_float, cout), residual_scale=1.0)
    else:
        residual = dict(residual=match.accum and as_pixels(match.accum.node, cout), **_int8_residual(match))
    if residual["residual"] is not None:
        ctx.notes.append("residual added out of place")
    kernel = mark_sibling(_call(ctx, match, as_pixels(match.x.node, cin), **residual), match.anchor, match.weight)
    return graph.call_function(aten.reshape.default, (kernel, [*shape[:-1], cout]))


CONV_KERNEL = own_conv.OwnKernel("pointwise", is_1x1, refusal, emit)
LINEAR_KERNEL = own_conv.OwnKernel("linear", is_linear, linear_refusal, emit_linear)
