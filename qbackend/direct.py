"""``qbackend.compile``: lower a converted PT2E module without Dynamo's re-trace.

A converted PT2E module is already an ATen-level FX graph, specialised by export to its input
shapes. ``torch.compile`` traces its Python code again, bytecode by bytecode, and guards every
constant: measured, that is 80-90% of qbackend's compile time (ResNet-18-like: 0.5 of 0.6 s,
MobileNetV2-like: 1.8 of 2.1 s). Here the graph goes to the same backend as it is, after a
fake-tensor pass that gives the nodes convert_pt2e added their shapes (the prepacks tune for
them). Each new input signature (shapes, dtypes, devices) is lowered once, as Dynamo would
recompile; anything that is not an ATen GraphModule goes through ``torch.compile``.
"""
from __future__ import annotations

import inspect
import logging
from typing import Callable, Optional

import torch
from torch.fx import GraphModule

from .backend import qbackend
from .freeze import set_constant

log = logging.getLogger("qbackend")


def _signature(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device, value.requires_grad)
    return ("value", type(value), value if isinstance(value, (int, float, bool, str, type(None))) else id(value))


def _frozen_copy(gm: GraphModule) -> GraphModule:
    """A copy of ``gm`` (graph and node meta; tensors shared) that takes its placeholders as
    arguments, returns its outputs flat (the caller does export's pytree in / out), and reads
    every constant as a frozen one, as the Dynamo path does (``freeze.set_constant``)."""
    graph = torch.fx.Graph()  # (default codegen; node meta copied per node, so the user's stays as it is)
    graph.output(graph.graph_copy(gm.graph, {}))
    work = GraphModule(gm, graph)
    for index, node in enumerate(n for n in work.graph.nodes if n.op == "get_attr"):
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part)
        if isinstance(value, torch.Tensor):
            node.target = f"_frozen_{index}"
            set_constant(work, node.target, value.detach())
    work.recompile()
    return work


def _with_shapes(gm: GraphModule, inputs: list) -> GraphModule:
    """``_frozen_copy`` whose nodes carry fake example values."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    work = _frozen_copy(gm)
    try:
        FakeTensorProp(work, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    except Exception as error:  # lowering still runs, its prepacks just tune for no shape
        log.info("qbackend.compile: no fake shapes for the graph (%s: %s)", type(error).__name__, error)
    return work


class CompiledGraphModule:
    """Calls a GraphModule through its lowered copies, one per input signature."""

    def __init__(self, gm: GraphModule, options: Optional[dict]):
        self.module, self.options = gm, dict(options or {})
        self.lowered: dict = {}  # input signature -> callable taking the graph's placeholders

    def _lower(self, inputs: list) -> Callable:
        return qbackend(_with_shapes(self.module, inputs), inputs, self.options)

    def __call__(self, *args, **kwargs):
        if kwargs:  # (named as in the module's forward, e.g. attention_mask=...)
            args = inspect.signature(self.module.forward).bind(*args, **kwargs).args
        inputs = list(self.module.graph.process_inputs(*args))
        key = tuple(map(_signature, inputs))
        if key not in self.lowered:
            self.lowered[key] = self._lower(inputs)
        return self.module.graph.process_outputs(self.lowered[key](*inputs))


EXPORT_GUARDS = "_guards_fn"  # the submodule torch.export calls to check its inputs' shapes


def _is_aten_graph(model) -> bool:
    """An exported graph: ATen calls, no submodule calls but export's own input checks."""
    return isinstance(model, GraphModule) and all(n.op != "call_module" or n.target == EXPORT_GUARDS
                                                  for n in model.graph.nodes)


def compile(model, options: Optional[dict] = None):
    """Lower ``model`` with qbackend. A converted PT2E module (an ATen GraphModule, e.g. from
    ``convert_pt2e``) is lowered directly, without Dynamo; any other module gets
    ``torch.compile(model, backend="qbackend", options=options)``. The same options apply."""
    if _is_aten_graph(model):
        return CompiledGraphModule(model, options)
    return torch.compile(model, backend="qbackend", options=options)
