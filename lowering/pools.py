"""Int8 pools on CPU: qbackend's own kernels (qbackend/kernels/csrc/max_pool_uint8.c,
global_avg_pool_uint8.c).

- Max pool: torch 2.13's quantized::max_pool2d runs on one thread here (0.39-0.43 ms for
  ResNet-18's 8x64x112x112 pool with 1 or 2 threads); the kernel runs on all of them. Exact:
  max commutes with the dequantize. Ceil mode too (GoogLeNet's 13 pools): its last, partial
  window is clipped to the image as the padding is.
- Global average pool (adaptive_avg_pool2d to 1x1, a classifier head's): torch pools int8
  only as a quantized tensor (three ops: 12 vs 9 us on MobileNetV2's head at batch 1, 68 vs
  31 at batch 8), and an own kernel joins the kernel chain around it. Within one step of the
  reference, as torch's.
"""
from __future__ import annotations

from typing import Optional

import torch

from qbackend.kernels import registry
from qbackend.patterns.base import fake_value

from . import own_conv
from .base import EmitContext

aten = torch.ops.aten


def _input_refusal(match) -> Optional[str]:
    value = fake_value(match.x.node)
    if value is None:
        return "the input's shape was not recorded (the kernel takes a batched [N, C, H, W] input)"
    if value.dim() != 4:
        return f"the kernel takes a batched [N, C, H, W] input, not one of rank {value.dim()}"
    if match.x.qparams.dtype != torch.uint8:
        return "the kernel reads uint8"
    return registry.available()


def emit_max_pool(ctx: EmitContext, match):
    kernel_size, stride, padding, dilation, ceil_mode = match.op_args
    ctx.kernel = f"{registry.NAMESPACE}::max_pool_u8.default"
    ctx.notes.append("qbackend's max pool kernel (quantized::max_pool2d runs on one thread)")
    return own_conv.call_kernel(ctx, "max_pool_u8", (match.x.node, *(tuple(a) for a in (kernel_size, stride, padding, dilation)))
                                + ((True,) if ceil_mode else ()))


def is_global_average(match) -> bool:
    return match.anchor.target is aten.adaptive_avg_pool2d.default and list(match.op_args[0]) == [1, 1]


def emit_global_average(ctx: EmitContext, match):
    x = match.x.qparams
    ctx.kernel = f"{registry.NAMESPACE}::global_avg_pool_u8.default"
    ctx.notes.append("qbackend's global average pool kernel (torch pools int8 as a quantized-tensor copy)")
    return own_conv.call_kernel(ctx, "global_avg_pool_u8", (match.x.node, x.zero_point, x.qmin, x.qmax))


MAX_POOL = own_conv.OwnKernel("max pool", lambda match: True, lambda ctx, match: _input_refusal(match), emit_max_pool)
GLOBAL_AVERAGE_POOL = own_conv.OwnKernel("global average pool", is_global_average, lambda ctx, match: _input_refusal(match),
                                         emit_global_average)
