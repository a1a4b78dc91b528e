"""A channel scale folded into the quantize after it: x * s -> q, s one factor per image and
channel computed in the graph (squeeze-excitation's sigmoid / hard-sigmoid gate in EfficientNet
and MobileNetV3). A constant factor is ``qsmooth``'s. Where s is a gate (``GATES``) only the
multiply reads, the match names it: a kernel may take the gate's input and apply it itself."""
from __future__ import annotations

import torch
from torch.fx import Node

from . import examples
from .base import GraphView, Match, NearMiss, Rule, fake_value, require
from .qdq import quantized_output

aten = torch.ops.aten
GATES = {aten.sigmoid.default: "sigmoid", aten.hardsigmoid.default: "hardsigmoid"}  # gate op -> its name


def _channel_factors(graph: GraphView, x: Node, factor: Node) -> bool:
    value, factors = fake_value(x), fake_value(factor)
    return (isinstance(x, Node) and isinstance(factor, Node) and graph.constant(factor) is None and value is not None
            and factors is not None and value.dim() == 4 and tuple(factors.shape) in ((value.shape[0], value.shape[1], 1, 1),
                                                                                      (1, value.shape[1], 1, 1)))


def select_qscale(graph: GraphView, mul: Node) -> Match:
    require(mul.target is aten.mul.Tensor and not mul.kwargs and len(mul.args) == 2, "not an ATen mul.Tensor call")
    first, second = mul.args
    operands = (first, second) if _channel_factors(graph, first, second) else (second, first)
    require(_channel_factors(graph, *operands),
            "neither operand is one computed factor per image and channel ([N or 1, C, 1, 1]) of the other's [N, C, H, W]")
    x, factors = operands
    for value in (fake_value(x), fake_value(factors)):
        require(value.dtype == torch.float32, f"the multiply is in {value.dtype}, not float32")
    quant, qparams = quantized_output(mul, "channel scale")
    gate = factors if (factors.op == "call_function" and factors.target in GATES and len(factors.args) == 1
                       and not factors.kwargs and len(factors.users) == 1) else None
    return Match(None, mul, (mul, quant), None, op_args=(factors, gate), output_quant=qparams, float_source=x)


QSCALE = Rule(
    name="qscale",
    anchors="smooth",
    pattern="x[N, C, H, W] * s[N|1, C, 1, 1] -> q  (s: sigmoid / hardsigmoid(t) or any)",
    doc="channel scale (squeeze-excitation gate, the gate too) + quant => one scale-and-quantize pass",
    select_fn=select_qscale,
    priority=0,
    example=examples.squeeze_excitation,
    near_misses=(NearMiss(examples.spatial_gate, "neither operand is one computed factor per image and channel"),),
)
