"""Calls a lowered graph where CPython's frame stack does not thrash.

CPython (3.11, 3.12, and 3.13 / 3.14 before their fix of gh-142183) keeps Python frames in
16 KB chunks of memory and frees a chunk as soon as its first frame returns. When a caller sits
just below a chunk's end, every Python call it makes maps a fresh chunk and unmaps it again: a
page fault and, in a multi-threaded process, a TLB shootdown on every other CPU, per call.
Measured on resnet50 at batch 1 (KVM guest): 19-34 faults a call and +2-3 ms (30-40%), or
nothing, depending only on how deep the user's code called the model. A lowered graph makes
dozens of Python calls per run (own-kernel wrappers, op overloads), so where it lands decides
its speed.

``StackRoom`` runs the callable from a frame padded by one of ``PADS``: the process's own
minor-fault count (``getrusage`` before and after, ~0.3 us each) tells whether a call
crossed chunks, and a pad that faults moves the call to another. Padding by at least the
depth the graph's calls reach below it puts the graph either clear of the chunk's end or at
the start of a fresh chunk (one crossing per run instead of one per call inside it).

A loop that times kernels (``lowering/choice.py``) runs whole in a fresh chunk instead
(``in_fresh_chunk``): one crossing for the loop, none per timed call. Inside Dynamo's backend
call, one crossing per call had added 40-110 us to every candidate (resnet50's layers).
"""
from __future__ import annotations

import functools
import threading
from typing import Callable

try:
    from resource import RUSAGE_THREAD, getrusage  # (Linux: the calling thread's faults)
except ImportError:  # no per-thread counter: calls run unpadded
    getrusage = None

PADS = (0, 256, 1024)  # extra frame slots (8 bytes each) under the caller: none, 2 KB, 8 KB


def _padded(slots: int) -> Callable:
    """``call(fn, args)``: ``fn(*args)`` from a frame ``slots`` locals larger than a plain call's."""
    if slots == 0:
        return lambda fn, args: fn(*args)
    names = ", ".join(f"_{i}" for i in range(slots))
    source = f"def call(fn, args):\n    if fn is None:\n        {names} = range({slots})\n    return fn(*args)\n"
    namespace: dict = {}
    exec(compile(source, f"<qbackend stack pad {slots}>", "exec"), namespace)  # (our own text, never a file)
    return namespace["call"]


_CALLS = tuple(_padded(slots) for slots in PADS)
FRESH_SLOTS = 4096  # 32 KB: more than a 16 KB chunk holds, so the frame starts a chunk of its own


@functools.cache
def _fresh_chunk_call() -> Callable:
    return _padded(FRESH_SLOTS)  # (built on first use: compiling it takes ~6 ms)


def in_fresh_chunk(fn: Callable, *args):
    """``fn(*args)`` from a frame that starts a chunk of its own, with ~24 KB of room after it."""
    return _fresh_chunk_call()(fn, args)


class _Judged(threading.local):
    """One thread's judgement of the pads: each thread calls from a depth of its own (two threads
    sharing one had thrown the pad between their depths, and one could read the other's fault
    list mid-reset: a TypeError from min() in the finally of the model's call)."""

    def __init__(self):
        self.pad = 0  # index into PADS
        self.faults: list = [None] * len(PADS)  # per pad: minor faults of its latest judged call
        self.judged = False  # past the first call


class StackRoom:
    """``fn`` called from the pad that faults least (see the module doc), judged per thread. The
    first call is not judged (it prepares kernels and allocates); a pad that faults is left for an
    untried one, then for the one that faulted least; a pad faulting well over what it did has a
    caller at a new depth, so every pad is tried again."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.threads = _Judged()

    def __getstate__(self):  # (a copy judges afresh: a threading.local does not copy)
        return {"fn": self.fn}

    def __setstate__(self, state):
        self.__init__(state["fn"])

    @property
    def pad(self) -> int:
        """The pad the calling thread's next call runs from."""
        return self.threads.pad

    @property
    def faults(self) -> list:
        """Per pad: minor faults of the calling thread's latest judged call from it (None: untried)."""
        return self.threads.faults

    def __call__(self, *args):
        # (no Python call of its own on the way: it would cross a chunk's end as easily)
        if getrusage is None:
            return self.fn(*args)
        state = self.threads
        pad, before = state.pad, getrusage(RUSAGE_THREAD).ru_minflt
        try:
            return _CALLS[pad](self.fn, args)
        finally:
            faults = getrusage(RUSAGE_THREAD).ru_minflt - before
            if faults or not state.judged:
                _observe(state, pad, faults)
            else:
                state.faults[pad] = 0


def _observe(state: _Judged, pad: int, faults: int) -> None:
    if not state.judged:
        state.judged = True
        return
    previous, state.faults[pad] = state.faults[pad], faults
    if not faults:
        return
    if previous is not None and faults > 2 * previous + 2:  # (not a fault or two of other causes)
        state.faults = [None] * len(PADS)
        state.faults[pad] = faults
    untried = [i for i, seen in enumerate(state.faults) if seen is None]
    state.pad = untried[0] if untried else min(range(len(PADS)), key=state.faults.__getitem__)
