"""A smoothing multiply folded into the activation quantize: x * (1/s) -> q.

``qbackend.smooth_quant`` leaves ``x * (1/s)`` (one factor per channel) where 1/s cannot be
folded into x's producer; PT2E then quantizes its output per tensor for the linear that reads
it (whose weight columns already carry s). The multiply and the quantize become one call:
the reference's float32 product, then the quantize of it (``fast_qdq``: ATen's vectorised
quantize on CPU, within one step of the reference on rounding ties like every boundary
quantize; the reference's own float steps elsewhere).
"""
from __future__ import annotations

import torch
from torch.fx import Node

from . import examples
from .base import GraphView, Match, NearMiss, Rule, fake_value, require
from .qdq import quantized_output

aten = torch.ops.aten
SMOOTH_ANCHORS = {aten.mul.Tensor}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def select_qsmooth(graph: GraphView, mul: Node) -> Match:
    require(mul.target is aten.mul.Tensor and not mul.kwargs and len(mul.args) == 2, "not an ATen mul.Tensor call")
    x, factor = mul.args
    factors = graph.constant(factor)
    require(factors is not None, "the multiplier is not a constant")
    value = fake_value(x)
    require(isinstance(x, Node) and value is not None and value.is_floating_point() and value.dim() >= 1,
            "the multiplied input is not a float tensor")
    require(list(factors.shape) == [value.shape[-1]] and factors.dtype == value.dtype,
            f"multiplier {_name(factors.dtype)} {list(factors.shape)} is not one {_name(value.dtype)} factor per "
            f"channel [{value.shape[-1]}]")
    quant, qparams = quantized_output(mul, "smoothing multiply")
    return Match(None, mul, (mul, quant), None, op_args=(factor,), output_quant=qparams, float_source=x)


QSMOOTH = Rule(
    name="qsmooth",
    anchors="smooth",
    pattern="x * per-channel constant -> q",
    doc="smoothing multiply + quant => one multiply-and-quantize call (the product, then the vectorised quantize)",
    select_fn=select_qsmooth,
    priority=0,
    example=examples.smoothed_linear,
    near_misses=(
        NearMiss(examples.smoothing_by_one_factor, "is not one float32 factor per channel"),
        NearMiss(examples.smoothed_value_returned, "not quantized by its only consumer"),
    ),
)
