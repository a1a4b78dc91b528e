"""Runs of qbackend's own kernels, with the views between them, as one call (``csrc/kernel_chain.c``).

Each own-kernel call from the graph costs ~4-20 us of Python besides its kernel (arguments,
the prepared-call lookup, the output's allocation, ctypes): on a MobileNetV2 image, 46 calls
of which most compute for 15-60 us; in a Llama decode step, ~70 calls (weight-only matmuls,
RMSNorm, rotary, SiLU-multiply) with ~100 views between them, most computing for under 5 us.
``chain_own_kernels`` replaces every run of consecutive own-kernel calls in a lowered graph
(constants aside, views of their values and of the run's inputs between them) by one call of a
``KernelChain``: its steps are prepared once per input signature (the first call runs the nodes
one by one, as the graph did, keeps their prepared calls and finds where each operand lives: a
chain input, a step's output, at an offset), its intermediates and the steps' scratch share one
arena laid out by their lifetimes, and later calls are one ctypes call. Values that leave the
run are fresh tensors (a leaving view, a view of one, made again per call), so nothing the
caller sees is ever reused. Where a call cannot be a C step (a kernel fell back to torch's ops,
a view copied: a prompt's head merge), that signature's calls run the nodes one by one.

A decode step's KV cache appends and attention are steps too. The cache's length is then no
part of the signature: each call checks the caches' room and passes their lengths as numbers
(KeyLength operands), so one program serves every step until a cache is reallocated.
"""
from __future__ import annotations

import ctypes
import functools
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate, map_arg

from qbackend.kernels.weight_only_linear import unflatten_rows

from qbackend.kernels import add_quantize, batch_norm_quantize, kv_append, layer_norm_quantize, rms_norm, rotary, silu_mul
from qbackend.kernels import (attention, channel_shuffle, conv_gemm, depthwise, fast_qdq, grouped, isa, library, pools, quantize, registry,
                              scale_quantize, stem, weight_only_mm)
from qbackend.kernels.chain_step import FOUR, X_TO_Y, At, KeyLength
from qbackend.kernels.structs import ChainStep, Operand

aten = torch.ops.aten

ALIGN = 64  # bytes: intermediates start on cache lines
MIN_STEPS = 2  # a single call gains nothing from a chain
MAX_PROGRAMS = 16  # input signatures a chain keeps prepared
PREPARE_EVERY = 64  # calls between two prepares once MAX_PROGRAMS are kept (the oldest then goes; a signature
# new at every call, e.g. a mask growing with the cache, would cost a prepare a call: more than it saves)
GROWS = 2  # the dim along which an append's cache grows: [batch, heads, rows, head dim]
CONVS = {"qconv": FOUR, "qconv_depthwise": X_TO_Y, "qconv_grouped": X_TO_Y, "qconv_stem": X_TO_Y, "max_pool_u8": X_TO_Y,
         "avg_pool_u8": X_TO_Y, "global_avg_pool_u8": X_TO_Y, "global_avg_pool_quantize": X_TO_Y}
# views a run may hold: they cost a step nothing (an operand's offset and strides, fixed per signature)
VIEW_METHODS = frozenset({"view", "reshape", "transpose", "unsqueeze", "squeeze", "contiguous", "permute", "flatten"})
VIEW_FUNCTIONS = frozenset({unflatten_rows, aten.slice.Tensor, aten.view.default, aten.reshape.default, aten.transpose.int,
                            aten.unsqueeze.default, aten.squeeze.dim})
KERNEL_TUPLES = frozenset({rms_norm.add_rms_norm, channel_shuffle.shuffle_halves, layer_norm_quantize.layer_norm_and_quantize})  # kernels returning several tensors (read through getitem)
WRITES_FIRST = frozenset({add_quantize.add_quantize_})  # kernels writing into their first operand: a step's value, never an input


