"""May a fused kernel overwrite a tensor in place?

oneDNN's binary conv writes its result into the accumulator (``sum`` post-op). That is only
safe when nobody can observe the old value afterwards: the buffer was allocated inside this
graph (not a graph input, constant or view of one), it is not returned, and every other
reader has already run. Inductor 2.13 skips these checks and writes into the caller's input.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Node

from .base import GraphView
from .qdq import is_op


def _returns_fresh_tensor(node: Node) -> bool:
    """The node's output is a new allocation (no view of an input), per the op schema.
    (onednn's binary conv mutates its accumulator but returns a separate tensor.)"""
    if node.op != "call_function":
        return False
    target = node.target
    if getattr(target, "fresh_output", False):
        return True
    if isinstance(target, torch._ops.OpOverload):
        return all(ret.alias_info is None for ret in target._schema.returns)
    return False


def written_inputs(node: Node, schema: Optional[torch.FunctionSchema] = None) -> list:
    """The nodes ``node`` writes into in place, as its op's schema marks them (``Tensor(a!)``),
    passed by position or keyword (``out=``); ``schema``: the schema of a plain function that
    stands for a registered op."""
    if schema is None:
        if not isinstance(node.target, torch._ops.OpOverload):
            return []
        schema = node.target._schema
    written = []
    for index, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        given = node.args[index] if index < len(node.args) else node.kwargs.get(arg.name)
        written += [n for n in (given if isinstance(given, (list, tuple)) else [given]) if isinstance(n, Node)]
    return written


def schema_writes(user: Node, value: Node) -> bool:
    """The user's op schema marks the argument ``value`` is passed as written in place."""
    return any(n is value for n in written_inputs(user))


def _only_reads(user: Node, value: Node) -> bool:
    """The user reads ``value`` without keeping a view of it or writing to it."""
    return _returns_fresh_tensor(user) and not schema_writes(user, value)


def clobber_blocker(graph: GraphView, buffer: Node, reader: Node, write_at: Node) -> Optional[str]:
    """Why ``buffer`` must not be overwritten by a kernel placed at ``write_at`` (None if it may).

    ``reader`` is the chain's own use of ``buffer`` (it is replaced by the kernel).
    """
    if graph.is_graph_input(buffer) or graph.constant(buffer) is not None or buffer.op == "get_attr":
        return f"{buffer.name} is a graph input or constant"
    if not _returns_fresh_tensor(buffer):
        return f"{buffer.name} may alias another tensor ({getattr(buffer.target, '__name__', buffer.target)})"
    if graph.is_graph_output(buffer):
        return f"{buffer.name} is returned by the graph"
    here = graph.position(write_at)
    for user in buffer.users:
        if user is reader:
            continue
        if not _only_reads(user, buffer):
            return f"{buffer.name} is also used by {user.name}, which may keep a view of it"
        # A dequantize's consumers may later be lowered to read the int8 buffer directly, at
        # their own position: they count as readers of the buffer too.
        readers = [user] + (list(user.users) if is_op(user, "dequantize_per_tensor") else [])
        for later in readers:
            if later is not write_at and graph.position(later) > here:
                return f"{buffer.name} is read again later by {later.name}"
    return None
