"""Int8 average pooling: dq(x) -> avg_pool2d | adaptive_avg_pool2d -> q(same qparams) => the
pool on the int8 tensor.

X86InductorQuantizer gives both pools' outputs their input's qparams. An int8 kernel rounds
the average once, where the reference rounds float arithmetic: they can differ by one step
where the mean falls half-way between two steps (measured: 7% of outputs of a 2x2 pool on
random data, never more than one step; see docs/design-notes.md).
"""
from __future__ import annotations

import torch
from torch.fx import Node

from . import examples
from .base import GraphView, Match, NearMiss, Rule, require
from .qdq import dequantized_activation, quantized_output, same_qparams

aten = torch.ops.aten
AVG_POOL_OPS = {aten.avg_pool2d.default, aten.adaptive_avg_pool2d.default}
AVG_POOL_ANCHORS = AVG_POOL_OPS | {aten._adaptive_avg_pool2d.default, torch.nn.functional.avg_pool2d,
                                   torch.nn.functional.adaptive_avg_pool2d}


def select_qavgpool(graph: GraphView, pool: Node) -> Match:
    require(pool.target in AVG_POOL_OPS, "pool is not an ATen avg_pool2d / adaptive_avg_pool2d call (not a PT2E graph)")
    require(not pool.kwargs, f"pool arguments passed by keyword: {sorted(pool.kwargs)}")
    x = dequantized_activation(pool.args[0])
    quant = quantized_output(pool, "pool")
    same_qparams(quant[1], x.qparams, "pool")
    return Match(None, pool, (pool, quant[0]), x, op_args=tuple(pool.args[1:]), output_quant=quant[1])


QAVGPOOL = Rule(
    name="qavgpool",
    anchors="avgpool",
    pattern="dq(x) -> avg_pool2d | adaptive_avg_pool2d -> q(same scale / zero point)",
    doc="dequant + average pool + quant => the pool on the int8 tensor (within one step of the reference)",
    select_fn=select_qavgpool,
    priority=0,
    example=examples.conv_avgpool_head,
    near_misses=(NearMiss(examples.avgpool_requantize, "output qparams differ"),),
)
