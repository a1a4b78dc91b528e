"""What qbackend's own kernels share as the CPU table uses them (``OwnKernel``, ``call_kernel``:
the convs, attention, the pools), and what its int8 conv / GEMM kernels (lowering/depthwise.py,
lowering/gemm.py) share besides: the requantization constants, the clamp post-op, and the
conditions on a match."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.fx import Node

from qbackend.kernels import registry
from qbackend.patterns.base import constant_value, fake_value

from .signed_int8 import nan_as


@dataclass(frozen=True)
class OwnKernel:
    """One of qbackend's own kernels as the CPU table uses it (lowering/cpu.py)."""

    name: str  # as the report says it
    applies: Callable  # match -> bool: the kind of op it is for (else it is not mentioned)
    refusal: Callable  # (ctx, match) -> why this one cannot run on it, or None
    emit: Callable  # (ctx, match) -> the node that replaces the match
    # match -> None where the kernel's fixed table says it beats oneDNN, else why not; no prior:
    # not measured against oneDNN, it always runs (lowering/choice.py)
    prior: Optional[Callable] = None


# Post-ops the kernels' epilogues run besides their clamp (vec_math.h: GELU by an erf / tanh,
# SiLU by an exp, error < 2e-7; hardswish in torch's order of operations): post-op -> the
# kernel's activation (common.ACTIVATIONS). EfficientNet's expand convs end in SiLU,
# MobileNetV3's in hardswish, MaxViT's in GELU (which oneDNN's conv does not fuse).
ACTIVATIONS = {"swish": lambda post: "swish", "hardswish": lambda post: "hardswish",
               "gelu": lambda post: {"none": "gelu", "tanh": "gelu_tanh"}[post.algorithm]}


def activation(post) -> str:
    return ACTIVATIONS[post.name](post) if post is not None and post.name in ACTIVATIONS else "none"


# post-op -> the clamp the kernels apply to the float result (hardtanh: its own bounds)
CLAMPS = {"none": (-math.inf, math.inf), "relu": (0.0, math.inf)}


def clamp_bounds(post) -> tuple[float, float]:
    name = post.name if post else "none"
    return CLAMPS[name] if name in CLAMPS else tuple(post.scalars)


def epilogue(post) -> tuple[str, float, float]:
    """(activation, low, high) of a kernel epilogue running ``post``: the activation it folds
    (then no clamp), or "none" and the post-op's clamp."""
    folded = activation(post)
    return (folded, *clamp_bounds(None if folded != "none" else post))


def refusal(ctx, match, int8_values, activations=()) -> Optional[str]:
    """Conditions every own conv kernel has: uint8 ``int8_values`` (QParams or None for float),
    a clamp post-op (or one of ``activations``), symmetric weights, a constant bias, and the
    kernels built."""
    if any(q is None or q.dtype != torch.uint8 for q in int8_values):
        return "the kernel reads and writes uint8"
    post = match.post_op.name if match.post_op else "none"
    if post not in CLAMPS and post != "hardtanh" and post not in activations:
        return f"post-op {post}: the kernel folds {' / '.join(('none', 'relu', 'hardtanh') + activations)}"
    if bool(match.weight.zero_points.any()):
        return "asymmetric weights"
    if match.bias is not None and constant_value(ctx.gm, match.bias) is None:
        return "the bias is not a constant"
    return registry.available()


def uint8_quantize_refusal(match) -> Optional[str]:
    """Why a fused float-op-and-quantize kernel cannot write this match's quantize (None if it
    can): it writes uint8, and stores a NaN as qmin, where the reference stores 0 (or the level
    lowering/signed_int8.py recorded)."""
    q = match.output_quant
    if q.dtype != torch.uint8:
        return f"the kernel writes uint8, not {q.dtype}"
    if nan_as(match.result).get("nan_as", 0) != q.qmin:
        return "the quantize stores NaN as another level than qmin"
    return None


def scale_and_offset(weight: torch.Tensor, w_scale: torch.Tensor, x_scale: float, x_zero_point: int,
                     bias: Optional[torch.Tensor] = None, shift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(mult, add) per output channel, float64: with acc = sum of x_u8 * w over the kernel
    window (padding reading the zero point), the float result is acc * mult + add, i.e.
    x_scale * w_scale * (acc - x_zero_point * sum(w)) + bias + ``shift``."""
    mult = x_scale * w_scale.double()
    add = -mult * x_zero_point * weight.reshape(weight.shape[0], -1).double().sum(1) + shift
    return mult, add if bias is None else add + bias.double()


def requantize_constants(ctx, match, shift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    x, w = match.x.qparams, match.weight
    bias = constant_value(ctx.gm, match.bias) if match.bias is not None else None
    return scale_and_offset(w.int8, w.scales, x.scale, x.zero_point, bias, shift)


def call_kernel_keeping_float(ctx, name: str, args: tuple, float_node: Node, quantize: Node) -> Node:
    """A kernel returning (uint8, float32) in place of ``float_node`` and the ``quantize`` that
    reads it: the float32 result goes to ``float_node``'s other readers; returns the uint8 one."""
    pair = call_kernel(ctx, name, args)
    quantized, value = (ctx.gm.graph.call_function(operator.getitem, (pair, i)) for i in (0, 1))
    value.meta = dict(float_node.meta)
    float_node.replace_all_uses_with(value, delete_user_cb=lambda user: user is not quantize)
    return quantized


def call_kernel(ctx, name: str, args: tuple) -> Node:
    """The kernel's call node, with the example value Dynamo records for other nodes: later
    rules read it (the next oneDNN conv prepacks for its input's shape)."""
    node = ctx.gm.graph.call_function(registry.own_kernel(name, traced=ctx.need_meta), args)
    values = [(constant_value(ctx.gm, a) if a.op == "get_attr" else fake_value(a)) if isinstance(a, Node) else a for a in args]
    if values[0] is not None:
        node.meta["example_value"] = registry.FAKES[name](*values)
    return node
