"""Runs of qbackend's own int8 kernels (GEMM, depthwise, stem conv, pools) as one call (``csrc/kernel_chain.c``).

Each own-kernel call from the graph costs ~4 us of Python besides its kernel (arguments,
the prepared-call lookup, the output's allocation, ctypes): on a MobileNetV2 image, 46 calls
of which most compute for 15-60 us. ``chain_own_kernels`` replaces every run of consecutive
own-kernel calls in a lowered graph (constants aside) by one call of a ``KernelChain``:
its steps are prepared once per input shape (the first call runs them one by one, as the
graph did, and keeps their prepared calls), its intermediates share one arena laid out by
their lifetimes, and later calls are one ctypes call. Values that leave the run are fresh
tensors, so nothing the caller sees is ever reused.
"""
from __future__ import annotations

import ctypes
import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from . import native

ALIGN = 64  # bytes: intermediates start on cache lines
KINDS = {"qconv": 0, "qconv_depthwise": 1, "qconv_stem": 1, "max_pool_u8": 1, "global_avg_pool_u8": 1}  # kernel_chain.c ``enum kind``
MIN_STEPS = 2  # a single call gains nothing from a chain


class _Operand(ctypes.Structure):
    _fields_ = [("base", ctypes.c_int), ("offset", ctypes.c_long)]


class _Step(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("function", ctypes.c_void_p), ("call", ctypes.c_void_p),
                ("x", _Operand), ("residual", _Operand), ("y", _Operand), ("yf", _Operand)]


NONE = _Operand(-1, 0)


@dataclass(frozen=True)
class Ref:
    """A tensor operand of a step: the chain's input ``index`` ("input") or step ``index``'s output ("step")."""

    source: str
    index: int


@dataclass
class Step:
    kernel: str  # a KINDS key
    args: tuple  # the plain function's arguments, tensor operands as Ref, constants as tensors
    name: str  # of the graph node it replaced (for listings)


class _Program:
    """A chain prepared for one set of input shapes: the C steps, the arena's size, the outputs'."""

    def __init__(self, steps: list, arena_bytes: int, outputs: list, prepared: list, input_count: int):
        self.steps = (_Step * len(steps))(*steps)
        self.arena_bytes = arena_bytes
        self.outputs = outputs  # (shape, strides, dtype) per chain output
        self.prepared = prepared  # holds the structs the steps point to
        self.bases_type = ctypes.c_void_p * (1 + input_count + len(outputs))

    def run(self, inputs: list) -> tuple:
        first = inputs[0]
        arena = first.new_empty(self.arena_bytes, dtype=torch.uint8)
        outputs = tuple(first.new_empty_strided(shape, strides, dtype=dtype) for shape, strides, dtype in self.outputs)
        # (made per call: ctypes lets go of the GIL, so another thread may run this program meanwhile)
        bases = self.bases_type(arena.data_ptr(), *(t.data_ptr() for t in inputs), *(y.data_ptr() for y in outputs))
        failed = native._load()[0].qb_run_chain(torch.get_num_threads(), len(self.steps), self.steps, bases)
        if failed:
            raise MemoryError(f"qbackend kernel chain: step {failed - 1} could not allocate its scratch")
        return outputs


