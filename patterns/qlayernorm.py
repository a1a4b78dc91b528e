"""A LayerNorm folded into the quantize after it: layer_norm(x) -> q (ConvNeXt's blocks, and a
BERT's / ViT's norms before a quantized linear). Other ops may read the normed rows too (a
post-LN BERT's residual): the lowering then keeps them as well."""
from __future__ import annotations

import torch
from torch.fx import Node

from . import examples
from .base import GraphView, Match, NearMiss, Rule, fake_value, require
from .qdq import output_quantize

aten = torch.ops.aten
NORM_ANCHORS = {aten.layer_norm.default}


def select_qlayernorm(graph: GraphView, norm: Node) -> Match:
    require(norm.target is aten.layer_norm.default and not norm.kwargs, "not an ATen layer_norm call")
    # (weight, bias and eps may be left out: their defaults, None, None, 1e-5)
    x, shape, weight, bias, eps = (tuple(norm.args) + (None, None, 1e-5)[len(norm.args) - 2:])[:5]
    value = fake_value(x)
    require(isinstance(x, Node) and value is not None and value.dtype == torch.float32 and value.dim() >= 1,
            "the input is not a float32 tensor")
    require(list(shape) == [value.shape[-1]], f"normalizes over {list(shape)}, not the last dimension alone")
    require(all(isinstance(t, Node) and graph.constant(t) is not None for t in (weight, bias)),
            "no constant weight and bias (elementwise_affine=False, or computed ones)")
    quantized = output_quantize(norm, only_consumer=False)
    require(quantized is not None, "LayerNorm output is not read by one quantize")
    quant, qparams = quantized
    return Match(None, norm, (norm, quant), None, op_args=(weight, bias, eps), output_quant=qparams, float_source=x)


QLAYERNORM = Rule(
    name="qlayernorm",
    anchors="norm",
    pattern="layer_norm(x[..., C], [C], weight, bias) -> q",
    doc="LayerNorm + quant => one normalize-and-quantize pass (the float rows never written)",
    select_fn=select_qlayernorm,
    priority=0,
    example=examples.normed_linear,
    near_misses=(NearMiss(examples.norm_over_two_dimensions, "not the last dimension alone"),
                 NearMiss(examples.norm_without_affine, "no constant weight and bias")),
)
