"""Shared quantize / dequantize sub-patterns, written once for every rule."""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Node

from qbackend.ops import graph_op
from qbackend.quantized_tensor import QuantizedLinearWeight

from .base import GraphView, NoMatch, QParams, QuantizedValue, QuantizedWeight, fake_value, require

# The integer range each activation dtype must use for the kernels to read it as-is: the
# oneDNN int8 kernels saturate to the full range of their output type.
FULL_RANGE = {torch.uint8: (0, 255), torch.int8: (-128, 127)}
SMALLEST_SCALE = torch.finfo(torch.float32).tiny  # (a smaller one's float32 inverse is infinite)


def is_op(node, name: str, packet: bool = False) -> bool:
    """``node`` calls the PT2E op ``name``; with ``packet``, also through its packet when that
    has one overload (Dynamo records ``torch.ops.torchao.dequantize_affine(...)`` as written)."""
    op = graph_op(name)
    if op is None or not isinstance(node, Node) or node.op != "call_function":
        return False
    return node.target is op or (packet and node.target is op.overloadpacket and len(op.overloadpacket.overloads()) == 1)


def _per_tensor_qparams(node: Node, what: str) -> QParams:
    """QParams of a per-tensor q/dq node: Python scalars (static), or graph nodes computed
    at run time (dynamic quantization: choose_qparams -> q.tensor -> dq.tensor)."""
    _, scale, zero_point, qmin, qmax, dtype = node.args[:6]
    static = isinstance(scale, float) and isinstance(zero_point, int)
    require(static or (isinstance(scale, Node) and isinstance(zero_point, Node)),
            f"{what} scale / zero point are neither constants nor tensors")
    require(dtype in FULL_RANGE, f"{what} dtype {dtype} is not uint8/int8")
    low, high = FULL_RANGE[dtype]
    # A reduced range (reduce_range=True: uint8 [0, 127]) reads the same; a kernel writing
    # it clamps its output to [qmin, qmax] (lowering/common.py).
    require(low <= qmin < qmax <= high, f"{what} range [{qmin}, {qmax}] is not within the {dtype} range {FULL_RANGE[dtype]}")
    if static:  # (what a kernel divides by, as a float32 inverse, and adds: a graph from a file may hold anything)
        require(SMALLEST_SCALE <= scale < float("inf") and qmin <= zero_point <= qmax,
                f"{what} scale {scale} / zero point {zero_point}: not a normal positive float32 scale and a zero point in range")
    return QParams(float(scale) if static else scale, int(zero_point) if static else zero_point, qmin, qmax, dtype)


def dequantized_activation(node, what: str = "activation", dynamic: bool = False) -> QuantizedValue:
    """x = dequantize_per_tensor(q, scale, zp, qmin, qmax, dtype) -> (q, qparams); with
    ``dynamic`` the .tensor form whose scale / zero point are computed at run time."""
    expected, other = ("dequantize_per_tensor_tensor", "dequantize_per_tensor") if dynamic else \
        ("dequantize_per_tensor", "dequantize_per_tensor_tensor")
    require(not is_op(node, other), f"{what} is {'statically' if dynamic else 'dynamically'} quantized")
    require(is_op(node, expected), f"{what} is not produced by {expected}")
    return QuantizedValue(node.args[0], _per_tensor_qparams(node, what))


def dequantized_weight(graph: GraphView, node, out_channels_axis: int = 0) -> QuantizedWeight:
    """w = dequantize_per_channel(int8 constant, scales, zero points, axis 0, -128, 127, int8)."""
    if is_op(node, "dequantize_per_tensor"):
        require(False, "weight is quantized per tensor; the rule needs per-channel symmetric int8 weights")
    require(is_op(node, "dequantize_per_channel"), "weight is not produced by dequantize_per_channel")
    qweight, scales, zero_points, axis, qmin, qmax, dtype = node.args[:7]
    int8 = graph.constant(qweight)
    require(int8 is not None, "weight is not a constant (it is computed or passed in at run time)")
    scales_t, zero_points_t = graph.constant(scales), graph.constant(zero_points)
    require(scales_t is not None and zero_points_t is not None, "weight scales / zero points are not constants")
    require(dtype == torch.int8 and int8.dtype == torch.int8, f"weight dtype is {dtype}, not int8")
    require(-128 <= qmin < qmax <= 127, f"weight range [{qmin}, {qmax}] is not within [-128, 127]")  # 7-bit: [-64, 63]
    require(axis == out_channels_axis, f"weight is quantized along axis {axis}, not the output-channel axis")
    channels = int8.shape[axis] if int8.dim() > axis else -1
    require(scales_t.shape == zero_points_t.shape == (channels,) and scales_t.is_floating_point(),
            f"weight scales {list(scales_t.shape)} / zero points {list(zero_points_t.shape)}: not one per output channel")
    require(bool(((scales_t >= SMALLEST_SCALE) & scales_t.isfinite()).all()), "weight scales are not all normal positive floats")
    require(bool((zero_points_t == 0).all()), "weight zero points are not all 0 (asymmetric weight)")
    return QuantizedWeight(int8, scales_t.to(torch.float32), zero_points_t)


