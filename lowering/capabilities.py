"""Kernel limits, asked of the kernel rather than assumed.

torch 2.13's CPU int8 conv accepts relu for conv1d/conv2d but not conv3d, and rejects gelu
for every rank; such facts change between releases. Each question runs the real op once on
a tiny input and is cached for the process.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from qbackend.ops import resolve


@functools.lru_cache(maxsize=None)
def conv_post_op_refusal(device: str, spatial_rank: int, attr: str, scalars: tuple, algorithm: str) -> Optional[str]:
    """None if the device's int8 conv runs ``attr`` for this rank, else the kernel's message."""
    qconv, prepack = resolve("qconv", device), resolve("qconv_prepack", device)
    if not (qconv and prepack):
        return qconv.reason if not qconv else prepack.reason
    ones = [1] * spatial_rank
    x = torch.full((1, 1, *[3] * spatial_rank), 128, dtype=torch.uint8, device=device)
    w = torch.ones((1, 1, *ones), dtype=torch.int8, device=device)
    w_scale = torch.ones(1, device=device)
    try:
        packed = prepack.op(w, w_scale, 1.0, 0, ones, [0] * spatial_rank, ones, 1, None)
        qconv.op(x, 1.0, 0, packed, w_scale, torch.zeros(1, dtype=torch.int64, device=device), None,
                 ones, [0] * spatial_rank, ones, 1, 1.0, 0, None, attr, list(scalars), algorithm)
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return None
