"""Float attention: matmul(q, k^T) -> [/ c | * c] -> [+ mask] -> softmax -> matmul(., v), and
the fused ``scaled_dot_product_attention`` call.

X86InductorQuantizer leaves attention in float. Written out, it runs as two batched matmuls on
transposed views plus a softmax over a materialised [B, H, L, S] score tensor; fused
scaled-dot-product attention reads q, k, v once (Inductor fuses the same pattern). A fused
call is matched too: torch's CPU kernel reads each key / value head once per query head
(grouped-query attention: 8 times in a Llama decode step) and runs dense heads slower than
qbackend's (lowering/attention.py).
"""
from __future__ import annotations

import numbers
from typing import Callable, NamedTuple

import torch
from torch.fx import Node

from . import examples
from .base import GraphView, Match, NearMiss, Rule, fake_value, require
from .qdq import single_user

aten = torch.ops.aten
SOFTMAX_OPS = {aten.softmax.int, aten._softmax.default}
FUSED_SDPA_OPS = frozenset({aten.scaled_dot_product_attention.default, torch.nn.functional.scaled_dot_product_attention})
ANY_SOFTMAX = frozenset(SOFTMAX_OPS | {torch.softmax, torch.nn.functional.softmax})
ATTENTION_ANCHORS = ANY_SOFTMAX | FUSED_SDPA_OPS
SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
MATMUL_OPS = {aten.matmul.default}
VIEW_OPS = {aten.view.default, aten.reshape.default}
SCORE_OPS = {aten.div.Tensor, aten.mul.Tensor, *MATMUL_OPS}  # (the scores, maybe scaled)


class WindowedMask(NamedTuple):
    """Swin's shifted-window attention adds two masks with a view between them:
    ``view(view(scores + bias, windowed) + windows, scores' shape)``. As one additive mask of the
    scores' shape (``combined``), each score gets ``bias + windows``: the same sums in another
    order (exactly the same where ``windows`` is 0, as off its masked positions)."""

    bias: Node  # broadcasts to the scores
    windows: Node  # broadcasts to the windowed view
    windowed: tuple  # the view's shape


class ScaledQueries(NamedTuple):
    """Scores multiplied by a tensor of one value per batch / head (Swin V2's logit scale): the
    queries multiplied by it instead, ``(q * factor) k^T`` for ``(q k^T) * factor`` (each score
    rounded once more: ~1e-7 of its value)."""

    queries: Node
    factor: Node


def combined(mask: WindowedMask, scores_shape, make: Callable):
    """``mask`` as one tensor of ``scores_shape``, ``make(target, *args)`` making each step (a
    graph node, or a value)."""
    windowed = make(aten.reshape.default, make(aten.expand.default, mask.bias, list(scores_shape)), list(mask.windowed))
    return make(aten.reshape.default, make(aten.add.Tensor, windowed, mask.windows), list(scores_shape))


