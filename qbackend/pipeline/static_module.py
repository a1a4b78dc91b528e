"""A converted model that Dynamo treats as fixed: its tensors become graph attributes guarded by
identity, not graph inputs that every call gathers and checks one by one.

By default Dynamo inlines a module's forward and lifts each parameter, buffer and tensor
attribute to a graph input. Every call then walks the module tree to fetch each one and checks
its dtype, shape and strides (5-6 guards a tensor: 2011 on mobilenet_v3_large). Inductor skips
most of that only with ``freezing=True``, a global setting. Dynamo's own per-module switch,
``torchdynamo_force_dynamic = False`` (``torch/_dynamo/mutation_guard.py``), asks it to specialize
on the module instead: tensors become ``get_attr`` nodes, checked by identity (qbackend freezes
them at compile time either way). It changes only the modules it is set on.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule
from torch.fx.graph_module import _USER_PRESERVED_ATTRIBUTES_KEY

from qbackend.pipeline.freeze import is_written

DYNAMO_SWITCH = "torchdynamo_force_dynamic"


def _writes_state(gm: GraphModule) -> bool:
    """The graph writes one of its own tensors in place (a buffer it updates): its values
    change from call to call, so they must stay inputs."""
    return any(node.op == "get_attr" and is_written(node) for node in gm.graph.nodes)


def mark_static(gm: GraphModule) -> GraphModule:
    """Mark ``gm`` and its submodules for Dynamo to specialize on (module docstring), unless its
    graph updates a tensor of its own; kept by ``copy.deepcopy``. Returns ``gm``."""
    if isinstance(gm, GraphModule) and not _writes_state(gm):
        for module in gm.modules():
            setattr(module, DYNAMO_SWITCH, False)
        gm.meta.setdefault(_USER_PRESERVED_ATTRIBUTES_KEY, {})[DYNAMO_SWITCH] = False  # (what GraphModule's deepcopy sets again)
    return gm


def is_static(module: torch.nn.Module) -> bool:
    return getattr(module, DYNAMO_SWITCH, True) is False
