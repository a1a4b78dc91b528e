"""int8 convs (groups 1, kernels up to 3x3) and int8 linears on CPU: qbackend's own int8 GEMM
kernel (qbackend/kernels/csrc/conv_gemm_int8.c), with the requantization, a clamp, GELU, SiLU or
hardswish post-op and a uint8 or float32 residual fused.

torch 2.13's onednn::qconv_pointwise / qlinear_pointwise cost ~50 us per call before any
compute (a MobileNetV2 image makes 35 1x1 convs; its 1280 -> 1000 classifier took 290 us for
1.3M multiply-adds), and their AVX2 int8 kernels are slower than this one up to a few thousand
output rows. Which of the two runs a layer is measured on the compiling machine
(lowering/choice.py: oneDNN's AMX kernels beat this one 1.4-3.7x on 3x3 convs); LIMITS, where
it was faster on the CPUs measured so far, is the prior when measuring is off.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx import Node

from qbackend.kernels import common, conv_gemm, isa, registry
from qbackend.patterns.base import fake_value

from . import own_conv
from .base import EmitContext
from .capabilities import INT16_MAX
from .common import mark_sibling, record_fake_value, static_shape
from .signed_int8 import NAN_AS

aten = torch.ops.aten


@dataclass(frozen=True)
class Limits:
    """Up to where a GEMM build (isa.gemm_build) beats oneDNN: linears of at most
    ``max_rows`` rows; 1x1 convs and convs of inputs whose zero point is not 0 of at most
    ``max_conv_pixels`` output pixels; other convs (3x3 after a ReLU) of at most
    ``max_dense_macs`` multiply-adds (where oneDNN's fixed ~22 us per call weighs)."""

    max_rows: int
    max_conv_pixels: int
    max_dense_macs: int = 0


# Measured against oneDNN's qlinear / qconv (benchmarks/bench_gemm.py, docs/benchmarks_gemm.md).
# AVX2 (no VNNI: oneDNN's int8 is slow too): linears 0.80-0.95x its time at 128-256 rows,
# 1.03x at 512; 1x1 stride-2 convs 0.75x; 3x3 of inputs whose zero point is not 0 (which
# oneDNN compensates slowly) 0.78-0.97x up to 6272 pixels, 1.07x at 25088.
# AVX512-VNNI on ymm (a Zen 4 EPYC, where zmm vpdpbusd is slow; the spread is the machine's):
# linears 0.43-0.53x at 1 row, 0.66-0.70x at 8, 0.89-0.93x at 32, 0.96-1.01x at 64, 0.96-1.23x
# at 128; 1x1 convs 0.66-0.93x up to 784 pixels, 0.95-1.67x from 1568; 3x3 of inputs whose zero
# point is not 0 0.32-0.33x at 49 pixels, 0.97-0.99x at 392.
# AVX512-VNNI on zmm (a Zen 5 EPYC, 2 zmm vpdpbusd per cycle): linears 0.36-0.41x at 1 row,
# 0.63x at 8, 0.91x at 32, 0.97x at 64, 0.96-1.01x at 128; 1x1 convs 0.53-0.93x up to 784
# pixels, 1.11-1.69x from 1568 (0.92-1.32x at 3136); 3x3 of inputs whose zero point is not 0
# 0.24x at 49 pixels, 0.67x at 392.
# 3x3 convs of zero-point-0 inputs (after a ReLU): ymm 1.0-1.5x oneDNN's time, stay on oneDNN;
# zmm 0.88-1.09x at batch 1 (115M multiply-adds each: ResNet-18 at batch 1 ran 2.46-2.53 ms
# with them on the GEMM, 2.87-3.02 on oneDNN, interleaved) and 0.95-1.14x at batch 8 (925M:
# end to end no gain, 1568 output pixels and up a loss), so up to 256M multiply-adds.
# AMX (the zmm build, its 1x1 convs of stride 1 and linears of 16 rows and more on tiles; a
# Sapphire Rapids Xeon, one thread, interleaved): linears 0.79-0.82x at 32-128 rows, 0.89-1.06x
# at 197 (ViT-B's); 1x1 convs 0.62-0.72x at batch 1 (196-3136 pixels), 0.78-1.08x at batch 8;
# its 3x3 convs are the zmm build's.
LIMITS = {"avx2": Limits(max_rows=256, max_conv_pixels=8192), "avx512_vnni": Limits(max_rows=16, max_conv_pixels=1024),
          "avx512_vnni_zmm": Limits(max_rows=32, max_conv_pixels=1024, max_dense_macs=256_000_000),
          "avx512_amx": Limits(max_rows=256, max_conv_pixels=1024, max_dense_macs=256_000_000)}


def limits() -> Limits:
    return LIMITS[isa.gemm_build()]

def _conv_output_shape(match) -> Optional[list[int]]:
    shape, p = static_shape(match.x.node), match.conv
    if shape is None:
        return None
    kernel = match.weight.int8.shape[2:]
    return [shape[0], match.weight.int8.shape[0],
            *(common.conv_output_size(*args) for args in zip(shape[2:], p.stride, p.padding, kernel, p.dilation))]


def _output_pixels(match) -> Optional[int]:
    shape = _conv_output_shape(match)
    return None if shape is None else shape[0] * math.prod(shape[2:])


def is_conv(match) -> bool:
    """A 2-D int8 conv (groups 1) with a static input shape."""
    p, w = match.conv, match.weight
    return p is not None and w is not None and p.spatial_rank == 2 and p.groups == 1 and _output_pixels(match) is not None


def conv_prior(match) -> Optional[str]:
    """Why the build's LIMITS (where it was faster than oneDNN on the CPUs measured) give this
    conv to oneDNN, or None."""
    pixels, build = _output_pixels(match), isa.gemm_build()
    if math.prod(match.weight.int8.shape[2:]) > 1 and match.x.qparams.zero_point == 0:
        macs = pixels * match.weight.int8.numel()
        if macs > limits().max_dense_macs:
            return f"{macs} multiply-adds of a zero-point-0 input > {limits().max_dense_macs} in LIMITS[{build!r}]"
    elif pixels > limits().max_conv_pixels:
        return f"{pixels} output pixels > {limits().max_conv_pixels} in LIMITS[{build!r}]"
    return None


def _in_kernel_order(weight: torch.Tensor) -> torch.Tensor:
    """[Cout, Cin, KH, KW] (or [Cout, Cin]) -> [Cout, KH * KW * ceil(Cin / 4) * 4]: the order the
    kernel sums in, each kernel position's Cin padded with zero weights to whole 4-input groups."""
    by_position = weight.reshape(*weight.shape[:2], -1).permute(0, 2, 1)
    return torch.nn.functional.pad(by_position, (0, -weight.shape[1] % 4)).reshape(weight.shape[0], -1)


def pairs_of_whole_words(weight_shape) -> bool:
    """Whether a weight [out, in per group, ...] has its input channels in whole groups of 4: its
    kernel order then pairs input channels 2j, 2j + 1 at one kernel position, as oneDNN's AVX2
    convs and linears do (measured: lowering/cpu.py ``_largest_pair_sum``)."""
    return len(weight_shape) >= 2 and weight_shape[1] > 1 and weight_shape[1] % 4 == 0


def largest_pair_sums(weight: torch.Tensor) -> torch.Tensor:
    """Per output channel, the most vpmaddubsw's int16 sum of a pair (w[o][2j], w[o][2j+1] in
    the kernel's order) can reach per unit of uint8 activation: max(|w_a + w_b|, |w_a|, |w_b|)
    (activations 0..qmax: same signs add up, opposite signs never pass the larger one)."""
    as_ints = weight.to(torch.int32) if not weight.is_floating_point() else weight
    pairs = _in_kernel_order(as_ints).reshape(weight.shape[0], -1, 2)
    return torch.maximum(pairs.sum(-1).abs(), pairs.abs().amax(-1)).amax(1)


def largest_adjacent_pair_sum(weight: torch.Tensor) -> int:
    return int(largest_pair_sums(weight).amax())


def _operands_refusal(match, output_shape: list[int]) -> Optional[str]:
    """The float output and float residual the kernel takes: float32, the output's shape."""
    if match.output_quant is None and match.float_dtype != torch.float32:
        return f"the kernel writes uint8 or float32, not {match.float_dtype}"
    if match.accum_float is not None:
        residual = fake_value(match.accum_float)
        if residual is None or residual.dtype != torch.float32:
            return f"the kernel adds uint8 or float32 residuals, not {getattr(residual, 'dtype', 'an unknown dtype')}"
        if list(residual.shape) != output_shape:
            return f"the residual's shape {list(residual.shape)} is not the output's"
        if match.output_quant is not None and NAN_AS in match.result.meta:
            return "a signed int8 output run as uint8 stores a NaN as 128, the kernel as 0 (a float residual may hold one)"
    return None


def int16_pairs_refusal(match) -> Optional[str]:
    """Why the AVX2 build of a kernel summing 4-input words (the GEMM, the grouped conv) would
    saturate on this match (None where it cannot, or the VNNI build, which adds in int32, runs)."""
    if isa.int8_build() == "avx2":
        bound = match.x.qparams.qmax * largest_adjacent_pair_sum(match.weight.int8)
        if bound > INT16_MAX:
            return f"its int16 pair sums could reach {bound} > {INT16_MAX} (8-bit weights; no AVX512-VNNI here)"
    return None


def exact16_build(ctx: EmitContext, match) -> bool:
    """Whether a kernel summing 4-input words (the GEMM, the grouped conv) runs ``match`` on its
    exact int16 build (``int16_pairs_refusal``: its AVX2 build would saturate), saying so."""
    saturating = int16_pairs_refusal(match)
    if saturating is not None:
        ctx.notes.append(f"its exact int16 build, not vpmaddubsw: {saturating}")
    return saturating is not None


def _gemm_refusal(ctx: EmitContext, match) -> Optional[str]:
    int8_values = (match.x.qparams,) + tuple(q for q in (match.output_quant, match.accum and match.accum.qparams) if q)
    return own_conv.refusal(ctx, match, int8_values, activations=tuple(own_conv.ACTIVATIONS))


def refusal(ctx: EmitContext, match) -> Optional[str]:
    """Why this conv is not for the kernel (None if it is)."""
    kernel = match.weight.int8.shape[2:]
    if math.prod(kernel) > conv_gemm.MAX_TAPS:
        return f"a {'x'.join(map(str, kernel))} kernel: the kernel takes up to {conv_gemm.MAX_TAPS} positions (3x3)"
    return _operands_refusal(match, _conv_output_shape(match)) or _gemm_refusal(ctx, match)


def is_linear(match) -> bool:
    """An int8 linear with a static input shape."""
    return (match.conv is None and match.weight is not None and match.weight.int8.dim() == 2
            and static_shape(match.x.node) is not None)


def linear_prior(match) -> Optional[str]:
    """Why the build's LIMITS give this linear to oneDNN (more than max_rows rows), or None."""
    rows = math.prod(static_shape(match.x.node)[:-1])
    return f"{rows} rows > {limits().max_rows} in LIMITS[{isa.gemm_build()!r}]" if rows > limits().max_rows else None


def linear_refusal(ctx: EmitContext, match) -> Optional[str]:
    """Why this linear is not for the kernel (None if it is)."""
    output_shape = [*static_shape(match.x.node)[:-1], match.weight.int8.shape[0]]
    return _operands_refusal(match, output_shape) or _gemm_refusal(ctx, match)


def pack(weight: torch.Tensor, exact16: bool = False) -> torch.Tensor:
    """The weight as [ceil(Cout/B)][KH*KW*ceil(Cin/4)][B][4], B = conv_gemm.GEMM_BLOCK (every int8
    build; Cout and each kernel position's Cin padded with zero weights): one row feeds B outputs
    x 4 inputs, a zmm vector or two ymm ones. ``exact16``: int16 values, 2 inputs a 4-byte word
    ([..][KH*KW*ceil(Cin/4)*2][B][2]), for conv_gemm_int8_exact16.c."""
    block, ordered, word = conv_gemm.GEMM_BLOCK, _in_kernel_order(weight), 2 if exact16 else 4
    ordered = torch.nn.functional.pad(ordered, (0, 0, 0, -ordered.shape[0] % block))
    packed = ordered.reshape(ordered.shape[0] // block, block, -1, word).permute(0, 2, 1, 3).contiguous().reshape(-1)
    return packed.to(torch.int16) if exact16 else packed


def _call(ctx: EmitContext, match, x: Node, residual: Optional[Node] = None, residual_scale: float = 0.0,
          shift: float = 0.0, geometry: tuple = ()) -> Node:
    """The kernel call; ``shift`` is what a residual's zero point adds to every output;
    ``geometry``: a conv's kernel size, stride, padding, dilation and input zero point."""
    out, post = match.output_quant, match.post_op
    activation, low, high = own_conv.epilogue(post)
    mult, add = own_conv.requantize_constants(ctx, match, shift)
    ctx.kernel = f"{registry.NAMESPACE}::qconv.default"
    requantize = (out.scale, out.zero_point, out.qmin, out.qmax) if out is not None else (1.0, 0, 0, 255)
    return own_conv.call_kernel(ctx, "qconv", (
        x, ctx.constant(pack(match.weight.int8, exact16=exact16_build(ctx, match)), "gemm_w"), ctx.constant(mult.float(), "gemm_mult"),
        ctx.constant(add.float(), "gemm_add"), residual, residual_scale, low, high, *requantize, out is None,
        activation, *geometry))


def _residual(ctx: EmitContext, match, as_input=lambda node, channels: node) -> dict:
    """The residual arguments of ``_call``: float32 added as it is, uint8 dequantized (its
    zero point folded into the offset); ``as_input`` shapes the residual like the kernel's output."""
    channels = match.weight.int8.shape[0]
    if match.accum_float is not None:
        residual = dict(residual=as_input(match.accum_float, channels), residual_scale=1.0)
    elif match.accum is not None:
        q = match.accum.qparams
        residual = dict(residual=as_input(match.accum.node, channels), residual_scale=q.scale, shift=-q.zero_point * q.scale)
    else:
        return {}
    ctx.notes.append("residual added out of place")
    return residual


def emit(ctx: EmitContext, match):
    p = match.conv
    ctx.notes.append(f"qbackend's int8 GEMM kernel ({_output_pixels(match)} output pixels)")
    geometry = (tuple(match.weight.int8.shape[2:]), tuple(p.stride), tuple(p.padding), tuple(p.dilation), match.x.qparams.zero_point)
    return _call(ctx, match, match.x.node, **_residual(ctx, match), geometry=geometry)


def emit_linear(ctx: EmitContext, match):
    """rows x in_features -> [rows, in_features, 1, 1], a 1x1 conv, and back. The output is a
    new tensor: a residual is read, never written."""
    shape, (cout, cin) = static_shape(match.x.node), match.weight.int8.shape
    rows = math.prod(shape[:-1])
    graph = ctx.gm.graph

    def as_pixels(node: Node, channels: int) -> Node:
        return record_fake_value(graph.call_function(aten.reshape.default, (node, [rows, channels, 1, 1])))

    ctx.notes.append(f"qbackend's int8 GEMM kernel ({rows} rows)")
    kernel = mark_sibling(_call(ctx, match, as_pixels(match.x.node, cin), **_residual(ctx, match, as_pixels)),
                          match.anchor, match.weight)
    return graph.call_function(aten.reshape.default, (kernel, [*shape[:-1], cout]))


CONV_KERNEL = own_conv.OwnKernel("conv", is_conv, refusal, emit, prior=conv_prior)
LINEAR_KERNEL = own_conv.OwnKernel("linear", is_linear, linear_refusal, emit_linear, prior=linear_prior)
