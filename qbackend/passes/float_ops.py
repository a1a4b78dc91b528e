"""Float ops as graphs spell them: Dynamo records a Hugging Face model's Python as torch
functions, operators and Tensor methods (``x * y``, ``x.pow(2)``, ``torch.rsqrt``); export and
PT2E's converted modules as ATen overloads. ``is_op(node, "mul")`` matches either spelling,
for the passes that fuse an LLM's float remainder (rms_norm.py, rotary.py)."""
from __future__ import annotations

import operator
from typing import Callable, Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.patterns.base import fake_value

from qbackend.passes.dead_code import eliminate_dead_code

aten = torch.ops.aten

# one row per op: its function / operator targets, its Tensor method name, its ATen overloads,
# the keyword arguments it may have (an ``alpha`` or ``out`` changes the op)
SPELLINGS = {
    "mul": ({operator.mul, torch.mul}, "mul", {aten.mul.Tensor}, set()),
    "add": ({operator.add, torch.add}, "add", {aten.add.Tensor}, set()),
    "neg": ({operator.neg, torch.neg}, "neg", {aten.neg.default}, set()),
    "pow": ({operator.pow, torch.pow}, "pow", {aten.pow.Tensor_Scalar}, set()),
    "mean": ({torch.mean}, "mean", {aten.mean.dim}, {"dim", "keepdim"}),
    "rsqrt": ({torch.rsqrt}, "rsqrt", {aten.rsqrt.default}, set()),
    "cat": ({torch.cat}, None, {aten.cat.default}, {"dim"}),
    "unsqueeze": ({torch.unsqueeze}, "unsqueeze", {aten.unsqueeze.default}, {"dim"}),
    "to": (set(), "to", set(), {"dtype"}),
    "silu": ({torch.nn.functional.silu}, None, {aten.silu.default}, {"inplace"}),
    "cos": ({torch.cos}, "cos", {aten.cos.default}, set()),
    "sin": ({torch.sin}, "sin", {aten.sin.default}, set()),
}


def is_op(node, name: str) -> bool:
    """``node`` calls float op ``name`` in one of its spellings (SPELLINGS)."""
    if not isinstance(node, Node) or not node.args:
        return False
    functions, method, overloads, keywords = SPELLINGS[name]
    spelled = (node.op == "call_function" and (node.target in functions or node.target in overloads)) or \
        (node.op == "call_method" and node.target == method)
    return spelled and set(node.kwargs) <= keywords


def float32(node) -> bool:
    value = fake_value(node)
    return value is not None and value.dtype == torch.float32


def through_noop_casts(node):
    """``node`` itself, or what it casts when it is ``x.to(torch.float32)`` of a float32 x
    (LlamaRMSNorm's casts to its input dtype: no-ops in a float32 model)."""
    while is_op(node, "to") and node.op == "call_method" and float32(node.args[0]) and \
            (node.args[1:] == (torch.float32,) or (len(node.args) == 1 and node.kwargs == {"dtype": torch.float32})):
        node = node.args[0]
    return node


def operands(node: Node, name: str) -> Optional[tuple]:
    """The two operands of a binary ``name`` call, else None."""
    return tuple(node.args[:2]) if is_op(node, name) and len(node.args) == 2 and not node.kwargs else None


def both_orders(pair: Optional[tuple]) -> list:
    """A commutative op's two operands both ways round ([] for None, no match)."""
    return [] if pair is None else [pair, pair[::-1]]


def single_user(node) -> bool:
    return isinstance(node, Node) and len(node.users) == 1


def calls_in_place_of(gm: GraphModule, match: Callable[[Node], Optional[tuple]], function: Callable, what: str) -> Optional[str]:
    """Each node for which ``match`` gives arguments becomes ``function(*arguments)`` (keeping
    its recorded value, which later matches read); the report's note, or None."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        found = match(node)
        if found is None:
            continue
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(function, found)
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        rewritten += 1
    eliminate_dead_code(gm)
    return f"{rewritten} {what} in one pass" if rewritten else None
