"""Quantized linear: dq(x) -> linear -> [relu] -> [q], 2-D or N-D input."""
from __future__ import annotations

import torch
from torch.fx import Node

from . import examples
from .base import GraphView, Match, NearMiss, Rule, require
from .qconv import fold_tail
from .qdq import dequantized_activation, dequantized_weight, float_dtype, per_channel_bias

aten = torch.ops.aten
LINEAR_OPS = {aten.linear.default}
LINEAR_ANCHORS = LINEAR_OPS | {torch._C._nn.linear, torch.nn.functional.linear}


def linear_core(graph: GraphView, linear: Node, dynamic: bool = False):
    """What every quantized-linear rule needs: int8 input, int8 weight, bias."""
    require(linear.target in LINEAR_OPS, "linear is not an ATen linear call (not a PT2E graph)")
    require(not linear.kwargs, f"linear arguments passed by keyword: {sorted(linear.kwargs)}")
    x = dequantized_activation(linear.args[0], dynamic=dynamic)
    weight = dequantized_weight(graph, linear.args[1])
    require(weight.int8.dim() == 2, "weight is not 2-D")
    bias = per_channel_bias(graph, linear.args[2] if len(linear.args) > 2 else None, weight.int8.shape[0])
    return x, weight, bias


def select_qlinear(graph: GraphView, linear: Node, dynamic: bool = False) -> Match:
    x, weight, bias = linear_core(graph, linear, dynamic)
    tail, post_op, out_q = fold_tail(linear)
    return Match(None, linear, (linear, *tail), x, weight, bias, post_op=post_op, output_quant=out_q,
                 float_dtype=float_dtype(linear), body_end=linear)


def select_qlinear_dynamic(graph: GraphView, linear: Node) -> Match:
    return select_qlinear(graph, linear, dynamic=True)


QLINEAR = Rule(
    name="qlinear",
    anchors="linear",
    pattern="dq(x) -> linear(dq_per_channel(w_int8), [bias]) -> [relu] -> [q]",
    doc="dequant + linear + post-op + quant => onednn qlinear (int8 or float out, weight prepacked once)",
    select_fn=select_qlinear,
    priority=0,
    example=examples.linear_relu,
    near_misses=(
        NearMiss(examples.linear_per_tensor_weight, "weight is quantized per tensor"),
        NearMiss(examples.linear_asymmetric_weight, "asymmetric weight"),
        NearMiss(examples.float_linear, "not produced by dequantize_per_tensor"),
    ),
)


QLINEAR_DYNAMIC = Rule(
    name="qlinear_dynamic",
    anchors="linear",
    pattern="choose_qparams(x) -> q.tensor -> dq.tensor -> linear(dq_per_channel(w_int8), [bias]) -> [post-op]",
    doc="dynamically quantized linear => onednn qlinear .tensor (activation scale / zero point computed per call)",
    select_fn=select_qlinear_dynamic,
    priority=0,
    example=examples.linear_relu,
    example_flags=(("is_dynamic", True),),
    near_misses=(NearMiss(examples.linear_per_tensor_weight, "activation is statically quantized"),),
)
