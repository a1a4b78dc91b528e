"""CPU (x86, oneDNN): the common emitters plus CPU kernel limits."""
from __future__ import annotations

import dataclasses

import torch

from .common import COMMON


def _uint8_activations(match):
    # The CPU int8 conv/linear kernels read unsigned activations only (signed int8 raises
    # "Input tensor should have uint8 ... data type").
    if match.x.qparams.dtype != torch.uint8:
        return f"CPU int8 kernels take uint8 activations, this one is {match.x.qparams.dtype}"
    return None


TABLE = {name: dataclasses.replace(lowering, limits=_uint8_activations) for name, lowering in COMMON.items()}
