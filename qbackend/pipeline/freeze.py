"""Freezing: parameters and buffers become constants of the compiled graph.

Dynamo (torch >= 2.5 with inlined nn modules) lifts every parameter and buffer to a graph
placeholder and passes the live tensor on each call; older paths use get_attr. Either way
the values are bound once here, as Inductor's freezing does: the compiled model then assumes
the weights no longer change.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from qbackend.graph_constants import set_constant
from qbackend.passes.in_place import first_write


def _is_parameter_or_buffer(node: Node, value) -> bool:
    if not isinstance(value, torch.Tensor):
        return False
    if isinstance(value, torch.nn.Parameter):
        return True
    static = node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
    return static is not None or getattr(value, "_dynamo_static_input_type", None) is not None


def is_written(node: Node) -> bool:
    """The graph mutates this input in place (e.g. a cache buffer), directly or through a view
    (``alias`` then ``add_`` in an export): it must stay an input."""
    return first_write(node) is not None


def freeze(gm: GraphModule, example_inputs) -> list[int]:
    """Turn parameter/buffer placeholders into constants; returns the indices of the inputs
    the compiled graph still takes at run time."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    runtime = []
    for index, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if not _is_parameter_or_buffer(node, value) or is_written(node):
            runtime.append(index)
            continue
        name = f"_frozen_{node.name}"
        set_constant(gm, name, value.detach())
        with gm.graph.inserting_before(node):
            constant = gm.graph.get_attr(name)
        constant.meta = dict(node.meta)
        node.replace_all_uses_with(constant)
        gm.graph.erase_node(node)
    _detach_attributes(gm)
    return runtime


def _detach_attributes(gm: GraphModule) -> None:
    """Parameters the graph reads as attributes (Dynamo's graph of a module it specializes on,
    qbackend/pipeline/static_module.py) become plain constants, as placeholders do: no autograd on a call."""
    for node in gm.graph.nodes:
        if node.op != "get_attr" or is_written(node):
            continue
        value = operator.attrgetter(node.target)(gm)  # (a dotted path for a submodule's tensor)
        if isinstance(value, torch.nn.Parameter) or isinstance(value, torch.Tensor) and value.requires_grad:
            node.target = f"_frozen_{node.name}"
            set_constant(gm, node.target, value.detach())
