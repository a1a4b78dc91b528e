"""Weight-only quantization: the math and the device-neutral storage format.

A weight-only quantized [N, K] weight is signed integers ``q`` (int4 in [-8, 7] or int8 in
[-128, 127]) with one scale per (row, group of ``group_size`` columns) and either an integer
zero point (``w = (q - zero_point) * scale``, the PT2E form) or a float offset
(``w = q * scale + offset``, torchao's float zero-point domain). Every device packs this form
its own way, at compile time or on first use; the packed layouts are never stored.

Neutral int4 storage puts two values in a byte (row-major; the even column in the low nibble)
as ``q + 8``, so an int4 model holds 1/8 of its fp32 weight bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

RANGE = {4: (-8, 7), 8: (-128, 127)}


@dataclass(frozen=True)
class GroupQuantized:
    """A weight-only quantized [N, K] weight, device-neutral."""

    bits: int
    stored: torch.Tensor  # int8 [N, K] within RANGE[bits]; with ``nibbles``, neutral uint8 [N, K / 2]
    scale: torch.Tensor  # float [N, K // group_size]
    group_size: int
    zero_point: Optional[torch.Tensor] = None  # int [N, G]: w = (q - zero_point) * scale
    offset: Optional[torch.Tensor] = None  # float [N, G]: w = q * scale + offset
    nibbles: bool = False  # int4 kept two per byte: packers unpack a few rows at a time

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.stored.shape
        return (n, 2 * k) if self.nibbles else (n, k)

    def rows(self, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """The int8 values of rows [start, stop) (all rows by default)."""
        part = self.stored[start:stop]
        return unpack_int4(part) if self.nibbles else part

    def nibble_storage(self, chunk_rows: int = 64) -> torch.Tensor:
        """The neutral int4 storage (uint8 [N, K / 2]): ``stored`` itself, or packed from int8
        values ``chunk_rows`` at a time (a few MB of int16 scratch, not 2 bytes per weight)."""
        if self.nibbles:
            return self.stored
        n = self.shape[0]
        return torch.cat([pack_int4(self.rows(start, start + chunk_rows)) for start in range(0, n, chunk_rows)])

    def float_offset(self) -> torch.Tensor:
        """The offset form of the zero point, ``w = q * scale + offset`` (float32 [N, G])."""
        if self.offset is not None:
            return self.offset.float()
        if self.zero_point is None:
            return torch.zeros_like(self.scale, dtype=torch.float32)
        return -self.zero_point.float() * self.scale.float()

    def is_symmetric(self) -> bool:
        zero = self.offset if self.offset is not None else self.zero_point
        return zero is None or not bool(zero.any())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = self.scale.float().repeat_interleave(self.group_size, dim=1)
        if self.offset is not None:
            w = self.rows().float() * scale + self.offset.float().repeat_interleave(self.group_size, dim=1)
        else:
            zero = 0 if self.zero_point is None else self.zero_point.float().repeat_interleave(self.group_size, dim=1)
            w = (self.rows().float() - zero) * scale
        return w.to(dtype)


def quantize(weight: torch.Tensor, bits: int, group_size: Optional[int] = None) -> GroupQuantized:
    """int4: asymmetric per group (min/max; integer zero points); int8: symmetric per row
    (``group_size`` None or K), the form the int8 weight-only kernels take."""
    n, k = weight.shape
    group_size = k if group_size is None else group_size
    if bits not in RANGE:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group_size}")
    qmin, qmax = RANGE[bits]
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    if bits == 8:
        if group_size != k:
            raise ValueError("int8 weight-only quantization is per output channel (group_size = in_features)")
        scale = (groups.abs().amax(dim=2) / qmax).clamp(min=torch.finfo(torch.float32).eps)
        q = torch.round(groups / scale[..., None]).clamp(qmin, qmax)
        return GroupQuantized(8, q.reshape(n, k).to(torch.int8), scale, group_size)
    low = groups.amin(dim=2).clamp(max=0)
    high = groups.amax(dim=2).clamp(min=0)
    scale = ((high - low) / (qmax - qmin)).clamp(min=torch.finfo(torch.float32).eps)
    zero_point = torch.round(qmin - low / scale).clamp(qmin, qmax)
    q = torch.round(groups / scale[..., None] + zero_point[..., None]).clamp(qmin, qmax)
    return GroupQuantized(4, q.reshape(n, k).to(torch.int8), scale, group_size, zero_point=zero_point.to(torch.int8))


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] in [-8, 7] -> uint8 [N, K / 2], the neutral storage layout."""
    if values.shape[-1] % 2:
        raise ValueError(f"int4 storage needs an even number of columns, got {values.shape[-1]}")
    unsigned = (values.to(torch.int16) + 8).to(torch.uint8)
    return unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] (neutral layout) -> int8 [N, K] in [-8, 7]."""
    low = (packed & 0xF).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)
