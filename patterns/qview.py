"""Int8 through view ops: [dq(x) | x] -> view / reshape / flatten / permute / ... -> q.

These ops only rearrange elements, so they commute with the elementwise (de)quantize:
- dq(x) -> views -> q (same qparams) => the views on the int8 tensor x (exact, q(dq(x)) == x);
- float x -> views -> q => q(x) -> the views on the int8 result (exact): the quantize moves
  up next to x's producer, where a conv / linear / pool / cat rule can then fold it.
A chain is anchored at its first op and runs to the quantize that is its only consumer.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from . import examples
from .base import GraphView, Match, NearMiss, Rule, fake_value, require
from .qdq import dequantized_activation, is_op, quantized_output, same_qparams, single_user

aten = torch.ops.aten
# Ops that rearrange (or only relabel) elements; argument 0 is the tensor, the rest is kept.
VIEW_OPS = {
    aten.view.default, aten.reshape.default, aten.flatten.using_ints, aten.permute.default,
    aten.transpose.int, aten.squeeze.dim, aten.unsqueeze.default,
}
VIEW_ANCHORS = VIEW_OPS
DEQUANTIZE_OPS = ("dequantize_per_tensor", "dequantize_per_tensor_tensor")


def _is_view_op(node) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in VIEW_OPS


def view_chain(first: Node) -> list[Node]:
    """``first`` and the view ops after it, each the only consumer of the previous one."""
    chain = [first]
    while _is_view_op(single_user(chain[-1])) and single_user(chain[-1]).args[0] is chain[-1]:
        chain.append(single_user(chain[-1]))
    return chain


def select_qview(graph: GraphView, first: Node) -> Match:
    require(first.target in VIEW_OPS, "not an ATen view / reshape / flatten / permute call")
    source = first.args[0]
    require(not (_is_view_op(source) and single_user(source) is first),
            "inside a view chain (the chain is anchored at its first op)")
    chain = view_chain(first)
    quant = quantized_output(chain[-1], "view chain")
    nodes = (*chain, quant[0])
    if any(is_op(source, name) for name in DEQUANTIZE_OPS):
        x = dequantized_activation(source, "view input")
        same_qparams(quant[1], x.qparams, "view")
        return Match(None, first, nodes, x, op_args=tuple(chain), output_quant=quant[1])
    value = fake_value(source)
    require(value is not None and value.is_floating_point(), "view input is neither dequantized nor a float tensor")
    return Match(None, first, nodes, None, op_args=tuple(chain), output_quant=quant[1], float_source=source)


QVIEW = Rule(
    name="qview",
    anchors="view",
    pattern="(dq(x) | x) -> view / reshape / flatten / permute / transpose / [un]squeeze ... -> q",
    doc="dequant + views + quant (same qparams) => the views on the int8 tensor; float x + views + quant "
        "=> quant(x) + the views on int8, so the producer can fold the quantize (exact)",
    select_fn=select_qview,
    priority=0,
    example=examples.conv_flatten_linear,
    near_misses=(
        NearMiss(examples.flatten_requantize, "output qparams differ"),
        NearMiss(examples.view_float_consumer, "not quantized by its only consumer"),
    ),
)
