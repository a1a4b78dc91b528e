"""Residual linear: dq(x) -> linear -> add(., other) -> [relu] -> [q] (transformer residuals)."""
from __future__ import annotations

from torch.fx import Node

from . import examples
from .base import GraphView, Match, NearMiss, Rule
from .qconv import fold_tail
from .qdq import float_dtype
from .qlinear import linear_core
from .residual import residual_add, set_accumulator


def select_qlinear_add(graph: GraphView, linear: Node, dynamic: bool = False) -> Match:
    add, other = residual_add(linear)
    x, weight, bias = linear_core(graph, linear, dynamic)
    tail, post_op, out_q = fold_tail(add)
    match = Match(None, linear, (linear, add, *tail), x, weight, bias, post_op=post_op,
                  output_quant=out_q, float_dtype=float_dtype(add), body_end=add)
    # The linear kernel adds a float residual for any output dtype (out of place, or in place
    # into a dead float accumulator).
    set_accumulator(graph, match, add, other, quantized=False)
    return match


def select_qlinear_add_dynamic(graph: GraphView, linear: Node) -> Match:
    return select_qlinear_add(graph, linear, dynamic=True)


QLINEAR_ADD = Rule(
    name="qlinear_add",
    anchors="linear",
    pattern="dq(x) -> linear(dq_per_channel(w_int8), [bias]) -> add(., other) -> [relu] -> [q]",
    doc="linear + residual add (+ relu) (+ quant) => onednn qlinear binary: 'sum' in place into a dead float residual, else 'add'",
    select_fn=select_qlinear_add,
    priority=10,
    example=examples.linear_residual,
    near_misses=(NearMiss(examples.linear_add_broadcast, "broadcasting add"),),
)


QLINEAR_ADD_DYNAMIC = Rule(
    name="qlinear_add_dynamic",
    anchors="linear",
    pattern="choose_qparams(x) -> q.tensor -> dq.tensor -> linear(dq_per_channel(w_int8), [bias]) -> add(., other) -> [relu]",
    doc="dynamically quantized linear + residual add => onednn qlinear .binary_tensor (scale / zero point computed per call)",
    select_fn=select_qlinear_add_dynamic,
    priority=10,
    example=examples.linear_residual,
    example_flags=(("is_dynamic", True),),
    near_misses=(NearMiss(examples.static_linear_residual, "activation is statically quantized"),),
)
