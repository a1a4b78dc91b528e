"""CPU (x86, oneDNN): the common emitters plus CPU kernel limits."""
from __future__ import annotations

import dataclasses

import torch

from .capabilities import (conv_binary_post_op_refusal, conv_post_op_refusal, linear_binary_post_op_refusal,
                           linear_post_op_refusal)
from .base import Lowering
from .common import COMMON
from .weight_only import emit_weight_only
from .weight_only import limits as weight_only_limits


def _uint8_activations(match):
    # The CPU int8 conv/linear kernels read unsigned activations only (signed int8 raises
    # "Input tensor should have uint8 ... data type").
    if match.x.qparams.dtype != torch.uint8:
        return f"CPU int8 kernels take uint8 activations, this one is {match.x.qparams.dtype}"
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


TABLE = {name: dataclasses.replace(lowering, limits=_limits) for name, lowering in COMMON.items()}
TABLE["int4_weight_linear"] = Lowering(emit_weight_only, ("int4_pack", "int4_mm"), weight_only_limits)
TABLE["int8_weight_linear"] = Lowering(emit_weight_only, ("int8_weight_only_mm",), weight_only_limits)
