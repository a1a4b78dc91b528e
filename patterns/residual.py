"""The residual add shared by the binary rules: conv/linear -> add(., other), either order."""
from __future__ import annotations

import torch
from torch.fx import Node

from .base import GraphView, Match, fake_value, require
from .inplace import clobber_blocker
from .qdq import dequantized_activation, float_dtype, single_user

aten = torch.ops.aten
ADD_OPS = {aten.add.Tensor, aten.add_.Tensor}


def residual_add(anchor: Node) -> tuple[Node, Node]:
    """The add consuming ``anchor`` (in either operand order) and its other operand. An
    in-place ``add_`` (torchvision's ``out += identity``) is the same add when it writes into
    ``anchor``, whose only reader it is; one writing into the other operand is not."""
    add = single_user(anchor)
    require(add is not None and add.op == "call_function" and add.target in ADD_OPS,
            "output is not consumed by a single add")
    require(add.target != aten.add_.Tensor or add.args[0] is anchor,
            "the in-place add writes into the residual, not into this output")
    require(add.kwargs.get("alpha", 1) == 1 and len(add.args) == 2, "add has alpha != 1")
    lhs, rhs = add.args
    other = rhs if lhs is anchor else lhs
    require(isinstance(other, Node) and other is not anchor, "add does not add a tensor to the output")
    out_val, other_val = fake_value(anchor), fake_value(other)
    require(out_val is not None and other_val is not None and out_val.shape == other_val.shape,
            "residual shape differs from the output (broadcasting add)")
    return add, other


def set_accumulator(graph: GraphView, match: Match, add: Node, other: Node, quantized: bool) -> None:
    """Record the residual operand: its int8 buffer (``quantized``) or its float value, and
    whether a kernel may overwrite that buffer in place."""
    if quantized:
        match.accum = dequantized_activation(other, "residual")
        require(match.accum.qparams.dtype == match.output_quant.dtype, "residual and output integer dtypes differ")
        buffer, reader = match.accum.node, other
    else:
        require(float_dtype(other) == match.float_dtype, "residual dtype differs from the output dtype")
        match.accum_float = other
        buffer, reader = other, add
    blocker = clobber_blocker(graph, buffer, reader, match.result)
    if blocker is None and match.x is not None and match.x.node is buffer:
        # (the kernel would write its output over the input it is still reading: a 5x5 conv's
        # windows came out garbage, one run in three)
        blocker = f"{buffer.name} is also the input the kernel reads"
    match.accum_clobber_safe = blocker is None
    match.accum_clobber_reason = blocker or ""
