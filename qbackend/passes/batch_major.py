"""Before lowering: linears read and write rows in the order their neighbours keep them.

``nn.MultiheadAttention(batch_first=True)`` transposes its [B, L, E] input to [L, B, E] and its
result back. In a traced graph that is: the in-projection reads transposed rows (oneDNN copies
them first), its heads are read L-major (a head's rows 3E * B floats apart), the
out-projection reads the attention output through a permute + reshape (a copy), and its result
comes back as a transposed view, so the residual add, the LayerNorm after it and the next
residual each copy or stride (vit_b_16 at batch 8: ~1 ms a layer).

A linear is row-wise: the rows it reads, in any order, give the same rows in that order. So
- ``linear(transpose(x))``, whose result only views then attention read, becomes
  ``transpose(linear(x))`` (the attention reads the strided heads where they are);
- ``views(linear(views(a)))`` that put the rows back in an order ``a`` can give directly
  become ``linear(a.permute(...).reshape(...))``, the result in place, no view after it; at
  batch 1 too, where the transposes move no rows but hid the result from the residual add
  that reads it (vit_b_16's out-projection then adds the residual in its epilogue).
Per-tensor quantize / dequantize between the views and the linear are elementwise and move
with it. Each row still goes through the same op: the values are bit-identical.
"""
from __future__ import annotations

import itertools
import math
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.lowering.common import static_shape
from qbackend.patterns.attention import FUSED_SDPA_OPS
from qbackend.patterns.base import fake_value
from qbackend.patterns.qdq import is_op

from qbackend.passes.view_chains import VIEWS, is_view, positions, replayed, view_chain

aten = torch.ops.aten
# what lies between a projection and the attention reading it (MultiheadAttention's head split)
_HEAD_SPLIT = VIEWS | {aten.select.int, aten.slice.Tensor, aten.contiguous.default}
_LEADING_PERMUTES = {aten.transpose.int, aten.permute.default}


def _elementwise_inputs(linear: Node) -> Optional[list[Node]]:
    """The per-tensor quantize / dequantize between a linear and the rows it reads (each read
    by the next alone), input first; None when anything else is there."""
    chain, node = [], linear.args[0]
    while is_op(node, "dequantize_per_tensor") or is_op(node, "quantize_per_tensor"):
        if len(node.users) != 1 or any(isinstance(a, Node) for a in node.args[1:]) or node.kwargs:
            return None
        chain.insert(0, node)
        node = node.args[0]
    return chain


def _refaked(nodes: list[Node], replaced: dict) -> Optional[dict]:
    """The example values ``nodes`` (in graph order) get with ``replaced``'s nodes standing in
    for their arguments; None when an op refuses them."""
    values = dict(replaced)

    def value(arg):
        return values[arg] if arg in values else fake_value(arg)

    for node in nodes:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value)
        try:
            values[node] = node.target(*args, **kwargs)
        except Exception:
            return None
    return values


def _moved(gm: GraphModule, nodes: list[Node], old_input: Node, new_input: Node, values: dict) -> None:
    """``nodes`` (a chain, each read by the next) re-created reading ``new_input`` where the
    first read ``old_input``, with their ``values``; the last one's readers read the new last.
    New nodes, new names: a reference value of the old name has the old rows' order."""
    mapping = {old_input: new_input}
    for node in nodes:
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(node.target, *torch.fx.node.map_arg((node.args, node.kwargs), lambda a: mapping.get(a, a)))
        new.meta.update({key: value for key, value in node.meta.items() if key != "example_value"})
        new.meta["example_value"] = values[node]
        mapping[node] = new
    nodes[-1].replace_all_uses_with(mapping[nodes[-1]])
    for node in reversed(nodes):
        gm.graph.erase_node(node)


def _reaches_attention(node: Node) -> list[Node]:
    """The head-split views from ``node`` when every path through them ends in attention
    (in graph order); [] otherwise."""
    views, pending, seen = [], [node], set()
    while pending:
        for user in pending.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "call_function" and user.target in FUSED_SDPA_OPS:
                continue
            if not is_view(user, _HEAD_SPLIT):
                return []
            views.append(user)
            pending.append(user)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(views, key=order.__getitem__)


def _keeps_last_dim(view: Node) -> bool:
    """A transpose / permute that leaves the last dim where it is: it moves whole rows."""
    value = fake_value(view.args[0])
    if value is None or view.target not in _LEADING_PERMUTES:
        return False
    last = value.dim() - 1
    if view.target is aten.transpose.int:
        return all(d % value.dim() != last for d in view.args[1:3])
    return view.args[1][-1] % value.dim() == last


