"""Two-operand einsums that are batched matrix products, as the matmul they are.

MaxViT writes its attention as ``einsum("BGHID,BGHJD->BGHIJ", q, k)`` and
``einsum("BGHIJ,BGHJD->BGHID", p, v)``. ATen's einsum is a composite (permutes, reshapes, a
bmm) that the attention pattern (matmul -> softmax -> matmul) cannot see through: maxvit_t's
22 attention blocks each ran a materialised score tensor, softmax and two einsums. Rewritten
as ``matmul(a, b^T)`` / ``matmul(a, b)`` they fuse like any other attention; an einsum of any
other form is left as it is.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule

from qbackend.lowering.common import record_fake_value
from qbackend.patterns.base import fake_value

aten = torch.ops.aten
_KEPT_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node")  # (the report names the source)


def matmul_form(equation: str) -> Optional[bool]:
    """Whether ``equation`` multiplies the first operand by the second transposed
    (``...ik,...jk->...ij``: True) or as it is (``...ik,...kj->...ij``: False), the same batch
    labels leading all three in the same order; None for every other einsum."""
    equation = equation.replace(" ", "")
    if equation.count("->") != 1 or "." in equation:
        return None
    inputs, out = equation.split("->")
    operands = inputs.split(",")
    if len(operands) != 2:
        return None
    a, b = operands
    if not len(a) == len(b) == len(out) >= 2 or any(len(set(s)) != len(s) for s in (a, b, out)):
        return None
    batch, (i, k), j = out[:-2], a[-2:], out[-1]
    if a[:-2] != batch or b[:-2] != batch or out[-2] != i:
        return None
    return {j + k: True, k + j: False}.get(b[-2:])


def _same_static_batch(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal batch sizes, every one a plain int (a symbolic size would add a shape guard here,
    after Dynamo's trace)."""
    batch = (*a.shape[:-2], *b.shape[:-2])
    return all(isinstance(n, int) for n in batch) and a.shape[:-2] == b.shape[:-2]


def einsums_as_matmuls(gm: GraphModule) -> int:
    """Rewrites every matrix-product einsum of two float tensors whose batch sizes agree (no
    broadcast, none symbolic); the number rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.einsum.default or node.kwargs or len(node.args) != 2:
            continue
        equation, operands = node.args
        transposed = matmul_form(equation) if isinstance(equation, str) and len(operands) == 2 else None
        values = [fake_value(operand) for operand in operands]
        if transposed is None or any(v is None or not v.is_floating_point() for v in values) \
                or values[0].dtype != values[1].dtype or not _same_static_batch(*values):
            continue
        a, b = operands
        with gm.graph.inserting_before(node):
            if transposed:
                b = record_fake_value(gm.graph.call_function(aten.transpose.int, (b, -2, -1)))
            product = record_fake_value(gm.graph.call_function(aten.matmul.default, (a, b)))
        for new in {b, product} - set(operands):
            new.meta.update({key: node.meta[key] for key in _KEPT_META if key in node.meta})
        node.replace_all_uses_with(product)
        gm.graph.erase_node(node)
        rewritten += 1
    return rewritten
