"""A BatchNorm between a dequantize and a quantize in one pass (csrc/batch_norm_quantize.c).

DenseNet normalizes each layer's input, the cat of the block's features so far, before its
conv: in the lowered graph ``cat`` of uint8 tensors, ``dequantize``, ``batch_norm`` (inference,
constant statistics), ``relu_``, ``quantize``: a cat and three float32 passes per layer, where
Inductor runs one fused loop (densenet121 at batch 1 ran 1.31x Inductor's time).
``batch_norms_quantized`` rewrites each such chain into one call that reads the cat's inputs in
place and writes the uint8 result; the values are the chain's (each step rounded as the
reference rounds it).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.graph_constants import set_constant
from qbackend.kernels import fast_qdq
from qbackend.kernels.batch_norm_quantize import batch_norm_quantize, kernel
from qbackend.patterns.base import constant_value, fake_value


aten = torch.ops.aten
_RELUS = (aten.relu.default, aten.relu_.default)


def linear_terms(weight, bias, mean, var, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha, beta) of inference batch norm, y = x * alpha + beta, as ATen computes them in float32:
    alpha = 1 / sqrt(var + eps) * weight, beta = bias - mean * alpha."""
    var = var.float()
    alpha = (1 / torch.sqrt(var + torch.tensor(eps, dtype=torch.float32))) * (torch.ones_like(var) if weight is None else weight.float())
    beta = (torch.zeros_like(var) if bias is None else bias.float()) - mean.float() * alpha
    return alpha.contiguous(), beta.contiguous()


class _Chain(NamedTuple):
    pieces: list  # the uint8 tensors (nodes) the dequantize reads, concatenated along channels
    dequantize: Node
    norm: Node
    relu: Optional[Node]


def _single_user(node, target) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in target and len(node.users) == 1


def _chain(gm: GraphModule, quantize: Node) -> Optional[tuple[_Chain, tuple, tuple]]:
    """(chain, the norm's (weight, bias, mean, var, eps), the quantize's (scale, zero point, qmin,
    qmax)) where ``quantize`` ends ``dequantize(uint8) -> batch_norm -> [relu] -> quantize``."""
    if quantize.op != "call_function" or quantize.target is not fast_qdq.quantize_per_tensor_channels_last \
            or len(quantize.args) != 6 or quantize.args[5] != torch.uint8:
        return None
    out_scale, out_zero_point, qmin, qmax = quantize.args[1:5]
    if quantize.kwargs.get("nan_as", 0) != qmin or set(quantize.kwargs) - {"nan_as"}:
        return None
    relu = quantize.args[0] if _single_user(quantize.args[0], _RELUS) and len(quantize.args[0].args) == 1 else None
    norm = relu.args[0] if relu is not None else quantize.args[0]
    if not _single_user(norm, (aten.batch_norm.default,)) or len(norm.args) < 8 or norm.args[5] is not False:
        return None
    dequantize, *params = norm.args[:5]
    eps = norm.args[7]
    values = [constant_value(gm, p) if p is not None else None for p in params]
    if values[2] is None or values[3] is None or any(p is not None and v is None for p, v in zip(params, values)):
        return None
    if not _single_user(dequantize, (fast_qdq.dequantize_per_tensor,)) or len(dequantize.args) != 6 or dequantize.kwargs \
            or dequantize.args[5] != torch.uint8:
        return None
    x = dequantize.args[0]
    value = fake_value(x)
    if value is None or value.dim() != 4 or value.dtype != torch.uint8 or values[2].numel() != value.shape[1]:
        return None
    pieces = [x]
    if x.target is aten.cat.default and len(x.users) == 1 and len(x.args) == 2 and x.args[1] in (1, -3):
        pieces = list(x.args[0])
    return _Chain(pieces, dequantize, norm, relu), (*values, float(eps)), (out_scale, out_zero_point, qmin, qmax)


def batch_norms_quantized(gm: GraphModule) -> Optional[str]:
    """Rewrite each dequantize -> batch_norm -> [relu] -> quantize chain (module docstring)."""
    if kernel() is None:
        return None
    graph, rewritten = gm.graph, 0
    for quantize in list(graph.nodes):
        found = _chain(gm, quantize)
        if found is None:
            continue
        chain, (weight, bias, mean, var, eps), quantized = found
        alpha, beta = linear_terms(weight, bias, mean, var, eps)
        in_scale, in_zero_point = chain.dequantize.args[1:3]
        names = []
        for what, value in (("alpha", alpha), ("beta", beta)):
            names.append(f"_qb_norm_{what}_{chain.norm.name}")
            set_constant(gm, names[-1], value)
        with graph.inserting_before(quantize):
            terms = [graph.get_attr(name) for name in names]
            fused = graph.call_function(batch_norm_quantize, (chain.pieces, in_scale, in_zero_point, *terms,
                                                              chain.relu is not None, *quantized))
        fused.meta = dict(quantize.meta)
        quantize.replace_all_uses_with(fused)
        cat = chain.dequantize.args[0]
        for dead in (quantize, chain.relu, chain.norm, chain.dequantize):
            if dead is not None:
                graph.erase_node(dead)
        if cat.target is aten.cat.default and not cat.users:
            graph.erase_node(cat)
        rewritten += 1
    return f"{rewritten} batch norm(s) between a dequantize and a quantize in one pass (qbackend's kernel)" if rewritten else None
