"""A squeeze-excitation block's pool reads the conv's float result in one pass.

RegNetY's, EfficientNet's and MobileNetV3's squeeze-excitation blocks multiply a conv's float32
result by per-channel factors computed from its pooled mean. PT2E quantizes the pool's input, so
the lowered graph quantizes the whole float tensor for the pool alone (``quantize_per_tensor`` ->
``global_avg_pool_u8``): a pass writing uint8 and a second reading it back. ``pools_read_floats``
rewrites each such pair, where the pool is the quantize's only reader, into one
``global_avg_pool_quantize`` call: the same integers summed, the same bytes out.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.patterns.base import fake_value

from qbackend.kernels import fast_qdq, registry

_QUANTIZES = (fast_qdq.quantize_per_tensor, fast_qdq.quantize_per_tensor_channels_last)


def _quantize_read_by_pool_alone(pool: Node) -> Optional[Node]:
    """The uint8 quantize of a 4-D float32 tensor that ``pool`` alone reads, else None."""
    quantize = pool.args[0]
    if not isinstance(quantize, Node) or quantize.op != "call_function" or quantize.target not in _QUANTIZES \
            or len(quantize.users) != 1 or set(quantize.kwargs) - {"nan_as"} or len(quantize.args) != 6:
        return None
    value = fake_value(quantize.args[0])
    if value is None or value.dtype != torch.float32 or value.dim() != 4 or quantize.args[5] != torch.uint8:
        return None
    return quantize


def pools_read_floats(gm: GraphModule) -> Optional[str]:
    if registry.available() is not None:  # (no own kernels: no uint8 pool either)
        return None
    traced, plain = registry.own_kernel_forms("global_avg_pool_u8")
    fused = 0
    for pool in list(gm.graph.nodes):
        if pool.op != "call_function" or pool.target not in (plain, traced) or pool.kwargs:
            continue
        quantize = _quantize_read_by_pool_alone(pool)
        if quantize is None:
            continue
        x, scale, zero_point, qmin, qmax, _ = quantize.args
        fused_pool = registry.own_kernel("global_avg_pool_quantize", traced=pool.target is traced)
        with gm.graph.inserting_before(pool):
            call = gm.graph.call_function(fused_pool, (x, scale, zero_point, qmin, qmax, quantize.kwargs.get("nan_as", 0),
                                                       *pool.args[1:]))
        call.meta = dict(pool.meta)
        pool.replace_all_uses_with(call)
        gm.graph.erase_node(pool)
        gm.graph.erase_node(quantize)
        fused += 1
    return f"{fused} pool(s) of a quantized float tensor in one pass (no uint8 copy for them)" if fused else None
