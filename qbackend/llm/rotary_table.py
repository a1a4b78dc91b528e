"""A rotary embedding's cos and sin read from tables, not computed on every call.

Hugging Face's rotary embedding (``LlamaRotaryEmbedding.forward``; Mistral's, Qwen2's the same)
computes cos and sin of the step's positions on every call: ``position_ids[..., None].float() *
inv_freq``, its cat with itself, cos, sin, the products with ``attention_scaling`` and the casts:
14 ops, ~0.13 ms of a ~5 ms int4 decode step. Each output row depends on one position and on
constants, so ``rotary_tables_cached`` computes the rows once for positions 0..P-1, by the
graph's own ops, and each call reads the rows of its positions (``torch.embedding``, one op per
output). The same ops give the same values (each table block is at most one of ATen's parallel
chunks, so its vector loop covers whole rows as the graph's does).

Positions past the table grow it to the next power of two; negative positions, or a table
past ``MAX_TABLE_BYTES``, run the graph's ops instead.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import Graph, GraphModule, Node

from qbackend.patterns.base import fake_value

from qbackend.passes.dead_code import eliminate_dead_code
from qbackend.passes.float_ops import is_op, operands

aten = torch.ops.aten

MIN_POSITIONS = 256
MAX_TABLE_BYTES = 64 << 20
TABLE_BLOCK_ELEMENTS = 32768  # ATen's GRAIN_SIZE: a block this size runs as one chunk on one thread
_POSITION_DTYPES = (torch.int64, torch.int32)


class RotaryTables:
    """``positions`` -> the tabulated outputs at those positions ([*positions.shape, *trailing] each)."""

    def __init__(self, compute: GraphModule, trailing: list[tuple[int, ...]], row_bytes: int):
        self.compute, self.trailing, self.row_bytes, self.tables = compute, trailing, row_bytes, None
        self.__name__ = "rotary_tables"  # (what the generated code calls it)

    def __call__(self, positions: torch.Tensor) -> tuple:
        tables = self.tables  # (read once: another thread may grow them meanwhile)
        if tables is not None and positions.dtype in _POSITION_DTYPES:
            try:
                return self._read(tables, positions)
            except IndexError:  # (a position past the table, or negative)
                pass
        return self._grown(positions)

    def _read(self, tables: list, positions: torch.Tensor) -> tuple:
        return tuple(torch.embedding(table, positions).view(*positions.shape, *dims)
                     for table, dims in zip(tables, self.trailing))

    def _grown(self, positions: torch.Tensor) -> tuple:
        if positions.dtype not in _POSITION_DTYPES or positions.numel() == 0:
            return tuple(self.compute(positions))
        low, high = (int(bound) for bound in torch.aminmax(positions))
        count = max(MIN_POSITIONS, 1 << high.bit_length())
        if low < 0 or count * self.row_bytes > MAX_TABLE_BYTES:
            return tuple(self.compute(positions))
        tables = self._tabulated(count, positions.dtype)
        if self.tables is None or self.tables[0].size(0) < count:  # (a thread that grew them further meanwhile keeps its)
            self.tables = tables
        return self._read(tables, positions)

    def _tabulated(self, count: int, dtype: torch.dtype) -> list[torch.Tensor]:
        rows = max(1, TABLE_BLOCK_ELEMENTS // max(int(torch.Size(dims).numel()) for dims in self.trailing))
        blocks = [self.compute(torch.arange(start, min(start + rows, count), dtype=dtype).unsqueeze(0))
                  for start in range(0, count, rows)]
        return [torch.cat([block[i].reshape(block[i].shape[1], -1) for block in blocks]) for i in range(len(self.trailing))]


def _adds_last_dim(node: Node) -> bool:
    if node.op == "call_function" and node.target is operator.getitem:
        return len(node.args) == 2 and node.args[1] == (Ellipsis, None)
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return is_op(node, "unsqueeze") and dim == -1


def _cast(node: Node) -> bool:
    """``x.float()``, ``x.to(dtype=..., device=...)`` or ATen's ``_to_copy`` of them."""
    if node.op == "call_method" and node.target in ("float", "to"):
        return all(not isinstance(a, Node) for a in node.args[1:]) and set(node.kwargs) <= {"dtype", "device"}
    return (node.op == "call_function" and node.target is aten._to_copy.default
            and set(node.kwargs) <= {"dtype", "device", "layout"})


