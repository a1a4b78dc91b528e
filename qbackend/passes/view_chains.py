"""After lowering: a chain of view ops (reshape, transpose, ...) that only moves a tensor's
elements back into their row-major order becomes one ``reshape``.

all-MiniLM-L6-v2's attention output went transpose -> reshape -> transpose -> reshape into the
out-projection, ~2-3 us of Python each, per layer. Whether a chain is such a reordering is
decided by running it on the integers 0 .. n - 1 in the chain's input shape: the values of a
chain of views depend on the input's values only, never on its strides, so the same holds for
any tensor the graph passes at run time (``reshape`` still copies where strides need it).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.lowering.common import static_shape

aten = torch.ops.aten

VIEWS = {aten.reshape.default, aten.view.default, aten.transpose.int, aten.permute.default, aten.unsqueeze.default,
         aten.squeeze.dim, aten.flatten.using_ints, aten.unflatten.int, aten.t.default}
MAX_ELEMENTS = 1 << 24  # (the replay's integers: 64 MB at most, once per chain at compile time)


def is_view(node, views=VIEWS) -> bool:
    """``node`` is one of ``views`` on a tensor, its other arguments constants."""
    return (isinstance(node, Node) and node.op == "call_function" and node.target in views and not node.kwargs
            and isinstance(node.args[0], Node) and not any(isinstance(a, Node) for a in node.args[1:]))


def view_chain(node, views=VIEWS) -> tuple[Node, list[Node]]:
    """(the first input that is none of ``views``, the views from it to ``node``: empty when
    ``node`` is none)."""
    chain = []
    while is_view(node, views):
        chain.insert(0, node)
        node = node.args[0]
    return node, chain


def positions(root: Node) -> Optional[torch.Tensor]:
    """0 .. n - 1 in ``root``'s static shape (None: symbolic, or over MAX_ELEMENTS): replayed
    through a chain of views, they say where each element of its result comes from."""
    shape = static_shape(root)
    if shape is None or math.prod(shape) > MAX_ELEMENTS:
        return None
    return torch.arange(math.prod(shape), dtype=torch.int32).reshape(shape)


def replayed(chain: list[Node], value: torch.Tensor) -> Optional[torch.Tensor]:
    """``value`` through the chain's ops; None where one cannot take it (a ``view`` the traced
    strides allowed and row-major ones do not)."""
    try:
        for node in chain:
            value = node.target(value, *node.args[1:])
    except RuntimeError:
        return None
    return value


def writes(user: Node) -> bool:
    """The user may write into its inputs: a mutable op schema, or an in-place name (``add_``,
    ``add_quantize_``)."""
    if isinstance(user.target, torch._ops.OpOverload):
        return user.target._schema.is_mutable
    name = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def _reorders_back(root: Node, chain: list[Node]) -> Optional[list[int]]:
    """The chain's output shape where its elements come out in the input's row-major order."""
    start = positions(root)
    value = None if start is None else replayed(chain, start)
    return list(value.shape) if value is not None and torch.equal(value.reshape(-1), start.reshape(-1)) else None


def view_chains_collapsed(gm: GraphModule) -> Optional[str]:
    """Each chain of two or more views ending in a non-view reader, whose input and views no op
    writes into (aliasing could then differ: a reshape is a view where the chain copied),
    becomes one reshape when it only restores row-major order."""
    collapsed = 0
    for end in list(gm.graph.nodes):
        if not is_view(end) or all(is_view(user) for user in end.users):
            continue
        root, chain = view_chain(end)
        if len(chain) < 2 or any(writes(user) for node in (root, *chain) for user in node.users):
            continue
        shape = _reorders_back(root, chain)
        if shape is None:
            continue
        with gm.graph.inserting_before(end):
            reshaped = gm.graph.call_function(aten.reshape.default, (root, shape))
        reshaped.meta = dict(end.meta)
        end.replace_all_uses_with(reshaped)
        collapsed += len(chain)
    return f"{collapsed} view op(s) folded into reshapes" if collapsed else None
