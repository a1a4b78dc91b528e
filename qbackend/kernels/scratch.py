"""Scratch memory a kernel call gets from its caller, kept between calls.

A kernel chain's steps share a region of the chain's arena (``chain_step.SCRATCH``); a plain
call outside a chain takes this thread's buffer. Freed and allocated again at every call, a
buffer past glibc's mmap threshold is a fresh mapping whose every page faults in, zeroed, each
time (regnet_y_400mf's grouped convs' padded inputs at batch 8, when every build copied them:
~2000 faults a call; now the int16 build's). A decode step's weight-only calls, each allocating
its scratch, had spent ~3 of ~12 us on it.
"""
from __future__ import annotations

import threading

import torch

_THREAD = threading.local()
MIN_BYTES = 1 << 16


def thread_scratch(size: int) -> int:
    """The address of ``size`` bytes of this thread's scratch (valid until its next call here:
    the kernels that take it do not nest)."""
    buffer = getattr(_THREAD, "buffer", None)
    if buffer is None or buffer.numel() < size:
        buffer = _THREAD.buffer = torch.empty(max(size, MIN_BYTES), dtype=torch.uint8)
    return buffer.data_ptr()
