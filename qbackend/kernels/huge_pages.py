"""Memory on 2 MB pages: libc's ``madvise`` asked to move a tensor's whole pages onto
transparent huge pages in place (``collapse``), and a cat written from a 2 MB boundary
(``aligned_cat``). Why and what it gains: qbackend/llm/huge_pages.py."""
from __future__ import annotations

import ctypes
import functools
import sys
from typing import Iterable

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # (linux/mman.h: back this range with transparent huge pages when it is touched)
MADV_COLLAPSE = 25  # (linux/mman.h: synchronous collapse into transparent huge pages, Linux 6.1+)


@functools.lru_cache(maxsize=None)
def _madvise():
    """libc's madvise, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def collapse(tensors: Iterable[torch.Tensor]) -> int:
    """Move the whole 2 MB pages inside each CPU tensor's bytes onto huge pages; returns the
    bytes moved (0 where Linux refuses: an older kernel, transparent huge pages off)."""
    madvise, moved, seen = _madvise(), 0, set()
    if madvise is None:
        return 0
    for tensor in tensors:
        if type(tensor) is not torch.Tensor or tensor.device.type != "cpu" or not tensor.is_contiguous():
            continue
        begin = tensor.data_ptr()
        start = (begin + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        end = (begin + tensor.numel() * tensor.element_size()) // HUGE_PAGE * HUGE_PAGE
        if end <= start or start in seen:
            continue
        seen.add(start)
        if madvise(start, end - start, MADV_COLLAPSE) == 0:
            moved += end - start
    return moved


def aligned_cat(tensors: list) -> torch.Tensor:
    """``torch.cat(tensors)`` (along dim 0, one dtype), written from a 2 MB boundary with huge
    pages asked for before the cat touches them, when it is a CPU tensor of at least half a page."""
    first = tensors[0]
    nbytes = sum(t.numel() for t in tensors) * first.element_size()
    if first.device.type != "cpu" or nbytes < HUGE_PAGE // 2:
        return torch.cat(tensors).contiguous()
    buffer = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -buffer.data_ptr() % HUGE_PAGE
    madvise = _madvise()
    if madvise is not None:
        madvise(buffer.data_ptr() + offset, (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE)
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    return torch.cat(tensors, out=buffer[offset:offset + nbytes].view(first.dtype).view(shape))
