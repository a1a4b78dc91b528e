"""The lowered graph as the callable the backend returns.

Each ATen / oneDNN op in FX's generated code is called through ``OpOverload.__call__``, a
Python frame around the op's C++ entry point (``OpOverload._op``). ``runnable`` runs a copy of
the graph whose ops call that entry point directly, through a ``functools.partial`` (called
from C, no frame of its own); the op, its arguments and its dispatch are the same. Measured
(one process, 300 interleaved calls, this Xeon): all-MiniLM-L6-v2 b1 6.25 -> 6.06 ms (147
ops), mobilenet_v3_large b1 4.44 -> 4.36 ms (42 ops). Fewer frames also leave fewer calls to
cross a chunk of Python's frame stack (``stack_room``), which wraps the result.

The copy shares the lowered module's constants; the GraphModule the report and tests read
keeps its op overloads.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.fx import GraphModule

from qbackend.runtime.stack_room import StackRoom


def _entry_point(op: torch._ops.OpOverload) -> Callable:
    call = functools.partial(op._op)
    # (FX names a non-torch callable's global from these; ``op``'s own say "torch.ops...")
    call.__module__, call.__name__ = "qbackend", str(op).replace(".", "_")
    return call


def copied_graph(gm: GraphModule) -> torch.fx.Graph:
    """A copy of ``gm``'s graph: its nodes, placeholders and codegen (input / output structure)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph._codegen = gm.graph._codegen
    return graph


def direct_calls(gm: GraphModule) -> GraphModule:
    return module_of_direct_calls(gm, copied_graph(gm))


def module_of_direct_calls(root: torch.nn.Module, graph: torch.fx.Graph) -> GraphModule:
    """``GraphModule(root, graph)`` with ``graph``'s ops (changed in place) calling their entry
    points."""
    for node in graph.nodes:
        if node.op == "call_function" and type(node.target) is torch._ops.OpOverload:  # (not a subclass with its own __call__)
            node.target = _entry_point(node.target)
    return GraphModule(root, graph)


class NodeSteps:
    """Some of a graph's nodes run one after another on given inputs, each op called as the
    lowered graph calls it (``_entry_point``), without generated code: the kernel choice times
    two such candidates per layer, and a GraphModule for each (FX's code generation, ~3 ms) had
    taken a quarter of a cold ``qbackend.compile`` (resnext50_32x4d at batch 8: 0.3 of 1.2 s).

    ``nodes`` in graph order; ``inputs``: the nodes whose values the call gets; ``constants``:
    node -> value (get_attr nodes); ``result``: the node whose value is returned."""

    def __init__(self, nodes: list, inputs: list, constants: dict, result):
        slot = {node: i for i, node in enumerate(inputs)}
        self.constants = list(constants.values())
        slot.update({node: len(inputs) + i for i, node in enumerate(constants)})
        self.steps = []
        for node in nodes:
            target = node.target
            if node.op == "call_function" and type(target) is torch._ops.OpOverload:
                target = _entry_point(target)
            elif node.op == "call_method":
                target = functools.partial(_method, target)
            elif node.op != "call_function":
                raise ValueError(f"NodeSteps runs call_function / call_method nodes, not {node.op}")
            args = torch.fx.node.map_arg(node.args, lambda n: _Slot(slot[n]))
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: _Slot(slot[n]))
            top = [(i, a.index) for i, a in enumerate(args) if type(a) is _Slot]
            nested = any(_has_slot(a) for a in args if type(a) is not _Slot) or any(map(_has_slot, kwargs.values()))
            self.steps.append((target, args, kwargs, top, nested))
            slot[node] = len(slot)
        self.result = slot[result]

    def __call__(self, *inputs):
        values = [*inputs, *self.constants]
        for target, args, kwargs, top, nested in self.steps:
            if nested:
                args, kwargs = (torch.fx.node.map_aggregate(x, lambda a: values[a.index] if type(a) is _Slot else a)
                                for x in (args, kwargs))
            else:
                args = list(args)
                for position, index in top:
                    args[position] = values[index]
            values.append(target(*args, **kwargs))
        return values[self.result]


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _has_slot(value) -> bool:
    if type(value) is _Slot:
        return True
    if isinstance(value, (list, tuple)):
        return any(map(_has_slot, value))
    if isinstance(value, dict):
        return any(map(_has_slot, value.values()))
    return False


def _method(name: str, obj, *args, **kwargs):
    return getattr(obj, name)(*args, **kwargs)


def runnable(lowered, runtime_inputs: list[int], total: int) -> Callable:
    """A callable taking Dynamo's ``total`` inputs, of which ``lowered`` (the GraphModule, or
    what Inductor compiled from it) reads ``runtime_inputs``. It runs with grad mode off: the
    lowered graph is an inference graph (its weights frozen, its kernels without gradients),
    and oneDNN's in-place sum cannot resize a float tensor autograd records (an input that
    requires grad gave "cannot resize variables that require grad" where the eager module ran)."""
    graph = direct_calls(lowered).forward if isinstance(lowered, GraphModule) else lowered
    keep = None if runtime_inputs == list(range(total)) else tuple(runtime_inputs)

    def forward(*args):
        with torch.no_grad():
            return graph(*args) if keep is None else graph(*[args[i] for i in keep])

    return StackRoom(forward)