def _constant(node) -> bool:
    """A number, a module constant, or a cast of one."""
    if not isinstance(node, Node):
        return isinstance(node, (int, float))
    return node.op == "get_attr" or (_cast(node) and _constant(node.args[0]))


def _within(constant, trailing: int) -> bool:
    """A number, or a constant of at most ``trailing`` dims: it broadcasts over those alone."""
    return not isinstance(constant, Node) or (fake_value(constant) is not None and fake_value(constant).dim() <= trailing)


def _trailing(node: Node, positions: Node) -> Optional[int]:
    value, base = fake_value(node), fake_value(positions)
    return None if value is None or base is None else value.dim() - base.dim()


def _per_position(node: Node, region: set, positions: Node) -> bool:
    """``node`` computes each row of its value from the same position's rows of its region inputs
    and from constants (broadcast over the trailing dims only)."""
    inside = [n for n in node.all_input_nodes if n in region or n is positions]
    if not inside:
        return False
    if _adds_last_dim(node) or _cast(node) or is_op(node, "cos") or is_op(node, "sin"):
        return len(node.all_input_nodes) == 1
    if (pair := operands(node, "mul")) is not None:
        trailing = _trailing(node, positions)
        return trailing is not None and all(p in region or (_constant(p) and _within(p, trailing)) for p in pair)
    if is_op(node, "cat") and node.args and isinstance(node.args[0], (list, tuple)):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        trailing = _trailing(node, positions)
        return all(n in region for n in node.args[0]) and trailing is not None and isinstance(dim, int) and -trailing <= dim < 0
    return False


def _match(positions: Node) -> Optional[tuple[list[Node], list[Node]]]:
    """(the nodes computed per position from ``positions``, in graph order; those read outside
    them), where they include a cos or sin and every output's trailing dims are static."""
    value = fake_value(positions)
    if value is None or value.dtype not in _POSITION_DTYPES or not any(_adds_last_dim(u) for u in positions.users):
        return None
    region, ordered = set(), []
    for node in positions.graph.nodes:
        if node.op in ("call_function", "call_method") and _per_position(node, region, positions):
            region.add(node)
            ordered.append(node)
    outputs = [n for n in ordered if any(u not in region for u in n.users)]
    if not any(is_op(n, "cos") or is_op(n, "sin") for n in ordered) or not outputs:
        return None
    for node in outputs:
        out = fake_value(node)
        if out is None or not out.is_floating_point() or not all(isinstance(d, int) for d in out.shape[value.dim():]):
            return None
    return ordered, outputs


def _table_module(gm: GraphModule, positions: Node, ordered: list[Node], outputs: list[Node]) -> GraphModule:
    """The region as a module of its own: positions in, the outputs out."""
    graph, root, env = Graph(), torch.nn.Module(), {}
    env[positions] = graph.placeholder("positions")

    def copied(node: Node) -> Node:
        if node not in env:
            if node.op == "get_attr":
                name = f"constant_{len(root._buffers)}"
                root.register_buffer(name, operator.attrgetter(node.target)(gm).detach())
                env[node] = graph.get_attr(name)
            else:  # (a cast of a constant)
                env[node] = graph.node_copy(node, copied)
        return env[node]

    for node in ordered:
        env[node] = graph.node_copy(node, copied)
    graph.output(tuple(env[n] for n in outputs))
    return GraphModule(root, graph)


def rotary_tables_cached(gm: GraphModule) -> Optional[str]:
    """Each rotary embedding's cos / sin (see the module docstring) read from tables."""
    rewritten = 0
    for positions in list(gm.graph.nodes):
        found = _match(positions)
        if found is None:
            continue
        ordered, outputs = found
        values = [fake_value(n) for n in outputs]
        trailing = [tuple(v.shape[fake_value(positions).dim():]) for v in values]
        row_bytes = sum(int(torch.Size(dims).numel()) * v.dtype.itemsize for dims, v in zip(trailing, values))
        tables = RotaryTables(_table_module(gm, positions, ordered, outputs), trailing, row_bytes)
        with gm.graph.inserting_before(outputs[0]):
            call = gm.graph.call_function(tables, (positions,))
            call.meta["example_value"] = tuple(fake_value(n) for n in outputs)
            for i, node in enumerate(outputs):
                read = gm.graph.call_function(operator.getitem, (call, i))
                read.meta = dict(node.meta)
                node.replace_all_uses_with(read)
        rewritten += 1
    eliminate_dead_code(gm)
    return f"{rewritten} rotary cos / sin computation(s) read from tables" if rewritten else None