def _calls(node, targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _only_feeds(node: Node, consumer: Node, what: str) -> None:
    require(single_user(node) is consumer, f"{what} is also read elsewhere (it would have to be materialised)")


def _transposed_last_two(node) -> Node:
    """``k`` for ``k.transpose(-2, -1)`` (any spelling of the last two dims)."""
    require(_calls(node, {aten.transpose.int}), "the key operand is not a transpose of the keys")
    rank = fake_value(node.args[0]).dim()
    require({d % rank for d in node.args[1:3]} == {rank - 2, rank - 1}, "the key transpose is not over the last two dims")
    return node.args[0]


def _float_mask(mask, like: Node, what: str) -> None:
    require(isinstance(mask, Node) and fake_value(mask) is not None, f"the {what} is not a tensor")
    require(fake_value(mask).dtype == fake_value(like).dtype, f"the {what} is not an additive float mask")


def _unscaled(operand, reader: Node) -> tuple:
    """``(x, c)`` for an operand ``x * c`` (a number) that only ``reader`` reads, else
    ``(operand, 1.0)``: the factor joins the attention's scale, ``(q k^T) c`` for ``q (k c)^T``
    (each score rounded once more: ~1e-7 of its value). MaxViT scales its keys."""
    if _calls(operand, {aten.mul.Tensor}) and single_user(operand) is reader:
        x, factor = operand.args[:2]
        if isinstance(factor, Node):
            x, factor = factor, x
        if isinstance(x, Node) and isinstance(factor, numbers.Real) and not isinstance(factor, bool) and factor != 0:
            return x, float(factor)
    return operand, 1.0


def _windowed_mask(view: Node, softmax: Node) -> tuple[Node, list, WindowedMask]:
    """(the scores, the nodes from their add to ``view``, the mask) of
    ``view(view(scores + bias, windowed) + windows, scores' shape)``."""
    outer = view.args[0]
    require(_calls(outer, {aten.add.Tensor}), "the viewed scores are not a masked view of the scores")
    _only_feeds(view, softmax, "the masked scores")
    _only_feeds(outer, view, "the masked scores")
    windowed, windows = outer.args[:2] if _calls(outer.args[0], VIEW_OPS) else outer.args[1::-1]
    require(_calls(windowed, VIEW_OPS) and _calls(windowed.args[0], {aten.add.Tensor}),
            "the masked scores are not a view of masked scores")
    inner = windowed.args[0]
    _only_feeds(windowed, outer, "the masked scores")
    _only_feeds(inner, windowed, "the masked scores")
    scores, bias = inner.args[:2] if _calls(inner.args[0], SCORE_OPS) else inner.args[1::-1]
    for mask, what in ((bias, "added term"), (windows, "windows' added term")):
        _float_mask(mask, softmax, what)
    require(fake_value(view).shape == fake_value(inner).shape, "the masked scores are viewed back to another shape")
    return scores, [inner, windowed, outer, view], WindowedMask(bias, windows, tuple(fake_value(windowed).shape))


def select_sdpa(graph: GraphView, softmax: Node) -> Match:
    require(softmax.target in SOFTMAX_OPS, "softmax is not an ATen softmax call (not a PT2E graph)")
    scores, dim = softmax.args[:2]
    cast = softmax.args[2] if len(softmax.args) > 2 else None
    require(not cast, "softmax changes the dtype")  # (_softmax: half_to_float; softmax.int: dtype)
    require(dim % fake_value(softmax).dim() == fake_value(softmax).dim() - 1, "softmax is not over the last dim")
    require(len(softmax.users) == 1, "the attention probabilities are also read elsewhere (they would have to be materialised)")
    out = next(iter(softmax.users))
    require(_calls(out, MATMUL_OPS) and out.args[0] is softmax, "softmax output is not multiplied by values")
    nodes, mask, scale = [softmax, out], None, 1.0
    node, consumer = scores, softmax  # walk back from the softmax input
    if _calls(node, VIEW_OPS):  # (Swin's shifted windows: a second mask added to a windowed view)
        found = _windowed_mask(node, softmax)
        nodes[:0] = found[1]
        node, consumer, mask = found[0], found[1][0], found[2]
    elif _calls(node, {aten.add.Tensor}):
        _only_feeds(node, consumer, "the masked scores")
        left, right = node.args[:2]
        inner, mask = (left, right) if _calls(left, SCORE_OPS) else (right, left)
        _float_mask(mask, softmax, "added term")
        nodes.insert(0, node)
        node, consumer = inner, node
    per_head = None
    if _calls(node, {aten.div.Tensor, aten.mul.Tensor}):
        _only_feeds(node, consumer, "the scaled scores")
        scaled, factor = node.args[:2]
        if node.target is aten.mul.Tensor and isinstance(factor, Node) and _calls(factor, MATMUL_OPS):
            scaled, factor = factor, scaled
        if isinstance(factor, Node):  # (one factor per batch / head: Swin V2's logit scale)
            require(node.target is aten.mul.Tensor, "scores are divided by a tensor")
            value = fake_value(factor)
            require(value is not None and value.dtype == fake_value(softmax).dtype and 0 < value.dim() <= 4
                    and tuple(value.shape[-2:]) == (1, 1), "scores are scaled by a tensor of more than one value per head")
            per_head = factor
        else:
            require(isinstance(factor, numbers.Number) and factor != 0, "scores are scaled by a tensor, not a constant")
            scale = 1.0 / factor if node.target is aten.div.Tensor else float(factor)
        nodes.insert(0, node)
        node, consumer = scaled, node
    require(_calls(node, MATMUL_OPS), "softmax input is not a matmul of queries and keys")
    _only_feeds(node, consumer, "the raw scores")
    nodes.insert(0, node)
    scores = node
    q, v = scores.args[0], out.args[1]
    k = _transposed_last_two(scores.args[1])
    (q, q_factor), (k, k_factor) = _unscaled(q, scores), _unscaled(k, scores.args[1])
    scale *= q_factor * k_factor
    shapes = [fake_value(t) for t in (q, k, v)]
    require(all(s is not None and s.dim() >= 3 for s in shapes), "queries, keys or values are not batched matrices")
    require(len({s.dim() for s in shapes}) == 1, "queries, keys and values differ in rank")
    require(shapes[0].shape[-1] == shapes[1].shape[-1] and shapes[1].shape[-2] == shapes[2].shape[-2],
            "queries, keys and values do not line up as attention")
    require(shapes[0].dtype in (torch.float32, torch.bfloat16, torch.float16), "attention is not in float")
    if per_head is not None:
        q = ScaledQueries(q, per_head)
    return Match(None, softmax, tuple(nodes), op_args=(q, k, v, mask, scale, False), float_dtype=shapes[0].dtype)


SDPA = Rule(
    name="sdpa",
    anchors="attention",
    pattern="matmul(q [* c], (k [* c])^T) -> [/ c | * c | * per-head t] -> [+ mask | + bias, view, + windows, view] -> softmax(-1) -> matmul(., v)",
    doc="float attention => fused scaled-dot-product attention (no materialised score matrix)",
    select_fn=select_sdpa,
    priority=0,
    example=examples.attention_block,
    near_misses=(NearMiss(examples.attention_probs_returned, "also read elsewhere"),),
    anchor_ops=ANY_SOFTMAX,
)


def select_fused_sdpa(graph: GraphView, call: Node) -> Match:
    given = {**SDPA_DEFAULTS, **dict(zip(SDPA_PARAMETERS, call.args)), **call.kwargs}
    require(set(given) <= set(SDPA_PARAMETERS), f"unknown arguments {sorted(set(given) - set(SDPA_PARAMETERS))}")
    q, k, v, mask = (given[name] for name in ("query", "key", "value", "attn_mask"))
    require(given["dropout_p"] == 0, "dropout in attention")
    require(given["is_causal"] in (False, True), "is_causal is not a constant")
    require(not (given["is_causal"] and mask is not None), "a mask and is_causal both given")
    shapes = [fake_value(t) if isinstance(t, Node) else None for t in (q, k, v)]
    require(all(s is not None and s.dim() == 4 for s in shapes), "queries, keys or values are not [batch, heads, length, dim]")
    heads, kv_heads = shapes[0].shape[1], shapes[1].shape[1]
    require(kv_heads == heads or (given["enable_gqa"] and heads % kv_heads == 0),
            f"{heads} query heads and {kv_heads} key / value heads without enable_gqa")
    require(mask is None or (isinstance(mask, Node) and fake_value(mask) is not None), "the mask is not a tensor")
    scale = given["scale"]
    require(scale is None or isinstance(scale, numbers.Number), "the scale is not a constant")
    scale = float(scale) if scale is not None else shapes[0].shape[-1] ** -0.5  # (torch's default)
    return Match(None, call, (call,), op_args=(q, k, v, mask, scale, given["is_causal"]), float_dtype=shapes[0].dtype)


FUSED_SDPA = Rule(
    name="sdpa_fused",
    anchors="attention",
    pattern="scaled_dot_product_attention(q, k, v, [mask | is_causal], [scale], [enable_gqa])",
    doc="fused attention call => qbackend's attention kernel (grouped queries read each key / value head once)",
    select_fn=select_fused_sdpa,
    priority=0,
    example=examples.grouped_query_attention,
    near_misses=(NearMiss(examples.flat_heads_fused_attention, "not [batch, heads, length, dim]"),),
    anchor_ops=FUSED_SDPA_OPS,
)
