"""ShuffleNet's channel shuffle in one pass (csrc/channel_shuffle.c).

ShuffleNetV2's blocks end in ``cat([x1, branch(x2)], 1)``, then ``channel_shuffle``: a view as
[N, 2, C / 2, H, W], ``transpose(1, 2)``, ``contiguous()`` and a view back, in float (the
quantizer leaves it there). On the channels-last tensors the int8 convs write, ATen runs that
as a cat and two full copies. ``shuffles_in_one_pass`` rewrites the lowered graph's shuffles
of two groups into one kernel call that reads the two halves (the cat's inputs, or channel
slices of the tensor) and writes the shuffled channels-last tensor; what read the contiguous
5-D tensor reads a view of it instead. The call also takes the steps around it: a stage's first
shuffle reads a uint8 cat through a dequantize (the call reads the cat's uint8 inputs), and a
quantize of the shuffle, or of its second half, is written by the call.
"""
from __future__ import annotations

import operator
from typing import NamedTuple, Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.kernels import fast_qdq
from qbackend.kernels.channel_shuffle import kernel, shuffle_halves, shuffle_pair
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


def _quantize_taken(call: Node, value: Node, targets: tuple) -> list[Node]:
    """Where ``value`` (``call``'s result, a view of it or its second half) is read only by a
    uint8 quantize of ``targets`` that stores a NaN as qmin (the next block's branch), ``call``
    writes it quantized: returns the quantize, now unused; else []."""
    quantize = next(iter(value.users)) if len(value.users) == 1 else None
    if quantize is None or quantize.target not in targets or len(quantize.args) != 6:
        return []
    _, scale, zero_point, qmin, qmax, dtype = quantize.args
    if dtype != torch.uint8 or quantize.kwargs.get("nan_as", 0) != qmin or set(quantize.kwargs) - {"nan_as"}:
        return []
    call.args = (*call.args[:2], call.args[2] if len(call.args) > 2 else None, (scale, zero_point, qmin, qmax))
    quantize.replace_all_uses_with(value)
    value.meta = dict(quantize.meta)  # (a uint8 value now)
    return [quantize]


def _read_as_uint8(x: Node) -> tuple[Node, Optional[tuple]]:
    """(the tensor the shuffle reads, its (scale, zero point) when uint8): a uint8 tensor's
    dequantize that only the shuffle reads (a stage's first shuffle, of the cat of its two
    branches' uint8 outputs) is read as its uint8 input, the kernel dequantizing as it goes."""
    if (x.target is fast_qdq.dequantize_per_tensor and len(x.users) == 1 and not x.kwargs and len(x.args) == 6
            and x.args[5] == torch.uint8 and isinstance(x.args[0], Node)):
        return x.args[0], (x.args[1], x.args[2])
    return x, None


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
        source, dequantized = _read_as_uint8(found.x)
        half = found.half
        with graph.inserting_before(node):
            if _cat_of_halves(source, half):
                halves = source.args[0]
            else:
                halves = [graph.call_function(aten.slice.Tensor, (source, 1, 0, half)),
                          graph.call_function(aten.slice.Tensor, (source, 1, half, 2 * half))]
            args = (*halves, dequantized) if dequantized else tuple(halves)
            chunk = _chunked_in_two(node, half)
            if chunk is not None:  # (its getitems read the pair of halves instead)
                pair = graph.call_function(shuffle_halves, args)
                chunk.replace_all_uses_with(pair)
                second = [user for user in pair.users if user.args[1] == 1]
                dead = [chunk, chunk.args[0], node, found.transpose, found.view] + (
                    _quantize_taken(pair, second[0], (fast_qdq.quantize_per_tensor_channels_last,)) if len(second) == 1 else [])
            else:
                shuffled = graph.call_function(shuffle_pair, args)
                view = graph.call_function(aten.view.default, (shuffled, found.shape))
                node.replace_all_uses_with(view)
                dead = [node, found.transpose, found.view] + _quantize_taken(
                    shuffled, view, (fast_qdq.quantize_per_tensor, fast_qdq.quantize_per_tensor_channels_last))
        for erased in dead:
            graph.erase_node(erased)
        for unused in dict.fromkeys((found.x, source)):  # (the dequantize, then the cat: read by the shuffle alone)
            if unused.op == "call_function" and unused.target in (fast_qdq.dequantize_per_tensor, aten.cat.default) \
                    and not unused.users:
                graph.erase_node(unused)
        rewritten += 1
    return f"{rewritten} channel shuffle(s) in one pass (qbackend's kernel)" if rewritten else None
