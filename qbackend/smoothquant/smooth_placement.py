"""Where SmoothQuant's 1/s goes: folded into the producer's own constant, or an explicit
per-channel multiply on the smoothed linears' input.

Folding is allowed only when nothing but the smoothed linears can see it:
- the producer's output is read by the smoothed linears alone (a post-LN BERT's LayerNorm
  output also feeds the residual add: folding would scale the residual);
- every constant it scales is read by this producer alone (one get_attr node, one user, no
  other attribute sharing its storage): GELU's 0.5 reused elsewhere must not change;
- the constant is per channel: shape [C] (or [1, .., 1, C]), so dividing it by s means the same
  as dividing the output by s. A [1] or scalar constant would need to grow to [C]; a scalar
  Python number is not a constant of this producer at all.
Everything else gets ``x * (1/s)`` as a new node that only the smoothed linears read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.graph_constants import constant_value

aten = torch.ops.aten


@dataclass
class Fold:
    """1/s can go into ``constants`` of ``producer``: each (node, how) with how(value, s)."""

    producer: Node
    constants: list  # [(get_attr node, Callable[[tensor, s], tensor])]


def _shared_reason(gm: GraphModule, node: Node, producer: Node) -> Optional[str]:
    """Why the constant behind ``node`` is not this producer's alone (None if it is)."""
    readers = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == node.target]
    users = [u for n in readers for u in n.users if u is not producer]
    if users:
        return f"constant {node.target} is also read by {', '.join(sorted(u.name for u in users))}"
    value = constant_value(gm, node)
    storage = value.untyped_storage().data_ptr()
    for name, other in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        if name != node.target and other.untyped_storage().data_ptr() == storage:
            return f"constant {node.target} shares its storage with {name}"
    return None


def _per_channel(gm: GraphModule, node, channels: int, what: str) -> Optional[str]:
    if not isinstance(node, Node):
        return f"{what} is a Python scalar ({node!r}), not a per-channel constant"
    value = constant_value(gm, node)
    if value is None:
        return f"{what} is not a constant"
    shape = list(value.shape)
    if shape[-1:] != [channels] or any(d != 1 for d in shape[:-1]):
        return f"{what} {node.target} has shape {shape}, not [{channels}]: scaling it per channel would change its meaning"
    return None


def _divide_last(value: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return value / s.to(value.dtype)


def _divide_rows(value: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return value / s.to(value.dtype)[:, None]


def _candidates(gm: GraphModule, producer: Node, channels: int) -> tuple[list, Optional[str]]:
    """The producer's per-channel constants and how to divide each by s, or the reason none."""
    target = producer.target
    if target is aten.layer_norm.default or target is aten.rms_norm.default:
        kind = "layer_norm" if target is aten.layer_norm.default else "rms_norm"
        weight = producer.args[2] if len(producer.args) > 2 else None
        bias = producer.args[3] if kind == "layer_norm" and len(producer.args) > 3 else None
        if weight is None:
            return [], f"{kind} {producer.name} has no affine weight to fold into"
        parts = [(weight, "weight")] + ([(bias, "bias")] if bias is not None else [])
        return [(n, _divide_last, f"{kind} {what}") for n, what in parts], None
    if target is aten.linear.default:
        parts = [(producer.args[1], _divide_rows, "linear weight rows")]
        if len(producer.args) > 2 and producer.args[2] is not None:
            parts.append((producer.args[2], _divide_last, "linear bias"))
        if constant_value(gm, producer.args[1]) is None:
            return [], f"linear {producer.name} has no constant weight"
        return parts, None
    if target is aten.mul.Tensor:
        consts = [a for a in producer.args if not isinstance(a, Node) or a.op == "get_attr"]
        if len(consts) != 1:
            return [], f"mul {producer.name} multiplies two computed tensors"
        return [(consts[0], _divide_last, "mul constant")], None
    return [], f"producer {producer.name} ({getattr(target, '__name__', target)}) has no per-channel constant"


def placement(gm: GraphModule, x: Node, linears: list[Node]) -> tuple[Optional[Fold], str]:
    """(Fold, "") when 1/s can be folded into ``x``'s producer, else (None, why not)."""
    if x.op != "call_function":
        return None, f"input {x.name} is a graph input, not computed by a node"
    others = sorted(u.name for u in x.users if u not in linears)
    if others:
        return None, f"output of {x.name} is also read by {', '.join(others)} (folding would change that input)"
    channels = linears[0].args[1].meta["val"].shape[1]
    parts, reason = _candidates(gm, x, channels)
    if reason:
        return None, reason
    for node, how, what in parts:
        shape_reason = _per_channel(gm, node, channels, what) if how is _divide_last else None
        shared_reason = _shared_reason(gm, node, x) if isinstance(node, Node) and node.op == "get_attr" else None
        if shape_reason or shared_reason:
            return None, "; ".join(r for r in (shape_reason, shared_reason) if r)
    return Fold(x, [(node, how) for node, how, _ in parts]), ""
