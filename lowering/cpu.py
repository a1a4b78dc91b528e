"""CPU (x86, oneDNN): the common emitters plus CPU kernel limits."""
from __future__ import annotations

import dataclasses

import torch

from .capabilities import (conv_binary_post_op_refusal, conv_post_op_refusal, linear_binary_post_op_refusal,
                           linear_post_op_refusal, quantized_tensor_pool_refusal)
from .base import Lowering
from .common import COMMON
from .signed_int8 import signed_activations_as_unsigned
from .weight_only import emit_weight_only, limits_for


def _uint8_activations(match):
    # The CPU int8 conv/linear kernels read unsigned activations only (signed int8 raises
    # "Input tensor should have uint8 ... data type"). PREPARE turns signed activations into
    # unsigned ones wherever only dequantizes read them; this catches the rest.
    if match.x.qparams.dtype != torch.uint8:
        return (f"CPU int8 kernels take uint8 activations, this one is {match.x.qparams.dtype}"
                " (and not convertible: something other than a dequantize reads the signed tensor)")
    return None


def _post_op(match):
    post = match.post_op
    if post is None:
        return None
    binary = match.accum is not None or match.accum_float is not None
    if match.conv is not None and binary:
        return conv_binary_post_op_refusal("cpu", post.name, post.scalars, post.algorithm)
    if match.conv is not None:
        return conv_post_op_refusal("cpu", match.conv.spatial_rank, post.name, post.scalars, post.algorithm)
    if binary:
        return linear_binary_post_op_refusal("cpu", post.name, post.scalars, post.algorithm)
    return linear_post_op_refusal("cpu", post.name, post.scalars, post.algorithm)


def _limits(match):
    return _uint8_activations(match) or _post_op(match)


# The rows that run an int8 kernel; the data-movement rows (cat, views) run plain ATen ops.
KERNEL_ROWS = ("qconv", "qconv_add", "qlinear", "qlinear_add", "qlinear_dynamic", "qlinear_add_dynamic", "qmaxpool2d")
TABLE = {**COMMON, **{name: dataclasses.replace(COMMON[name], limits=_limits) for name in KERNEL_ROWS}}
TABLE["qavgpool"] = dataclasses.replace(COMMON["qavgpool"], limits=lambda match: _uint8_activations(match) or quantized_tensor_pool_refusal("cpu"))
TABLE["int4_weight_linear"] = Lowering(emit_weight_only, ("int4_pack", "int4_mm"), limits_for("cpu"))
TABLE["int8_weight_linear"] = Lowering(emit_weight_only, ("int8_weight_only_mm",), limits_for("cpu"))

# Graph rewrites run before the rules (each returns a report note or None).
PREPARE = (signed_activations_as_unsigned,)
