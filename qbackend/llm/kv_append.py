"""A KV cache's ``cat`` as an append into room kept after the cached rows.

Hugging Face's ``DynamicCache`` grows each layer's keys and values by
``torch.cat([cache, new], dim=-2)`` every decode step: a copy of the whole cache per token
(at 2048 positions, 16 MB read and written per step of a 4-layer Llama-architecture model, 2 of
its 11.7 ms). ``kv_cache_appends`` rewrites such a cat, one whose first input is a graph input
and whose result only fused attention (any strides) and the graph's output read, into
``append``: the result is a view of a buffer with room along the cat's dim, and the next
step's cat of that view writes only the new rows into the room and returns a longer view.

The values are the cat's. What may differ is only what aliasing can show: the result shares
storage with the input view (rows the input shows are never written again), so an in-place
write into the old cache tensor would show in the new one. A buffer records how far it is
filled; a view that does not end there (a cropped cache, a second branch from one cache
state) gets a new buffer, so no two live views are ever extended into the same rows. Two
threads extending one cache state at once (a shared prompt prefix, beam branches) race for
the same room: each checks it, then ``claim`` decides under a lock who takes it, and the other
gets a new buffer, as a branch does (without the lock both got views of the same rows; one
thread alone pays an uncontended acquire per append, or per chain call).

In a kernel chain (kernel_chain.py) an append whose value only attention and the graph's output
read is a C step (``chain_call``): the chain claims the room before its call (``claim``) and passes
the cached rows as a number (the program stays one while the cache grows).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.kernels.kv_append import append
from qbackend.passes.attention_cleanup import reaches_only_strided_readers


aten = torch.ops.aten
CATS = frozenset({torch.cat, aten.cat.default})


def _cat_of_graph_input(node: Node) -> Optional[tuple[Node, Node, int]]:
    """(past, new, dim) of ``cat([past, new], dim)`` whose ``past`` is a graph input."""
    if node.op != "call_function" or node.target not in CATS:
        return None
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or not isinstance(dim, int) \
            or set(node.kwargs) - {"tensors", "dim"}:
        return None
    past, new = tensors
    if not (isinstance(past, Node) and past.op == "placeholder" and isinstance(new, Node)):
        return None
    return past, new, dim


def _read_by_output_and_attention(node: Node) -> bool:
    """The cat's value leaves the graph (the cache keeps it) and, inside it, only readers that
    take any strides see it."""
    outputs = [user for user in node.users if user.op == "output"]
    inside = [user for user in node.users if user.op != "output"]
    return bool(outputs) and reaches_only_strided_readers(node, readers=inside)


def kv_cache_appends(gm: GraphModule) -> Optional[str]:
    """Rewrite each KV cache cat (see the module docstring) into ``append``."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        found = _cat_of_graph_input(node)
        if found is None or not _read_by_output_and_attention(node):
            continue
        past, new, dim = found
        node.target, node.args, node.kwargs = append, (past, new, dim), {}
        rewritten += 1
    return f"{rewritten} KV cache cat(s) append into room kept after the cache's rows" if rewritten else None
