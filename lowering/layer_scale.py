"""A constant per-channel multiply after an int8 linear, folded into the linear.

ConvNeXt's layer scale: ``gamma[C, 1, 1] * permute(linear(x, W, b))``, 18 standalone multiplies
of the linear's float output (convnext_tiny at batch 1: 0.52 ms a call of ATen's ``mul``).
With ``W = (w_int8 - zp) * s`` per output channel,

    gamma * (x @ W.T + b) == x @ (W * gamma).T + b * gamma,  W * gamma = (w_int8 - zp) * (s * gamma)

so the weight's per-channel scales and the bias take the factor and the multiply goes (float32
rounding apart: ~1e-7 relative). New constants are made, never the shared ones rescaled (the
trap SmoothQuant folding fell into). Only where every factor is positive and finite (the
kernels' weight scales are positive), the permute and multiply are the linear's only readers,
and the factor varies along the linear's output channels only.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.graph_constants import set_constant
from qbackend.patterns.base import constant_value, fake_value
from qbackend.patterns.qdq import is_op, single_user

aten = torch.ops.aten


def _channel_factors(gm: GraphModule, mul: Node) -> Optional[tuple[Node, torch.Tensor]]:
    """(the permute the multiply reads, one factor per linear output channel) or None."""
    for permute, factor in (mul.args, reversed(mul.args)):
        gamma = constant_value(gm, factor)
        if gamma is None or not isinstance(permute, Node) or permute.target is not aten.permute.default:
            continue
        linear, order = permute.args
        value = fake_value(permute)
        if value is None or value.dtype != torch.float32 or gamma.dtype != torch.float32 or gamma.dim() > value.dim():
            continue
        channel_dim = list(order).index(len(order) - 1)  # where the linear's output channels went
        shape = [1] * (value.dim() - gamma.dim()) + list(gamma.shape)
        if any(size != 1 for d, size in enumerate(shape) if d != channel_dim) or shape[channel_dim] not in (1, value.shape[channel_dim]):
            continue
        factors = gamma.reshape(-1).expand(value.shape[channel_dim])
        if bool((factors > 0).all()) and bool(factors.isfinite().all()):
            return permute, factors
    return None


def fold_layer_scale(gm: GraphModule) -> Optional[str]:
    folded = 0
    for mul in list(gm.graph.nodes):
        if mul.op != "call_function" or mul.target is not aten.mul.Tensor or mul.kwargs or len(mul.args) != 2:
            continue
        found = _channel_factors(gm, mul)
        if found is None:
            continue
        permute, factors = found
        linear = permute.args[0]
        if not (isinstance(linear, Node) and linear.target is aten.linear.default and single_user(linear) is permute
                and single_user(permute) is mul and len(linear.args) == 3 and not linear.kwargs):
            continue
        _, weight, bias = linear.args
        bias_value = constant_value(gm, bias) if bias is not None else None
        if not is_op(weight, "dequantize_per_channel") or single_user(weight) is not linear or weight.args[3] != 0 \
                or (bias is not None and bias_value is None):
            continue
        scales = constant_value(gm, weight.args[1])
        if scales is None or scales.shape != factors.shape:
            continue
        with gm.graph.inserting_before(weight):
            new_scales = _constant(gm, f"{weight.name}_scales", scales * factors.to(scales.dtype))
            new_bias = _constant(gm, f"{linear.name}_bias", bias_value * factors.to(bias_value.dtype)) if bias is not None else None
        weight.update_arg(1, new_scales)
        linear.update_arg(2, new_bias)
        mul.replace_all_uses_with(permute)
        gm.graph.erase_node(mul)
        folded += 1
    return f"{folded} per-channel constant multiply(s) after a linear folded into its weight scales and bias" if folded else None


def _constant(gm: GraphModule, hint: str, value: torch.Tensor) -> Node:
    name = f"_qb_layer_scale_{hint}"
    set_constant(gm, name, value)
    return gm.graph.get_attr(name)
