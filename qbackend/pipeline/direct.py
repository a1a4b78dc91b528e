"""``qbackend.compile``: lower a converted PT2E module without Dynamo's re-trace.

A converted PT2E module is already an ATen-level FX graph, with the input shapes export fixed
or left symbolic. ``torch.compile`` traces its Python code again, bytecode by bytecode, and
guards every constant: measured, that is 60-90% of qbackend's compile time (ResNet-18-like: 0.5
of 0.6 s, MobileNetV2-like: 1.8 of 2.1 s) and 0.3-0.5 ms of guard checks per call. Here the
graph goes to the same backend as it is, with the values export recorded on its nodes (the
prepacks tune for fixed shapes).

An export with symbolic sizes (``quantize_x86(..., dynamic_batch=True)``) is lowered once for
all of them: every input whose sizes lie in export's ranges runs that one lowering. Any other
input signature (a size export fixed at 0 or 1, another device, non-contiguous inputs) is
lowered for its own shapes, at most ``SPECIALISED_LIMIT`` of them kept, least recently used
dropped. Anything that is not an ATen GraphModule goes through ``torch.compile``.
"""
from __future__ import annotations

import collections
import functools
import inspect
import logging
import operator
import threading
from typing import Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule

from qbackend.pipeline.backend import qbackend
from qbackend.graph_constants import set_constant
from qbackend.archive.graph_archive import RECORDED_VALUE, RecordedInput, Symbol, ValueReader

log = logging.getLogger("qbackend")

EXPORT_GUARDS = "_guards_fn"  # the submodule torch.export calls to check its inputs' shapes
EXPORT_RANGES = "range_constraints"  # the sizes export vouches for, on the module it returns (and quantize_x86's)
SPECIALISED_LIMIT = 8  # lowerings kept for input signatures the symbolic one does not serve


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


def qdq_name(node) -> Optional[str]:
    target = node.target
    if node.op != "call_function" or getattr(target, "namespace", None) != "quantized_decomposed":
        return None
    name = target.__name__.split(".")[0]
    return name if name in _QDQ_OUT_DTYPE else None


def _reuse_export_values(work: GraphModule, inputs: list, symbolic: bool = False) -> bool:
    """Give ``work``'s nodes the values export recorded, and convert_pt2e's quantize /
    dequantize nodes their input's in the output dtype: what a fake-tensor pass would give
    (measured 0.55 s on ResNet-50, 0.75 s on ViT-B/16, a third of qbackend.compile) at a
    fraction of its cost. Only where export fixed every shape and the inputs have its strides,
    so each value is the one this call's inputs give, or, ``symbolic``, for the lowering that
    serves every input ``SymbolicInputs`` admits; False (nothing changed) otherwise."""
    placeholders = [n for n in work.graph.nodes if n.op == "placeholder"]
    recorded = [n.meta.get("val") for n in placeholders]
    if len(recorded) != len(inputs) or not all(
            isinstance(r, torch.Tensor) and isinstance(x, torch.Tensor) and r.dtype == x.dtype
            # (ints checked first: comparing a symbolic size to an int fixes it in export's shape env)
            and (symbolic or (all(isinstance(d, int) for d in (*r.shape, *r.stride()))
                              and tuple(r.shape) == tuple(x.shape) and tuple(r.stride()) == tuple(x.stride())))
            for r, x in zip(recorded, inputs)):
        return False
    values = export_values(work)
    return values is not None and _set_values(values)


def _set_values(values: dict, inputs: Optional[list] = None) -> bool:
    """Set each node's value (``node.meta["val"]``, what the lowering reads); True. Meta tensors
    (``_meta_values``', ``_archive_values``') become empty tensors of the CPU ``inputs``' device,
    never written or read: the kernels' checks the lowering asks compare a value's device with
    their own (a loaded DistilBERT's attention, on meta values, stayed on torch's SDPA where the
    in-process compile, on export's fake CPU tensors, fused it)."""
    device = next((x.device for x in inputs or () if isinstance(x, torch.Tensor)), None)
    on_cpu = device is not None and device.type == "cpu"
    for node, value in values.items():
        node.meta["val"] = pytree.tree_map(functools.partial(_on, device), value) if on_cpu else value
    return True


