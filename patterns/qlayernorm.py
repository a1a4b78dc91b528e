"""A LayerNorm folded into the quantize after it: layer_norm(x) -> q (ConvNeXt's blocks, and a
BERT's / ViT's norms before a quantized linear)."""
from __future__ import annotations

import torch
from torch.fx import Node

from . import examples
from .base import GraphView, Match, NearMiss, Rule, fake_value, require
from .qdq import quantized_output

aten = torch.ops.aten
NORM_ANCHORS = {aten.layer_norm.default}


def select_qlayernorm(graph: GraphView, norm: Node) -> Match:
    require(norm.target is aten.layer_norm.default and not norm.kwargs and len(norm.args) >= 4,
            "not an ATen layer_norm call with a weight and a bias")
    x, shape, weight, bias = norm.args[:4]
    eps = norm.args[4] if len(norm.args) > 4 else 1e-5
    value = fake_value(x)
    require(isinstance(x, Node) and value is not None and value.dtype == torch.float32 and value.dim() >= 1,
            "the input is not a float32 tensor")
    require(list(shape) == [value.shape[-1]], f"normalizes over {list(shape)}, not the last dimension alone")
    require(all(graph.constant(t) is not None for t in (weight, bias)), "the weight or bias is not a constant")
    quant, qparams = quantized_output(norm, "LayerNorm")
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
                 NearMiss(examples.normed_value_returned, "not quantized by its only consumer")),
)
