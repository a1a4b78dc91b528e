"""Residual conv: dq(x) -> conv2d -> add(., dq(acc)) -> [relu] -> [q], in-place sum into acc."""
from __future__ import annotations

import torch
from torch.fx import Node

from . import examples
from .base import GraphView, Match, NearMiss, Rule, fake_value, require
from .inplace import clobber_blocker
from .qconv import conv_core, conv_params, fold_tail
from .qdq import dequantized_activation, float_dtype, single_user

aten = torch.ops.aten
ADD_OPS = {aten.add.Tensor}


def _residual_add(conv: Node) -> tuple[Node, Node]:
    """The add consuming the conv (in either operand order) and its other operand."""
    add = single_user(conv)
    require(add is not None and add.op == "call_function" and add.target in ADD_OPS,
            "conv output is not consumed by a single add")
    require(add.kwargs.get("alpha", 1) == 1 and len(add.args) == 2, "add has alpha != 1")
    lhs, rhs = add.args
    other = rhs if lhs is conv else lhs
    require(isinstance(other, Node) and other is not conv, "add does not add a tensor to the conv output")
    conv_val, other_val = fake_value(conv), fake_value(other)
    require(conv_val is not None and other_val is not None and conv_val.shape == other_val.shape,
            "residual shape differs from the conv output (broadcasting add)")
    return add, other


def select_qconv_add(graph: GraphView, conv: Node) -> Match:
    require(conv_params(conv).spatial_rank == 2, "binary (residual) fusion exists only for conv2d")
    add, other = _residual_add(conv)
    params, x, weight, bias = conv_core(graph, conv)
    tail, post_op, out_q = fold_tail(add)
    result = tail[-1] if tail else add
    match = Match(None, conv, (conv, add, *tail), x, weight, bias, conv=params, post_op=post_op,
                  output_quant=out_q, float_dtype=float_dtype(add), body_end=add)
    if out_q is not None:
        match.accum = dequantized_activation(other, "residual")
        require(match.accum.qparams.dtype == out_q.dtype, "residual and output integer dtypes differ")
        buffer, reader = match.accum.node, other
    else:
        require(float_dtype(other) == match.float_dtype, "residual dtype differs from the output dtype")
        match.accum_float = other
        buffer, reader = other, add
    blocker = clobber_blocker(graph, buffer, reader, result)
    match.accum_clobber_safe = blocker is None
    match.accum_clobber_reason = blocker or ""
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
    ),
)