def _projection_before_transpose(gm: GraphModule, linear: Node) -> bool:
    """``linear(transpose(x))`` (quantize / dequantize between) read only by views into
    attention -> ``transpose(linear(x))``."""
    elementwise = _elementwise_inputs(linear)
    if elementwise is None:
        return False
    permute = (elementwise or [linear])[0].args[0]
    if not (is_view(permute, _LEADING_PERMUTES) and len(permute.users) == 1 and _keeps_last_dim(permute)):
        return False
    x, x_value = permute.args[0], fake_value(permute.args[0])
    if x_value is None or not x_value.is_contiguous() or fake_value(permute).is_contiguous():
        return False
    views = _reaches_attention(linear)
    if not views:
        return False
    moved = [*elementwise, linear]
    values = _refaked(moved, {permute: x_value})
    transposed_value = values and permute.target(values[linear], *permute.args[1:])
    view_values = values and _refaked(views, {linear: transposed_value})
    if view_values is None:
        return False
    with gm.graph.inserting_after(linear):
        transposed = gm.graph.call_function(permute.target, (linear, *permute.args[1:]))
    transposed.meta["example_value"] = transposed_value
    linear.replace_all_uses_with(transposed, delete_user_cb=lambda user: user is not transposed)
    _moved(gm, moved, permute, x, values)
    gm.graph.erase_node(permute)
    for view in views:
        view.meta["example_value"] = view_values[view]
    return True


def _result_views(linear: Node) -> list[Node]:
    """The views, each the previous one's only reader, after a linear read by the first alone."""
    views, node = [], linear
    while len(node.users) == 1 and is_view(next(iter(node.users))):
        node = next(iter(node.users))
        views.append(node)
    return views


def _permutation_giving(source: torch.Tensor, target: torch.Tensor) -> Optional[tuple]:
    """The dims order of ``source`` whose reshape to ``target``'s shape equals it (identity
    first), or None."""
    for order in itertools.permutations(range(source.dim())):
        candidate = source.permute(order)
        if math.prod(candidate.shape) == target.numel():
            try:
                if torch.equal(candidate.reshape(target.shape), target):
                    return order
            except RuntimeError:
                continue
    return None


def _rows_in_result_order(gm: GraphModule, linear: Node) -> bool:
    """``views(linear(views(a)))`` whose rows an order of ``a``'s dims gives as they are ->
    ``linear(a.permute(order).reshape(rows, K))``."""
    elementwise = _elementwise_inputs(linear)
    results = _result_views(linear)
    if elementwise is None or not results or len(linear.users) != 1:
        return False
    first = (elementwise or [linear])[0]
    source, reads = view_chain(first.args[0])
    out, last = fake_value(linear), results[-1]
    start = positions(source)
    if not reads or start is None or start.dim() > 5 or out is None or static_shape(last) is None:
        return False
    rows_read = replayed(reads, start)
    if rows_read is None:
        return False
    k, n = rows_read.shape[-1], out.shape[-1]
    m = rows_read.numel() // k
    element_ids = replayed(results, torch.arange(m * n, dtype=torch.int32).reshape(out.shape))
    if element_ids is None or element_ids.shape[-1] != n:
        return False
    result_rows = element_ids[..., 0].reshape(-1).floor_divide(n)
    # each result row one whole row of the linear's, its columns in order (a permute inside
    # the rows is no row order)
    if not torch.equal(element_ids.reshape(-1, n), result_rows[:, None] * n + torch.arange(n, dtype=torch.int32)):
        return False
    if torch.equal(result_rows, torch.arange(m, dtype=torch.int32)) and not any(
            view.target in _LEADING_PERMUTES for view in results):
        return False  # (rows in order, only reshapes after: nothing to gain)
    wanted = rows_read.reshape(m, k)[result_rows.long()].reshape(*element_ids.shape[:-1], k)
    order = _permutation_giving(start, wanted)
    if order is None:
        return False
    with gm.graph.inserting_before(first):
        rows = source
        if order != tuple(range(len(order))):
            rows = gm.graph.call_function(aten.permute.default, (rows, list(order)))
        rows = gm.graph.call_function(aten.reshape.default, (rows, list(wanted.shape)))
    new_views = [rows] if rows.args[0] is source else [rows.args[0], rows]
    values = _refaked(new_views, {})
    old_input = first.args[0]
    moved = [*elementwise, linear]
    values = values and _refaked(moved, {**values, old_input: values[rows]})
    if values is None or tuple(values[linear].shape) != tuple(fake_value(last).shape):
        for node in reversed(new_views):
            gm.graph.erase_node(node)
        return False
    for node in new_views:
        node.meta["example_value"] = values[node]
    last.replace_all_uses_with(linear)
    for node in reversed(results):
        gm.graph.erase_node(node)
    _moved(gm, moved, old_input, rows, values)
    for node in reversed(reads):
        if not node.users:
            gm.graph.erase_node(node)
    return True


def linears_in_row_order(gm: GraphModule) -> Optional[str]:
    """Both rewrites on every linear of the graph; a report note, None when none applied."""
    into, out_of = 0, 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.linear.default:
            if _projection_before_transpose(gm, node):  # (then ``node`` is gone: a new linear replaced it)
                into += 1
            elif _rows_in_result_order(gm, node):
                out_of += 1
    if not into + out_of:
        return None
    return (f"{into} linear(s) read their rows untransposed, {out_of} write theirs in the order read after them "
            "(batch-first MultiheadAttention: no row copies around attention)")
