"""Which kernel runs a conv / linear on this CPU: measured here, not read from a table measured
on another.

Where one of qbackend's own kernels and oneDNN can both run a match, both are emitted, each
emitted piece of graph is run on inputs of the layer's shape and layout, interleaved, within a
small budget, and one is erased: the own kernel's unless oneDNN is faster by more than
OWN_KEPT_WITHIN. Both times are kept per layer signature in
the machine's choice cache (qbackend/kernels/choice_cache.py), so the next compile, in this process or
another, decides the same way without timing. Modes (``Options.kernel_choice``, or
``QBACKEND_KERNEL_CHOICE``): "measure" (the default), "cached" (measured choices only, else the
prior) and "prior" (the kernels' fixed tables, e.g. lowering/gemm.py LIMITS: reproducible
across machines).
"""
from __future__ import annotations

import dataclasses
import operator
import os
import statistics
import time
from typing import Callable, NamedTuple, Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.kernels.choice_cache import fastest_of
from qbackend.patterns.base import QuantizedWeight, fake_value
from qbackend.runtime.runnable import NodeSteps
from qbackend.runtime.stack_room import in_fresh_chunk

from .base import EmitContext
from .common import static_shape

MODES = ("measure", "cached", "prior")
ENVIRONMENT = "QBACKEND_KERNEL_CHOICE"
# Timed calls per layer: MIN_ROUNDS interleaved rounds, more (up to MAX_ROUNDS, within
# BUDGET_SECONDS per candidate) while the two candidates' samples overlap.
BUDGET_SECONDS = 0.01
MIN_ROUNDS, MAX_ROUNDS = 3, 30
PATTERN = 4096  # the input values repeat with this period
RECORD = fastest_of("own", "fallback")  # what is kept per layer signature: both times, the faster
# The own kernel runs unless the fallback's measured time is below its own by more than this
# factor: its time includes a Python call that a kernel chain does not make, and a fallback call
# between own kernels splits their chain (the measured choice on a noisy 2-core VM flipped
# EfficientNet's near ties from process to process, each flip a split).
OWN_KEPT_WITHIN = 1.10


def keeps_own(record: dict) -> bool:
    """Whether a layer measured as ``record`` (RECORD) runs on the own kernel."""
    return record["own"] <= record["fallback"] * OWN_KEPT_WITHIN


def mode(option: Optional[str]) -> str:
    chosen = option or os.environ.get(ENVIRONMENT) or "measure"
    if chosen not in MODES:
        raise ValueError(f"qbackend: kernel_choice={chosen!r}; valid: {', '.join(map(repr, MODES))}")
    return chosen


def signature(kernel_name: str, match) -> Optional[str]:
    """What the speed of this layer depends on; None when a shape is not static."""
    residual_node = match.accum.node if match.accum is not None else match.accum_float
    if static_shape(match.x.node) is None or (residual_node is not None and static_shape(residual_node) is None):
        return None
    x, w, p, post = fake_value(match.x.node), match.weight.int8, match.conv, match.post_op
    residual = fake_value(residual_node)
    parts = [kernel_name, match.rule.name, f"x{list(x.shape)}", f"w{list(w.shape)}",
             f"zp0={match.x.qparams.zero_point == 0}", f"post={post.name}/{post.algorithm}" if post else "post=none",
             "out=u8" if match.output_quant is not None else f"out={match.float_dtype}"]
    if p is not None:
        parts.append(f"conv={list(p.stride)}/{list(p.padding)}/{list(p.dilation)}/{p.groups}")
    if residual is not None:
        parts.append(f"residual={residual.dtype}{list(residual.shape)}")
    return " ".join(parts)


READERS = "qbackend_linear_readers"  # node meta: how many float linears read the int8 value


def siblings(match) -> int:
    """How many linears read this linear's int8 input (itself included): the sibling merge
    (sibling_linears.py) runs them as one call of their summed width, so that width is timed
    (all-MiniLM-L6-v2 b8, AVX2 EPYC: the own GEMM won Q, K and V alone, 1568 vs 1689 us, and
    lost merged, 2.94 vs 2.79 ms; the model ran 5.6% slower for it)."""
    if match.rule.name != "qlinear" or match.conv is not None:
        return 1
    meta = match.x.node.meta  # (counted when the first of them is lowered: later, it reads the input itself)
    if READERS not in meta:
        meta[READERS] = max(1, sum(_plain_linear(user) for dq in match.x.node.users for user in dq.users))
    return meta[READERS]


