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
state) gets a new buffer, so no two live views are ever extended into the same rows.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node

from .attention_cleanup import reaches_only_strided_readers

aten = torch.ops.aten
CATS = frozenset({torch.cat, aten.cat.default})
_FILLED = "_qbackend_kv_filled"  # a buffer's attribute: rows written along its dim


def room_after(rows: int) -> int:
    """Rows a new buffer keeps free past ``rows``: a quarter more, at least 256 (a reallocation
    copies the cache once; this bounds that to every ~rows/4 steps, and the memory to 1.25x)."""
    return max(256, rows // 4)


def _extends(past: torch.Tensor, new: torch.Tensor, dim: int) -> Optional[torch.Tensor]:
    """The buffer ``past`` is a view of, when ``new`` fits into its room right after ``past``'s
    rows, and nothing else was written there."""
    base = past._base
    if base is None or getattr(base, _FILLED, None) is None or base.dtype != past.dtype or past.dim() != base.dim():
        return None
    filled = getattr(base, _FILLED)
    stride = base.stride(dim)
    if past.stride() != base.stride() or past.storage_offset() % stride:
        return None
    start = past.storage_offset() // stride
    if start + past.size(dim) != filled or filled + new.size(dim) > base.size(dim):
        return None
    if any(past.size(d) != base.size(d) for d in range(past.dim()) if d != dim):
        return None
    return base


def append(past: torch.Tensor, new: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.cat([past, new], dim)``, written into room after ``past`` when it has it."""
    if not (isinstance(past, torch.Tensor) and isinstance(new, torch.Tensor)) or past.requires_grad or new.requires_grad \
            or past.dtype != new.dtype or past.device != new.device or new.dim() == 0:
        return torch.cat([past, new], dim)
    if past.dim() == 1 and past.numel() == 0:  # (cat skips a 1-D empty tensor: a cache's first fill)
        past = new.narrow(dim, 0, 0)
    d = dim % new.dim() if -new.dim() <= dim < new.dim() else None
    if d is None or past.dim() != new.dim() or any(past.size(i) != new.size(i) for i in range(new.dim()) if i != d):
        return torch.cat([past, new], dim)
    rows, added = past.size(d), new.size(d)
    base = _extends(past, new, d)
    if base is None:
        shape = list(new.shape)
        shape[d] = rows + added + room_after(rows + added)
        base = torch.empty(shape, dtype=new.dtype, device=new.device)
        base.narrow(d, 0, rows).copy_(past)
        start = 0
    else:
        start = past.storage_offset() // base.stride(d)
    base.narrow(d, start + rows, added).copy_(new)
    setattr(base, _FILLED, start + rows + added)
    return base.narrow(d, start, rows + added)


append.reads_any_strides = True  # (the values it appends, whatever their layout)


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
    return bool(outputs) and reaches_only_strided_readers(inside)


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