def _on(device: torch.device, value):
    """A meta tensor as an empty one of ``device`` (its memory untouched: no resident pages)."""
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
    return value


def export_values(gm: GraphModule) -> Optional[dict]:
    """node -> the value export recorded on it (convert_pt2e's quantize / dequantize nodes: their
    input's in the output dtype; constants: one like them, an assert: None); None where a node
    has none or export recorded no fake tensors."""
    recorded = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = getattr(recorded[0], "fake_mode", None) if recorded else None
    if fake_mode is None:
        return None

    def like(source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        with fake_mode:
            return torch.empty_strided(source.shape, source.stride(), dtype=dtype, device=source.device)

    values = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "call_function") and "val" in node.meta:
            values[node] = node.meta["val"]  # (a tensor, a symbolic size, a tuple, None from an assert)
        elif isinstance(node.target, torch._ops.OpOverload) and not node.target._schema.returns:
            values[node] = None  # (an assert; a loaded archive records no value for it)
        elif node.op == "get_attr":
            constant = operator.attrgetter(node.target)(gm)
            if isinstance(constant, torch.Tensor):
                values[node] = like(constant, constant.dtype)
        elif qdq_name(node) is not None and node.args[0] in values:
            values[node] = like(values[node.args[0]], _QDQ_OUT_DTYPE[qdq_name(node)](node))
        elif node.op != "output" and node.target != EXPORT_GUARDS:
            return None
    return values


def _meta_values(work: GraphModule, inputs: list) -> bool:
    """Give ``work``'s nodes meta-tensor values for these inputs, from ATen's meta kernels: the
    shapes, strides and dtypes a fake-tensor pass gives, at a third of its cost (ResNet-50:
    0.16 s). (Not Dynamo-free: some meta kernels are Python references that import it.) False
    (nothing changed) where an op has no meta kernel or a value depends on data."""
    values, placeholders = {}, iter(inputs)
    try:
        for node in work.graph.nodes:
            if node.op == "placeholder":
                values[node] = _meta(next(placeholders))
            elif node.op == "get_attr":
                values[node] = _meta(getattr(work, node.target))
            elif node.op == "call_function":
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
                values[node] = node.target(*args, **kwargs)
            elif node.op != "output":
                return False
    except Exception as error:  # (NotImplementedError, or a data-dependent op's error)
        log.debug("qbackend.compile: no meta values (%s: %s)", type(error).__name__, error)
        return False
    return _set_values(values, inputs)


def _archive_values(work: GraphModule, inputs: list, symbols: Optional[dict] = None) -> bool:
    """Give ``work``'s nodes the values a loaded archive recorded (``graph_archive``): export's
    own, with no propagation. For the sizes these inputs bind to its symbols, as meta tensors
    (no fake-tensor mode, whose import brings Dynamo's); or, given the archive's ``symbols``
    (name -> Symbol), as fake tensors of symbolic sizes in a shape env of their own, for the
    lowering that serves every size they admit. False (nothing changed) where a node has no
    record, a size does not evaluate, or an input's sizes or strides are not the recorded ones."""
    nodes = [n for n in work.graph.nodes if n.op != "output"]
    if not nodes or any(RECORDED_VALUE not in n.meta for n in nodes):
        return False
    placeholders = [n for n in nodes if n.op == "placeholder"]
    records = [n.meta[RECORDED_VALUE] for n in placeholders]
    if not all(isinstance(x, torch.Tensor) and isinstance(r, dict) and len(r.get("sizes", ())) == x.dim()
               for r, x in zip(records, inputs)):
        return False
    if symbols is None:
        bound = {size: actual for r, x in zip(records, inputs) for size, actual in zip(r["sizes"], x.shape)
                 if isinstance(size, str) and size.isidentifier()}
        reader, constant = ValueReader(bound), _meta
    else:
        reader, constant = _symbolic_reader(symbols, inputs[0].device)
    values = {}
    try:
        for node in nodes:
            record = node.meta[RECORDED_VALUE]
            if node.op == "get_attr":
                values[node] = constant(operator.attrgetter(node.target)(work))
            elif record is None and not (isinstance(node.target, torch._ops.OpOverload) and not node.target._schema.returns):
                return False  # (only an assert records no value)
            else:
                values[node] = reader.value(record)
    except (ValueError, KeyError, ZeroDivisionError, SyntaxError, RuntimeError, OverflowError) as error:
        # (a size no tensor can have: RuntimeError from empty_strided; propagated values are used instead)
        log.debug("qbackend.compile: the archive's values do not evaluate (%s)", error)
        return False
    if symbols is None and not all(tuple(values[n].shape) == tuple(x.shape) and values[n].stride() == x.stride()
                                   and values[n].dtype == x.dtype for n, x in zip(placeholders, inputs)):
        return False
    return _set_values(values, inputs if symbols is None else None)


