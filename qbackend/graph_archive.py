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

import ast
import importlib
import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node

FORMAT, VERSION = "qbackend graph", 1
NAMESPACES = ("aten", "quantized_decomposed", "prims")  # the operators a converted graph calls
TARGETS = {"operator.getitem": operator.getitem}  # the Python callables it calls
RECORDED_VALUE = "qbackend_recorded_value"  # node meta: the value record ``load`` read
_MEMORY_FORMATS = {str(f): f for f in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d,
                                       torch.preserve_format)}


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


def _dtype(name: str) -> torch.dtype:
    return _decode({"dtype": name}, {})


def _target_name(target) -> str:
    for name, known in TARGETS.items():
        if target is known:
            return name
    if isinstance(target, torch._ops.OpOverload) and target.namespace in NAMESPACES:
        return f"{target.namespace}::{target._opname}.{target._overloadname}"
    raise ValueError(f"qbackend.save: the graph calls {target!r}, which a saved graph cannot name "
                     f"(operators of {', '.join(NAMESPACES)} and {', '.join(TARGETS)} only)")


def _target(name: str):
    if name in TARGETS:
        return TARGETS[name]
    namespace, _, op = name.partition("::")
    packet, _, overload = op.rpartition(".")
    if namespace not in NAMESPACES or not packet:
        raise ValueError(f"qbackend.load: the archive names {name!r}, not an operator it may call")
    if namespace == "quantized_decomposed":
        importlib.import_module("torch.ao.quantization.fx._decomposed")  # (registers them; torch's own, not torchao)
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


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


def _decode(value, nodes: dict):
    if isinstance(value, (list, tuple)):
        return type(value)(_decode(item, nodes) for item in value)
    if not isinstance(value, dict):
        return value
    (kind, item), = value.items()
    if kind == "node":
        return nodes[item]
    if kind == "dict":
        return {key: _decode(entry, nodes) for key, entry in item}
    if kind in ("dtype", "layout"):
        found = getattr(torch, item, None)
        if not isinstance(found, (torch.dtype, torch.layout)):
            raise ValueError(f"qbackend.load: unknown {kind} {item!r}")
        return found
    if kind == "device":
        return torch.device(item)
    if kind == "memory_format":
        return _MEMORY_FORMATS[item]
    raise ValueError(f"qbackend.load: unknown argument record {kind!r}")