def _plan(sizes: list, lifetimes: list) -> tuple[list, int]:
    """Arena offsets for intermediates of ``sizes`` bytes live over step ``lifetimes`` (first,
    last): first fit, two overlap in memory only if their lifetimes do not (a step's output
    never shares memory with its inputs: their lifetimes meet at that step)."""
    offsets, placed, total = [], [], 0
    for size, (first, last) in zip(sizes, lifetimes):
        size = -(-size // ALIGN) * ALIGN
        busy = sorted((o, o + s) for o, s, (f, l) in placed if f <= last and first <= l)
        offset = 0
        for start, end in busy:
            if offset + size <= start:
                break
            offset = max(offset, end)
        offsets.append(offset)
        placed.append((offset, size, (first, last)))
        total = max(total, offset + size)
    return offsets, total


class KernelChain:
    """What a chain node calls: ``chain(*inputs)`` gives the tuple of its outputs."""

    def __init__(self, steps: list, input_count: int, outputs: list):
        self.steps = steps
        self.input_count = input_count
        self.outputs = outputs  # step indices whose values leave the chain
        self._programs: dict = {}

    def __getstate__(self):  # (prepared ctypes structs are per process: copies prepare again)
        return {**self.__dict__, "_programs": {}}

    def listing(self) -> list:
        """The steps as (node name, kernel, arguments) with operands named: what the graph held."""
        return [(step.name, step.kernel, step.args) for step in self.steps]

    def __call__(self, *inputs) -> tuple:
        inputs = [x.contiguous(memory_format=torch.channels_last) for x in inputs]
        key = tuple((x.shape, x.dtype, x.device) for x in inputs)
        program = self._programs.get(key)
        if program is None:
            outputs, self._programs[key] = self._first_run(inputs)
            return outputs
        return program.run(inputs)

    def _first_run(self, inputs: list) -> tuple[tuple, _Program]:
        """Runs the steps one by one (checking every argument as the graph's calls did) and
        prepares the program for these input shapes from their prepared calls."""
        lib = native._load()[0]
        values, prepared = [], []
        for step in self.steps:
            args = [(inputs if a.source == "input" else values)[a.index] if isinstance(a, Ref) else a for a in step.args]
            values.append(native.PLAIN[step.kernel](*args))
            prepared.append(native.PREPARED_CALLS[step.kernel](lib, *args, trusted=True))
        return tuple(values[i] for i in self.outputs), self._program(values, prepared)

    def _program(self, values: list, prepared: list) -> _Program:
        leaving = {step: k for k, step in enumerate(self.outputs)}
        inner = [i for i in range(len(self.steps)) if i not in leaving]
        last_use = {i: i for i in inner}
        for j, step in enumerate(self.steps):
            for a in step.args:
                if isinstance(a, Ref) and a.source == "step" and a.index in last_use:
                    last_use[a.index] = j
        sizes = [values[i].numel() * values[i].element_size() for i in inner]
        offsets, arena_bytes = _plan(sizes, [(i, last_use[i]) for i in inner])
        place = dict(zip(inner, offsets))
        first_output = 1 + self.input_count

        def operand(a) -> _Operand:
            if not isinstance(a, Ref):
                return NONE
            if a.source == "input":
                return _Operand(1 + a.index, 0)
            if a.index in leaving:
                return _Operand(first_output + leaving[a.index], 0)
            return _Operand(0, place[a.index])

        steps = []
        for i, (step, call) in enumerate(zip(self.steps, prepared)):
            out = operand(Ref("step", i))
            float_out = step.kernel == "qconv" and call.dtype == torch.float32  # (an X_TO_Y call knows its output's dtype)
            residual = step.args[4] if step.kernel == "qconv" else None
            steps.append(_Step(KINDS[step.kernel], ctypes.cast(call.function, ctypes.c_void_p).value, call.address,
                               operand(step.args[0]), operand(residual), NONE if float_out else out, out if float_out else NONE))
        outputs = [(values[i].shape, values[i].stride(), values[i].dtype) for i in self.outputs]
        return _Program(steps, arena_bytes, outputs, prepared, self.input_count)


def _runs(gm: GraphModule, kernels: dict) -> list[list[Node]]:
    """Maximal runs of own-kernel calls (``kernels``: plain function -> name) in graph order,
    constants between them aside."""
    runs, current = [], []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            continue
        if node.op == "call_function" and node.target in kernels and not node.kwargs:  # (steps keep positional args)
            current.append(node)
            continue
        if len(current) >= MIN_STEPS:
            runs.append(current)
        current = []
    return runs


def chain_own_kernels(gm: GraphModule) -> Optional[str]:
    """Replace each run of own-kernel calls by one chain call; a note for the report (None: no chain)."""
    kernels = {native.PLAIN[name]: name for name in KINDS}
    runs = _runs(gm, kernels)  # (before anything loads the kernels: most graphs have no run)
    if not runs or native.available() is not None:
        return None
    for number, run_nodes in enumerate(runs):
        index = {node: i for i, node in enumerate(run_nodes)}
        inputs: list[Node] = []

        def ref(a):
            if not isinstance(a, Node):
                return a
            if a in index:
                return Ref("step", index[a])
            if a.op == "get_attr":
                return operator.attrgetter(a.target)(gm)
            if a not in inputs:
                inputs.append(a)
            return Ref("input", inputs.index(a))

        steps = [Step(kernels[node.target], tuple(ref(a) for a in node.args), node.name) for node in run_nodes]
        leaving = [node for node in run_nodes if any(user not in index for user in node.users)]
        chain = KernelChain(steps, len(inputs), [index[node] for node in leaving])
        chain.__name__ = f"kernel_chain_{number}"  # (what the generated code calls it)
        with gm.graph.inserting_after(run_nodes[-1]):
            call = gm.graph.call_function(chain, tuple(inputs))
        previous = call
        for k, node in enumerate(leaving):
            with gm.graph.inserting_after(previous):
                previous = gm.graph.call_function(operator.getitem, (call, k))
            previous.meta.update(node.meta)
            node.replace_all_uses_with(previous, delete_user_cb=lambda user: user not in index)
        for node in reversed(run_nodes):
            gm.graph.erase_node(node)
    steps = sum(map(len, runs))
    return f"{steps} own-kernel calls run as {len(runs)} chain{'s' * (len(runs) != 1)} (one C call each)"
