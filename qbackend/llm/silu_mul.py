"""SwiGLU's gate, ``silu(gate) * up``, in one pass (csrc/silu_mul.c).

Llama's MLP (Mistral's, Qwen2's the same) computes ``act_fn(gate_proj(x)) * up_proj(x)``; with
gate and up merged into one weight-only call, both operands are slices of its output. The graph's
two ops read and write the intermediate twice (a 512-token prompt: 4 x 11.5 MB per layer); the
kernel reads the slices in place and writes the product once. ``silu_muls_fused`` rewrites
each ``silu(a) * b`` of two float32 tensors of one shape.
"""
from __future__ import annotations

from typing import Optional

from torch.fx import GraphModule, Node

from qbackend.kernels.silu_mul import kernel, silu_mul
from qbackend.passes.float_ops import both_orders, calls_in_place_of, float32, is_op, operands, single_user
from qbackend.patterns.base import fake_value


def _gated(node: Node) -> Optional[tuple[Node, Node]]:
    """(a, b) when ``node`` is ``silu(a) * b`` (either order) of float32 tensors of one shape."""
    for gate, up in both_orders(operands(node, "mul")):
        if is_op(gate, "silu") and single_user(gate) and len(gate.args) == 1 and not gate.kwargs.get("inplace", False) \
                and float32(gate.args[0]) and float32(up) and fake_value(gate.args[0]).shape == fake_value(up).shape:
            return gate.args[0], up
    return None


def silu_muls_fused(gm: GraphModule) -> Optional[str]:
    """Rewrite each ``silu(a) * b`` (see the module docstring) into one call."""
    return None if kernel() is None else calls_in_place_of(gm, _gated, silu_mul, "SiLU-and-multiply(s)")
