"""Checks of an archive's records before anything is built from them (``graph_archive.py``).

An archive is data from anywhere. FX turns a graph into Python source made of its node names,
placeholder and attribute targets and keyword keys, and the input structure's argument names
and keys: each of those must be a plain identifier, or that string is code. Sizes are
expressions of the input sizes, read from their syntax tree within bounds; constants must lie
inside their storage. Every failure is one ``ArchiveError`` naming the record.
"""
from __future__ import annotations

import ast
import keyword
import operator

import torch

MAX_NAME = 256  # characters of a name or a size expression
MAX_NESTING = 16  # of argument containers and of a size expression's syntax tree
MAX_INT = 2**62  # any integer argument or size
MAX_EXPONENT = 64  # of a ``**`` in a size expression
MAX_STRING = 4096  # characters of a string argument

DTYPES = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
LAYOUTS = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.layout)}
MEMORY_FORMATS = {str(f): f for f in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d,
                                      torch.preserve_format)}
DEVICE_TYPES = ("cpu", "xpu", "cuda", "meta")
# what a constant may hold: plain numbers (no quantized, complex or bit-packed dtypes)
CONSTANT_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                             torch.int16, torch.int32, torch.int64, torch.bool})


class ArchiveError(ValueError):
    """An archive ``qbackend.load`` refuses: which record, and what is wrong with it."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"qbackend.load: {where}: {problem}")


def identifier(value, where: str) -> str:
    """``value`` if it is a Python identifier that is not a keyword (safe in generated source)."""
    if not (isinstance(value, str) and len(value) <= MAX_NAME and value.isidentifier() and value.isascii()
            and not keyword.iskeyword(value)):
        raise ArchiveError(where, f"{_short(value)} is not a plain identifier")
    return value


def dotted(value, where: str) -> str:
    """``value`` if it is identifiers or indices (``layers.0.weight``) joined by dots."""
    if not isinstance(value, str) or len(value) > MAX_NAME:
        raise ArchiveError(where, f"{_short(value)} is not an attribute path")
    for part in value.split("."):
        if not (part.isascii() and part.isdigit()):
            identifier(part, where)
    return value


def integer(value, where: str) -> int:
    if type(value) is not int or abs(value) > MAX_INT:
        raise ArchiveError(where, f"{_short(value)} is not an integer within ±2**62")
    return value


def choice(table: dict, name, where: str):
    if not isinstance(name, str) or name not in table:
        raise ArchiveError(where, f"unknown value {_short(name)}")
    return table[name]


def device(name, where: str) -> torch.device:
    if not isinstance(name, str) or name.partition(":")[0] not in DEVICE_TYPES:
        raise ArchiveError(where, f"unknown device {_short(name)}")
    try:
        return torch.device(name)
    except RuntimeError as error:
        raise ArchiveError(where, f"unknown device {_short(name)}") from error


def record(value, shape: tuple, where: str):
    """``value`` if it is a tuple or list of ``len(shape)`` items of the types ``shape`` names."""
    if not isinstance(value, (tuple, list)) or len(value) != len(shape) or not all(map(isinstance, value, shape)):
        names = ", ".join(t.__name__ if isinstance(t, type) else "/".join(s.__name__ for s in t) for t in shape)
        raise ArchiveError(where, f"expected a record of ({names}), got {_short(value)}")
    return value


def constant(name: str, tensor, where: str) -> torch.Tensor:
    """``tensor`` if it is a plain CPU tensor of numbers whose elements lie inside its storage,
    no two at one address."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        raise ArchiveError(where, f"{name} is a {type(tensor).__name__}, not a tensor")
    if tensor.dtype not in CONSTANT_DTYPES or tensor.layout != torch.strided or tensor.device.type != "cpu":
        raise ArchiveError(where, f"{name}: a {tensor.dtype} {tensor.layout} tensor on {tensor.device} cannot be a constant")
    sizes, strides, offset = tensor.shape, tensor.stride(), tensor.storage_offset()
    if tensor.dim() > 8 or offset < 0 or any(s < 0 for s in strides):
        raise ArchiveError(where, f"{name}: sizes {list(sizes)}, strides {list(strides)}, offset {offset}")
    if tensor.numel():
        last = offset + sum((size - 1) * stride for size, stride in zip(sizes, strides))
        if (last + 1) * tensor.element_size() > tensor.untyped_storage().nbytes():
            raise ArchiveError(where, f"{name}: sizes {list(sizes)}, strides {list(strides)} and offset {offset} "
                                      f"reach past its storage of {tensor.untyped_storage().nbytes()} bytes")
        if not dense(tensor):
            raise ArchiveError(where, f"{name}: strides {list(strides)} make elements overlap or leave gaps")
    return tensor


