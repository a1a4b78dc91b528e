"""Squeeze-excitation's channel scale and the quantize after it as one pass on CPU: qbackend's
scale_quantize kernel (qbackend/kernels/csrc/scale_quantize.c; the reference's integers, one read of
the float features where ATen's multiply writes them and its quantize reads them again:
109 vs 123 us on EfficientNet's largest, 1x96x112x112). The gate making the factors (sigmoid,
hard sigmoid) runs in the kernel too: no float op is left between the block's convs, so one
kernel chain runs the block (EfficientNet-B0: 16 blocks, each had left the chain 3 times)."""
from __future__ import annotations

from typing import Optional

from qbackend.kernels import registry, scale_quantize
from qbackend.patterns.base import fake_value
from qbackend.patterns.qscale import GATES

from . import own_conv
from .base import EmitContext


def refusal(ctx: EmitContext, match) -> Optional[str]:
    return (own_conv.uint8_quantize_refusal(match)
            or scale_quantize.scale_quantize_refusal(fake_value(match.float_source), fake_value(match.op_args[0]))
            or registry.available())


def emit(ctx: EmitContext, match):
    q = match.output_quant
    factors, gate = match.op_args
    source, name = (gate.args[0], GATES[gate.target]) if gate is not None else (factors, "none")
    ctx.kernel = f"{registry.NAMESPACE}::scale_quantize.default"
    ctx.notes.append("qbackend's scale-and-quantize kernel" + (f", its {name} gate too" if gate is not None else ""))
    return own_conv.call_kernel(ctx, "scale_quantize", (match.float_source, source, q.scale, q.zero_point, q.qmin, q.qmax, name))


KERNEL = own_conv.OwnKernel("scale-and-quantize", lambda match: True, refusal, emit)
