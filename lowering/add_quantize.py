"""A float sum and the quantize after it as one pass on CPU: qbackend's add_quantize kernel
(qbackend/kernels/csrc/add_quantize.c; ConvNeXt's 56x56x96 residual at batch 1: 37 vs 59 us for ATen's
add and the quantize). The sum stays float for its other readers: in the add's target where
the add was in place (ConvNeXt's `x += residual`: no new 1.2 MB tensor a call)."""
from __future__ import annotations

from typing import Optional

import torch

from qbackend.kernels import add_quantize, registry
from qbackend.patterns.base import fake_value

from . import own_conv
from .base import EmitContext


def limits(match) -> Optional[str]:
    return (own_conv.uint8_quantize_refusal(match)
            or add_quantize.add_quantize_refusal(fake_value(match.float_source), fake_value(match.op_args[0])) or registry.available())


def emit(ctx: EmitContext, match):
    """The uint8 copy; the float sum for the add's other readers: written into the add's target
    where the add was in place (the pattern checked nothing else reads that), else a new tensor."""
    q, add = match.output_quant, match.anchor
    args = (match.float_source, match.op_args[0], q.scale, q.zero_point, q.qmin, q.qmax)
    ctx.notes.append("qbackend's add-and-quantize kernel")
    if add.target is torch.ops.aten.add_.Tensor:
        ctx.kernel = f"{registry.NAMESPACE}::add_quantize_.default"
        quantized = own_conv.call_kernel(ctx, "add_quantize_", args)
        add.replace_all_uses_with(match.float_source, delete_user_cb=lambda user: user is not match.result)
        return quantized
    ctx.kernel = f"{registry.NAMESPACE}::add_quantize.default"
    return own_conv.call_kernel_keeping_float(ctx, "add_quantize", args, add, match.result)
