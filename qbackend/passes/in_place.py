"""What writes into what: in-place writes and the views they reach, from the op's schema.

An op's schema marks each argument it writes (``Tensor(a!)``, also ``out=``) and each result
that shares an argument's memory (a view ``Tensor(a)``, an in-place op's ``Tensor(a!)``); qbackend's
own kernels' plain functions have the schema of the op they stand for. Freezing (a model tensor
the graph writes stays an input) and constant folding (constant_writes.py) read it here.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import Node

from qbackend.patterns.inplace import written_inputs

from qbackend.kernels import registry
from qbackend.passes.dead_code import _IN_PLACE_OPERATORS


def op_schema(target) -> Optional[torch.FunctionSchema]:
    """The schema of an op, or of the op an own kernel's plain function stands for."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema
    name = next((name for name, function in registry.PLAIN.items() if function is target), None)
    return None if name is None else registry.op(name)._schema  # (in a graph: the kernels are loaded)


def aliased_input(node: Node) -> Optional[Node]:
    """The input whose storage ``node``'s result shares (a view, an in-place op's result, an item
    of a tensor or of a tuple of views), per the op's schema; None for a new tensor."""
    if node.op == "call_function" and node.target is operator.getitem:
        return node.args[0] if isinstance(node.args[0], Node) else None
    schema = op_schema(node.target) if node.op == "call_function" else None
    aliases = {a for ret in schema.returns if ret.alias_info is not None for a in ret.alias_info.before_set} if schema else ()
    for index, arg in enumerate(schema.arguments if aliases else ()):
        if arg.alias_info is not None and aliases & set(arg.alias_info.before_set):
            given = node.args[index] if index < len(node.args) else node.kwargs.get(arg.name)
            return given if isinstance(given, Node) else None
    return None


def writes(user: Node, value: Node) -> Optional[bool]:
    """Whether ``user`` writes into ``value`` in place: its op's schema, torch's trailing
    underscore on a Tensor method, Python's in-place operators (Dynamo's graphs); None for a
    Python function, whose effects nothing states."""
    if user.op == "call_method":
        return user.args[0] is value and user.target.endswith("_") and not user.target.endswith("__")
    if user.op != "call_function":
        return False
    if user.target in _IN_PLACE_OPERATORS:
        return user.args[0] is value
    schema = op_schema(user.target)
    if schema is not None:
        return any(n is value for n in written_inputs(user, schema))
    return False if user.target is operator.getitem else None


def first_write(node: Node) -> Optional[Node]:
    """A node that writes into ``node``'s value, directly or through views; None if none states it."""
    pending = [node]
    while pending:
        value = pending.pop()
        for user in value.users:
            if writes(user, value):
                return user
            if aliased_input(user) is value:
                pending.append(user)
    return None
