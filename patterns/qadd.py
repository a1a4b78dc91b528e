"""A float residual sum folded into the quantize after it: a + b -> q, where the sum also stays
float for later readers (ConvNeXt's block output: the next block's residual, and quantized,
its depthwise conv's input). Runs after the conv / linear rules, which fold the adds they can
into their kernels first."""
from __future__ import annotations

import torch
from torch.fx import Node

from . import examples
from .base import GraphView, Match, NearMiss, Rule, fake_value, require
from .qdq import output_quantize
from .qview import VIEW_OPS

aten = torch.ops.aten
ADD_ANCHORS = {aten.add.Tensor, aten.add_.Tensor}


def _written_only_here(target: Node, add: Node) -> bool:
    """An in-place add may become a new sum where nothing else reads what it writes into: the
    target, and each view it is of a fresh value (ConvNeXt's GEMM output, reshaped, then
    permuted), has no other reader."""
    if list(target.users) != [add]:
        return False
    while target.op == "call_function" and target.target in VIEW_OPS:
        base = target.args[0]
        if not isinstance(base, Node) or len(base.users) != 1:
            return False
        target = base
    return target.op == "call_function"


def select_qadd(graph: GraphView, add: Node) -> Match:
    require(add.target in ADD_ANCHORS and not add.kwargs and len(add.args) == 2, "not an ATen add of two tensors")
    a, b = add.args
    values = [fake_value(t) if isinstance(t, Node) else None for t in (a, b)]
    require(all(v is not None and v.dtype == torch.float32 for v in values), "not a sum of two float32 tensors")
    require(values[0].shape == values[1].shape, "operands of different shapes (a broadcast)")
    if add.target is aten.add_.Tensor:
        require(_written_only_here(a, add), "the in-place add writes into a tensor other ops read")
    quantized = output_quantize(add, only_consumer=False)
    require(quantized is not None, "the sum is not read by one quantize")
    quant, qparams = quantized
    require(not _read_before(add, quant), "a reader of the sum comes before its quantize")
    return Match(None, add, (add, quant), None, op_args=(b,), output_quant=qparams, float_source=a)


def _read_before(add: Node, quant: Node) -> bool:
    """Does a reader of ``add`` run between it and ``quant``? (The fused call takes the
    quantize's place: such a reader would see the sum before it exists.)"""
    node = add.next
    while node is not quant and node.op != "output":
        if node in add.users:
            return True
        node = node.next
    return False


QADD = Rule(
    name="qadd",
    anchors="add",
    pattern="a + b -> q (the sum may have float readers too)",
    doc="float residual add + quant => one pass writing the float sum and its int8 copy",
    select_fn=select_qadd,
    priority=0,
    example=examples.residual_sum_quantized,
    near_misses=(NearMiss(examples.broadcast_sum_quantized, "operands of different shapes"),),
)
