"""LayerNorm and the quantize after it as one pass on CPU: qbackend's layer_norm_quantize
kernel (qbackend/kernels/csrc/layer_norm_quantize.c). ATen's LayerNorm writes the float32 rows and
the quantize reads them again; at ConvNeXt's 96 channels ATen also spends ~30 ns a row of its
own (3136 rows: 64 us here against ~145 for the two ATen calls). A post-LN transformer's
residual reads the normed rows too: the kernel then writes them as well."""
from __future__ import annotations

from typing import Optional

from qbackend.kernels import layer_norm_quantize, registry
from qbackend.patterns.base import constant_value, fake_value

from . import own_conv
from .base import EmitContext


def refusal(ctx: EmitContext, match) -> Optional[str]:
    weight, bias, eps = match.op_args
    return (own_conv.uint8_quantize_refusal(match)
            or layer_norm_quantize.layer_norm_quantize_refusal(fake_value(match.float_source), constant_value(ctx.gm, weight),
                                                  constant_value(ctx.gm, bias), float(eps)) or registry.available())


def emit(ctx: EmitContext, match):
    """The uint8 rows; where other ops read the normed rows too (a post-LN transformer's
    residual), the kernel writes the float32 rows for them as well."""
    q, norm = match.output_quant, match.anchor
    weight, bias, eps = match.op_args
    args = (match.float_source, weight, bias, float(eps), q.scale, q.zero_point, q.qmin, q.qmax)
    ctx.notes.append("qbackend's LayerNorm-and-quantize kernel")
    if len(norm.users) == 1:
        ctx.kernel = f"{registry.NAMESPACE}::layer_norm_quantize.default"
        return own_conv.call_kernel(ctx, "layer_norm_quantize", args)
    ctx.kernel = f"{registry.NAMESPACE}::layer_norm_and_quantize.default"
    return own_conv.call_kernel_keeping_float(ctx, "layer_norm_and_quantize", args, norm, match.result)


KERNEL = own_conv.OwnKernel("LayerNorm-and-quantize", lambda match: True, refusal, emit)
