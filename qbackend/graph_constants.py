"""A compiled graph's constants: each a buffer of the GraphModule mirrored in its instance
__dict__, set by freezing, the lowering and the passes, dropped once nothing reads it."""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node


def constant_value(gm: GraphModule, node) -> Optional[torch.Tensor]:
    """The tensor a get_attr node reads from ``gm``, a dotted target (an exported module's
    ``layer1.0.conv1.weight``) followed through its submodules; None for anything else."""
    if not isinstance(node, Node) or node.op != "get_attr":
        return None
    value = gm
    for part in node.target.split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) else None


def set_constant(gm: GraphModule, name: str, value: torch.Tensor) -> None:
    """A graph constant: a (non-persistent) buffer, so FX knows it, mirrored in the instance
    __dict__. The generated code reads ``self.<name>`` on every call; through
    nn.Module.__getattr__ that costs ~1.5 us per buffer (0.3 ms per call on MobileNetV2), a
    __dict__ hit costs nothing."""
    gm.register_buffer(name, value, persistent=False)
    gm.__dict__[name] = value


def drop_unused_constants(gm: GraphModule) -> None:
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name in [n for n in gm._buffers if n not in used and n in gm.__dict__]:
        del gm._buffers[name]
        del gm.__dict__[name]
