"""HOW a device runs a matched rule: emitters, Unsupported entries, the emit context."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.graph_constants import set_constant
from qbackend.ops import Resolved, resolve


@dataclass(frozen=True)
class Unsupported:
    """A rule this device cannot run, and why (shown in the report and the docs)."""

    reason: str


@dataclass(frozen=True)
class Lowering:
    """Emit a match with the device's kernels.

    ``emit(ctx, match) -> Node`` inserts the lowered node(s) and returns the one that replaces
    ``match.result``. ``limits(match) -> reason | None`` states kernel limits that depend on
    the match (e.g. a post-op this kernel rejects for this rank); it never re-checks the pattern.
    """

    emit: Callable
    needs: tuple[str, ...]  # logical ops (qbackend.ops) the emitter calls; all must resolve
    limits: Optional[Callable] = None
    needs_for: Optional[Callable] = None  # match -> logical ops that depend on it (a conv's rank)
    # (ctx, match) -> True where the emitter runs the whole match although ``limits`` refuse it
    # (one of qbackend's own kernels fuses a post-op oneDNN's cannot)
    runs_anyway: Optional[Callable] = None

    def needs_of(self, match) -> tuple[str, ...]:
        return self.needs + (tuple(self.needs_for(match)) if self.needs_for is not None else ())


@dataclass
class EmitContext:
    gm: GraphModule
    device: str
    registry: object = None
    need_meta: bool = False  # the lowered graph will be traced with fake tensors: Meta kernels only
    weight_only_compute: str = "auto"  # how float activations meet weight-only kernels (weight_only.COMPUTE_CHOICES)
    weight_only_dense_rows: Optional[int] = None  # from this many rows on, weight-only linears run dense
    kernel_choice: str = "prior"  # own kernel or oneDNN: "measure", "cached" or "prior" (lowering/choice.py)
    choices: object = None  # the machine's choice cache (qbackend.kernels.choice_cache.ChoiceCache) unless "prior"
    notes: list = field(default_factory=list)  # what the last emit decided that the report should say
    kernel: str = ""  # the last emit's kernel, when its result node is not the kernel call
    erased: set = field(default_factory=set)  # nodes the emitted matches removed from the graph
    _resolved: dict = field(default_factory=dict)
    _constants: int = 0

    def op(self, logical: str) -> Resolved:
        if logical not in self._resolved:
            self._resolved[logical] = resolve(logical, self.device, self.registry, need_meta=self.need_meta)
        return self._resolved[logical]

    def call_now(self, logical: str, *args):
        """Run an op at compile time (weight prepacking)."""
        return self.op(logical).op(*args)

    def constant(self, value: torch.Tensor, hint: str) -> Node:
        """A get_attr node holding ``value`` on the compiled module (inserted where the graph
        cursor is)."""
        name = f"_qb_{hint}_{self._constants}"
        self._constants += 1
        set_constant(self.gm, name, value)
        return self.gm.graph.get_attr(name)

    def call(self, logical: str, args: tuple) -> Node:
        return self.gm.graph.call_function(self.op(logical).op, args)
