"""A converted PT2E graph as plain records: what ``qbackend.save`` writes and ``load`` reads.

The records hold nodes (op, target by name, arguments), the constants the graph reads, the
input / output structure and each input's dtype and sizes (an int, or the name of a symbol with
its range). ``torch.load(weights_only=True)`` reads them: no pickled code runs, and the only
callables a graph can name are ATen / quantize-dequantize operators and ``TARGETS``.

Why not ``torch.export.save``: loading that archive imports Dynamo and runs type hints and
sympy over every node (ResNet-50: 3.8 s before the first lowering); these records load in
~0.2 s, and the first call lowers from meta-tensor values (``direct.py``).
"""
from __future__ import annotations

import collections
import importlib
import json
import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node

from qbackend.archive import archive_checks as check
from qbackend.archive.archive_checks import ArchiveError
from qbackend.archive.operator_allowlist import ALLOWED, overload_name, resolve

FORMAT, VERSION = "qbackend graph", 1
TARGETS = {"operator.getitem": operator.getitem}  # the Python callables a converted graph calls
RECORDED_VALUE = "qbackend_recorded_value"  # node meta: the value record ``load`` read
NODE_KINDS = ("placeholder", "get_attr", "call_function", "output")


@dataclass(frozen=True)
class RecordedInput:
    """One input as export recorded it: dtype, device, sizes (an int, or a symbol's name)."""
    dtype: torch.dtype
    device: torch.device
    sizes: tuple


@dataclass(frozen=True)
class Symbol:
    """A symbolic size: the sizes export vouches for (``high`` None: no bound) and the one it
    traced with."""
    low: int
    high: Optional[int]
    hint: int


def _torch_name(value) -> str:
    """A dtype's or layout's name in ``torch`` ("float32", "strided")."""
    return str(value).removeprefix("torch.")


def _target_name(target) -> str:
    for name, known in TARGETS.items():
        if target is known:
            return name
    if isinstance(target, torch._ops.OpOverload) and overload_name(target) in ALLOWED:
        return overload_name(target)
    raise ValueError(f"qbackend.save: the graph calls {target!r}, which qbackend.load does not allow "
                     f"(python -m qbackend.archive_operators lists the operators it does)")


def _target(name, where: str):
    if not isinstance(name, str):
        raise ArchiveError(where, f"a target {check._short(name)}, not an operator's name")
    if name in TARGETS:
        return TARGETS[name]
    op = resolve(name) if name in ALLOWED else None
    if op is None:
        raise ArchiveError(where, f"{check._short(name)} is not an operator a saved graph may call "
                                  f"(python -m qbackend.archive_operators lists them)")
    return op