@functools.cache
def kernels() -> dict:
    """name -> (the plain function graphs call, its chain step: (args, result) -> StepCall or None)."""
    return {"qconv": (conv_gemm.qconv, conv_gemm.chain_call), "qconv_depthwise": (depthwise.qconv_depthwise, depthwise.chain_call),
            "qconv_grouped": (grouped.qconv_grouped, grouped.chain_call), "qconv_stem": (stem.qconv_stem, stem.chain_call),
            "max_pool_u8": (pools.max_pool_u8, pools.max_pool_chain_call),
            "avg_pool_u8": (pools.avg_pool_u8, pools.avg_pool_chain_call),
            "global_avg_pool_u8": (pools.global_avg_pool_u8, pools.global_avg_pool_chain_call),
            "global_avg_pool_quantize": (pools.global_avg_pool_quantize, pools.global_avg_pool_quantize_chain_call),
            "scale_quantize": (scale_quantize.scale_quantize, scale_quantize.chain_call),
            "quantize_per_tensor": (fast_qdq.quantize_per_tensor, quantize.dense_chain_call),
            "int4_mm_int16": (weight_only_mm.int4_mm_int16, weight_only_mm.chain_call),
            "int8_mm_int16": (weight_only_mm.int8_mm_int16, weight_only_mm.chain_call),
            "rms_norm": (rms_norm.rms_norm, rms_norm.chain_call), "add_rms_norm": (rms_norm.add_rms_norm, rms_norm.chain_call),
            "rotary": (rotary.rotary, rotary.chain_call), "silu_mul": (silu_mul.silu_mul, silu_mul.chain_call),
            "attention_f32": (attention.attention_f32, attention.chain_call),
            "attention_from_projection": (attention.attention_from_projection, attention.projection_chain_call),
            "layer_norm_quantize": (layer_norm_quantize.layer_norm_quantize, layer_norm_quantize.chain_call),
            "layer_norm_and_quantize": (layer_norm_quantize.layer_norm_and_quantize, layer_norm_quantize.chain_call),
            "add_quantize_": (add_quantize.add_quantize_, add_quantize.chain_call),
            "batch_norm_quantize": (batch_norm_quantize.batch_norm_quantize, batch_norm_quantize.chain_call),
            "kv_append": (kv_append.append, kv_append.chain_call),
            "shuffle_pair": (channel_shuffle.shuffle_pair, channel_shuffle.chain_call),
            "shuffle_halves": (channel_shuffle.shuffle_halves, channel_shuffle.chain_call)}


@library.once
def _run_chain():
    """kernel_chain.c's runner: (threads, steps, the steps, their bases) -> 0, 1 + the step that
    could not allocate its scratch, or -1 - the step that refused this call's values."""
    return isa.c_function("qb_run_chain", (ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p), ctypes.c_int)


NONE = Operand(-1, 0)


@dataclass(frozen=True)
class Ref:
    """A tensor operand of a step: the chain's input ``index`` ("input") or step ``index``'s value ("step")."""

    source: str
    index: int


@dataclass
class Step:
    kernel: Optional[str]  # a kernels() key; None: a view (``view``) or a pick of a step's outputs (operator.getitem)
    args: tuple  # the call's arguments, tensor operands as Ref, constants as tensors
    name: str  # of the graph node it replaced (for listings)
    view: Any = None  # a view: its method's name (a str) or its function


class _NotAStep(Exception):
    """A call the chain's C steps cannot run for this signature."""


class _Reallocated(_NotAStep):
    """A KV cache append that moved the cache to a new buffer: the signature of a cache's first
    fill or a full buffer, not seen again (the next call's cache has other strides)."""


