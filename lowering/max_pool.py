"""Int8 max pooling on CPU: qbackend's own kernel (qbackend/csrc/max_pool_uint8.c).

torch 2.13's quantized::max_pool2d runs on one thread here (0.39-0.43 ms for ResNet-18's
8x64x112x112 pool with 1 or 2 threads); the kernel here runs on all of them. Exact: max
commutes with the dequantize. Ceil mode keeps torch's kernel.
"""
from __future__ import annotations

from typing import Optional

import torch

from qbackend import native
from qbackend.patterns.base import fake_value

from . import own_conv
from .base import EmitContext


def refusal(ctx: EmitContext, match) -> Optional[str]:
    """Why this pool is not for the kernel (None if it is)."""
    kernel_size, stride, padding, dilation, ceil_mode = match.op_args
    if ceil_mode:
        return "ceil_mode: the kernel pools in floor mode"
    value = fake_value(match.x.node)
    if value is None or value.dim() != 4:
        return "the kernel takes a batched [N, C, H, W] input"
    if match.x.qparams.dtype != torch.uint8:
        return "the kernel reads uint8"
    return native.available()


def emit(ctx: EmitContext, match):
    kernel_size, stride, padding, dilation, _ = match.op_args
    ctx.kernel = f"{native.NAMESPACE}::max_pool_u8.default"
    ctx.notes.append("qbackend's max pool kernel (quantized::max_pool2d runs on one thread)")
    return own_conv.call_kernel(ctx, "max_pool_u8", (match.x.node, *(tuple(a) for a in (kernel_size, stride, padding, dilation))))


KERNEL = own_conv.OwnKernel("max pool", lambda match: True, refusal, emit)
