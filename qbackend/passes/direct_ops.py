"""A graph's Python-level spellings of an op rewritten to the one ATen call they make.

A decode step runs its graph right after its weights streamed through every cache (~130 MB
for benchmarks/bench_llm.py's model), so each call's Python runs cold. Measured after a 96 MB
stream, median of 100: ``F.embedding(ids, w)`` 71 us, ``torch.embedding(w, ids)`` 36 us;
``(torch.arange(1) + s).unsqueeze(0)`` 91 us, ``torch.arange(s, s + 1).unsqueeze(0)`` 42 us.
The values are the same: F.embedding without max_norm calls torch.embedding (padding_idx
touches only gradients), and arange(n) + s is arange(s, s + n) in int64 either way.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from qbackend.passes.float_ops import is_op

# F.embedding's arguments after (input, weight) whose defaults leave it one torch.embedding call
_EMBEDDING_DEFAULTS = (("padding_idx", None), ("max_norm", None), ("norm_type", 2.0), ("scale_grad_by_freq", False),
                       ("sparse", False))


def _plain_embedding(node: Node) -> bool:
    if node.op != "call_function" or node.target is not F.embedding or len(node.args) < 2:
        return False
    given = dict(zip((name for name, _ in _EMBEDDING_DEFAULTS), node.args[2:])) | dict(node.kwargs)
    return all(given.get(name, default) == default for name, default in _EMBEDDING_DEFAULTS) and \
        set(given) <= {name for name, _ in _EMBEDDING_DEFAULTS}


def _offset_arange(node: Node) -> Optional[tuple[Node, int, Node]]:
    """(arange, n, s) of ``torch.arange(n) + s`` with n a number and s an int or SymInt input."""
    if not is_op(node, "add") or node.op != "call_function" or len(node.args) != 2:
        return None
    for arange, offset in (node.args, reversed(node.args)):
        if isinstance(arange, Node) and arange.op == "call_function" and arange.target is torch.arange \
                and len(arange.args) == 1 and type(arange.args[0]) is int and set(arange.kwargs) <= {"device"} \
                and len(arange.users) == 1 and isinstance(offset, Node) \
                and isinstance(offset.meta.get("example_value", offset.meta.get("val")), (int, torch.SymInt)):
            return arange, arange.args[0], offset
    return None


def direct_ops(gm: GraphModule) -> Optional[str]:
    """Rewrite the spellings above; a note for the report (None: none found)."""
    count = 0
    for node in list(gm.graph.nodes):
        if _plain_embedding(node):
            node.target, node.args, node.kwargs = torch.embedding, (node.args[1], node.args[0]), {}
            count += 1
        elif (found := _offset_arange(node)) is not None:
            arange, n, offset = found
            with gm.graph.inserting_before(node):
                end = gm.graph.call_function(operator.add, (offset, n))
                end.meta.update({key: value + n for key, value in offset.meta.items() if key in ("example_value", "val")})
            node.target, node.args, node.kwargs = torch.arange, (offset, end), dict(arange.kwargs)
            gm.graph.erase_node(arange)
            count += 1
    return f"{count} embedding / position op(s) called as their ATen op" if count else None