def _symbolic_reader(symbols: dict, device: torch.device) -> tuple[ValueReader, Callable]:
    """(a reader giving fake tensors whose sizes are one symbol per archive symbol, at export's
    example size; constants as fake tensors of the same mode)."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    bound = {}
    for name, symbol in symbols.items():
        source = ConstantSource(f"qbackend_{name}")
        expr = shape_env.create_symbol(symbol.hint, source, dynamic_dim=DimDynamic.DYNAMIC)
        bound[name] = shape_env.create_symintnode(expr, hint=symbol.hint, source=source)

    def fake(sizes, strides, dtype):
        with mode:
            return torch.empty_strided(sizes, strides, dtype=dtype, device=device)

    return ValueReader(bound, fake), mode.from_tensor


def _meta(value):
    """A meta tensor with ``value``'s shape, strides and dtype (anything else as it is)."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")


def _with_shapes(gm: GraphModule, inputs: list) -> GraphModule:
    """``_frozen_copy`` whose nodes carry example values for these inputs."""
    work = _frozen_copy(gm)
    if _reuse_export_values(work, inputs) or _archive_values(work, inputs) or _meta_values(work, inputs):
        return work
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    try:
        FakeTensorProp(work, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    except Exception as error:  # lowering still runs, its prepacks just tune for no shape
        log.info("qbackend.compile: no fake shapes for the graph (%s: %s)", type(error).__name__, error)
    return work


def _fits(recorded: Optional[RecordedInput], value) -> bool:
    """``value`` may stand where export recorded ``recorded``: same dtype and rank, and every
    dim export fixed has that size (a symbolic dim takes any)."""
    if recorded is None:
        return True
    return (isinstance(value, torch.Tensor) and value.dtype == recorded.dtype and value.dim() == len(recorded.sizes)
            and all(not isinstance(r, int) or r == v for r, v in zip(recorded.sizes, value.shape)))


def recorded_inputs(gm: GraphModule) -> tuple[list[Optional[RecordedInput]], dict[str, Symbol]]:
    """(each placeholder's recorded dtype, device and sizes, None where export recorded no
    tensor; the symbols among those sizes, by name). A size that is an expression of export's
    symbols, or a symbolic size of an input export recorded strided, stays out of the symbols
    (no lowering for symbolic sizes then: ``SymbolicInputs``)."""
    ranges, inputs, symbols = getattr(gm, EXPORT_RANGES, None), [], {}
    for node in (n for n in gm.graph.nodes if n.op == "placeholder"):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            inputs.append(None)
            continue
        sizes = []
        for size in value.shape:
            symbol = None if isinstance(size, int) or not _recorded_contiguous(value) else _symbol(size, ranges)
            if symbol is not None:
                symbols[str(symbol[0])] = Symbol(symbol[1], symbol[2], size.node.hint)
            sizes.append(size if isinstance(size, int) else str(size.node.expr) if symbol is not None else None)
        inputs.append(RecordedInput(value.dtype, value.device, tuple(sizes)))
    return inputs, symbols


def _binds(signature: inspect.Signature, count: int) -> bool:
    try:
        signature.bind(*range(count))
    except TypeError:
        return False
    return True


class InputBinding:
    """A call's arguments as an exported graph's placeholders, in export's structure
    (positional inputs, then keyword inputs by name); None if they do not bind."""

    def __init__(self, gm: GraphModule):
        self.parameters = inspect.signature(gm.forward)  # (binding runs on every call)
        info = getattr(gm.graph._codegen, "pytree_info", None)
        self.in_spec = info.in_spec if info is not None else None
        if self.in_spec is not None:
            positional, keyword = self.in_spec.children() if hasattr(self.in_spec, "children") else self.in_spec.children_specs
            self.positional, self.keyword = positional.num_children, tuple(keyword.context or ())
        # export's structure is that many positional leaves and no keywords: tensors passed so
        # are the placeholders as they come (binding and pytree had cost mobilenet_v2_like b1
        # 0.26-0.39 ms a call on Zen 3, run cold after its kernels)
        self.plain = (self.in_spec is not None and not self.keyword and _binds(self.parameters, self.positional)
                      and pytree.tree_flatten((tuple(range(self.positional)), {}))[1] == self.in_spec)

    def placeholders(self, args, kwargs) -> Optional[list]:
        if self.plain and not kwargs and len(args) == self.positional and all(type(a) is torch.Tensor for a in args):
            return list(args)
        try:
            bound = self.parameters.bind(*args, **kwargs)
        except TypeError:
            return None
        if self.in_spec is None:
            return list(bound.args)
        bound.apply_defaults()
        values = list(bound.arguments.values())
        inputs, spec = pytree.tree_flatten((tuple(values[:self.positional]), dict(zip(self.keyword, values[self.positional:]))))
        return inputs if spec == self.in_spec else None


class SymbolicInputs:
    """The inputs one lowering for export's symbolic sizes serves: every symbolic size a plain
    symbol within export's range (one value per symbol across the inputs), contiguous, on the
    recorded device. None when export fixed every size or recorded a size as an expression or
    an input without a value (then each shape is lowered for itself)."""

    def __init__(self, recorded: list[Optional[RecordedInput]], symbols: dict[str, Symbol]):
        self.sizes = []  # (input index, dim, symbol, low, high)
        self.devices = []
        for index, value in enumerate(recorded):
            if value is None:
                raise ValueError("an input without a recorded tensor value")
            self.devices.append(value.device)
            for dim, size in enumerate(value.sizes):
                if isinstance(size, int):
                    continue
                if size not in symbols:
                    raise ValueError(f"input {index} dim {dim}: not a plain symbol, or strided")
                self.sizes.append((index, dim, size, symbols[size].low, symbols[size].high))
        if not self.sizes:
            raise ValueError("no symbolic size")

    def admit(self, inputs: list) -> bool:
        values = {}
        for index, dim, symbol, low, high in self.sizes:
            size = inputs[index].shape[dim]
            if size < low or (high is not None and size > high) or values.setdefault(symbol, size) != size:
                return False
        return all(x.device == d and x.is_contiguous() for x, d in zip(inputs, self.devices))


def symbol_range(size: torch.SymInt, ranges: Optional[dict] = None) -> Optional[tuple]:
    """(symbol, lowest size, highest or None) of a size export recorded as one plain symbol;
    None for an expression of its symbols. ``ranges``: export's ``range_constraints``, the
    sizes it vouches for (from 0 or the Dim's min; its shape environment reasons from 2 up),
    taken from 1 up; without them, the shape environment's."""
    expr = size.node.expr
    if not expr.is_Symbol:
        return None
    bounds = ranges[expr] if ranges and expr in ranges else size.node.shape_env.var_to_range[expr]
    try:
        high = int(bounds.upper)
    except (TypeError, AttributeError, OverflowError):  # (torch's int_oo converts to nothing)
        high = None
    return expr, max(1, int(bounds.lower)), high


def _symbol(size, ranges) -> Optional[tuple]:
    try:
        return symbol_range(size, ranges)
    except (AttributeError, KeyError):  # (no shape env on the value)
        return None


def _recorded_contiguous(value: torch.Tensor) -> bool:
    expected = 1
    for size, stride in reversed(list(zip(value.shape, value.stride()))):
        if size != 1 and stride != expected:
            return False
        expected = expected * size
    return True


def _symbolic_inputs(recorded: list, symbols: dict) -> Optional[SymbolicInputs]:
    try:
        return SymbolicInputs(recorded, symbols)
    except ValueError as why:
        log.debug("qbackend.compile: one lowering per input shape (%s)", why)
        return None


class CompiledGraphModule:
    """Calls a GraphModule through its lowered copies, as Dynamo recompiles: the first input
    signature gets a lowering for its own shapes; a second that export's symbolic sizes admit
    makes the one lowering for those sizes, which serves every admitted signature after it;
    any other signature gets a lowering of its own (at most ``SPECIALISED_LIMIT`` kept). Inputs
    the graph was not exported for (another dtype, rank or fixed size, another structure,
    wrong arguments) go to the module itself, which runs them or raises as it would eagerly.

    ``recorded`` / ``symbols``: a loaded archive's inputs and symbols (``deploy.load``); by
    default read from export's values on ``gm``."""

    SYMBOLIC = "symbolic sizes"  # the key of the lowering for export's symbolic sizes

    def __init__(self, gm: GraphModule, options: Optional[dict], recorded: Optional[list] = None,
                 symbols: Optional[dict] = None):
        self.module, self.options = gm, dict(options or {})
        self.lowered = collections.OrderedDict()  # key -> callable taking the graph's placeholders
        if recorded is None:
            recorded, symbols = recorded_inputs(gm)
        self.recorded, self.symbols, self.symbolic = recorded, symbols, _symbolic_inputs(recorded, symbols)
        self.first_shape_lowered = False  # (the first signature the symbolic sizes admit has)
        self.binding = InputBinding(gm)
        # threads calling one module: the table's order changes on every call, a lowering evicts
        # (both had raised KeyErrors), and a signature is lowered once, by one of them
        self._table, self._lowering = threading.Lock(), threading.Lock()

    def __getstate__(self):  # (locks do not copy: a copy gets its own)
        return {name: value for name, value in self.__dict__.items() if name not in ("_table", "_lowering")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._table, self._lowering = threading.Lock(), threading.Lock()

    def _placeholders(self, args, kwargs) -> Optional[list]:
        inputs = self.binding.placeholders(args, kwargs)
        if inputs is None or len(inputs) != len(self.recorded) or not all(map(_fits, self.recorded, inputs)):
            return None
        return inputs

    def _key(self, inputs: list):
        signature = tuple(map(_signature, inputs))
        if signature in self.lowered or self.symbolic is None or not self.symbolic.admit(inputs):
            return signature
        if not self.first_shape_lowered and self.SYMBOLIC not in self.lowered:
            self.first_shape_lowered = True  # (lowered for its shapes: no symbolic values to build, kernels timed)
            return signature
        return self.SYMBOLIC

    def _lower(self, inputs: list, key) -> tuple[object, Callable]:
        """(the key the lowering serves, the lowering)."""
        guards = getattr(self.module, EXPORT_GUARDS, None)
        if guards is not None:  # export's input checks read shapes only, fixed per signature
            guards(*inputs)
        if key == self.SYMBOLIC:
            work = _frozen_copy(self.module)
            if _reuse_export_values(work, inputs, symbolic=True) or _archive_values(work, inputs, self.symbols):
                return key, qbackend(work, inputs, self.options)
            log.info("qbackend.compile: export recorded no value on some node; one lowering per input shape")
            self.symbolic, key = None, tuple(map(_signature, inputs))
        return key, qbackend(_with_shapes(self.module, inputs), inputs, self.options)

    def __call__(self, *args, **kwargs):
        inputs = self._placeholders(args, kwargs)
        if inputs is None:
            return self.module(*args, **kwargs)
        key = self._key(inputs)
        lowered = self.lowered.get(key)
        if lowered is None:
            lowered = self._lowered(inputs, key)
        else:
            with self._table:
                if key in self.lowered:  # (else another thread evicted it since: this call still runs it)
                    self.lowered.move_to_end(key)
        return self.module.graph.process_outputs(lowered(*inputs))

    def _lowered(self, inputs: list, key) -> Callable:
        """The lowering for ``key``, made now unless another thread made it meanwhile, put in the table."""
        with self._lowering:
            lowered = self.lowered.get(key)
            if lowered is None:
                key, lowered = self._lower(inputs, key)
            with self._table:
                self.lowered[key] = lowered
                self.lowered.move_to_end(key)
                specialised = [k for k in self.lowered if k != self.SYMBOLIC]  # (oldest use first)
                if len(specialised) > SPECIALISED_LIMIT:
                    del self.lowered[specialised[0]]
        return lowered


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
