"""Weights a decode step streams, on 2 MB pages.

A weight-only LLM decode step reads every weight once (a 4-layer Llama-architecture int4 model:
130 MB a token). On 4 KB pages that stream costs a TLB miss per 4 KB; the same 17 kernel calls
ran 7-10% faster (paired) with their weights on 2 MB pages, at 4.2-4.4 ms, the machine's
copy-bandwidth floor (Zen 4, 2 threads). ``streamed_weights_on_huge_pages`` asks Linux to
move the weight-only kernels' constants onto transparent huge pages in place
(``madvise(MADV_COLLAPSE)``, Linux 6.1+): the same addresses and bytes, no copy kept. That
leaves each tensor's partial first and last 2 MB page; the tensors qbackend makes itself (the
merged weights of sibling linears) are written from a 2 MB boundary instead (``aligned_cat``).
Where the kernel or its settings refuse, nothing changes.
"""
from __future__ import annotations

import ctypes
import functools
import sys
import time
from typing import Iterable, Optional

import torch
from torch.fx import GraphModule

from qbackend.patterns.base import constant_value

from qbackend.kernels import native

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


def _weight_only_calls():
    from qbackend.llm.dense_swiglu import swiglu  # (they import the lowering, which imports aligned_cat)
    from qbackend.llm.dense_weight_only import WEIGHT_ONLY, kernel_or_dense

    return {native.PLAIN[name] for name in WEIGHT_ONLY} | {kernel_or_dense, swiglu}


def _flat(args) -> list:
    """The arguments, those in tuples too (swiglu's two linears)."""
    return [a for arg in args for a in (_flat(arg) if isinstance(arg, tuple) else [arg])]


def streamed_weights_on_huge_pages(gm: GraphModule) -> Optional[str]:
    """The constants the graph's weight-only kernel calls read, on huge pages (see the module
    docstring)."""
    calls = _weight_only_calls()
    tensors = [value for node in gm.graph.nodes if node.op == "call_function" and node.target in calls
               for arg in _flat(node.args) if (value := constant_value(gm, arg)) is not None]
    if not tensors:
        return None
    start = time.perf_counter()
    moved = collapse(tensors)
    if not moved:
        return None
    return (f"{moved / 2**20:.0f} MB of weight-only weights on 2 MB pages "
            f"({(time.perf_counter() - start) * 1e3:.0f} ms): fewer TLB misses as a step streams them")
