"""A KV cache's ``cat`` as an append into room kept after the cached rows (csrc/kv_append.c):
the rooms, their claims under threads, the function lowered graphs call and its kernel chain
step. Why and the graph rewrite: qbackend/llm/kv_append.py."""
from __future__ import annotations

import ctypes
import threading
from typing import Optional

import torch

from qbackend.kernels import isa
from qbackend.kernels.chain_step import KeyLength, StepCall, step_call
from qbackend.kernels.structs import KvAppendCall


_FILL = "_qbackend_kv_fill"  # an append buffer's attribute: its _Fill
_CLAIMS = threading.Lock()  # held while a claim compares and advances fills (see claim)


class _Fill:
    """Rows written along an append buffer's dim, and the buffer's layout (fixed: the buffer
    itself never leaves this module, only views of it; kept so that a step's room check reads
    the view's metadata only: 8 caches' checks took ~90 us cold, ~30 warm)."""

    __slots__ = ("rows", "shape", "strides", "dtype")

    def __init__(self, buffer: torch.Tensor, rows: int):
        self.rows, self.shape, self.strides, self.dtype = rows, buffer.shape, buffer.stride(), buffer.dtype


def filled_rows(buffer: Optional[torch.Tensor]) -> Optional[int]:
    """Rows written into append buffer ``buffer`` (None: not one)."""
    fill = getattr(buffer, _FILL, None)
    return None if fill is None else fill.rows


def room_after(rows: int) -> int:
    """Rows a new buffer keeps free past ``rows``: a quarter more, at least 256 (a reallocation
    copies the cache once; this bounds that to every ~rows/4 steps, and the memory to 1.25x)."""
    return max(256, rows // 4)


def room(past: torch.Tensor, added: int, dim: int) -> Optional[tuple[torch.Tensor, int, _Fill]]:
    """(the buffer ``past`` is a view of, the row ``past`` starts at, the buffer's _Fill) when
    ``added`` rows fit into its room right after ``past``'s rows, and nothing else was written
    there yet: the room is the caller's only once ``claim`` says so."""
    base = past._base
    fill = getattr(base, _FILL, None)
    if fill is None or past.dtype != fill.dtype or past.stride() != fill.strides:
        return None
    shape, (start, misaligned) = past.shape, divmod(past.storage_offset(), fill.strides[dim])
    if misaligned or start + shape[dim] != fill.rows or fill.rows + added > fill.shape[dim] \
            or shape[:dim] != fill.shape[:dim] or shape[dim + 1:] != fill.shape[dim + 1:]:
        return None
    return base, start, fill


def claim(appends: list, dim: int) -> Optional[list[tuple[torch.Tensor, int, _Fill]]]:
    """``room`` of each (past, rows added) in distinct buffers, taken for the caller (the
    buffers' fills advanced past the added rows, which the caller then writes): for all of
    them, or None when one has no room, two share a buffer, or another caller took one first."""
    found = [room(past, added, dim) for past, added in appends]
    if None in found or len({id(f[0]) for f in found}) < len(found):
        return None
    with _CLAIMS:  # (``room`` read the fills unlocked: compare them again and advance, no thread between)
        if any(fill.rows != start + past.size(dim) for (_, start, fill), (past, _) in zip(found, appends)):
            return None
        for (_, start, fill), (past, added) in zip(found, appends):
            fill.rows = start + past.size(dim) + added
    return found


def append(past: torch.Tensor, new: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.cat([past, new], dim)``, written into room after ``past`` when it has it."""
    if not (isinstance(past, torch.Tensor) and isinstance(new, torch.Tensor)) or past.requires_grad or new.requires_grad \
            or past.dtype != new.dtype or past.device != new.device or new.dim() == 0:
        return torch.cat([past, new], dim)
    if past.dim() == 1 and past.numel() == 0:  # (cat skips a 1-D empty tensor: a cache's first fill)
        past = new.narrow(dim, 0, 0)
    d = dim % new.dim() if -new.dim() <= dim < new.dim() else None
    if d is None or past.dim() != new.dim() or any(past.size(i) != new.size(i) for i in range(new.dim()) if i != d):
        return torch.cat([past, new], dim)
    rows, added = past.size(d), new.size(d)
    found = claim([(past, added)], d)
    if found is not None:
        [(base, start, _)] = found
    else:  # (a new buffer: this thread's alone until it returns a view of it)
        shape = list(new.shape)
        shape[d] = rows + added + room_after(rows + added)
        base, start = torch.empty(shape, dtype=new.dtype, device=new.device), 0
        setattr(base, _FILL, _Fill(base, rows + added))
        base.narrow(d, 0, rows).copy_(past)
    base.narrow(d, start + rows, added).copy_(new)
    return base.narrow(d, start, rows + added)


append.reads_any_strides = True  # (the values it appends, whatever their layout)


def chain_call(args: tuple, out: torch.Tensor) -> Optional[StepCall]:
    """``append`` of [B, H, rows, D] rows (the last dim dense) into ``past``'s room along dim 2
    as a kernel chain step (qb_kv_append_call). Operands: the new rows, the cache, its rows (a
    number per call)."""
    past, new, dim = args
    if past.dim() != 4 or dim % 4 != 2 or out.data_ptr() != past.data_ptr() or new.dtype != past.dtype \
            or new.shape[:2] != past.shape[:2] or new.shape[3] != past.shape[3] or new.shape[2] == 0 \
            or new.stride(3) != 1 or past.stride(3) != 1:
        return None
    size = new.element_size()
    call = KvAppendCall(*new.shape[:3], new.shape[3] * size, (ctypes.c_long * 3)(*(size * s for s in new.stride()[:3])),
                        (ctypes.c_long * 3)(*(size * s for s in past.stride()[:3])))
    return step_call(isa.c_address("qb_kv_append_call"), call, (new, past, KeyLength(past), None))
