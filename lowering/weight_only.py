"""Weight-only int4 / int8 linears in a graph: the packed weight (qbackend/kernels/weight_only_linear.py)
and its kernel's steps recorded as nodes."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from qbackend.kernels import registry
from qbackend.patterns.base import fake_value
from qbackend.kernels.weight_only_linear import kernel_of, linear_steps, pack, refusal

from .common import mark_sibling


def limits_for(device: str) -> Callable:
    """The lowering table's view of ``refusal``."""
    return lambda match: refusal(match.weight_only, device)


def emit_weight_only(ctx, match):
    x = match.float_input
    value = fake_value(x)
    packed = pack(match.weight_only, ctx.device, value.dtype, ctx.weight_only_compute, lambda name: ctx.op(name).op)
    if packed.op in registry.OPS:
        ctx.notes.append(f"{value.dtype} activations quantized per group to int16 for qbackend's kernel "
                         "(options={'weight_only_compute': 'bf16'} runs torch's)")
    elif packed.compute_dtype != value.dtype:
        ctx.notes.append(f"{value.dtype} activations computed in {packed.compute_dtype} "
                         "(options={'weight_only_compute': 'activation'} keeps them)")
    if packed.note:
        ctx.notes.append(packed.note)
    bits, kernel = match.weight_only.bits, kernel_of(packed.op, ctx.op)
    ctx.kernel = kernel.qualname
    call_target = registry.own_kernel(packed.op, traced=ctx.need_meta) if packed.op in registry.OPS else kernel.op
    args = tuple(ctx.constant(a, f"int{bits}_w") if isinstance(a, torch.Tensor) else a for a in packed.args)
    dense = None
    if ctx.weight_only_dense_rows is not None:
        dense = ctx.constant(match.weight_only.dequantize(packed.compute_dtype), f"int{bits}_dense")
        ctx.notes.append(f"dense {packed.compute_dtype} matmul from {ctx.weight_only_dense_rows} rows on")
    graph, calls = ctx.gm.graph, []

    def call(fn, *a, **k):
        calls.append(graph.call_function(fn, a, k))
        return calls[-1]

    result = linear_steps(call, x, value.dim(), value.dtype, dataclasses.replace(packed, args=args), call_target, match.bias,
                          dense, ctx.weight_only_dense_rows)
    if packed.op in registry.OPS and dense is None:  # (sibling_linears.py merges those reading one input)
        mark_sibling(next(n for n in calls if n.target is call_target), match.anchor, None)
    return result
