"""Weights a decode step streams, on 2 MB pages.

A weight-only LLM decode step reads every weight once (a 4-layer Llama-architecture int4 model:
130 MB a token). On 4 KB pages that stream costs a TLB miss per 4 KB; the same 17 kernel calls
ran 7-10% faster (paired) with their weights on 2 MB pages, at 4.2-4.4 ms, the machine's
copy-bandwidth floor (Zen 4, 2 threads). ``streamed_weights_on_huge_pages`` asks Linux to
move the weight-only kernels' constants onto transparent huge pages in place
(``madvise(MADV_COLLAPSE)``, Linux 6.1+): the same addresses and bytes, no copy kept, so no
memory beyond the pages' rounding. Where the kernel or its settings refuse, nothing changes.
"""
from __future__ import annotations

import ctypes
import functools
import sys
import time
from typing import Iterable, Optional

import torch
from torch.fx import GraphModule

from qbackend.lowering.sibling_linears import MERGED
from qbackend.patterns.base import constant_value

from . import native
from .dense_weight_only import WEIGHT_ONLY, kernel_or_dense
from .freeze import set_constant

HUGE_PAGE = 2 << 20
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


MADV_HUGEPAGE = 14


def aligned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` starting on a 2 MB boundary, its pages asked for as huge pages before
    the copy touches them (so all but the last come as 2 MB pages)."""
    nbytes = tensor.numel() * tensor.element_size()
    buffer = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -buffer.data_ptr() % HUGE_PAGE
    madvise = _madvise()
    if madvise is not None:
        madvise(buffer.data_ptr() + offset, (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE)
    copy = buffer[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
    copy.copy_(tensor)
    return copy


def _weight_only_calls():
    plain = {native.PLAIN[name] for name in WEIGHT_ONLY}
    return plain | {kernel_or_dense}


def streamed_weights_on_huge_pages(gm: GraphModule) -> Optional[str]:
    """The constants the graph's weight-only kernel calls read, on huge pages (see the module
    docstring)."""
    calls = _weight_only_calls()
    reads = {arg for node in gm.graph.nodes if node.op == "call_function" and node.target in calls
             for arg in node.args if constant_value(gm, arg) is not None}
    if not reads:
        return None
    start = time.perf_counter()
    tensors = []
    for read in reads:
        value = constant_value(gm, read)
        if read.target.startswith(f"_qb_{MERGED}_") and value.is_contiguous() and value.numel() * value.element_size() >= HUGE_PAGE // 2:
            value = aligned_copy(value)  # (qbackend's own tensor: moved whole, its ends included)
            set_constant(gm, read.target, value)
        tensors.append(value)
    moved = collapse(tensors)
    if not moved:
        return None
    return (f"{moved / 2**20:.0f} MB of weight-only weights on 2 MB pages "
            f"({(time.perf_counter() - start) * 1e3:.0f} ms): fewer TLB misses as a step streams them")
