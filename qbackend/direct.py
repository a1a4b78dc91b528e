"""``qbackend.compile``: lower a converted PT2E module without Dynamo's re-trace.

A converted PT2E module is already an ATen-level FX graph, specialised by export to its input
shapes. ``torch.compile`` traces its Python code again, bytecode by bytecode, and guards every
constant: measured, that is 60-90% of qbackend's compile time (ResNet-18-like: 0.5 of 0.6 s,
MobileNetV2-like: 1.8 of 2.1 s) and 0.3-0.5 ms of guard checks per call. Here the graph goes
to the same backend as it is, after a fake-tensor pass that gives the nodes convert_pt2e added
their shapes (the prepacks tune for them). Each input shape the export allows is lowered once;
anything that is not an ATen GraphModule goes through ``torch.compile``.
"""
from __future__ import annotations

import inspect
import logging
import operator
from typing import Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule

from .backend import qbackend
from .freeze import set_constant

log = logging.getLogger("qbackend")

EXPORT_GUARDS = "_guards_fn"  # the submodule torch.export calls to check its inputs' shapes


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
    for node in [n for n in graph.nodes if n.op == "call_module" and n.target == EXPORT_GUARDS]:
        graph.erase_node(node)  # (checked once per input signature instead: ``CompiledGraphModule._lower``)
    work = GraphModule(gm, graph)
    for index, node in enumerate(n for n in work.graph.nodes if n.op == "get_attr"):
        value = operator.attrgetter(node.target)(gm)  # (a dotted path for a submodule's tensor)
        if isinstance(value, torch.Tensor):
            node.target = f"_qb_frozen_{index}"  # (a name export never uses)
            set_constant(work, node.target, value.detach())
    work.recompile()
    return work


# convert_pt2e's nodes, the only ones export gave no value: each gives its input's shape and
# strides in another dtype (the dtype argument of a quantize, float32 or ``out_dtype`` out of a
# dequantize)
_QDQ_OUT_DTYPE = {
    "quantize_per_tensor": lambda node: node.args[5] if len(node.args) > 5 else node.kwargs["dtype"],
    "quantize_per_channel": lambda node: node.args[6] if len(node.args) > 6 else node.kwargs["dtype"],
    "dequantize_per_tensor": lambda node: node.kwargs.get("out_dtype") or torch.float32,
    "dequantize_per_channel": lambda node: node.kwargs.get("out_dtype") or torch.float32,
}


def _qdq_name(node) -> Optional[str]:
    target = node.target
    if node.op != "call_function" or getattr(target, "namespace", None) != "quantized_decomposed":
        return None
    name = target.__name__.split(".")[0]
    return name if name in _QDQ_OUT_DTYPE else None


def _reuse_export_values(work: GraphModule, inputs: list) -> bool:
    """Give ``work``'s nodes the values export recorded, and convert_pt2e's quantize /
    dequantize nodes their input's in the output dtype: what a fake-tensor pass would give
    (measured 0.55 s on ResNet-50, 0.75 s on ViT-B/16, a third of qbackend.compile) at a
    fraction of its cost. Only where export fixed every shape and the inputs have its strides,
    so each value is the one this call's inputs give; False (nothing changed) otherwise."""
    placeholders = [n for n in work.graph.nodes if n.op == "placeholder"]
    recorded = [n.meta.get("val") for n in placeholders]
    if len(recorded) != len(inputs) or not all(
            isinstance(r, torch.Tensor) and isinstance(x, torch.Tensor) and r.dtype == x.dtype
            and tuple(r.shape) == tuple(x.shape) and tuple(r.stride()) == tuple(x.stride())
            and all(isinstance(d, int) for d in (*r.shape, *r.stride()))
            for r, x in zip(recorded, inputs)):
        return False
    fake_mode = getattr(recorded[0], "fake_mode", None) if recorded else None
    if fake_mode is None:
        return False

    def like(source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        with fake_mode:
            return torch.empty_strided(source.shape, source.stride(), dtype=dtype, device=source.device)

    values = {}
    for node in work.graph.nodes:
        if node.op in ("placeholder", "call_function") and isinstance(node.meta.get("val"), torch.Tensor):
            values[node] = node.meta["val"]
        elif node.op == "get_attr":
            constant = getattr(work, node.target)
            if isinstance(constant, torch.Tensor):
                values[node] = like(constant, constant.dtype)
        elif _qdq_name(node) is not None and node.args[0] in values:
            values[node] = like(values[node.args[0]], _QDQ_OUT_DTYPE[_qdq_name(node)](node))
        elif node.op != "output":
            return False
    for node, value in values.items():
        node.meta["val"] = value
    return True


def _with_shapes(gm: GraphModule, inputs: list) -> GraphModule:
    """``_frozen_copy`` whose nodes carry fake example values."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    work = _frozen_copy(gm)
    if _reuse_export_values(work, inputs):
        return work
    try:
        FakeTensorProp(work, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    except Exception as error:  # lowering still runs, its prepacks just tune for no shape
        log.info("qbackend.compile: no fake shapes for the graph (%s: %s)", type(error).__name__, error)
    return work


def _fits(recorded, value) -> bool:
    """``value`` may stand where export recorded ``recorded``: same dtype and rank, and every
    dim export fixed has that size (a symbolic dim takes any)."""
    if not isinstance(recorded, torch.Tensor):
        return True
    return (isinstance(value, torch.Tensor) and value.dtype == recorded.dtype and value.dim() == recorded.dim()
            and all(not isinstance(r, int) or r == v for r, v in zip(recorded.shape, value.shape)))


class CompiledGraphModule:
    """Calls a GraphModule through its lowered copies, one per input signature. Inputs the
    graph was not exported for (another dtype, rank or fixed size, another structure, wrong
    arguments) go to the module itself, which runs them or raises exactly as it would eagerly."""

    def __init__(self, gm: GraphModule, options: Optional[dict]):
        self.module, self.options = gm, dict(options or {})
        self.lowered: dict = {}  # input signature -> callable taking the graph's placeholders
        self.recorded = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        self.parameters = inspect.signature(gm.forward)  # (binding runs on every call)
        info = getattr(gm.graph._codegen, "pytree_info", None)
        self.in_spec = info.in_spec if info is not None else None

    def _placeholders(self, args, kwargs) -> Optional[list]:
        try:
            bound = self.parameters.bind(*args, **kwargs)
        except TypeError:
            return None
        if self.in_spec is not None:
            inputs, spec = pytree.tree_flatten((bound.args, {}))
            if spec != self.in_spec:
                return None
        else:
            inputs = list(bound.args)
        if len(inputs) != len(self.recorded) or not all(map(_fits, self.recorded, inputs)):
            return None
        return inputs

    def _lower(self, inputs: list) -> Callable:
        guards = getattr(self.module, EXPORT_GUARDS, None)
        if guards is not None:  # export's input checks read shapes only, fixed per signature
            guards(*inputs)
        return qbackend(_with_shapes(self.module, inputs), inputs, self.options)

    def __call__(self, *args, **kwargs):
        inputs = self._placeholders(args, kwargs)
        if inputs is None:
            return self.module(*args, **kwargs)
        key = tuple(map(_signature, inputs))
        if key not in self.lowered:
            self.lowered[key] = self._lower(inputs)
        return self.module.graph.process_outputs(self.lowered[key](*inputs))


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
