"""ShuffleNet's channel shuffle in one pass (csrc/channel_shuffle.c).

ShuffleNetV2's blocks end in ``cat([x1, branch(x2)], 1)``, then ``channel_shuffle``: a view as
[N, 2, C / 2, H, W], ``transpose(1, 2)``, ``contiguous()`` and a view back, in float (the
quantizer leaves it there). On the channels-last tensors the int8 convs write, ATen runs that
as a cat and two full copies. ``shuffles_in_one_pass`` rewrites the lowered graph's shuffles
of two groups into one kernel call that reads the two halves (the cat's inputs, or channel
slices of the tensor) and writes the shuffled channels-last tensor; what read the contiguous
5-D tensor reads a view of it instead.
"""
from __future__ import annotations

import operator
from typing import NamedTuple, Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.kernels import fast_qdq
from qbackend.kernels.channel_shuffle import kernel, shuffle_halves, shuffle_halves_quantized, shuffle_pair
from qbackend.patterns.base import fake_value


aten = torch.ops.aten
_VIEWS = (aten.reshape.default, aten.view.default)


class _Shuffle(NamedTuple):
    """A matched ``contiguous(transpose(view(x, [N, 2, half, H, W]), 1, 2))``."""
    x: Node
    half: int
    shape: list  # [N, half, 2, H, W]: the transposed view's
    transpose: Node
    view: Node


def _two_group_shuffle(node: Node) -> Optional[_Shuffle]:
    """``node`` as a two-group channel shuffle of a 4-D float32 x, or None."""
    if node.op != "call_function" or node.target is not aten.contiguous.default or len(node.args) != 1 or node.kwargs:
        return None
    transpose = node.args[0]
    if not (isinstance(transpose, Node) and transpose.target is aten.transpose.int
            and sorted(transpose.args[1:]) == [1, 2] and len(transpose.users) == 1):
        return None
    view = transpose.args[0]
    if not (isinstance(view, Node) and view.target in _VIEWS and len(view.users) == 1):
        return None
    x, shape = view.args[0], view.args[1]
    value = fake_value(x)
    if (not isinstance(value, torch.Tensor) or value.dim() != 4 or value.dtype != torch.float32 or len(shape) != 5
            or shape[1] != 2 or not isinstance(value.shape[1], int) or value.shape[1] % 2 or shape[2] != value.shape[1] // 2):
        return None
    return _Shuffle(x, value.shape[1] // 2, [shape[0], shape[2], shape[1], shape[3], shape[4]], transpose, view)


def _chunked_in_two(shuffle: Node, half: int) -> Optional[Node]:
    """The ``chunk(view(shuffle, [N, C, H, W]), 2, 1)`` that alone reads ``shuffle``, with only
    getitems reading it (ShuffleNetV2's next block splitting its input), or None."""
    if len(shuffle.users) != 1 or half % 2:
        return None
    flat = next(iter(shuffle.users))
    if flat.target not in _VIEWS or len(flat.users) != 1 or len(flat.args[1]) != 4:
        return None
    chunk = next(iter(flat.users))
    if chunk.target is not aten.chunk.default or tuple(chunk.args[1:]) not in ((2, 1), (2, -3)) or chunk.kwargs:
        return None
    return chunk if all(u.target is operator.getitem for u in chunk.users) else None


def _returned(node: Node) -> bool:
    """The graph returns ``node`` or a view of it: the caller gets the reference's layout."""
    pending = [node]
    while pending:
        users = pending.pop().users
        if any(user.op == "output" for user in users):
            return True
        pending.extend(user for user in users if user.target in _VIEWS)
    return False


def _cat_of_halves(x: Node, half: int) -> bool:
    """``x`` is ``cat([a, b], 1)`` of two ``half``-channel tensors, read only by the shuffle."""
    if x.target is not aten.cat.default or len(x.users) != 1 or len(x.args) < 2 or x.args[1] not in (1, -3):
        return False
    parts = x.args[0]
    return len(parts) == 2 and all(isinstance(v := fake_value(p), torch.Tensor) and v.shape[1] == half for p in parts)


def _second_half_quantized(pair: Node) -> list[Node]:
    """Where the second half of ``pair`` (a shuffle_halves call) is read only by a uint8
    quantize (the next block's branch), the call writes it quantized: returns the quantize,
    now unused; else []."""
    second = [user for user in pair.users if user.args[1] == 1]
    quantize = next(iter(second[0].users)) if len(second) == 1 and len(second[0].users) == 1 else None
    if quantize is None or quantize.target is not fast_qdq.quantize_per_tensor_channels_last or len(quantize.args) != 6:
        return []
    _, scale, zero_point, qmin, qmax, dtype = quantize.args
    if dtype != torch.uint8 or quantize.kwargs.get("nan_as", 0) != qmin or set(quantize.kwargs) - {"nan_as"}:
        return []
    pair.target, pair.args = shuffle_halves_quantized, (*pair.args, scale, zero_point, qmin, qmax)
    quantize.replace_all_uses_with(second[0])
    second[0].meta = dict(quantize.meta)  # (a uint8 value now)
    return [quantize]


def shuffles_in_one_pass(gm: GraphModule) -> Optional[str]:
    """Rewrite each two-group channel shuffle whose result (or a view of it) the graph does not
    return."""
    graph, rewritten = gm.graph, 0
    if kernel() is None:
        return None
    for node in list(graph.nodes):
        found = _two_group_shuffle(node)
        if found is None or _returned(node):
            continue
        x, half = found.x, found.half
        with graph.inserting_before(node):
            if _cat_of_halves(x, half):
                halves = x.args[0]
            else:
                halves = [graph.call_function(aten.slice.Tensor, (x, 1, 0, half)),
                          graph.call_function(aten.slice.Tensor, (x, 1, half, 2 * half))]
            chunk = _chunked_in_two(node, half)
            if chunk is not None:  # (its getitems read the pair of halves instead)
                pair = graph.call_function(shuffle_halves, tuple(halves))
                chunk.replace_all_uses_with(pair)
                dead = [chunk, chunk.args[0], node, found.transpose, found.view] + _second_half_quantized(pair)
            else:
                shuffled = graph.call_function(shuffle_pair, tuple(halves))
                node.replace_all_uses_with(graph.call_function(aten.view.default, (shuffled, found.shape)))
                dead = [node, found.transpose, found.view]
        for erased in dead:
            graph.erase_node(erased)
        if x.target is aten.cat.default and not x.users:
            graph.erase_node(x)
        rewritten += 1
    return f"{rewritten} channel shuffle(s) in one pass (qbackend's kernel)" if rewritten else None
