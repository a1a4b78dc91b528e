"""Weight-only quantized linears: float x, int4 / int8 weight with per-group scales.

The weight reaches the linear in one of four forms, all read into one ``GroupQuantized``:
- a ``QuantizedLinearWeight`` constant (``qbackend.quantize_weights``), used by ``linear(x, w)``,
  ``matmul(x, w.t())`` or ``x @ w.T``;
- PT2E's ``dequantize_per_channel_group(int constant, scales, zero points, ...)``;
- torchao's ``dequantize_affine(int constant, block_size [1, group], scale, zero point, ...)``;
- ``dequantize_per_channel(int8 constant, ...)`` read by a linear whose input is float.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import Node

from qbackend.quantized_tensor import QuantizedLinearWeight
from qbackend.weight_only.weight_quant import GroupQuantized

from . import examples
from .base import GraphView, Match, NearMiss, NoMatch, Rule, fake_value, require
from .qdq import is_op, per_channel_bias, transposed_source
from .qlinear import LINEAR_ANCHORS

aten = torch.ops.aten
MATMUL_TARGETS = {torch.matmul, operator.matmul, aten.matmul.default, aten.mm.default}
# integer range width -> bits (a 4-bit weight may be stored signed [-8, 7] or unsigned [0, 15])
BITS_OF_RANGE = {15: 4, 255: 8}


WEIGHT_DEQUANTIZE = ("dequantize_per_channel_group", "dequantize_affine", "dequantize_per_channel")


def is_weight_matmul(node: Node) -> bool:
    """A matmul whose right operand is a transposed constant or dequantized weight: a linear
    written by hand (x @ w.T)."""
    if node.op != "call_function" or node.target not in MATMUL_TARGETS or len(node.args) != 2:
        return False
    source = transposed_source(node.args[1])
    return isinstance(source, Node) and (source.op == "get_attr" or any(is_op(source, n, packet=True) for n in WEIGHT_DEQUANTIZE))


def _integers(graph: GraphView, node, qmin: int, qmax: int, zero_point, dtype) -> tuple[int, torch.Tensor, Optional[torch.Tensor]]:
    """(bits, signed values, signed zero points) of a constant integer weight in [qmin, qmax]."""
    values = graph.constant(node)
    require(values is not None, "weight integers are not a constant (computed or passed in at run time)")
    require(values.dim() == 2 and not values.is_floating_point(), "weight integers are not a 2-D integer tensor")
    require(dtype is None or values.dtype == dtype, f"weight integers are {values.dtype}, the dequantize says {dtype}")
    bits = BITS_OF_RANGE.get(qmax - qmin)
    require(bits is not None, f"weight range [{qmin}, {qmax}] is neither 4-bit nor 8-bit")
    # (the kernels pack the values into bits-wide fields: one outside the range would wrap)
    require(values.numel() == 0 or qmin <= int(values.min()) and int(values.max()) <= qmax,
            f"weight integers outside their range [{qmin}, {qmax}]")
    shift = -(1 << (bits - 1)) - qmin  # unsigned storage -> signed values
    zero = None
    if zero_point is not None:
        zero = graph.constant(zero_point)
        require(zero is not None, "weight zero points are not a constant")
        require(not zero.is_floating_point() and (zero.numel() == 0 or qmin <= int(zero.min()) and int(zero.max()) <= qmax),
                f"weight zero points are not integers in [{qmin}, {qmax}]")
        zero = (zero.to(torch.int16) + shift).to(torch.int8)
    return bits, (values.to(torch.int16) + shift).to(torch.int8).contiguous(), zero


def _grouped(graph: GraphView, qweight, scales, zero_points, qmin: int, qmax: int, group_size: Optional[int],
             what: str, dtype=None) -> GroupQuantized:
    """The constant weight, scales and zero points behind a dequantize (``group_size`` None:
    one group per row)."""
    scale = graph.constant(scales)
    require(scale is not None, "weight scales are not a constant")
    bits, values, zero = _integers(graph, qweight, qmin, qmax, zero_points, dtype)
    n, k = values.shape
    group_size = k if group_size is None else group_size
    require(isinstance(group_size, int) and group_size > 0 and scale.is_floating_point(),
            f"group size {group_size} or {scale.dtype} scales")
    require(k % group_size == 0, f"in_features {k} is not a multiple of the group size {group_size}")
    groups = k // group_size
    require(scale.numel() == n * groups, f"{what} scales have {scale.numel()} values, expected {n} x {groups}")
    require(zero is None or zero.numel() == n * groups, f"{what} zero points do not match the scales")
    return GroupQuantized(bits, values, scale.reshape(n, groups).float(), group_size,
                          zero_point=None if zero is None else zero.reshape(n, groups))


def _per_channel_group(graph: GraphView, node: Node) -> GroupQuantized:
    qweight, scales, zero_points, qmin, qmax, dtype, group_size = node.args[:7]
    return _grouped(graph, qweight, scales, zero_points, qmin, qmax, group_size, "dequantize_per_channel_group", dtype)


def _affine(graph: GraphView, node: Node) -> GroupQuantized:
    args = list(node.args) + [None] * (7 - len(node.args))
    qweight, block_size, scales, zero_points, _dtype, qmin, qmax = args[:7]
    qmin, qmax = node.kwargs.get("quant_min", qmin), node.kwargs.get("quant_max", qmax)
    require(qmin is not None and qmax is not None, "dequantize_affine without quant_min / quant_max")
    require(len(block_size) == 2 and block_size[0] == 1, f"block_size {list(block_size)} is not [1, group]")
    return _grouped(graph, qweight, scales, zero_points, int(qmin), int(qmax), block_size[1], "dequantize_affine")


def _per_channel_int8(graph: GraphView, node: Node) -> GroupQuantized:
    qweight, scales, zero_points, axis, qmin, qmax, dtype = (tuple(node.args) + (None,) * 7)[:7]
    require(axis == 0, f"weight is quantized along axis {axis}, not the output-channel axis")
    return _grouped(graph, qweight, scales, zero_points, qmin, qmax, None, "dequantize_per_channel", dtype)


def weight_only_weight(graph: GraphView, node, transposed: bool) -> GroupQuantized:
    """The [out, in] weight behind ``node`` (``transposed``: node is its [in, out] view)."""
    if transposed:
        node = transposed_source(node)
    value = graph.constant(node)
    if isinstance(value, QuantizedLinearWeight):
        require(not value.transposed, "the quantized weight is a transposed view ([in, out]), not [out, in]")
        return value.group_quantized()
    if is_op(node, "dequantize_per_channel_group", packet=True):
        return _per_channel_group(graph, node)
    if is_op(node, "dequantize_affine", packet=True):
        return _affine(graph, node)
    if is_op(node, "dequantize_per_channel", packet=True):
        return _per_channel_int8(graph, node)
    raise NoMatch("weight is not quantized: no dequantize or quantized weight tensor produces it")


def select_weight_only(graph: GraphView, anchor: Node, bits: int) -> Match:
    is_matmul = anchor.target in MATMUL_TARGETS
    require(not anchor.kwargs, f"arguments passed by keyword: {sorted(anchor.kwargs)}")
    x, weight_node = anchor.args[:2]
    bias = None if is_matmul or len(anchor.args) < 3 else anchor.args[2]
    x_value = fake_value(x)
    require(x_value is not None and x_value.dtype in (torch.float32, torch.bfloat16, torch.float16),
            "activation is not a float32 / bfloat16 / float16 tensor")
    require(not is_op(x, "dequantize_per_tensor"), "activation is int8-quantized (a static int8 linear rule applies)")
    weight = weight_only_weight(graph, weight_node, transposed=is_matmul)
    require(weight.bits == bits, f"weight is int{weight.bits}, not int{bits}")
    require(x_value.shape[-1] == weight.shape[1], "activation width differs from the weight's in_features")
    bias = per_channel_bias(graph, bias, weight.shape[0])
    return Match(None, anchor, (anchor,), float_input=x, bias=bias, weight_only=weight, float_dtype=x_value.dtype)


def _rule(bits: int, select_fn, example, near_misses: tuple) -> Rule:
    group = "per-group (32-256) asymmetric" if bits == 4 else "per-channel symmetric"
    return Rule(
        name=f"int{bits}_weight_linear",
        anchors="linear",
        pattern=f"linear(x_float, int{bits} weight) | matmul(x_float, int{bits} weight.t())",
        doc=f"float linear with a {group} int{bits} weight => int{bits} packed-weight matmul (weight packed once)",
        select_fn=select_fn,
        priority=0,
        example=example,
        example_is_quantized=True,
        near_misses=near_misses,
    )


def select_int4_weight_linear(graph: GraphView, anchor: Node) -> Match:
    return select_weight_only(graph, anchor, 4)


def select_int8_weight_linear(graph: GraphView, anchor: Node) -> Match:
    return select_weight_only(graph, anchor, 8)


INT4_WEIGHT_LINEAR = _rule(4, select_int4_weight_linear, examples.int4_weight_mlp, (
    NearMiss(examples.weight_only_runtime_weight, "weight integers are not a constant"),
    NearMiss(examples.int8_weight_mlp, "weight is int8, not int4"),
))
INT8_WEIGHT_LINEAR = _rule(8, select_int8_weight_linear, examples.int8_weight_mlp, (
    NearMiss(examples.float_linear, "weight is not quantized"),
    NearMiss(examples.int8_asymmetric_weight, "has no zero point (asymmetric weight)"),
))
WEIGHT_LINEAR_ANCHORS = LINEAR_ANCHORS  # plus hand-written matmuls: see is_weight_matmul