def _plain_linear(node: Node) -> bool:
    """A linear whose result no add reads (an add fuses into it: that one runs apart)."""
    adds = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)
    return node.target is torch.ops.aten.linear.default and not any(user.target in adds for user in node.users)


def _widened(match, times: int):
    """``match`` with its weight rows repeated ``times`` (no bias): a layer's time does not
    depend on its values, only on its shapes."""
    w = match.weight
    weight = QuantizedWeight(w.int8.repeat(times, 1), w.scales.repeat(times), w.zero_points.repeat(times))
    return dataclasses.replace(match, weight=weight, bias=None)


def _pattern_like(value: torch.Tensor, seed: int) -> torch.Tensor:
    """Varied values of ``value``'s shape and dtype (a cheap pattern: random numbers for a batch-8
    layer cost more than timing it), in the layout the lowered graph passes: 4-D activations
    channels-last (what every int8 conv, oneDNN's or qbackend's, writes and the boundary
    quantize makes; Dynamo's example strides are the float model's), others contiguous."""
    layout = torch.channels_last if value.dim() == 4 else torch.contiguous_format
    codes = (torch.arange(PATTERN, dtype=torch.int32) * 7919 + seed * 104729) % 251  # (251: prime, not a row length)
    block = (codes.float() / 125.0 - 1.0 if value.dtype.is_floating_point else codes - (128 if value.dtype == torch.int8 else 0))
    out = torch.empty(value.shape, dtype=value.dtype, memory_format=layout)
    whole, rest = divmod(out.numel(), PATTERN)
    data = out.as_strided((out.numel(),), (1,))  # (dense in either layout: its storage in order)
    data[:whole * PATTERN].view(whole, PATTERN).copy_(block.to(value.dtype).expand(whole, PATTERN))
    data[whole * PATTERN:].copy_(block[:rest].to(value.dtype))
    return out


def runnable(gm: GraphModule, nodes: list[Node], result: Node, values: dict) -> Optional[tuple[Callable, list]]:
    """The emitted ``nodes`` as a callable of their own and inputs for it, one per graph node read
    (``values``: node -> tensor, shared between candidates); None when an input is not a tensor
    of static shape."""
    steps = [node for node in nodes if node.op != "get_attr"]  # (the emitted constants are read as any other)
    emitted, inputs, constants = set(steps), [], {}
    for node in steps:
        for used in node.all_input_nodes:
            if used in emitted or used in constants or used in inputs:
                continue
            if used.op == "get_attr":
                constants[used] = operator.attrgetter(used.target)(gm)
                continue
            if static_shape(used) is None:
                return None
            if used not in values:
                values[used] = _pattern_like(fake_value(used), len(values))
            inputs.append(used)
    # (ops called as the lowered graph will call them)
    return NodeSteps(steps, inputs, constants, result), [values[node] for node in inputs]


def time_each(candidates: dict[str, tuple[Callable, list]]) -> dict[str, float]:
    """Median seconds per call of each candidate, timed in interleaved rounds after one warm-up
    call each (oneDNN builds its primitive on the first): at least MIN_ROUNDS, then until the
    samples no longer overlap or BUDGET_SECONDS per candidate are spent. The loop runs in a
    fresh chunk of Python's frame stack, as the lowered graph runs (``qbackend.runtime.stack_room``)."""
    return in_fresh_chunk(_time_rounds, candidates)


@torch.no_grad()
def _time_rounds(candidates: dict[str, tuple[Callable, list]]) -> dict[str, float]:
    for fn, inputs in candidates.values():
        fn(*inputs)
    samples: dict[str, list] = {name: [] for name in candidates}
    start = time.perf_counter()
    for round_ in range(1, MAX_ROUNDS + 1):
        for name, (fn, inputs) in candidates.items():
            begin = time.perf_counter()
            fn(*inputs)
            samples[name].append(time.perf_counter() - begin)
        if round_ >= MIN_ROUNDS:
            fast, slow = sorted(samples.values(), key=statistics.median)
            if max(fast) < min(slow) or time.perf_counter() - start > BUDGET_SECONDS * len(candidates):
                break
    return {name: statistics.median(times) for name, times in samples.items()}