def per_channel_bias(graph: GraphView, bias, channels: int) -> Optional[Node]:
    """``bias`` if it is None or a float tensor of one value per output channel."""
    if bias is None:
        return None
    require(isinstance(bias, Node), "bias is not a tensor")
    value = graph.constant(bias)
    value = value if value is not None else fake_value(bias)
    require(value is not None and value.is_floating_point() and tuple(value.shape) == (channels,),
            f"bias of shape {list(value.shape) if value is not None else '?'} for {channels} output channels")
    return bias


def transposed_source(node) -> Optional[Node]:
    """``w`` when ``node`` is a 2-D transpose of it (w.t(), w.T, permute(1, 0), transpose(0, 1))."""
    if not isinstance(node, Node) or node.op not in ("call_function", "call_method") or not node.args:
        return None
    target, rest = node.target, tuple(node.args[1:])
    if target in ("t", torch.t, torch.ops.aten.t.default) and not rest:
        return node.args[0]
    if target is getattr and rest == ("T",):
        return node.args[0]
    if target in ("permute", torch.permute, torch.ops.aten.permute.default):
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
        return node.args[0] if tuple(dims) in ((1, 0), (-1, -2), (1, -2), (-1, 0)) else None
    if target in ("transpose", torch.transpose, torch.ops.aten.transpose.int) and len(rest) == 2:
        return node.args[0] if {rest[0] % 2, rest[1] % 2} == {0, 1} else None
    return None


def quantized_operand(graph: GraphView, node) -> bool:
    """``node`` carries quantized values: made by a dequantize op of any flow (PT2E's, torchao's
    affine ones), or a weight-only quantized constant (``qbackend.quantize_weights``), directly or
    through a transpose (``x @ w.t()``). A conv / linear with neither operand quantized was left
    float by whoever quantized the model."""
    node = transposed_source(node) or node
    if isinstance(graph.constant(node), QuantizedLinearWeight):
        return True
    return isinstance(node, Node) and node.op == "call_function" and "dequantize" in str(node.target)


def single_user(node: Node) -> Optional[Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def output_quantize(node: Node, only_consumer: bool = True) -> Optional[tuple[Node, QParams]]:
    """The quantize that is the only consumer of ``node`` (or, not ``only_consumer``, the one
    quantize among its consumers), if it is one the kernels can fuse."""
    quants = [u for u in node.users if is_op(u, "quantize_per_tensor") and u.args[0] is node]
    user = single_user(node) if only_consumer else quants[0] if len(quants) == 1 else None
    if user is None or not is_op(user, "quantize_per_tensor") or user.args[0] is not node:
        return None  # (a dynamic quantize is never folded: its qparams depend on the output)
    try:
        return user, _per_tensor_qparams(user, "output")
    except NoMatch:
        return None


def quantized_output(node: Node, what: str) -> tuple[Node, QParams]:
    """The quantize that is ``node``'s only consumer (NoMatch if there is none)."""
    quant = output_quantize(node)
    require(quant is not None, f"{what} output is not quantized by its only consumer")
    return quant


def same_qparams(qparams: QParams, expected: QParams, what: str) -> None:
    """An op that only moves or averages int8 values is exact on the int8 tensor only when its
    output is quantized as its input was."""
    require(qparams == expected, f"output qparams differ from the input's (a requantize, not a pure int8 {what})")


def float_dtype(node: Node) -> torch.dtype:
    value = fake_value(node)
    return value.dtype if value is not None and value.is_floating_point() else torch.float32