def records(gm: GraphModule, inputs: list[RecordedInput], symbols: dict[str, Symbol], values: dict) -> dict:
    """``gm``'s graph, the constants it reads, its inputs and the values export recorded on its
    nodes (``values``: node name -> value) as weights-only records."""
    nodes, constants = [], {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            raise ValueError(f"qbackend.save: the graph calls a submodule ({node.target}); save an exported graph")
        target = node.target
        if node.op == "call_function":
            target = _target_name(target)
        elif node.op == "get_attr":
            constants[target] = operator.attrgetter(target)(gm).detach()
        nodes.append((node.name, node.op, target, _encode(node.args), _encode(dict(node.kwargs)),
                      _value_record(values.get(node.name))))
    info = getattr(gm.graph._codegen, "pytree_info", None)
    return {"format": FORMAT, "version": VERSION, "nodes": nodes, "constants": constants,
            "inputs": [(_torch_name(i.dtype), str(i.device), list(i.sizes)) for i in inputs],
            "symbols": {name: (s.low, s.high, s.hint) for name, s in symbols.items()},
            "pytree": None if info is None else (list(info.orig_args), pytree.treespec_dumps(info.in_spec),
                                                 pytree.treespec_dumps(info.out_spec))}


def graph_module(saved: dict) -> tuple[GraphModule, list[RecordedInput], dict[str, Symbol]]:
    """(the module ``records`` described, its inputs, its symbols)."""
    if saved.get("format") != FORMAT or saved.get("version") != VERSION:
        raise ValueError(f"qbackend.load: not a {FORMAT} archive of version {VERSION}")
    root, graph, nodes = torch.nn.Module(), torch.fx.Graph(), {}
    for name, tensor in saved["constants"].items():
        _set_attribute(root, name, tensor)
    for name, op, target, args, kwargs, value in saved["nodes"]:
        args, kwargs = _decode(args, nodes), _decode(kwargs, nodes)
        if op == "call_function":
            target = _target(target)
        elif op not in ("placeholder", "get_attr", "output"):
            raise ValueError(f"qbackend.load: a node of kind {op!r} in the archive")
        node = graph.create_node(op, target, args, kwargs, name=name)
        nodes[name] = node
        node.meta[RECORDED_VALUE] = value
        if node.name != name:
            raise ValueError(f"qbackend.load: node name {name!r} given twice")
    if saved["pytree"] is not None:
        orig_args, in_spec, out_spec = saved["pytree"]
        graph._codegen = torch.fx.graph._PyTreeCodeGen(torch.fx.graph._PyTreeInfo(
            orig_args, pytree.treespec_loads(in_spec), pytree.treespec_loads(out_spec)))
    inputs = [RecordedInput(_dtype(dtype), torch.device(device), tuple(sizes))
              for dtype, device, sizes in saved["inputs"]]
    symbols = {name: Symbol(*bounds) for name, bounds in saved["symbols"].items()}
    return GraphModule(root, graph), inputs, symbols


def _set_attribute(root: torch.nn.Module, dotted: str, tensor: torch.Tensor) -> None:
    *path, name = dotted.split(".")
    for part in path:
        if not hasattr(root, part):
            root.add_module(part, torch.nn.Module())
        root = getattr(root, part)
    root.register_buffer(name, tensor)


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


# what sympy prints for the size expressions export records (torch's FloorDiv and Mod among them)
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
              ast.Mod: operator.mod, ast.Pow: operator.pow}
_FUNCTIONS = {"FloorDiv": operator.floordiv, "Mod": operator.mod, "PythonMod": operator.mod, "Max": torch.sym_max,
              "Min": torch.sym_min}


def _evaluate(tree: ast.AST, symbols: dict):
    """An integer expression over ``symbols`` (ints or SymInts), read from its syntax tree (no
    ``eval``: the archive is data, and only these forms are sizes)."""
    if isinstance(tree, ast.Constant) and type(tree.value) is int:
        return tree.value
    if isinstance(tree, ast.Name) and tree.id in symbols:
        return symbols[tree.id]
    if isinstance(tree, ast.BinOp) and type(tree.op) in _OPERATORS:
        return _OPERATORS[type(tree.op)](_evaluate(tree.left, symbols), _evaluate(tree.right, symbols))
    if isinstance(tree, ast.UnaryOp) and isinstance(tree.op, ast.USub):
        return -_evaluate(tree.operand, symbols)
    if isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name) and tree.func.id in _FUNCTIONS and not tree.keywords:
        return _FUNCTIONS[tree.func.id](*(_evaluate(arg, symbols) for arg in tree.args))
    raise ValueError(f"not a size expression: {ast.dump(tree)}")


class ValueReader:
    """Value records made concrete for sizes bound to the symbols (ints, or a shape env's
    symbolic sizes): sizes, and tensors ``tensor(sizes, strides, dtype)`` makes (meta tensors
    by default: shape, strides and dtype are all a lowering reads)."""

    def __init__(self, symbols: dict, tensor=None):
        self.symbols, self.parsed = symbols, {}
        self.tensor = tensor or (lambda sizes, strides, dtype: torch.empty_strided(sizes, strides, dtype=dtype, device="meta"))

    def size(self, record):
        if isinstance(record, int):
            return record
        if record not in self.parsed:
            self.parsed[record] = ast.parse(record, mode="eval").body
        return _evaluate(self.parsed[record], self.symbols)

    def value(self, record):
        if isinstance(record, list):
            return [self.value(item) for item in record]
        if record is None or "size" in record:
            return None if record is None else self.size(record["size"])
        return self.tensor([self.size(d) for d in record["sizes"]], [self.size(d) for d in record["strides"]],
                           _dtype(record["dtype"]))
