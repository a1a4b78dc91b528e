"""CPU (x86, oneDNN): the common emitters plus CPU kernel limits."""
from __future__ import annotations

import dataclasses

import torch

from .capabilities import conv_post_op_refusal
from .common import COMMON


def _uint8_activations(match):
    # The CPU int8 conv/linear kernels read unsigned activations only (signed int8 raises
    # "Input tensor should have uint8 ... data type").
    if match.x.qparams.dtype != torch.uint8:
        return f"CPU int8 kernels take uint8 activations, this one is {match.x.qparams.dtype}"
    return None


def _conv_post_op(match):
    post = match.post_op
    if match.conv is None or post is None or match.accum is not None or match.accum_float is not None:
        return None
    return conv_post_op_refusal("cpu", match.conv.spatial_rank, post.name, post.scalars, post.algorithm)


def _limits(match):
    return _uint8_activations(match) or _conv_post_op(match)


TABLE = {name: dataclasses.replace(lowering, limits=_limits) for name, lowering in COMMON.items()}
