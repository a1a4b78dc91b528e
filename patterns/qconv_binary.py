"""Residual conv: dq(x) -> conv2d -> add(., dq(acc) | acc) -> [relu] -> [q], in-place sum into acc."""
from __future__ import annotations

from torch.fx import Node

from . import examples
from .base import GraphView, Match, NearMiss, Rule, require
from .qconv import conv_core, conv_params, fold_tail
from .qdq import float_dtype
from .residual import residual_add, set_accumulator


def select_qconv_add(graph: GraphView, conv: Node) -> Match:
    require(conv_params(conv).spatial_rank == 2, "binary (residual) fusion exists only for conv2d")
    add, other = residual_add(conv)
    params, x, weight, bias = conv_core(graph, conv)
    tail, post_op, out_q = fold_tail(add)
    match = Match(None, conv, (conv, add, *tail), x, weight, bias, conv=params, post_op=post_op,
                  output_quant=out_q, float_dtype=float_dtype(add), body_end=add)
    # oneDNN's sum needs the accumulator in the output's dtype: int8 out sums the int8 residual.
    set_accumulator(graph, match, add, other, quantized=out_q is not None)
    return match


QCONV_ADD = Rule(
    name="qconv_add",
    anchors="conv",
    pattern="dq(x) -> conv2d(dq_per_channel(w_int8), bias) -> add(., dq(acc) | acc) -> [relu] -> [q]",
    doc="residual conv + add (+ relu) (+ quant) => onednn qconv binary 'sum', in place into acc when safe, else into a copy",
    select_fn=select_qconv_add,
    priority=10,
    example=examples.residual_block,
    near_misses=(
        NearMiss(examples.conv1d_add, "only for conv2d"),
        NearMiss(examples.conv_add_broadcast, "broadcasting add"),
        NearMiss(examples.conv_add_into_residual, "the in-place add writes into the residual"),
    ),
)
