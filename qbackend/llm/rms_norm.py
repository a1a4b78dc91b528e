"""Llama-style RMSNorm, and the residual add before it, in one pass (csrc/rms_norm_f32.c).

Hugging Face's LlamaRMSNorm (Mistral's and Qwen2's are the same) reaches the graph as ~8 float
ops: ``h = x.to(float32)``, ``h.pow(2).mean(-1, keepdim=True)``, ``+ eps``, ``rsqrt``,
``h * that``, ``.to(dtype)``, ``weight * that``. A decode step runs 2 per layer and one before
the head, each ~21 us of dispatch for a 2048-wide row; the residual add that feeds all but the
first is one op more. ``rms_norms_fused`` rewrites each such chain on a float32 x into one call
of ``rms_norm(x, weight, eps)``, or of ``add_rms_norm(a, b, weight, eps)`` when x is ``a + b``:
that returns (sum, norm), the sum for the residual stream's later adds.
"""
from __future__ import annotations

import operator
from typing import NamedTuple, Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.kernels.rms_norm import add_rms_norm, kernel, rms_norm
from qbackend.passes.dead_code import eliminate_dead_code
from qbackend.passes.float_ops import both_orders, float32, is_op, operands, single_user, through_noop_casts
from qbackend.patterns.base import constant_value, fake_value


class _Norm(NamedTuple):
    x: Node  # the rows normalized
    weight: Node
    eps: float


def _mean_of_squares(node, h: Node) -> bool:
    """``node`` is ``h.pow(2).mean(-1, keepdim=True)``, each read only by the next."""
    if not (is_op(node, "mean") and single_user(node)):
        return False
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    if keepdim is not True or len(dims) != 1 or dims[0] not in (-1, fake_value(h).dim() - 1):
        return False
    square = node.args[0]
    return is_op(square, "pow") and single_user(square) and square.args[0] is h and tuple(square.args[1:]) == (2,) \
        and not square.kwargs


def _inverse_rms(node, h: Node) -> Optional[float]:
    """eps, when ``node`` is ``rsqrt(mean(h^2, -1) + eps)`` read only by the product."""
    if not (is_op(node, "rsqrt") and single_user(node) and len(node.args) == 1 and single_user(node.args[0])):
        return None
    for variance, eps in both_orders(operands(node.args[0], "add")):
        if isinstance(eps, (int, float)) and not isinstance(eps, bool) and _mean_of_squares(variance, h):
            return float(eps)
    return None


def _norm(gm: GraphModule, node: Node) -> Optional[_Norm]:
    """``node`` as ``weight * (h * rsqrt(mean(h^2, -1) + eps))`` of a float32 h (casts to
    float32 around it allowed), with a 1-D float32 weight of h's last dim, else None."""
    for weight, normed in both_orders(operands(node, "mul")):
        inner = through_noop_casts(normed)
        w = fake_value(weight) if fake_value(weight) is not None else constant_value(gm, weight)
        if w is None or w.dtype != torch.float32 or w.dim() != 1 or not single_user(inner) \
                or (inner is not normed and not single_user(normed)):
            continue
        for h, inverse in both_orders(operands(inner, "mul")):
            eps = _inverse_rms(inverse, h) if isinstance(h, Node) and fake_value(h) is not None else None
            x = through_noop_casts(h)
            if eps is None or not float32(x) or fake_value(x).shape[-1] != w.shape[0]:
                continue
            if h is not x and len(h.users) != 2:  # (the cast feeds the square and the product only)
                continue
            return _Norm(x, weight, eps)
    return None


def _residual_sum(norm: _Norm, order: dict) -> Optional[tuple[Node, Node]]:
    """(a, b) when the normalized x is ``a + b`` of two float32 tensors of its shape and the
    norm's weight is defined before x (or is a constant read that can move there)."""
    parts = operands(norm.x, "add")
    if parts is None or not all(isinstance(p, Node) and float32(p) for p in parts):
        return None
    shape = fake_value(norm.x).shape
    if any(fake_value(p).shape != shape for p in parts):
        return None
    if order[norm.weight] > order[norm.x]:
        if norm.weight.op != "get_attr":
            return None
        norm.x.append(norm.weight)  # (a constant read moves up to where the pair is computed)
    return parts


def rms_norms_fused(gm: GraphModule) -> Optional[str]:
    """Rewrite each RMSNorm chain (see the module docstring) into one call."""
    if kernel() is None:
        return None
    graph, fused, with_sum = gm.graph, 0, 0
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        norm = _norm(gm, node)
        if norm is None:
            continue
        parts = _residual_sum(norm, order)
        if parts is None:
            with graph.inserting_before(node):
                normed = graph.call_function(rms_norm, (norm.x, norm.weight, norm.eps))
        else:  # (the sum's other readers, the residual stream, read it from the pair)
            with graph.inserting_after(norm.x):
                pair = graph.call_function(add_rms_norm, (*parts, norm.weight, norm.eps))
            with graph.inserting_after(pair):
                total = graph.call_function(operator.getitem, (pair, 0))
            with graph.inserting_after(total):
                normed = graph.call_function(operator.getitem, (pair, 1))
            total.meta = dict(norm.x.meta)
            norm.x.replace_all_uses_with(total)
            with_sum += 1
        normed.meta = dict(node.meta)  # (a later norm's match reads the dtypes and shapes)
        node.replace_all_uses_with(normed)
        fused += 1
    eliminate_dead_code(gm)
    return f"{fused} RMSNorm(s) in one pass ({with_sum} with the residual add before it)" if fused else None
