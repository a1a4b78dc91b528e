"""Rotary position embedding in one pass (csrc/rotary_f32.c).

Hugging Face's ``apply_rotary_pos_emb`` (Llama, Mistral, Qwen2) reaches the graph as 7 float
ops per tensor: ``q * cos``, two halves of q, a negation, their cat (``rotate_half``), a
product with sin and the sum; ~31 us of dispatch per layer for a decode step's queries and
keys. ``rotaries_fused`` rewrites each into one call of ``rotary(q, cos, sin)``, whose values are
the graph's bit for bit (the same products and sum, each rounded). Its output is dense where the
graph's followed q's layout, so only a result that readers taking any strides read (fused
attention, a KV cache's cat or a StaticCache's index_copy_, through views) is rewritten.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.kernels.rotary import kernel, rotary
from qbackend.llm.kv_append import CATS
from qbackend.passes.attention_cleanup import reaches_only_strided_readers
from qbackend.passes.float_ops import both_orders, calls_in_place_of, float32, is_op, operands
from qbackend.patterns.base import fake_value


aten = torch.ops.aten


def _half(node, q: Node, half: int, first: bool) -> bool:
    """``node`` is q's first (or second) half along its last dim: ``q[..., :half]`` or an ATen slice."""
    if not isinstance(node, Node) or len(node.users) != 1:
        return False
    start, stop = (0, half) if first else (half, 2 * half)
    if node.op == "call_function" and node.target is aten.slice.Tensor and node.args[0] is q and not node.kwargs:
        dim, lo, hi, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
        lo, hi = lo or 0, 2 * half if hi is None else min(hi, 2 * half)
        return dim in (-1, 3) and step == 1 and (lo, hi) == (start, stop)
    if node.op == "call_function" and node.target is operator.getitem and node.args[0] is q:
        index = node.args[1]
        if not (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice)):
            return False
        part = index[1]
        lo = 0 if part.start is None else part.start
        hi = 2 * half if part.stop is None else part.stop
        return part.step in (None, 1) and lo == start and hi == stop
    return False


def _rotated(node, q: Node, half: int) -> bool:
    """``node`` is ``cat((-q[..., half:], q[..., :half]), dim=-1)``, read only by the product."""
    if not (is_op(node, "cat") and len(node.users) == 1):
        return False
    parts = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if dim not in (-1, 3) or not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return False
    negated, first = parts
    return is_op(negated, "neg") and len(negated.users) == 1 and _half(negated.args[0], q, half, first=False) \
        and _half(first, q, half, first=True)


def _rotary(node: Node) -> Optional[tuple[Node, Node, Node]]:
    """(q, cos, sin) when ``node`` is ``q * cos + rotate_half(q) * sin`` on float32 4-D q."""
    terms = operands(node, "add")
    for direct, turned in both_orders(terms):
        plain, rotated = operands(direct, "mul"), operands(turned, "mul")
        if plain is None or rotated is None or len(direct.users) != 1 or len(turned.users) != 1:
            continue
        for q, cos in both_orders(plain):
            value = fake_value(q)
            if not (isinstance(q, Node) and float32(q) and value.dim() == 4 and isinstance(value.shape[-1], int)
                    and value.shape[-1] % 2 == 0 and float32(cos) and float32(node)):
                continue
            for cat, sin in both_orders(rotated):
                if _rotated(cat, q, value.shape[-1] // 2) and float32(sin) and fake_value(node).shape == value.shape:
                    return q, cos, sin
    return None


def rotaries_fused(gm: GraphModule) -> Optional[str]:
    """Rewrite each rotary embedding (see the module docstring) into one call."""
    if kernel() is None:
        return None

    def match(node: Node) -> Optional[tuple]:
        found = _rotary(node)
        # (a KV cache's cat left as it is, or a StaticCache's index_copy_, reads only the rotated values)
        return found if found is not None and reaches_only_strided_readers(node, CATS) else None

    return calls_in_place_of(gm, match, rotary, "rotary embedding(s)")