class _Program:
    """A chain prepared for one input signature: the C steps, the arena's size, the outputs'."""

    def __init__(self, steps: list, arena_bytes: int, outputs: list, picks: list, prepared: list, inputs: list, appends: list):
        self.steps = (ChainStep * len(steps))(*steps)
        self.like = next(k for k, t in enumerate(inputs) if isinstance(t, torch.Tensor))  # (new_empty: faster than torch.empty)
        self.arena_bytes = arena_bytes
        self.outputs = outputs  # (shape, strides, dtype) per output buffer
        self.picks = picks  # per leaving value: ("input" / "output" / "append", its index, None or a view's (shape, strides, offset))
        self.prepared = prepared  # holds the structs the steps point to
        self.appends = appends  # per KV cache append: (the cache's input index, rows it adds)
        self.bases_type = ctypes.c_void_p * (1 + len(inputs) + len(outputs) + len(appends))
        self.spare_arenas: list = []  # kept between calls: see ``run``

    def run(self, inputs: list) -> Optional[tuple]:
        """The leaving values; None where a cache has no room for its rows (or two share one, or
        another thread took it), or a step refused this call's values (QB_STEP_REFUSED): the
        caller then runs the nodes, which reallocate the cache, or compute the values as the
        graph did. (Steps write nothing the nodes read but a claimed cache's room.)"""
        caches = kv_append.claim([(inputs[k], added) for k, added in self.appends], GROWS) if self.appends else ()
        if caches is None:
            return None
        first = inputs[self.like]
        # The arena is kept for the next call: a fresh one was a fresh mmap whenever it exceeded
        # glibc's mmap threshold, every page of it faulted in and zeroed again at every call
        # (regnet_y_400mf at batch 8: ~1100 of the ~4300 faults a call that cost 13 of its 92 ms
        # of CPU). Each thread running this program at once takes its own (list.pop / append:
        # atomic under the GIL).
        try:
            arena = self.spare_arenas.pop()
        except IndexError:
            arena = first.new_empty(self.arena_bytes, dtype=torch.uint8)
        outputs = [first.new_empty_strided(shape, strides, dtype=dtype) for shape, strides, dtype in self.outputs]
        # (made per call: ctypes lets go of the GIL, so another thread may run this program meanwhile)
        bases = self.bases_type(arena.data_ptr(), *(t.data_ptr() if isinstance(t, torch.Tensor) else None for t in inputs),
                                *(y.data_ptr() for y in outputs), *(inputs[k].shape[GROWS] for k, _ in self.appends))
        failed = _run_chain()(torch.get_num_threads(), len(self.steps), self.steps, bases)
        self.spare_arenas.append(arena)
        if failed > 0:
            raise MemoryError(f"qbackend kernel chain: step {failed - 1} could not allocate its scratch")
        if failed < 0:
            return None
        grown = [base.narrow(GROWS, start, inputs[k].shape[GROWS] + added)
                 for (base, start, _), (k, added) in zip(caches, self.appends)]
        sources = {"input": inputs, "output": outputs, "append": grown}
        return tuple(_viewed(sources[source][k], view) for source, k, view in self.picks)


def _resolved(args: tuple, inputs: list, values: list) -> tuple:
    """A step's arguments with its Refs replaced by the chain's inputs and the steps' values."""
    return map_aggregate(args, lambda a: (inputs if a.source == "input" else values)[a.index] if isinstance(a, Ref) else a)


def _viewed(base: torch.Tensor, view: Optional[tuple]) -> torch.Tensor:
    """``base`` itself, or the view of it a leaving value is: (shape, strides, element offset)."""
    return base if view is None else base.as_strided(view[0], view[1], base.storage_offset() + view[2])


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


def _extent(t: torch.Tensor) -> int:
    """Bytes from t's first element to past its last."""
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()


