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


def _ask(device: str, run) -> Optional[str]:
    try:
        run()
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return None


def _unresolved(device: str, *logical: str) -> Optional[str]:
    missing = [r for r in (resolve(name, device) for name in logical) if not r]
    return missing[0].reason if missing else None


@functools.lru_cache(maxsize=None)
def conv_post_op_refusal(device: str, spatial_rank: int, attr: str, scalars: tuple, algorithm: str) -> Optional[str]:
    """None if the device's int8 conv runs ``attr`` for this rank, else the kernel's message."""
    unresolved = _unresolved(device, "qconv", "qconv_prepack")
    if unresolved:
        return unresolved
    qconv, prepack = resolve("qconv", device).op, resolve("qconv_prepack", device).op
    ones, zeros = [1] * spatial_rank, [0] * spatial_rank
    x = torch.full((1, 1, *[3] * spatial_rank), 128, dtype=torch.uint8, device=device)
    w = torch.ones((1, 1, *ones), dtype=torch.int8, device=device)
    w_scale, w_zp = torch.ones(1, device=device), torch.zeros(1, dtype=torch.int64, device=device)

    def run():
        packed = prepack(w, w_scale, 1.0, 0, ones, zeros, ones, 1, None)
        qconv(x, 1.0, 0, packed, w_scale, w_zp, None, ones, zeros, ones, 1, 1.0, 0, None, attr, list(scalars), algorithm)

    return _ask(device, run)


@functools.lru_cache(maxsize=None)
def linear_post_op_refusal(device: str, attr: str, scalars: tuple, algorithm: str) -> Optional[str]:
    """None if the device's int8 linear runs ``attr``, else the kernel's message."""
    unresolved = _unresolved(device, "qlinear", "qlinear_prepack")
    if unresolved:
        return unresolved
    qlinear, prepack = resolve("qlinear", device).op, resolve("qlinear_prepack", device).op
    x = torch.full((1, 4), 128, dtype=torch.uint8, device=device)
    w = torch.ones((4, 4), dtype=torch.int8, device=device)
    w_scale, w_zp = torch.ones(4, device=device), torch.zeros(4, dtype=torch.int64, device=device)

    def run():
        qlinear(x, 1.0, 0, prepack(w, None), w_scale, w_zp, None, 1.0, 0, None, attr, list(scalars), algorithm)

    return _ask(device, run)


@functools.lru_cache(maxsize=None)
def conv_binary_post_op_refusal(device: str, attr: str, scalars: tuple, algorithm: str) -> Optional[str]:
    """None if the device's int8 conv2d + sum runs unary ``attr`` after the sum."""
    unresolved = _unresolved(device, "qconv_binary", "qconv_prepack")
    if unresolved:
        return unresolved
    qconv_binary, prepack = resolve("qconv_binary", device).op, resolve("qconv_prepack", device).op
    x = torch.full((1, 1, 3, 3), 128, dtype=torch.uint8, device=device)
    w = torch.ones((1, 1, 1, 1), dtype=torch.int8, device=device)
    w_scale, w_zp = torch.ones(1, device=device), torch.zeros(1, dtype=torch.int64, device=device)

    def run():
        accum = torch.zeros((1, 1, 3, 3), dtype=torch.uint8, device=device).contiguous(memory_format=torch.channels_last)
        packed = prepack(w, w_scale, 1.0, 0, [1, 1], [0, 0], [1, 1], 1, None)
        qconv_binary(x, 1.0, 0, packed, w_scale, w_zp, accum, None, [1, 1], [0, 0], [1, 1], 1, 1.0, 0, None,
                     1.0, 0, "sum", 1.0, attr, list(scalars), algorithm)

    return _ask(device, run)


@functools.lru_cache(maxsize=None)
def linear_binary_post_op_refusal(device: str, attr: str, scalars: tuple, algorithm: str) -> Optional[str]:
    """None if the device's int8 linear + add runs unary ``attr`` after the add."""
    unresolved = _unresolved(device, "qlinear_binary", "qlinear_prepack")
    if unresolved:
        return unresolved
    qlinear_binary, prepack = resolve("qlinear_binary", device).op, resolve("qlinear_prepack", device).op
    x = torch.full((1, 4), 128, dtype=torch.uint8, device=device)
    w = torch.ones((4, 4), dtype=torch.int8, device=device)
    w_scale, w_zp = torch.ones(4, device=device), torch.zeros(4, dtype=torch.int64, device=device)

    def run():
        other = torch.zeros((1, 4), device=device)
        qlinear_binary(x, 1.0, 0, prepack(w, None), w_scale, w_zp, other, None, 1.0, 0, torch.float32,
                       1.0, 0, "add", 1.0, attr, list(scalars), algorithm)

    return _ask(device, run)
