"""A compiled graph's constants are shared by all its calls: a write into one changes the next.

Freezing binds the model's tensors as constants (freeze.py) and constant folding computes
values of constants once (cleanup.fold_constants, constant_fills.py). A graph that then writes
into such a value in place changes every later call's input: T5's relative position buckets
(``buckets += torch.where(...)`` on a value made from ``arange``, then an embedding lookup) gave
the reference's output once and ``index out of range`` on the second call. Writes are read from
the op's schema (``Tensor(a!)``, ``out=``), through any chain of views (an in-place op's result
is one too):

- a model tensor the graph writes into is its state, not a constant: freezing keeps it an input,
  folding reads it per call (eager writes into the model's tensor too);
- a write into a value folding made runs once at compile time where it takes constants only and
  nothing read that value at run time before it (T5's buckets fold with their embedding lookup);
  otherwise the value is copied at the start of every call, before its first reader, with the
  reason in the report; so is a folded value the graph returns (the caller may write into it).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.patterns.base import constant_value
from qbackend.patterns.inplace import written_inputs

from qbackend.graph_constants import set_constant
from qbackend.passes.in_place import aliased_input, first_write, writes

aten = torch.ops.aten


def _root(node: Node) -> Node:
    """The node whose storage ``node``'s value is (following views back)."""
    while (source := aliased_input(node)) is not None:
        node = source
    return node


def _storage(value) -> Optional[tuple]:
    """What tells tensors that share memory apart; None for no memory (or none to reach)."""
    try:
        storage = value.untyped_storage()
        return (storage.device, storage.data_ptr()) if storage.nbytes() else None
    except (RuntimeError, NotImplementedError, TypeError):  # (opaque: mkldnn; wrapper subclasses: a weight-only weight)
        return None


class FoldedConstants:
    """fold_constants' view of the graph's constants, in graph order: which it may read (not
    the model's state, not a value written at run time before), which values it made (it owns
    them: a write into one may run now), and which of those must be copied per call."""

    def __init__(self, gm: GraphModule):
        self.gm = gm
        self.owned = set()  # names of constants only this graph holds (new tensors and their views)
        self.read = set()  # storages of owned constants read at run time so far
        self.changing = {}  # storage -> why: not a constant from here on (owned: copied per call)
        for node in gm.graph.nodes:
            value = constant_value(gm, node)
            if value is not None and _storage(value) is not None and first_write(node) is not None:
                self.changing.setdefault(_storage(value), None)  # (the model's state: no copy)

    def value(self, node) -> Optional[torch.Tensor]:
        """The constant ``node`` reads, where it is one for the rest of the graph."""
        value = constant_value(self.gm, node)
        return None if value is None or _storage(value) in self.changing else value

    def _owned_storage(self, node: Node) -> Optional[tuple]:
        root = _root(node)
        return _storage(getattr(self.gm, root.target)) if root.op == "get_attr" and root.target in self.owned else None

    def replace(self, node: Node, value: torch.Tensor) -> None:
        """``node`` becomes the constant ``value``: owned unless it shares memory with an input
        that is not (a view of the model's weight; ``dropout``'s early return)."""
        if not node.users:  # (a write folded)
            self.gm.graph.erase_node(node)
            return
        name = f"_folded_{node.name}"
        if all(n.target in self.owned for n in node.all_input_nodes
               if n.op == "get_attr" and _storage(getattr(self.gm, n.target)) == _storage(value)):
            self.owned.add(name)
        set_constant(self.gm, name, value)
        with self.gm.graph.inserting_before(node):
            constant = self.gm.graph.get_attr(name)
        constant.meta = dict(node.meta)
        node.replace_all_uses_with(constant)
        self.gm.graph.erase_node(node)

    def fold_write(self, node: Node) -> bool:
        """Run ``node`` now where it writes only into owned constants, reads constants only and
        no earlier run-time node read what it writes (that reader would see the result)."""
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) \
                or torch.Tag.nondeterministic_seeded in node.target.tags:
            return False
        returns = node.target._schema.returns
        if node.users and not (len(returns) == 1 and isinstance(returns[0].type, torch.TensorType)):
            return False
        written = written_inputs(node)
        if not written or not all(n.op == "get_attr" and n.target in self.owned for n in written) \
                or any(self.value(n) is None for n in node.all_input_nodes) \
                or any(self._owned_storage(n) in self.read for n in written):
            return False
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: getattr(self.gm, n.target))
        value = node.target(*args, **kwargs)
        same = next((n for n in written if getattr(self.gm, n.target) is value), None)
        if same is not None:  # (an in-place op returns its tensor: one constant, not two names for it)
            node.replace_all_uses_with(same)
        self.replace(node, value)
        return True

    def kept(self, node: Node) -> None:
        """``node`` runs at run time: what it reads of owned constants is read then, and what it
        may write into (or, the output, hand to the caller) must be copied per call."""
        for given in node.all_input_nodes:
            storage = self._owned_storage(given)
            if storage is None:
                continue
            self.read.add(storage)
            written = True if node.op == "output" else writes(node, given)
            if written is not False and self.changing.get(storage) is None:
                name = getattr(node.target, "__name__", node.target)
                self.changing[storage] = "the graph returns it" if node.op == "output" else \
                    f"{name} {'writes' if written else 'may write'} into it at run time"

    def copy_per_call(self) -> list[str]:
        """Give every call its own copy of each owned constant that changes at run time, made
        before its first reader; notes for the report."""
        order = {node: index for index, node in enumerate(self.gm.graph.nodes)}
        groups = {}
        for node in order:
            if node.op == "get_attr" and node.target in self.owned and node.users:
                storage = _storage(getattr(self.gm, node.target))
                if self.changing.get(storage) is not None:
                    groups.setdefault(storage, []).append(node)
        notes = []
        for storage, members in groups.items():
            first = min((user for member in members for user in member.users), key=order.__getitem__)
            with self.gm.graph.inserting_before(first):
                copies = self._copies(members)
            for member, copy in zip(members, copies):
                member.replace_all_uses_with(copy, delete_user_cb=lambda user: user not in copies)
            notes.append(f"constant {', '.join(m.target for m in members)} copied on every call: {self.changing[storage]}")
        return notes

    def _copies(self, members: list) -> list:
        """Nodes giving a copy of ``members``' memory, each member's view of it (one: a clone)."""
        graph = self.gm.graph
        if len(members) == 1:
            copy = graph.call_function(aten.clone.default, (members[0],))
            copy.meta = dict(members[0].meta)
            return [copy]
        first = getattr(self.gm, members[0].target)
        memory = torch.empty(0, dtype=first.dtype, device=first.device).set_(first.untyped_storage())
        name = f"{members[0].target}_memory"
        set_constant(self.gm, name, memory)
        copy = graph.call_function(aten.clone.default, (graph.get_attr(name),))
        views = []
        for member in members:
            value = getattr(self.gm, member.target)
            source = copy if value.dtype == first.dtype else graph.call_function(aten.view.dtype, (copy, value.dtype))
            views.append(graph.call_function(aten.as_strided.default, (source, tuple(value.shape), value.stride(), value.storage_offset())))
            views[-1].meta = dict(member.meta)
        return views
