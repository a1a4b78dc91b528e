"""Int8 pools on CPU: qbackend's own kernels (qbackend/kernels/csrc/max_pool_uint8.c,
global_avg_pool_uint8.c).

- Max pool: torch 2.13's quantized::max_pool2d runs on one thread here (0.39-0.43 ms for
  ResNet-18's 8x64x112x112 pool with 1 or 2 threads); the kernel runs on all of them. Exact:
  max commutes with the dequantize. Ceil mode too (GoogLeNet's 13 pools): its last, partial
  window is clipped to the image as the padding is.
- Average pool (avg_pool2d: DenseNet's transitions): torch pools int8 only as a quantized tensor
  (three ops), and the own kernel joins the kernel chain around it. Within one step of the
  reference, as torch's.
- Global average pool (adaptive_avg_pool2d to 1x1, a classifier head's): torch pools int8
  only as a quantized tensor (three ops: 12 vs 9 us on MobileNetV2's head at batch 1, 68 vs
  31 at batch 8), and an own kernel joins the kernel chain around it. Within one step of the
  reference, as torch's.
"""
from __future__ import annotations

from typing import Optional

import torch

from qbackend.kernels import pools, registry
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


AVG_POOL_DEFAULTS = ([], 0, False, True, None)  # avg_pool2d's stride, padding, ceil_mode, count_include_pad, divisor_override


def _pair(value) -> tuple:
    return tuple(value) * (2 // len(value)) if isinstance(value, (list, tuple)) else (value, value)


def average_pool_arguments(match) -> tuple:
    """avg_pool2d's arguments, torch's defaults filled in: kernel, stride, padding (pairs),
    ceil_mode, count_include_pad, divisor (0: none)."""
    kernel_size, stride, padding, ceil_mode, count_include_pad, divisor = (*match.op_args,
                                                                           *AVG_POOL_DEFAULTS[len(match.op_args) - 1:])
    kernel_size = _pair(kernel_size)
    return (kernel_size, _pair(stride) if stride else kernel_size, _pair(padding), bool(ceil_mode), bool(count_include_pad),
            divisor or 0)


def _average_refusal(match) -> Optional[str]:
    kernel_size, _, padding, _, _, divisor = average_pool_arguments(match)
    most = pools.AVG_POOL_MAX_WINDOW
    if kernel_size[0] * kernel_size[1] > most or not 0 <= divisor <= most:
        return f"kernel {list(kernel_size)}, divisor {divisor}: the kernel takes windows of up to {most} pixels, divisors to {most}"
    if any(2 * p > k for p, k in zip(padding, kernel_size)):
        return f"padding {list(padding)} over half the kernel {list(kernel_size)}"
    return _input_refusal(match)


def emit_average(ctx: EmitContext, match):
    x = match.x.qparams
    ctx.kernel = f"{registry.NAMESPACE}::avg_pool_u8.default"
    ctx.notes.append("qbackend's average pool kernel (torch pools int8 as a quantized-tensor copy)")
    return own_conv.call_kernel(ctx, "avg_pool_u8", (match.x.node, *average_pool_arguments(match), x.zero_point, x.qmin, x.qmax))


def is_global_average(match) -> bool:
    return match.anchor.target is aten.adaptive_avg_pool2d.default and list(match.op_args[0]) == [1, 1]


def emit_global_average(ctx: EmitContext, match):
    x = match.x.qparams
    ctx.kernel = f"{registry.NAMESPACE}::global_avg_pool_u8.default"
    ctx.notes.append("qbackend's global average pool kernel (torch pools int8 as a quantized-tensor copy)")
    return own_conv.call_kernel(ctx, "global_avg_pool_u8", (match.x.node, x.zero_point, x.qmin, x.qmax))


MAX_POOL = own_conv.OwnKernel("max pool", lambda match: True, lambda ctx, match: _input_refusal(match), emit_max_pool)
AVERAGE_POOL = own_conv.OwnKernel("average pool", lambda match: match.anchor.target is aten.avg_pool2d.default,
                                  lambda ctx, match: _average_refusal(match), emit_average)
GLOBAL_AVERAGE_POOL = own_conv.OwnKernel("global average pool", is_global_average, lambda ctx, match: _input_refusal(match),
                                         emit_global_average)
