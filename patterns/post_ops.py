"""Unary post-ops a conv / linear rule may fold: one row per graph op.

Which post-ops a given kernel accepts is a device fact, asked by the lowering tables; this
table only says how a graph op reads as a oneDNN post-op (name, scalars, algorithm).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.fx import Node

from .base import PostOp

aten = torch.ops.aten


def _arg(node: Node, index: int, name: str, default):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _hardtanh(node: Node) -> PostOp:
    return PostOp("hardtanh", (float(_arg(node, 1, "min_val", -1.0)), float(_arg(node, 2, "max_val", 1.0))))


def _gelu(node: Node) -> Optional[PostOp]:
    approximate = _arg(node, 1, "approximate", "none")
    return PostOp("gelu", (), approximate) if approximate in ("none", "tanh") else None


def _leaky_relu(node: Node) -> PostOp:
    return PostOp("leaky_relu", (float(_arg(node, 1, "negative_slope", 0.01)),))


# graph op -> how to read it as a PostOp (None when its arguments are not foldable)
UNARY: dict[object, Callable[[Node], Optional[PostOp]]] = {
    aten.relu.default: lambda node: PostOp("relu"),
    aten.relu_.default: lambda node: PostOp("relu"),
    aten.hardtanh.default: _hardtanh,  # also nn.ReLU6: hardtanh(x, 0, 6)
    aten.hardtanh_.default: _hardtanh,
    aten.gelu.default: _gelu,
    aten.leaky_relu.default: _leaky_relu,
    aten.leaky_relu_.default: _leaky_relu,
    aten.tanh.default: lambda node: PostOp("tanh"),
    aten.hardswish.default: lambda node: PostOp("hardswish"),
    aten.hardswish_.default: lambda node: PostOp("hardswish"),
    aten.silu.default: lambda node: PostOp("swish"),
    aten.silu_.default: lambda node: PostOp("swish"),
}


def unary_post_op(node: Node, source: Node) -> Optional[tuple[Node, PostOp]]:
    """If ``node`` is a foldable unary op applied to ``source``, its PostOp."""
    if node is None or node.op != "call_function" or node.target not in UNARY:
        return None
    if not node.args or node.args[0] is not source:
        return None
    post_op = UNARY[node.target](node)
    return (node, post_op) if post_op is not None else None
