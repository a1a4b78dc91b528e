"""Int8 max pooling: dq(x) -> max_pool2d -> q(same qparams) => max pool on the int8 tensor.

Max commutes with the monotonic dequantize, so with equal input and output qparams the int8
result is exactly the reference's.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from . import examples
from .base import GraphView, Match, NearMiss, Rule, per_dim, require
from .qdq import dequantized_activation, quantized_output, same_qparams

aten = torch.ops.aten
MAX_POOL_OPS = {aten.max_pool2d.default}
POOL_ANCHORS = MAX_POOL_OPS | {aten.max_pool2d_with_indices.default, torch.nn.functional.max_pool2d}


def select_qmaxpool2d(graph: GraphView, pool: Node) -> Match:
    require(pool.target in MAX_POOL_OPS, "pool is not an ATen max_pool2d call (not a PT2E graph)")
    require(not pool.kwargs, f"max_pool2d arguments passed by keyword: {sorted(pool.kwargs)}")
    x = dequantized_activation(pool.args[0])
    quant = quantized_output(pool, "max_pool2d")
    same_qparams(quant[1], x.qparams, "max")
    return Match(None, pool, (pool, quant[0]), x, op_args=max_pool2d_args(pool), output_quant=quant[1])


def max_pool2d_args(pool: Node) -> tuple:
    """(kernel, stride, padding, dilation, ceil_mode) with ATen's defaults filled in."""
    defaults = [None, None, [], 0, 1, False]  # input, kernel, stride ([] = kernel), padding, dilation, ceil_mode
    _, kernel, stride, padding, dilation, ceil_mode = list(pool.args) + defaults[len(pool.args):]
    kernel = per_dim(kernel, 2)
    return kernel, per_dim(stride, 2) if stride else kernel, per_dim(padding, 2), per_dim(dilation, 2), bool(ceil_mode)


QMAXPOOL2D = Rule(
    name="qmaxpool2d",
    anchors="pool",
    pattern="dq(x) -> max_pool2d -> q(same scale / zero point)",
    doc="dequant + max_pool2d + quant => max pool on the int8 tensor (exact)",
    select_fn=select_qmaxpool2d,
    priority=0,
    example=examples.conv_maxpool_conv,
    near_misses=(NearMiss(examples.maxpool_requantize, "output qparams differ"),),
)
