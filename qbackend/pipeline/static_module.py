"""A converted model that Dynamo treats as fixed: its tensors become graph attributes guarded by
identity, not graph inputs that every call gathers and checks one by one.

By default Dynamo inlines a module's forward and lifts each parameter, buffer and tensor
attribute to a graph input. Every call then walks the module tree to fetch each one and checks
its dtype, shape and strides (5-6 guards a tensor: 2011 on mobilenet_v3_large). Inductor skips
most of that only with ``freezing=True``, a global setting. Dynamo's own per-module switch,
``torchdynamo_force_dynamic = False`` (``torch/_dynamo/mutation_guard.py``), asks it to specialize
on the module instead: tensors become ``get_attr`` nodes, checked by identity (qbackend freezes
them at compile time either way). It changes only the modules it is set on.

Dynamo also walks the module tree down to each tensor the graph reads and guards every step
(a submodule's dict, its identity, its child's): 731 guard nodes for mobilenet_v2_like's 212
tensors, a third of a cold call's ~1 ms in Dynamo. So the tensors read from submodules move to
the root under flat names (``state_dict`` and ``load_state_dict`` keep the dotted keys, through
``RenamedKeys``), and ``get_attr`` nodes nothing reads (a converted module exported and loaded
again keeps one per float weight ``convert_pt2e`` replaced) go.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule
from torch.fx.graph_module import _USER_PRESERVED_ATTRIBUTES_KEY

from qbackend.pipeline.freeze import is_written

DYNAMO_SWITCH = "torchdynamo_force_dynamic"
FLAT_SEPARATOR = "__"  # (a dotted target "a.b.w" is read from the root as "a__b__w")


def _writes_state(gm: GraphModule) -> bool:
    """The graph writes one of its own tensors in place (a buffer it updates): its values
    change from call to call, so they must stay inputs."""
    return any(node.op == "get_attr" and is_written(node) for node in gm.graph.nodes)


class RenamedKeys:
    """A state-dict hook renaming its module's own keys by ``names``: the flat names of the
    tensors ``mark_static`` moved to the root to their dotted keys after ``state_dict`` (in
    ``order``, the keys' order before the move), back before ``load_state_dict``, so both keep
    the dotted keys."""

    def __init__(self, names: dict, order: tuple = ()):
        self.names, self.rank = names, {key: i for i, key in enumerate(order)}

    def __call__(self, module, state: dict, prefix: str, *_):
        items = []
        for key, value in state.items():
            local = key[len(prefix):] if key.startswith(prefix) else None
            items.append((self.names.get(local, local), key, value))
        if self.rank:  # (after state_dict: the module's keys in their order, others of its own after
            # them; the keys saved before its own, a parent's or a sibling's, first as they came)
            unranked = len(self.rank)
            items.sort(key=lambda item: -1 if item[0] is None else self.rank.get(item[0], unranked))
        state.clear()  # (in place: the hook's contract)
        for local, key, value in items:
            state[key if local is None else prefix + local] = value


def _drop_unread_attributes(gm: GraphModule) -> None:
    for node in [n for n in gm.graph.nodes if n.op == "get_attr" and not n.users]:
        gm.graph.erase_node(node)


def _flat_name(target: str) -> str:
    """A Python identifier (as a ``get_attr`` target an archive takes): ``0.weight`` -> ``_0__weight``."""
    flat = target.replace(".", FLAT_SEPARATOR)
    return flat if flat.isidentifier() else "_" + flat


def _move_to_root(gm: GraphModule, target: str) -> bool:
    """Move the tensor at ``target`` (in a submodule) to the root under its flat name, as the
    same kind of attribute (parameter, buffer, plain); False where that name is taken or no
    identifier, or the attribute is no tensor."""
    path, _, leaf = target.rpartition(".")
    owner, flat = gm.get_submodule(path), _flat_name(target)
    if hasattr(gm, flat) or not flat.isidentifier():
        return False
    if leaf in owner._parameters:
        gm.register_parameter(flat, owner._parameters.pop(leaf))
    elif leaf in owner._buffers:
        persistent = leaf not in owner._non_persistent_buffers_set
        owner._non_persistent_buffers_set.discard(leaf)
        gm.register_buffer(flat, owner._buffers.pop(leaf), persistent=persistent)
    elif isinstance(owner.__dict__.get(leaf), torch.Tensor):
        setattr(gm, flat, owner.__dict__.pop(leaf))
    else:
        return False
    return True


def _flatten_attributes(gm: GraphModule) -> None:
    """Every tensor a ``get_attr`` node reads from a submodule, read from the root (module docstring)."""
    nested = {node.target for node in gm.graph.nodes if node.op == "get_attr" and "." in node.target}
    if not nested:
        return
    order = tuple(gm.state_dict(keep_vars=True))
    dotted_by_flat = {_flat_name(target): target for target in sorted(nested) if _move_to_root(gm, target)}
    flat_by_dotted = {dotted: flat for flat, dotted in dotted_by_flat.items()}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in flat_by_dotted:
            node.target = flat_by_dotted[node.target]
    if dotted_by_flat:
        gm.register_state_dict_post_hook(RenamedKeys(dotted_by_flat, order))
        gm.register_load_state_dict_pre_hook(RenamedKeys(flat_by_dotted))


def mark_static(gm: GraphModule) -> GraphModule:
    """Mark ``gm`` and its submodules for Dynamo to specialize on, its tensors read from the root
    and its unread ``get_attr`` nodes gone (module docstring), unless its graph updates a tensor
    of its own; kept by ``copy.deepcopy``. Returns ``gm``."""
    if isinstance(gm, GraphModule) and not _writes_state(gm):
        _drop_unread_attributes(gm)
        _flatten_attributes(gm)
        gm.recompile()
        for module in gm.modules():
            setattr(module, DYNAMO_SWITCH, False)
        gm.meta.setdefault(_USER_PRESERVED_ATTRIBUTES_KEY, {})[DYNAMO_SWITCH] = False  # (what GraphModule's deepcopy sets again)
    return gm


LIFTED_WEIGHTS_NOTED = 32  # weights lifted to graph inputs from which the report says so


def lifted_weights_note(lifted: int) -> Optional[str]:
    """The report's note on a graph that got ``lifted`` weights as inputs (a module Dynamo did
    not specialize on), or None below ``LIFTED_WEIGHTS_NOTED``."""
    if lifted < LIFTED_WEIGHTS_NOTED:
        return None
    return (f"{lifted} weights reached this graph as inputs, which Dynamo gathers and checks one by one on every call "
            "(mobilenet_v3_large: ~0.7 ms a call at batch 1): for a converted PT2E module, "
            "qbackend.pipeline.static_module.mark_static(module) before torch.compile makes them constants checked by "
            "identity (quantize_x86 returns its module marked)")


def is_static(module: torch.nn.Module) -> bool:
    return getattr(module, DYNAMO_SWITCH, True) is False