def _encode(value):
    """An argument as weights-only data: nodes, dtypes, devices, layouts and memory formats as
    one-key dicts, containers kept."""
    if isinstance(value, Node):
        return {"node": value.name}
    if isinstance(value, torch.dtype):
        return {"dtype": _torch_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": _torch_name(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value)}
    if isinstance(value, tuple):
        return tuple(map(_encode, value))
    if isinstance(value, list):  # (FX's immutable_list too: pickled as a plain list)
        return list(map(_encode, value))
    if isinstance(value, dict):
        return {"dict": [(key, _encode(item)) for key, item in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"qbackend.save: a graph argument of type {type(value).__name__} cannot be saved")


# torch's "to the end" for a slice (sys.maxsize): export writes it where a slice's end is a
# dynamic size's whole length (a DistilBERT exported with a free sequence length); the one
# integer beyond check.MAX_INT an archive may hold, and only there
SLICE_TO_END = 2**63 - 1


def _decode(value, nodes: dict, where: str, depth: int = 0):
    """An argument record as a graph argument, every part checked (earlier nodes only)."""
    if depth > check.MAX_NESTING:
        raise ArchiveError(where, "arguments nested too deeply")
    if isinstance(value, (list, tuple)):
        return type(value)(_decode(item, nodes, where, depth + 1) for item in value)
    if value is None or isinstance(value, (bool, float)):
        return value
    if isinstance(value, int):
        if value == SLICE_TO_END and depth == 1:  # (an argument itself: _check_call allows it as a slice's end only)
            return value
        return check.integer(value, where)
    if isinstance(value, str):
        if len(value) > check.MAX_STRING:
            raise ArchiveError(where, "a string argument of over 4096 characters")
        return value
    if not isinstance(value, dict) or len(value) != 1:
        raise ArchiveError(where, f"an argument of type {type(value).__name__}")
    (kind, item), = value.items()
    if kind == "node":
        if not isinstance(item, str) or item not in nodes:
            raise ArchiveError(where, f"reads {check._short(item)}, not an earlier node")
        return nodes[item]
    if kind == "dict":
        if not isinstance(item, list):
            raise ArchiveError(where, "a dict record that is not a list of pairs")
        pairs = [check.record(pair, ((str, int), object), where) for pair in item]
        return {key: _decode(entry, nodes, where, depth + 1) for key, entry in pairs}
    if kind == "dtype":
        return check.choice(check.DTYPES, item, where)
    if kind == "layout":
        return check.choice(check.LAYOUTS, item, where)
    if kind == "memory_format":
        return check.choice(check.MEMORY_FORMATS, item, where)
    if kind == "device":
        return check.device(item, where)
    raise ArchiveError(where, f"unknown argument record {check._short(kind)}")


def records(gm: GraphModule, inputs: list[RecordedInput], symbols: dict[str, Symbol], values: dict,
            sources: dict[str, str], about: dict) -> dict:
    """``gm``'s graph, the constants it reads, its inputs and the values export recorded on its
    nodes (``values``: node name -> value) as weights-only records; ``sources``: node name ->
    the module path the report names it by; ``about``: plain data on how the model was made
    (versions, quantization recipe)."""
    nodes, constants = [], {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            raise ValueError(f"qbackend.save: the graph calls a submodule ({node.target}); save an exported graph")
        target = node.target
        if node.op == "call_function":
            target = _target_name(target)
        elif node.op == "get_attr":
            constants[target] = _dense(operator.attrgetter(target)(gm).detach())
        nodes.append((node.name, node.op, target, _encode(node.args), _encode(dict(node.kwargs)),
                      _value_record(values.get(node.name))))
    info = getattr(gm.graph._codegen, "pytree_info", None)
    return {"format": FORMAT, "version": VERSION, "nodes": nodes, "constants": constants,
            "inputs": [(_torch_name(i.dtype), str(i.device), list(i.sizes)) for i in inputs],
            "symbols": {name: (s.low, s.high, s.hint) for name, s in symbols.items()},
            "pytree": None if info is None else (list(info.orig_args), pytree.treespec_dumps(info.in_spec),
                                                 pytree.treespec_dumps(info.out_spec)),
            "sources": dict(sources), "about": check.plain_data(about, "about")}


def described(saved) -> dict:
    """What an archive says of itself (``about``: versions, recipe), checked; {} for archives
    saved before it was recorded."""
    _check_format(saved)
    return check.plain_data(_optional(saved, "about"), "about")


def _check_format(saved) -> None:
    if not isinstance(saved, dict) or saved.get("format") != FORMAT or saved.get("version") != VERSION:
        raise ArchiveError("the archive", f"not a {FORMAT} archive of version {VERSION}")


def _optional(saved: dict, name: str) -> dict:
    """A dict record that archives of this version may lack."""
    value = saved.get(name, {})
    if not isinstance(value, dict):
        raise ArchiveError(name, f"expected a dict, got {type(value).__name__}")
    return value


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """(``load`` takes no constant whose elements overlap: an expanded one is saved whole)"""
    return tensor if check.dense(tensor) else tensor.contiguous()


def graph_module(saved) -> tuple[GraphModule, list[RecordedInput], dict[str, Symbol]]:
    """(the module ``records`` described, its inputs, its symbols), every record checked before
    anything is built from it; ArchiveError names the first that is wrong."""
    _check_format(saved)
    symbols = _symbols(_field(saved, "symbols", dict))
    inputs = [_recorded_input(entry, symbols, f"input {index}")
              for index, entry in enumerate(_field(saved, "inputs", list))]
    constants = _field(saved, "constants", dict)
    root = torch.nn.Module()
    for name, tensor in constants.items():
        _set_attribute(root, check.dotted(name, "constant name"), check.constant(name, tensor, f"constant {name}"))
    graph, nodes = torch.fx.Graph(), {}
    # (sizes at the example sizes; a symbol export derived from data counts as 1 here)
    reader = ValueReader({**{name: symbol.hint for name, symbol in symbols.items()}, None: 1})
    for index, entry in enumerate(_field(saved, "nodes", list)):
        name, op, target, args, kwargs, value = check.record(entry, (str, str, object, (list, tuple), dict, object),
                                                             f"node {index}")
        where = f"node {check.identifier(name, f'node {index} name')}"
        if nodes and next(reversed(nodes.values())).op == "output" or op not in NODE_KINDS:
            raise ArchiveError(where, f"a node of kind {check._short(op)}" + (" after the output" if op in NODE_KINDS else ""))
        args, kwargs = _decode(args, nodes, where), _decode(kwargs, nodes, where)
        if not isinstance(kwargs, dict):
            raise ArchiveError(where, "keyword arguments that are not a dict record")
        target = _node_target(op, target, tuple(args), kwargs, constants, where)
        if op in ("placeholder", "get_attr", "output") and (kwargs or (op != "output" and args)):
            raise ArchiveError(where, f"a {op} node with arguments")
        if op == "output" and not (len(args) == 1 and isinstance(args[0], (list, tuple))):
            raise ArchiveError(where, "an output node takes one sequence of outputs")
        node = graph.create_node(op, target, tuple(args), kwargs, name=name)
        if node.name != name:
            raise ArchiveError(where, "the name is given twice, or is a Python builtin")
        nodes[name] = node
        node.meta[RECORDED_VALUE] = _checked_value(value, reader, where)
    if not nodes or next(reversed(nodes.values())).op != "output":
        raise ArchiveError("nodes", "the graph has no output")
    for name, source in _optional(saved, "sources").items():  # (older archives have none)
        if name not in nodes or not isinstance(source, str) or len(source) > check.MAX_STRING or not source.isprintable():
            raise ArchiveError(f"source of {check._short(name)}", "not a node's module path")
        nodes[name].meta["nn_module_stack"] = {"archived": (source, "")}  # (what the report names a layer by)
    _check_asserts(nodes.values())
    placeholders = sum(n.op == "placeholder" for n in nodes.values())
    if len(inputs) != placeholders:
        raise ArchiveError("inputs", f"{len(inputs)} recorded for {placeholders} placeholders")
    if saved.get("pytree") is not None:
        graph._codegen = _pytree_codegen(saved["pytree"], placeholders)
        outputs = len(next(reversed(nodes.values())).args[0])
        if graph._codegen.pytree_info.out_spec.num_leaves != outputs:
            raise ArchiveError("pytree output", f"a structure of {graph._codegen.pytree_info.out_spec.num_leaves} "
                                                f"outputs for {outputs}")
    try:
        return GraphModule(root, graph), inputs, symbols
    except SyntaxError as error:  # (identifiers only, yet two may clash: a placeholder named self)
        raise ArchiveError("nodes", f"the graph's names do not make a Python function ({error.msg})") from error


def _field(saved: dict, name: str, kind: type):
    value = saved.get(name)
    if not isinstance(value, kind):
        raise ArchiveError(name, f"expected a {kind.__name__}, got {type(value).__name__}")
    return value


def _symbols(saved: dict) -> dict[str, Symbol]:
    symbols = {}
    for name, bounds in saved.items():
        where = f"symbol {check.identifier(name, 'symbol name')}"
        low, high, hint = check.record(bounds, (int, (int, type(None)), int), where)
        if not 0 <= check.integer(low, where) <= check.integer(hint, where) or (
                high is not None and check.integer(high, where) < hint):
            raise ArchiveError(where, f"range {low}..{high} with example size {hint}")
        symbols[name] = Symbol(low, high, hint)
    return symbols


def _recorded_input(entry, symbols: dict, where: str) -> RecordedInput:
    dtype, device, sizes = check.record(entry, (str, str, list), where)
    for size in sizes:
        if isinstance(size, str) and size not in symbols or not isinstance(size, str) and check.integer(size, where) < 0:
            raise ArchiveError(where, f"size {check._short(size)}: neither a symbol nor a size")
    if len(sizes) > check.MAX_NESTING:
        raise ArchiveError(where, f"{len(sizes)} dimensions")
    return RecordedInput(check.choice(check.DTYPES, dtype, where), check.device(device, where), tuple(sizes))


def _node_target(op: str, target, args: tuple, kwargs: dict, constants: dict, where: str):
    if op == "placeholder":
        return check.identifier(target, f"{where} target")
    if op == "get_attr":
        if not isinstance(target, str) or target not in constants:
            raise ArchiveError(where, f"reads {check._short(target)}, which is not a saved constant")
        return target
    if op == "output":
        if target != "output":
            raise ArchiveError(where, "an output node's target must be 'output'")
        return target
    function = _target(target, where)
    if isinstance(function, torch._ops.OpOverload):
        _check_call(function._schema, args, kwargs, where)
    elif kwargs or len(args) != 2 or not isinstance(args[0], Node) or type(args[1]) is not int:
        raise ArchiveError(where, f"{target} takes a node and an index")
    return function


def _check_asserts(nodes) -> None:
    """Each dtype assert holds for the value recorded for its input: the lowering runs on those
    values and drops the asserts, so one that fails eagerly must not load."""
    for node in nodes:
        if node.target is torch.ops.aten._assert_tensor_metadata.default and "dtype" in node.kwargs:
            record = node.args[0].meta.get(RECORDED_VALUE) if node.args and isinstance(node.args[0], Node) else None
            if not isinstance(record, dict) or check.DTYPES.get(record.get("dtype")) != node.kwargs["dtype"]:
                raise ArchiveError(f"node {node.name}", f"asserts dtype {node.kwargs['dtype']} of a value recorded as "
                                                        f"{record.get('dtype') if isinstance(record, dict) else record}")


def _check_call(schema, args: tuple, kwargs: dict, where: str) -> None:
    """The arguments bind to the operator's schema: count, names and kinds (what the graph
    computes must be what the operator does, not a call that only the lowering would accept)."""
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        raise ArchiveError(where, f"{len(args)} arguments for {schema.name}, which takes {len(positional)} positional")
    named = {a.name: a for a in schema.arguments}
    for key in kwargs:
        if check.identifier(key, f"{where} keyword") not in named or key in {a.name for a in positional[:len(args)]}:
            raise ArchiveError(where, f"{schema.name} takes no keyword {key!r} here")
    given = {**dict(zip((a.name for a in positional), args)), **kwargs}
    for argument in schema.arguments:
        if argument.name not in given:
            if not argument.has_default_value() and argument.type.kind() != "OptionalType":
                raise ArchiveError(where, f"{schema.name} needs its argument {argument.name}")
        elif not _fits_type(argument.type, given[argument.name]):
            raise ArchiveError(where, f"{schema.name}'s {argument.name} ({argument.type}) given {check._short(given[argument.name])}")
        elif type(given[argument.name]) is int and given[argument.name] == SLICE_TO_END \
                and (schema.name, schema.overload_name, argument.name) != ("aten::slice", "Tensor", "end"):
            check.integer(given[argument.name], f"{where} {argument.name}")  # (raises: out of range)


_ENUMS = (torch.dtype, torch.layout, torch.memory_format)  # (a schema's ScalarType, Layout, MemoryFormat read as int)
_KINDS = {  # schema type kind -> the Python values it takes (a number for a Tensor: wrapped, as torch does)
    "TensorType": (Node, int, float), "IntType": (int, Node) + _ENUMS, "FloatType": (float, int, Node), "BoolType": (bool, Node),
    "NumberType": (int, float, Node), "StringType": (str,), "DeviceObjType": (torch.device,),
}


def _fits_type(kind, value) -> bool:
    name = kind.kind()
    if name == "OptionalType":
        return value is None or _fits_type(kind.getElementType(), value)
    if name == "ListType":
        element = kind.getElementType()
        if element.kind() == "IntType" and isinstance(value, int):  # (an int for an int[N]: stride=1)
            return True
        return isinstance(value, (list, tuple)) and all(_fits_type(element, item) for item in value)
    return isinstance(value, _KINDS.get(name, object))


def _set_attribute(root: torch.nn.Module, dotted: str, tensor: torch.Tensor) -> None:
    *path, name = dotted.split(".")
    for part in path + [name]:
        if hasattr(torch.nn.Module, part) or part.startswith("__"):
            raise ArchiveError(f"constant {dotted}", f"{part!r} names an attribute every module has")
    for part in path:
        if part not in root._modules:
            if hasattr(root, part):
                raise ArchiveError(f"constant {dotted}", f"{part!r} is a constant and a module")
            root.add_module(part, torch.nn.Module())
        root = root._modules[part]
    if hasattr(root, name):
        raise ArchiveError(f"constant {dotted}", "saved twice, or also a module")
    root.register_buffer(name, tensor)


def _checked_value(record, reader: "ValueReader", where: str, depth: int = 0):
    """``record`` if it is a value record (``_value_record``) whose sizes evaluate, at the
    symbols' example sizes, to sizes within bounds."""
    if depth > check.MAX_NESTING:
        raise ArchiveError(where, "a value record nested too deeply")
    if record is None:
        return None
    if isinstance(record, list):
        return [_checked_value(item, reader, where, depth + 1) for item in record]
    if isinstance(record, dict) and set(record) == {"size"}:
        reader.size(record["size"], where)
        return record
    if isinstance(record, dict) and set(record) == {"dtype", "sizes", "strides"}:
        check.choice(check.DTYPES, record["dtype"], where)
        sizes, strides = record["sizes"], record["strides"]
        if not (isinstance(sizes, list) and isinstance(strides, list) and len(sizes) == len(strides) <= check.MAX_NESTING):
            raise ArchiveError(where, "a tensor record's sizes and strides")
        if any(reader.size(d, where) < 0 for d in sizes + strides):
            raise ArchiveError(where, "a negative size or stride")
        return record
    raise ArchiveError(where, f"not a value record: {check._short(record)}")


def _size_record(size):
    return size if isinstance(size, int) else str(size.node.expr)


def _value_record(value):
    """A node's value as data: a tensor's dtype, sizes and strides, a size (ints, or expressions
    of the symbols as sympy prints them), a list of those; None for anything else."""
    if isinstance(value, torch.Tensor):
        return {"dtype": _torch_name(value.dtype), "sizes": [_size_record(d) for d in value.shape],
                "strides": [_size_record(d) for d in value.stride()]}
    if isinstance(value, (torch.SymInt, int)) and not isinstance(value, bool):
        return {"size": _size_record(value)}
    if isinstance(value, (tuple, list)):
        return [_value_record(item) for item in value]
    return None


def _pytree_codegen(saved, placeholders: int) -> torch.fx.graph._PyTreeCodeGen:
    """The input / output structure: argument names as identifiers, specs read as plain JSON
    (``pytree.treespec_loads`` imports any module an enum record names)."""
    orig_args, in_spec, out_spec = check.record(saved, (list, str, str), "pytree")
    orig_args = [check.identifier(name, "pytree argument") for name in orig_args]
    in_spec, out_spec = _spec(in_spec, "pytree input"), _spec(out_spec, "pytree output")
    if in_spec.num_leaves != placeholders:
        raise ArchiveError("pytree input", f"{in_spec.num_leaves} inputs for {placeholders} placeholders")
    if not (in_spec.type is tuple and in_spec.num_children == 2 and in_spec.child(0).type is tuple
            and in_spec.child(1).type is dict):
        raise ArchiveError("pytree input", "not export's (positional inputs, keyword inputs) structure")
    keywords = in_spec.child(1).context
    if len(orig_args) != in_spec.child(0).num_children + len(keywords):
        raise ArchiveError("pytree input", f"{len(orig_args)} argument names for its structure")
    for key in keywords:  # (written into the generated source as the call's keywords)
        check.identifier(key, "pytree keyword input")
    return torch.fx.graph._PyTreeCodeGen(torch.fx.graph._PyTreeInfo(orig_args, in_spec, out_spec))


_SPEC_TYPES = ("builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict", "collections.namedtuple",
               "torch.fx.immutable_collections.immutable_list", "torch.fx.immutable_collections.immutable_dict")


def _spec(text: str, where: str) -> pytree.TreeSpec:
    if len(text) > 1 << 20:
        raise ArchiveError(where, "a structure of over 1 MB")
    try:
        protocol, schema = json.loads(text)
    except (ValueError, TypeError, RecursionError) as error:
        raise ArchiveError(where, f"not a structure record ({type(error).__name__})") from error
    if protocol != 1:
        raise ArchiveError(where, f"structure protocol {check._short(protocol)}")
    return _spec_node(schema, where, 0)


# Modules of installed libraries whose import registers the output types their models return
# (transformers' ModelOutput subclasses register themselves with pytree), imported when an
# archive's output names one of their types: a fixed list, never a module the archive brings
# (a DistilBERT classifier saved in one process did not load in another without the import).
OUTPUT_TYPE_MODULES = frozenset({"transformers.modeling_outputs"})


def _import_output_types(module: str) -> None:
    """Import ``module`` of OUTPUT_TYPE_MODULES if its library is installed (else the type stays
    unregistered and the caller says so)."""
    try:
        importlib.import_module(module)
    except ImportError:
        pass


def _spec_node(schema, where: str, depth: int) -> pytree.TreeSpec:
    """One level of pytree's JSON protocol 1: containers of this list, or a type registered in
    this process by that name (importing nothing but OUTPUT_TYPE_MODULES), with a plain JSON context."""
    if depth > check.MAX_NESTING or not isinstance(schema, dict) or set(schema) != {"type", "context", "children_spec"}:
        raise ArchiveError(where, "not a structure record")
    kind, context, children = schema["type"], schema["context"], schema["children_spec"]
    if kind is None and context is None and children == []:
        return getattr(pytree, "treespec_leaf", pytree.LeafSpec)()  # (torch 2.13 warns on constructing a LeafSpec)
    module = kind.rpartition(".")[0] if isinstance(kind, str) else ""
    if module in OUTPUT_TYPE_MODULES and kind not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
        _import_output_types(module)
    if kind not in _SPEC_TYPES and kind not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE or not isinstance(children, list) \
            or not isinstance(context, str):
        hint = (f": import {module} first (load imports nothing an archive names beyond {sorted(OUTPUT_TYPE_MODULES)})"
                if module and all(part.isidentifier() for part in module.split(".")) and len(module) <= check.MAX_NAME
                and module not in OUTPUT_TYPE_MODULES else "")
        raise ArchiveError(where, f"a structure of type {check._short(kind)}, which this process has not registered{hint}")
    python_type = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE[kind]
    entry = pytree.SUPPORTED_SERIALIZED_TYPES[python_type]
    try:
        context = (json.loads(context) if entry.from_dumpable_context is None else entry.from_dumpable_context(context))
    except Exception as error:  # (a malformed context: json's or the type's own error)
        raise ArchiveError(where, f"a {kind} context that does not read ({type(error).__name__})") from error
    if python_type in (dict, collections.OrderedDict, torch.fx.immutable_collections.immutable_dict) and not (
            isinstance(context, list) and len(context) == len(children) and all(isinstance(k, (str, int)) for k in context)):
        raise ArchiveError(where, "a dict's keys that are not a list of strings or ints, one per entry")
    if python_type in (tuple, list, torch.fx.immutable_collections.immutable_list) and context is not None:
        raise ArchiveError(where, f"a {kind} with a context")
    return pytree.TreeSpec(python_type, context, [_spec_node(child, where, depth + 1) for child in children])


class ValueReader:
    """Value records made concrete for sizes bound to the symbols (ints, or a shape env's
    symbolic sizes): sizes, and tensors ``tensor(sizes, strides, dtype)`` makes (meta tensors
    by default: shape, strides and dtype are all a lowering reads)."""

    def __init__(self, symbols: dict, tensor=None):
        self.symbols, self.parsed = symbols, {}
        self.tensor = tensor or (lambda sizes, strides, dtype: torch.empty_strided(sizes, strides, dtype=dtype, device="meta"))

    def size(self, record, where: str = "a size"):
        if isinstance(record, int):
            return check.integer(record, where)
        tree = self.parsed.get(record) if isinstance(record, str) else None
        if tree is None:
            tree = self.parsed[record] = check.size_expression(record, where)
        return check.evaluate(tree, self.symbols, where)

    def value(self, record):
        if isinstance(record, list):
            return [self.value(item) for item in record]
        if record is None or "size" in record:
            return None if record is None else self.size(record["size"])
        return self.tensor([self.size(d) for d in record["sizes"]], [self.size(d) for d in record["strides"]],
                           check.DTYPES[record["dtype"]])
