"""Unary post-ops a conv / linear rule may fold: one row per graph op.

Which post-ops a given kernel accepts is a device fact, asked by the lowering tables; this
table only says how a graph op reads as a oneDNN post-op.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.fx import Node

from .base import PostOp

aten = torch.ops.aten

# graph op -> how to read it as a PostOp (None when its arguments are not foldable)
UNARY: dict[object, Callable[[Node], Optional[PostOp]]] = {
    aten.relu.default: lambda node: PostOp("relu"),
    aten.relu_.default: lambda node: PostOp("relu"),
}


def unary_post_op(node: Node, source: Node) -> Optional[tuple[Node, PostOp]]:
    """If ``node`` is a foldable unary op applied to ``source``, its PostOp."""
    if node is None or node.op != "call_function" or node.target not in UNARY:
        return None
    if node.args[0] is not source:
        return None
    post_op = UNARY[node.target](node)
    return (node, post_op) if post_op is not None else None
