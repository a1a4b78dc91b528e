"""Intel GPU (XPU): what torch's in-tree XPU registrations of the onednn int8 ops run.

Read from torch's sources (aten/src/ATen/native/mkldnn/xpu/qconv.cpp, qlinear.cpp and their
oneDNN helpers), since no XPU is available where this table was written:

- ``onednn::qconv_prepack`` returns the weight unchanged and ``onednn::qlinear_prepack`` its
  transpose, so the common emitters' compile-time prepack works as on CPU (the transposed
  linear weight is stored contiguous: the kernel would copy it on every call).
- Activations may be int8 (XPUInductorQuantizer's default) or uint8; an int8 output has the
  input's integer dtype, whatever ``output_dtype`` says; float outputs are float32 or bf16.
- ``qlinear_pointwise`` takes 2-D input only (N-D input is flattened around it);
  ``qlinear_pointwise.binary`` 2-D or 3-D input, ``add`` / ``sum`` with relu or nothing after.
- conv1d / conv3d take no post-op; conv2d relu, hardtanh, hardswish, swish; conv2d + ``sum``
  with relu or nothing after.

Where an XPU is present the post-op limits are asked of the kernel as on CPU; elsewhere the
limits above stand in for the answer, and say so.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from qbackend.patterns.base import Match

from .base import Lowering, Unsupported
from .capabilities import conv_post_op_refusal, linear_post_op_refusal
from .common import COMMON, emit_qlinear_2d, static_shape
from .layer_scale import fold_layer_scale
from .weight_only import emit_weight_only, limits_for

SOURCE = "torch's XPU kernel source (no XPU here to ask)"
CONV_POST_OPS = {1: ("none",), 2: ("none", "relu", "hardtanh", "hardswish", "swish"), 3: ("none",)}
LINEAR_POST_OPS = ("none", "relu", "leaky_relu", "tanh", "gelu", "hardtanh", "hardswish", "swish")
BINARY_POST_OPS = ("none", "relu")  # after conv2d + sum, linear + add / sum
FLOAT_OUTPUTS = (torch.float32, torch.bfloat16)
PREPARE = (fold_layer_scale,)  # (no signed -> unsigned rewrite: the XPU kernels read int8 and uint8 alike)


def device_present() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def _listed(what: str, name: str, allowed: tuple) -> Optional[str]:
    if name in allowed:
        return None
    return f"the XPU int8 {what} takes post-ops {', '.join(allowed)}, not {name} ({SOURCE})"


def _output_dtype(match: Match) -> Optional[str]:
    out = match.output_quant
    if out is not None and out.dtype != match.x.qparams.dtype:
        return (f"the XPU int8 kernels write their input's integer dtype ({match.x.qparams.dtype}); "
                f"this output is quantized to {out.dtype}")
    if out is None and match.float_dtype not in FLOAT_OUTPUTS:
        return f"the XPU int8 kernels write float32 or bf16 float outputs, not {match.float_dtype}"
    return None


def _conv_post_op(match: Match) -> Optional[str]:
    post, rank = match.post_op, match.conv.spatial_rank
    if post is None:
        return None
    if device_present():
        return conv_post_op_refusal("xpu", rank, post.name, post.scalars, post.algorithm)
    return _listed(f"conv{rank}d", post.name, CONV_POST_OPS[rank])


def _linear_post_op(match: Match) -> Optional[str]:
    post = match.post_op
    if post is None:
        return None
    if device_present():
        return linear_post_op_refusal("xpu", post.name, post.scalars, post.algorithm)
    return _listed("linear", post.name, LINEAR_POST_OPS)


def _binary_post_op(match: Match) -> Optional[str]:
    post = match.post_op
    return None if post is None else _listed("conv / linear + add", post.name, BINARY_POST_OPS)


def _static_rows(match: Match) -> Optional[str]:
    if static_shape(match.x.node) is None:
        return "the XPU int8 linear takes 2-D input; this input's shape is symbolic, so it is not flattened"
    return None


def _binary_rank(match: Match) -> Optional[str]:
    rank = len(static_shape(match.x.node) or ())
    return None if rank in (2, 3) else f"the XPU int8 linear + add takes 2-D or 3-D input, this one is {rank}-D"


def _first(*checks):
    def limits(match):
        return next((reason for reason in (check(match) for check in checks) if reason), None)
    return limits


NO_DYNAMIC = Unsupported("XPUInductorQuantizer has no dynamic quantization; dynamic graphs are a CPU flow")
TABLE = {
    "qconv": dataclasses.replace(COMMON["qconv"], limits=_first(_output_dtype, _conv_post_op)),
    "qconv_add": dataclasses.replace(COMMON["qconv_add"], limits=_first(_output_dtype, _binary_post_op)),
    "qlinear": Lowering(emit_qlinear_2d, COMMON["qlinear"].needs, _first(_static_rows, _output_dtype, _linear_post_op)),
    "qlinear_add": dataclasses.replace(COMMON["qlinear_add"], limits=_first(_binary_rank, _output_dtype, _binary_post_op)),
    "qlinear_dynamic": NO_DYNAMIC,
    "qlinear_add_dynamic": NO_DYNAMIC,
    "qmaxpool2d": Unsupported("quantized::max_pool2d has CPU kernels only (XPUInductorQuantizer leaves max_pool2d float)"),
    "qavgpool": Unsupported("runs the ATen pool on a quantized tensor: torch has no quantized tensors on XPU"),
    "int4_weight_linear": Lowering(emit_weight_only, ("int4_pack", "int4_mm_scales_zeros"), limits_for("xpu")),
    "int8_weight_linear": Lowering(emit_weight_only, ("int8_weight_only_mm",), limits_for("xpu")),
    # plain ATen data movement, exact on any device that has the op
    "qcat": COMMON["qcat"],
    "qview": COMMON["qview"],
    "sdpa": COMMON["sdpa"],  # composite: torch picks XPU's own attention kernel
    "sdpa_fused": COMMON["sdpa_fused"],
    "qsmooth": COMMON["qsmooth"],
    "qscale": COMMON["qscale"],
    "qlayernorm": COMMON["qlayernorm"],
    "qadd": Unsupported("no add-and-quantize kernel on XPU: the graph's add and quantize stay"),
}
