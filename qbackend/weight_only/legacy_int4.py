"""Int4 weights packed by torch 2.3-2.5's CPU ``_convert_weight_to_int4pack``: back to the
device-neutral form.

That op returned int32 [N/8, K/(16*inner_k_tiles), 32, inner_k_tiles/2], a shape copied from
CUDA; the N*K/2 bytes behind it are a blocked layout chosen by the CPU capability ATen ran
with (``torch.backends.cpu.get_cpu_capability()``), not by ``inner_k_tiles``. Rows come in
blocks of BLOCK_N output channels; inside a block the bytes run k-major, and which two
channels share a byte depends on the capability. torch >= 2.6's
``_convert_weight_to_int4pack_for_cpu`` writes the same bytes as uint8 [N, K/2], so old
checkpoints only run where the capability matches; unpacking to the neutral form works
everywhere. The checkpoint does not record its capability: pass ``isa`` if it was packed on
another kind of machine.
"""
from __future__ import annotations

from typing import Optional

import torch


ISAS = ("avx512", "avx2", "default")
BLOCK_N = {"avx512": 64, "avx2": 32, "default": 32}


def current_isa() -> str:
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability(), "default")


def _nibble_positions(n_out: int, k_in: int, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(byte index, is-high-nibble) of every weight element [N, K] in the packed bytes."""
    block = BLOCK_N[isa]
    n = torch.arange(n_out)[:, None]
    k = torch.arange(k_in)[None, :]
    start = n // block * block
    size = torch.clamp(n_out - start, max=block)  # the last block may be short (16, 32 or 48)
    j = n - start
    base = start * k_in // 2
    # generic: channels 2j and 2j+1 share a byte (every short block, and the 'default' ISA)
    byte = base + k * (size // 2) + j // 2
    high = (j % 2).expand_as(byte)
    if isa == "avx512":  # 64-channel blocks: byte d holds channel d (low) and d + 32 (high)
        full = (size == 64).expand_as(byte)
        byte = torch.where(full, base + k * 32 + (j // 16 % 2) * 16 + j % 16, byte)
        high = torch.where(full, j // 32, high)
    elif isa == "avx2":  # 32-channel blocks: byte d holds channel d (low) and d + 16 (high)
        full = (size == 32).expand_as(byte)
        byte = torch.where(full, base + k * 16 + j % 16, byte)
        high = torch.where(full, j // 16, high)
    return byte, high.bool()


def unpack_old_cpu_int4(packed: torch.Tensor, in_features: int, isa: Optional[str] = None) -> torch.Tensor:
    """Old CPU-packed int4 (int32 4-D, or its uint8 bytes) -> int8 [N, K] in [-8, 7]."""
    isa = isa or current_isa()
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
    raw = packed.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    n_out = raw.numel() * 2 // in_features
    if n_out * in_features != raw.numel() * 2 or n_out % 16:
        raise ValueError(f"{tuple(packed.shape)} {packed.dtype} is not an int4 weight with in_features {in_features}")
    byte, high = _nibble_positions(n_out, in_features, isa)
    values = raw[byte].to(torch.int16)
    values = torch.where(high, values >> 4, values & 0xF)
    return (values - 8).to(torch.int8)

