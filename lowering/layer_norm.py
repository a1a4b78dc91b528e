"""LayerNorm and the quantize after it as one pass on CPU: qbackend's layer_norm_quantize
kernel (qbackend/csrc/layer_norm_quantize.c). ATen's LayerNorm writes the float32 rows and
the quantize reads them again; at ConvNeXt's 96 channels ATen also spends ~30 ns a row of its
own (3136 rows: 64 us here against ~145 for the two ATen calls)."""
from __future__ import annotations

from typing import Optional

import torch

from qbackend import native
from qbackend.patterns.base import constant_value, fake_value

from . import own_conv
from .base import EmitContext
from .signed_int8 import nan_as


def refusal(ctx: EmitContext, match) -> Optional[str]:
    q = match.output_quant
    if q.dtype != torch.uint8:
        return f"the kernel writes uint8, not {q.dtype}"
    if nan_as(match.result).get("nan_as", 0) != q.qmin:  # (the kernel stores a NaN as qmin)
        return "the quantize stores NaN as another level than qmin"
    weight, bias, eps = match.op_args
    return (native.layer_norm_quantize_refusal(fake_value(match.float_source), constant_value(ctx.gm, weight),
                                               constant_value(ctx.gm, bias), float(eps)) or native.available())


def emit(ctx: EmitContext, match):
    q = match.output_quant
    weight, bias, eps = match.op_args
    ctx.kernel = f"{native.NAMESPACE}::layer_norm_quantize.default"
    ctx.notes.append("qbackend's LayerNorm-and-quantize kernel")
    return own_conv.call_kernel(ctx, "layer_norm_quantize", (match.float_source, weight, bias, float(eps), q.scale,
                                                             q.zero_point, q.qmin, q.qmax))


KERNEL = own_conv.OwnKernel("LayerNorm-and-quantize", lambda match: True, refusal, emit)
