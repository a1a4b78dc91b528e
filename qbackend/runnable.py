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

from .stack_room import StackRoom


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
