"""``F.normalize(x, p=2, dim=-1, eps)`` in one pass (csrc/l2_normalize_f32.c).

Swin V2's cosine attention normalizes its queries and keys before their product; an exported
graph spells it ``x / linalg_vector_norm(x, 2, [-1], keepdim).clamp_min(eps).expand_as(x)``: four
ops and two passes, 24 a call of swin_v2_t (~2 ms of ~30 at batch 1). ``l2_normalizes_fused``
rewrites each into one call, which reads the strided head views of a merged projection in place.
"""
from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.kernels.l2_normalize import kernel, l2_normalize
from qbackend.passes.float_ops import calls_in_place_of, float32, single_user
from qbackend.patterns.base import fake_value


aten = torch.ops.aten


def _called(node, target) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is target


def _normalized(node: Node) -> Optional[tuple]:
    """(x, eps) when ``node`` is ``x / clamp_min(linalg_vector_norm(x, 2, [-1], True), eps)``
    (expanded to x's shape or not) of a float32 x, its steps read by nothing else."""
    if not _called(node, aten.div.Tensor) or len(node.args) != 2 or node.kwargs or not float32(node):
        return None
    x, divisor = node.args
    if _called(divisor, aten.expand_as.default) and single_user(divisor) and divisor.args[1] is x:
        divisor = divisor.args[0]
    if not (_called(divisor, aten.clamp_min.default) and single_user(divisor) and len(divisor.args) == 2):
        return None
    norm, eps = divisor.args
    if not (_called(norm, aten.linalg_vector_norm.default) and single_user(norm) and not norm.kwargs and len(norm.args) == 4
            and norm.args[0] is x and float32(x)) or not isinstance(eps, numbers.Real) or isinstance(eps, bool):
        return None
    order, dims, keepdim = norm.args[1:]
    if order != 2 or keepdim is not True or not isinstance(dims, (list, tuple)) or list(dims) not in ([-1], [fake_value(x).dim() - 1]):
        return None
    return x, float(eps)


def l2_normalizes_fused(gm: GraphModule) -> Optional[str]:
    """Rewrite each normalize (see ``_normalized``) into one call."""
    return None if kernel() is None else calls_in_place_of(gm, _normalized, l2_normalize, "L2 normalization(s)")
