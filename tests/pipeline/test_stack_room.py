"""qbackend.runtime.stack_room: no run of a lowered graph thrashes CPython's frame-stack chunks.

The callers below sit at every depth across a 16 KB chunk (recursion in ~100-byte steps,
refined by pads in 16-byte steps), so some of them sit just below a chunk's end, where each
Python call the workload makes maps and unmaps a fresh chunk (a page fault per call).
"""
import copy
import functools
import sys
import threading
from types import SimpleNamespace

import pytest

from qbackend.runtime import stack_room
from qbackend.runtime.stack_room import PADS, StackRoom, in_fresh_chunk

from tests.helpers import in_threads

pytestmark = pytest.mark.skipif(stack_room.getrusage is None, reason="no per-thread fault counter (Linux only)")

CALLS = 50  # Python calls one run of the workload makes
FINE = tuple(stack_room._padded(slots) for slots in range(0, 16, 2))


def _leaf():
    return None


def _workload():
    for _ in range(CALLS):
        _leaf()


def _at_depth(depth: int, fn, *args):
    return fn(*args) if depth == 0 else _at_depth(depth - 1, fn, *args)


def _faults(fn, *args) -> int:
    before = stack_room.getrusage(stack_room.RUSAGE_THREAD).ru_minflt
    fn(*args)
    return stack_room.getrusage(stack_room.RUSAGE_THREAD).ru_minflt - before


def _everywhere(probe) -> list:
    """``probe()`` (its fault count) from callers spread over a whole chunk."""
    found = []
    for depth in range(0, 200, 1):
        for fine in FINE:
            found.append(_at_depth(depth, fine, probe, ()))
    return found


def test_some_depth_thrashes_without_it_and_none_with_it():
    def plain():
        return sum(_faults(_workload) for _ in range(3))

    def guarded():
        room = StackRoom(_workload)
        runs = [_faults(room) for _ in range(1 + len(PADS) + 3)]  # (from the depth that is measured)
        return sum(runs[-3:])  # after the first (not judged) and at most one try per pad

    plain_worst = max(_everywhere(plain))
    # CPython < 3.13 (gh-142183, fixed in later 3.13 / 3.14 releases) frees a chunk whenever
    # its first frame returns: somewhere, every one of the workload's calls faults.
    assert plain_worst >= 3 * CALLS or sys.version_info >= (3, 13)
    assert max(_everywhere(guarded)) <= 3 * 5  # a crossing or two per run at most, wherever it is called


def test_in_fresh_chunk_runs_a_loop_without_a_crossing_per_call():
    def loop():
        return _faults(_workload)

    assert max(_everywhere(lambda: in_fresh_chunk(loop))) == 0


class _Script:
    """``getrusage`` as the guard reads it (before and after each call): scripted faults per call."""

    def __init__(self, per_call):
        self.per_call, self.total, self.reads = list(per_call), 0, 0

    def __call__(self, who):
        self.reads += 1
        if self.reads % 2 == 0:
            self.total += self.per_call.pop(0)
        return SimpleNamespace(ru_minflt=self.total)


def _pads_used(monkeypatch, faults_per_call: list) -> tuple[list, StackRoom]:
    """The pad each call ran from, when call i sees ``faults_per_call[i]`` faults."""
    monkeypatch.setattr(stack_room, "getrusage", _Script(faults_per_call))
    room = StackRoom(lambda: None)
    pads = []
    for _ in faults_per_call:
        pads.append(room.pad)
        room()
    return pads, room


def test_the_pad_that_faults_least_is_kept(monkeypatch):
    # the first call (unjudged), then pad 0 faults, pad 1 faults less, pad 2 more: the guard
    # settles on pad 1 and stays there
    pads, room = _pads_used(monkeypatch, [50, 30, 1, 4, 1, 1])
    assert pads == [0, 0, 1, 2, 1, 1]
    assert room.faults == [30, 1, 4]


def test_a_pad_faulting_well_over_before_tries_every_pad_again(monkeypatch):
    # settled on pad 0 without faults; the caller moves, pad 0 now faults: pads 1 and 2 are tried
    pads, _ = _pads_used(monkeypatch, [9, 0, 0, 20, 0, 0])
    assert pads == [0, 0, 0, 0, 1, 1]


def test_a_fault_or_two_of_other_causes_keeps_the_pad(monkeypatch):
    # settled on pad 1 at 3 faults (the least), then 4 and 2: still pad 1
    pads, _ = _pads_used(monkeypatch, [0, 9, 3, 5, 4, 2, 4])
    assert pads == [0, 0, 1, 2, 1, 1, 1]


def test_each_thread_judges_the_pads_from_its_own_depth(monkeypatch):
    """Two threads calling one compiled model in lockstep: one faults as the first test's caller
    does, the other never; each keeps the pads it would alone (they had shared one judgement,
    which the faulting thread moved under the other)."""
    scripts = {"faulting": [50, 30, 1, 4, 1, 1], "quiet": [0] * 6}
    per_thread = {}
    monkeypatch.setattr(stack_room, "getrusage", lambda who: per_thread[threading.get_ident()](who))
    room, barrier, pads = StackRoom(lambda: None), threading.Barrier(len(scripts), timeout=30), {}

    def run(name):
        per_thread[threading.get_ident()], pads[name] = _Script(scripts[name]), []
        for _ in scripts[name]:
            pads[name].append(room.pad)
            room()
            barrier.wait()  # (every thread's call judged before the next)

    in_threads([functools.partial(run, name) for name in scripts], barrier.abort)
    assert pads == {"faulting": [0, 0, 1, 2, 1, 1], "quiet": [0] * 6}


def test_a_copy_runs_the_same_callable_and_judges_afresh():
    room = StackRoom(lambda: 7)
    room()
    copied = copy.deepcopy(room)
    assert copied() == 7 and copied.fn is room.fn and copied.threads is not room.threads