MAX_ITEMS = 10_000  # of a description (plain_data)


def plain_data(value, where: str, depth: int = 0, items: list | None = None):
    """``value`` if it is plain JSON-like data: None, bools, numbers, strings, lists, and dicts
    with string keys, at most MAX_NESTING deep and MAX_ITEMS items in all (what describes an
    archive: its recipe, the versions it was made with)."""
    items = [0] if items is None else items
    items[0] += 1
    if depth > MAX_NESTING or items[0] > MAX_ITEMS:
        raise ArchiveError(where, "a description nested too deep or too long")
    kind = type(value)  # (exactly these types: a subclass pickles as a global of its own)
    if value is None or kind in (bool, int, float):
        return value
    if kind is str:
        if len(value) > MAX_STRING:
            raise ArchiveError(where, f"a string of {len(value)} characters")
        return value
    if kind in (list, tuple):
        return [plain_data(v, where, depth + 1, items) for v in value]
    if kind is dict and all(type(k) is str and len(k) <= MAX_NAME for k in value):
        return {k: plain_data(v, where, depth + 1, items) for k, v in value.items()}
    raise ArchiveError(where, f"{_short(value)} is not plain data")


def dense(tensor: torch.Tensor) -> bool:
    """Its elements fill a block of memory, each at its own address (any order of dims)."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# Size expressions: what sympy prints for the sizes export records (torch's FloorDiv and Mod
# among them), and nothing else.
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
              ast.Mod: operator.mod, ast.Pow: operator.pow}
_FUNCTIONS = {"FloorDiv": operator.floordiv, "Mod": operator.mod, "PythonMod": operator.mod, "Max": torch.sym_max,
              "Min": torch.sym_min}


def size_expression(text, where: str) -> ast.AST:
    """The syntax tree of a size expression (checked as ``evaluate`` reads it)."""
    if not isinstance(text, str) or len(text) > MAX_NAME:
        raise ArchiveError(where, f"{_short(text)} is not a size expression")
    try:
        return ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise ArchiveError(where, f"{_short(text)} is not a size expression ({type(error).__name__})") from error


def evaluate(tree: ast.AST, symbols: dict, where: str, depth: int = 0):
    """An integer expression over ``symbols`` (ints or SymInts), read from its syntax tree: no
    ``eval``, only the forms above, every integer within ±2**62, exponents up to 64. A name
    ``symbols`` lacks (a size export derived from data) is ``symbols.get(None)`` if given."""
    if depth > MAX_NESTING:
        raise ArchiveError(where, "a size expression nested too deeply")
    if isinstance(tree, ast.Constant):
        return integer(tree.value, where)
    if isinstance(tree, ast.Name) and (tree.id in symbols or None in symbols) and tree.id.isidentifier():
        return symbols.get(tree.id, symbols.get(None))
    if isinstance(tree, ast.UnaryOp) and isinstance(tree.op, ast.USub):
        return _bounded(-evaluate(tree.operand, symbols, where, depth + 1), where)
    if isinstance(tree, ast.BinOp) and type(tree.op) in _OPERATORS:
        if isinstance(tree.op, ast.Pow) and not (isinstance(tree.right, ast.Constant) and type(tree.right.value) is int
                                                 and 0 <= tree.right.value <= MAX_EXPONENT):
            raise ArchiveError(where, f"a size raised to {ast.unparse(tree.right)[:40]}: only constant exponents 0-64")
        left, right = evaluate(tree.left, symbols, where, depth + 1), evaluate(tree.right, symbols, where, depth + 1)
        return _bounded(_apply(_OPERATORS[type(tree.op)], left, right, where), where)
    if (isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name) and tree.func.id in _FUNCTIONS
            and not tree.keywords and 2 <= len(tree.args) <= 16):
        function = _FUNCTIONS[tree.func.id]
        values = [evaluate(arg, symbols, where, depth + 1) for arg in tree.args]
        result = values[0]
        for value in values[1:]:
            result = _apply(function, result, value, where)
        return _bounded(result, where)
    raise ArchiveError(where, f"not a size expression: {ast.dump(tree)[:80]}")


def _apply(function, left, right, where: str):
    try:
        return function(left, right)
    except ZeroDivisionError as error:
        raise ArchiveError(where, "a size divided by zero") from error


def _bounded(value, where: str):
    if isinstance(value, int) and not isinstance(value, bool):
        return integer(value, where)
    if isinstance(value, torch.SymInt):  # (its example size bounded as an int is)
        hint = getattr(value.node, "hint", None)
        if hint is not None:
            integer(hint, where)
        return value
    raise ArchiveError(where, f"a size evaluates to {_short(value)}")
