"""Tensors a graph builds from fixed values by writing into a fresh one, folded at compile time.

Swin's shifted-window attention builds its window mask each call: ``x.new_zeros((H, W))``, a
``fill_`` of each of 9 regions through slice views, then view / permute / subtract /
``masked_fill``: ~30 ops of a value that depends on shapes only (with the combined attention
mask, ~1 ms a call of swin_t). ``fold_constants`` folds pure ops of constants and the writes
into what it folded (constant_writes.py); this lets it start from such a fresh tensor: a
``new_zeros`` / ``new_ones`` / ``new_full`` (its tensor argument gives dtype and device only)
whose every write, through any chain of views, takes constants and whose result no one reads,
and no view of which leaves the graph or reaches anything but ATen ops (a Python function
could write into it).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.patterns.base import constant_value, fake_value
from qbackend.patterns.inplace import schema_writes

aten = torch.ops.aten
FRESH = frozenset({aten.new_zeros.default, aten.new_ones.default, aten.new_full.default})
# the largest constant a factory or a fresh tensor folds into (cleanup.py's and this module's):
# a bigger one costs more memory than its ops cost time
MAX_ELEMENTS = 1 << 20


def is_view(node: Node) -> bool:
    """The op returns a view of an input."""
    return isinstance(node.target, torch._ops.OpOverload) and any(
        ret.alias_info is not None for ret in node.target._schema.returns)


def _constant_soon(gm: GraphModule, value) -> bool:
    """A constant, or a pure op of constants that ``fold_constants`` reaches first (a lifted
    tensor's ``lift_fresh_copy``)."""
    if not isinstance(value, Node):
        return True
    if constant_value(gm, value) is not None:
        return True
    return (value.op == "call_function" and isinstance(value.target, torch._ops.OpOverload)
            and not value.target._schema.is_mutable and all(constant_value(gm, n) is not None for n in value.all_input_nodes))


def _foldable_write(gm: GraphModule, user: Node, written: Node) -> bool:
    return (not user.users and not user.kwargs
            and all(a is written or _constant_soon(gm, a) for a in user.args))


def fresh_value(gm: GraphModule, node: Node) -> Optional[torch.Tensor]:
    """``node``'s value where it is such a fresh tensor (module docstring), else None."""
    if node.op != "call_function" or node.target not in FRESH:
        return None
    value, like = fake_value(node), fake_value(node.args[0])
    if value is None or like is None or value.numel() > MAX_ELEMENTS or value.device.type != "cpu" \
            or not all(_constant_soon(gm, a) for a in node.args[1:]):
        return None
    pending = [node]
    while pending:
        alias = pending.pop()
        for user in alias.users:
            if user.op != "call_function" or not isinstance(user.target, torch._ops.OpOverload):
                return None
            if schema_writes(user, alias):
                if not _foldable_write(gm, user, alias):
                    return None
            elif is_view(user):
                pending.append(user)
    args, kwargs = torch.fx.node.map_arg((node.args[1:], node.kwargs), lambda n: getattr(gm, n.target))
    return node.target(torch.empty(0, dtype=like.dtype), *args, **kwargs)  # (its argument's dtype; CPU, as its value)