# How the candidates are timed; tests replace it to simulate another machine.
measure: Callable[[dict], dict] = time_each


def _microseconds(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us"


class Candidate(NamedTuple):
    result: Node  # what replaces the match
    nodes: list  # the nodes its emitter added, in graph order
    notes: list  # the report's notes with it
    kernel: str  # the emitter's ctx.kernel


def _emitted(ctx: EmitContext, emit: Callable, match, notes: list) -> Candidate:
    before = set(ctx.gm.graph.nodes)
    ctx.notes, ctx.kernel = list(notes), ""
    result = emit(ctx, match)
    return Candidate(result, [n for n in ctx.gm.graph.nodes if n not in before], ctx.notes, ctx.kernel)


def _erase(ctx: EmitContext, candidate: Candidate) -> None:
    for node in reversed(candidate.nodes):
        ctx.gm.graph.erase_node(node)


def _settle(ctx: EmitContext, kept: Candidate, note: str) -> Node:
    ctx.notes, ctx.kernel = kept.notes + [note], kept.kernel
    return kept.result


def _keep(ctx: EmitContext, kept: Candidate, dropped: Candidate, note: str) -> Node:
    _erase(ctx, dropped)
    return _settle(ctx, kept, note)


def _note(seconds: dict, fallback: str) -> str:
    return f"measured on this machine: {_microseconds(seconds['own'])} vs {fallback}'s {_microseconds(seconds['fallback'])}"


def choose(ctx: EmitContext, match, kernel, fallback_emit: Callable, fallback: str) -> Node:
    """Emit ``match`` with qbackend's ``kernel`` (own_conv.OwnKernel, which can run it) or
    ``fallback_emit``, whichever is faster here (see the module docstring)."""
    not_own = f"{fallback}, not qbackend's {kernel.name} kernel"
    width = siblings(match)
    key = signature(kernel.name, match) if ctx.kernel_choice != "prior" and ctx.choices is not None else None
    key, merged = (f"{key} siblings={width}", f" ({width} siblings as one call)") if key is not None and width > 1 else (key, "")
    record = ctx.choices.get(key, RECORD) if key is not None else None  # (an invalid one: measured again)
    if record is not None:
        if keeps_own(record):
            result = kernel.emit(ctx, match)
        else:
            ctx.notes.append(not_own)
            result = fallback_emit(ctx, match)
        ctx.notes.append(_note(record, fallback) + merged)
        return result
    if key is None or ctx.kernel_choice != "measure":
        reason = kernel.prior(match)
        if reason is None:
            return kernel.emit(ctx, match)
        ctx.notes.append(f"{not_own}: {reason}")
        return fallback_emit(ctx, match)
    notes = list(ctx.notes)
    timed = match if width == 1 else _widened(match, width)
    own = _emitted(ctx, kernel.emit, timed, notes)
    try:
        other = _emitted(ctx, fallback_emit, timed, notes + [not_own])
    except Exception as error:  # oneDNN refused the layer at prepack time: the own kernel runs it
        if width > 1:
            _erase(ctx, own)
            own = _emitted(ctx, kernel.emit, match, notes)
        return _settle(ctx, own, f"{fallback} could not run it: {type(error).__name__}: {error}")
    values: dict = {}
    runs = {name: runnable(ctx.gm, c.nodes, c.result, values) for name, c in (("own", own), ("fallback", other))}
    why_not = "an input is not static" if None in runs.values() else None
    try:
        seconds = None if why_not else measure(runs)
    except Exception as error:  # a candidate failed on random inputs: the fixed table decides
        why_not = f"{type(error).__name__}: {error}"
    if why_not is not None:
        keep_own = kernel.prior(match) is None
        note = f"not measured ({why_not})"
    else:
        record = {"winner": "own" if seconds["own"] < seconds["fallback"] else "fallback", **seconds}
        ctx.choices.put(key, record)
        keep_own, note = keeps_own(record), _note(record, fallback) + merged
    if width > 1:  # (the timed candidates were the merged width: emit the layer itself)
        _erase(ctx, own)
        _erase(ctx, other)
        return _settle(ctx, _emitted(ctx, kernel.emit, match, notes) if keep_own
                       else _emitted(ctx, fallback_emit, match, notes + [not_own]), note)
    return _keep(ctx, own if keep_own else other, other if keep_own else own, note)