class KernelChain:
    """What a chain node calls: ``chain(*inputs)`` gives the tuple of its outputs."""

    def __init__(self, steps: list, input_count: int, outputs: list):
        self.steps = steps
        self.input_count = input_count
        self.outputs = outputs  # step indices whose values leave the chain
        self.channels_last = any(step.kernel in CONVS for step in steps)  # (the int8 conv kernels' layout)
        # inputs that are KV caches an append grows: their length is no part of a signature
        self.caches = frozenset(step.args[0].index for step in steps if step.kernel == "kv_append" and step.args[0].source == "input")
        self._programs: dict = {}  # signature -> _Program, or None: run the nodes one by one
        self._calls = self._next_prepare = 0

    def __getstate__(self):  # (prepared ctypes structs are per process: copies prepare again)
        return {**self.__dict__, "_programs": {}, "_calls": 0, "_next_prepare": 0}

    def listing(self) -> list:
        """The kernel steps as (node name, kernel, arguments) with operands named: what the graph held."""
        return [(step.name, step.kernel, step.args) for step in self.steps if step.kernel is not None]

    def __call__(self, *inputs) -> tuple:
        if self.channels_last:  # (views between steps may make an input of another rank)
            inputs = [x.contiguous(memory_format=torch.channels_last) if isinstance(x, torch.Tensor) and x.dim() == 4 else x
                      for x in inputs]
        key = tuple(_signature(x, k in self.caches) for k, x in enumerate(inputs))
        self._calls += 1
        program = self._programs.get(key, False)
        if program:
            outputs = program.run(inputs)
            if outputs is not None:
                return outputs
        if program is not False:  # (a known signature: run stepwise, or its caches are full this call)
            return self._stepwise(inputs)[0]
        outputs, values = self._stepwise(inputs)
        # (changed on a copy, then swapped in: threads preparing at once had evicted the same
        # program twice, a KeyError; a program one of them prepared may be lost, never an error)
        programs = dict(self._programs)
        if len(programs) >= MAX_PROGRAMS:
            if self._calls < self._next_prepare:
                return outputs
            del programs[next(iter(programs))]
        try:
            program = self._program(inputs, values)
        except _Reallocated:
            return outputs
        except _NotAStep:
            program = None
        programs[key] = program
        self._programs = programs
        self._next_prepare = self._calls + PREPARE_EVERY
        return outputs

    def _stepwise(self, inputs) -> tuple[tuple, list]:
        """The steps run as the graph ran its nodes: (the leaving values, every step's value)."""
        table, values = kernels(), []
        for step in self.steps:
            args = _resolved(step.args, inputs, values)
            if step.kernel is not None:
                values.append(table[step.kernel][0](*args))
            elif isinstance(step.view, str):
                values.append(getattr(args[0], step.view)(*args[1:]))
            else:
                values.append(step.view(*args))
        return tuple(values[i] for i in self.outputs), values

    def _program(self, inputs: list, values: list) -> _Program:
        """The C program for these inputs from the first run's ``values``: each kernel step's
        call, each operand placed (in an input, an output or the arena, at a byte offset)."""
        table = kernels()
        buffers: list = []  # every kernel step's output tensors: (tensor, the C step writing it)
        origins: list = []  # per step: ("input", k), ("buffer", b), ("tuple", buffer indices) or ("append", a)
        calls: list = []
        appends: list = []  # per KV cache append: (the cache's input index, rows it adds)
        for i, step in enumerate(self.steps):
            if step.kernel == "kv_append":  # (its value is the cache, longer: in place, its length given per call)
                cache = inputs[step.args[0].index]
                if values[i].untyped_storage().data_ptr() != cache.untyped_storage().data_ptr():
                    raise _Reallocated(step.name)
                call = table[step.kernel][1](_resolved(step.args, inputs, values), values[i])
                if call is None:
                    raise _NotAStep(step.name)
                origins.append(("append", len(appends)))
                appends.append((step.args[0].index, values[i].shape[GROWS] - cache.shape[GROWS]))
                calls.append(call)
            elif step.kernel is not None:
                results = values[i] if isinstance(values[i], tuple) else (values[i],)
                indices = tuple(range(len(buffers), len(buffers) + len(results)))
                buffers.extend((t, len(calls)) for t in results)
                origins.append(("tuple", indices) if isinstance(values[i], tuple) else ("buffer", indices[0]))
                call = table[step.kernel][1](_resolved(step.args, inputs, values), values[i])
                if call is None:
                    raise _NotAStep(step.name)
                calls.append(call)
            elif step.view is operator.getitem and step.args[0].source == "step" and origins[step.args[0].index][0] == "tuple":
                origins.append(("buffer", origins[step.args[0].index][1][step.args[1]]))
            else:
                base = step.args[0]
                origins.append(("input", base.index) if base.source == "input" else origins[base.index])
                if origins[-1][0] == "append" or base.source == "input" and base.index in self.caches:
                    raise _NotAStep("a view of a growing KV cache")  # (its shape would be fixed)
        where = {id(values[i]): origin for i, origin in enumerate(origins) if origin[0] != "tuple"}
        where.update({id(t): ("buffer", b) for b, (t, _) in enumerate(buffers)})  # (outputs no getitem reads too)
        where.update({id(t): ("input", k) for k, t in enumerate(inputs) if isinstance(t, torch.Tensor)})
        leaving = list(dict.fromkeys(origins[i][1] for i in self.outputs if origins[i][0] == "buffer"))
        last_read = [step for _, step in buffers]

        def located(t: torch.Tensor) -> tuple:
            """(origin, byte offset) of operand ``t``: a view of an input or of a buffer that did not copy."""
            origin = where.get(id(t))
            if origin is None:
                raise _NotAStep("an operand that is neither an input nor a step's value")
            if origin[0] == "append":  # (the cache itself, longer: at its input's address)
                return ("input", appends[origin[1]][0]), 0
            base = inputs[origin[1]] if origin[0] == "input" else buffers[origin[1]][0]
            offset = t.data_ptr() - base.data_ptr()
            if (t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() or offset < 0
                    or offset + _extent(t) > _extent(base)):
                raise _NotAStep("a view that copied")
            return origin, offset

        def read(t, position: int):
            """Operand ``t`` placed: (origin, byte offset), the read counted in its buffer's lifetime."""
            tensor, inside = (t, 0) if isinstance(t, torch.Tensor) else (t.tensor, t.offset)
            origin, offset = located(tensor)
            if inside and not 0 < inside < _extent(tensor):
                raise _NotAStep("an address outside its tensor")
            if origin[0] == "buffer":
                last_read[origin[1]] = max(last_read[origin[1]], position)
            return origin, offset + inside

        placed, listed = [], []
        for position, call in enumerate(calls):
            operands = []
            for t in call.operands:
                if isinstance(t, KeyLength):
                    t = ("length", where.get(id(t.keys)), t.keys.shape[GROWS])
                elif isinstance(t, (torch.Tensor, At)):
                    t = read(t, position)
                operands.append(t)
            placed.append(operands)
            listed.append([read(t, position) for t in call.listed])
        inner = [b for b in range(len(buffers)) if b not in leaving]
        offsets, arena_bytes = _plan([buffers[b][0].numel() * buffers[b][0].element_size() for b in inner],
                                     [(buffers[b][1], last_read[b]) for b in inner])
        place = dict(zip(inner, offsets))
        scratch_at = -(-arena_bytes // ALIGN) * ALIGN
        arena_bytes = scratch_at + max((call.scratch for call in calls), default=0)

        sizes_at = 1 + self.input_count + len(leaving)  # (bases: the arena, inputs, outputs, then each append's cache length)
        growing = {k: a for a, (k, _) in enumerate(appends)}

        def operand(o) -> Operand:
            if o is None:
                return NONE
            if isinstance(o, str):  # SCRATCH
                return Operand(0, scratch_at)
            if o[0] == "length":  # a cache's length per call (an append's value: plus the rows it adds), else fixed
                _, origin, fixed = o
                if origin is not None and origin[0] == "append":
                    return Operand(sizes_at + origin[1], appends[origin[1]][1])
                if origin is not None and origin[0] == "input" and origin[1] in growing:
                    return Operand(sizes_at + growing[origin[1]], 0)
                return Operand(-1, fixed)
            (kind, k), offset = o
            if kind == "input":
                return Operand(1 + k, offset)
            if k in leaving:
                return Operand(1 + self.input_count + leaving.index(k), offset)
            return Operand(0, place[k] + offset)

        steps = [ChainStep(call.kind, call.function, call.call, *(operand(o) for o in operands), *[NONE] * (6 - len(operands)))
                 for call, operands in zip(calls, placed)]
        for call, operands in zip(calls, listed):  # (a LIST step's own operands, in its prepared call)
            for k, o in enumerate(operands):
                call.listed_into[k] = operand(o)
        outputs = [(buffers[b][0].shape, buffers[b][0].stride(), buffers[b][0].dtype) for b in leaving]
        picks = []
        for i in self.outputs:  # (a leaving view: made again on its base, input or output)
            (kind, k), t = origins[i], values[i]
            if kind == "append":
                picks.append(("append", k, None))
                continue
            base = inputs[k] if kind == "input" else buffers[k][0]
            same = t.shape == base.shape and t.stride() == base.stride() and t.data_ptr() == base.data_ptr()
            view = None if same else (tuple(t.shape), t.stride(), located(t)[1] // t.element_size())
            picks.append(("input", k, view) if kind == "input" else ("output", leaving.index(k), view))
        return _Program(steps, arena_bytes, outputs, picks, calls, inputs, appends)


def _signature(x, cache: bool) -> tuple:
    """What a program is prepared for: a tensor's shape (a KV cache's without its length), strides,
    dtype and device; a number by value (a size the lowering computed may be an input)."""
    if not isinstance(x, torch.Tensor):
        return type(x), x
    return (tuple(x.shape[:GROWS]) + (-1,) + tuple(x.shape[GROWS + 1:]) if cache else x.shape), x.stride(), x.dtype, x.device


def _joins(node: Node, kernel: str) -> bool:
    """Whether this call of ``kernel`` may be a step: attention without a mask (a mask's length
    grows with the cache: a signature per step), an append whose cache only it reads and whose
    value only attention's keys / values and the graph's output do (its length is given per call)."""
    if kernel == "attention_f32":
        return len(node.args) > 3 and node.args[3] is None
    if kernel == "quantize_per_tensor":  # (where the one-pass kernel runs it: a dense float32 input)
        x = node.args[0].meta.get("val", node.args[0].meta.get("example_value")) if isinstance(node.args[0], Node) else None
        return isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.numel() > 0 and quantize.dense(x)
    if kernel == "kv_append":
        cache = node.args[0]
        return isinstance(cache, Node) and cache.op == "placeholder" and len(cache.users) == 1 and all(
            user.op == "output" or (user.target is attention.attention_f32 and node not in (user.args[0], *user.args[3:]))
            for user in node.users)
    return True


def _member(node: Node, kernel_targets: dict, run: set) -> bool:
    """Whether ``node`` may join a run (``run``: its nodes so far)."""
    if node.op not in ("call_function", "call_method") or node.kwargs:  # (steps keep positional args)
        return False
    if node.op == "call_function" and node.target in kernel_targets:  # (a tuple is read through its getitems only)
        if node.target in WRITES_FIRST and not _a_steps_value(node.args[0], kernel_targets, run):
            return False  # (a write into the chain's input: a call that runs the nodes again would read it written)
        return _joins(node, kernel_targets[node.target]) and (
            node.target not in KERNEL_TUPLES or all(user.target is operator.getitem for user in node.users))
    if node.op == "call_function" and node.target is operator.getitem:  # a kernel's output, or a basic index (a view)
        if isinstance(node.args[0], Node) and node.args[0].target in KERNEL_TUPLES:
            return node.args[0] in run and isinstance(node.args[1], int)
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        base = node.args[0]
        tensor = isinstance(base, Node) and (base in run or isinstance(base.meta.get("val"), torch.Tensor))
        return tensor and base.op != "get_attr" and all(
            i is None or i is Ellipsis or type(i) is int or (type(i) is slice and all(
                type(v) in (int, type(None)) for v in (i.start, i.stop, i.step))) for i in index)
    is_view = node.target in VIEW_METHODS if node.op == "call_method" else node.target in VIEW_FUNCTIONS
    return is_view and isinstance(node.args[0], Node) and node.args[0].op != "get_attr"


def _a_steps_value(node, kernel_targets: dict, run: set) -> bool:
    """``node`` is a kernel step of ``run`` or a view of one (through the run's views)."""
    while isinstance(node, Node) and node in run and node.target not in kernel_targets:
        node = node.args[0]
    return isinstance(node, Node) and node in run


def _pick(node: Node) -> bool:
    """``node`` picks one output of a kernel returning several."""
    return node.target is operator.getitem and isinstance(node.args[0], Node) and node.args[0].target in KERNEL_TUPLES


def _runs(gm: GraphModule, kernel_targets: dict, movable: Callable[[Node], bool]) -> list[list[Node]]:
    """Maximal runs of own-kernel calls (``kernel_targets``: plain function -> name) and views
    in graph order, constants between them aside, without the views that end a run. A call
    between a run's nodes that reads none of them and that ``movable`` admits (one that writes
    nothing) moves before the run instead of ending it: a transformer's mask, made from the
    graph's input between its first LayerNorm and first linear, had split the encoder's run."""
    runs, current, members, moving = [], [], set(), []

    def hoisted(node: Node) -> bool:
        """Whether ``node`` moves before the run (once the run is kept)."""
        if not current or node.op not in ("call_function", "call_method") or not movable(node) or any(
                a in members for a in node.all_input_nodes) or any(
                step.target is kv_append.append for step in current):  # (an append writes a cache the node may read)
            return False
        moving.extend(a for a in node.all_input_nodes if a.op == "get_attr")  # (a constant read here: before it too)
        moving.append(node)
        return True

    def close():
        while current and current[-1].target not in kernel_targets and not _pick(current[-1]):
            current.pop()
        if sum(node.target in kernel_targets for node in current) >= MIN_STEPS:
            runs.append(list(current))
            for node in dict.fromkeys(moving):  # (in order; a constant two of them read, once)
                current[0].prepend(node)
        current.clear()
        members.clear()
        moving.clear()

    for node in list(gm.graph.nodes):  # (a copy: hoisting moves nodes)
        if node.op == "get_attr":
            continue
        if _member(node, kernel_targets, members) and _tensor_operands(node):
            current.append(node)
            members.add(node)
            continue
        if not hoisted(node):
            close()
    close()
    return runs


def _tensor_operands(node: Node) -> bool:
    """No node the call reads is known to hold a size or a number (Dynamo's placeholders keep
    theirs under example_value; nodes the lowering made carry none: KernelChain keys such
    inputs by value)."""
    found = []
    map_arg((node.args, node.kwargs), found.append)
    return not any(isinstance(a.meta.get("val", a.meta.get("example_value")),
                              (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)) for a in found)


def chain_own_kernels(gm: GraphModule, movable: Callable[[Node], bool] = lambda node: False) -> Optional[str]:
    """Replace each run of own-kernel calls by one chain call; a note for the report (None: no
    chain). ``movable``: whether a node may run earlier than placed, as far as its own effects go
    (by default none moves)."""
    kernel_targets = {plain: name for name, (plain, _) in kernels().items()}
    runs = _runs(gm, kernel_targets, movable)  # (before anything loads the kernels: most graphs have no run)
    if not runs or registry.available() is not None:
        return None
    for number, run_nodes in enumerate(runs):
        _replace(gm, run_nodes, kernel_targets, number)
    steps = sum(node.target in kernel_targets for run_nodes in runs for node in run_nodes)
    return f"{steps} own-kernel calls run as {len(runs)} chain{'s' * (len(runs) != 1)} (one C call each)"


def chain_calls(gm: GraphModule) -> int:
    """How many chain calls ``gm`` makes (the report counts them)."""
    return sum(isinstance(node.target, KernelChain) for node in gm.graph.nodes)


def _replace(gm: GraphModule, run_nodes: list, kernel_targets: dict, number: int) -> None:
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

    steps = []
    for node in run_nodes:
        args = map_aggregate(node.args, ref)
        if node.target in kernel_targets:
            steps.append(Step(kernel_targets[node.target], args, node.name))
        else:
            steps.append(Step(None, args, node.name, node.target))
    leaving = [node for node in run_nodes if node.target not in KERNEL_TUPLES and any(user not in index for user in node.users)]
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
