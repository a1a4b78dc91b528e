"""A prompt's Llama MLP, ``down(silu(gate(x)) * up(x))``, as one call over dense slices.

Where qbackend/llm/dense_weight_only.py runs the merged gate / up linear and the down linear as
dense bf16 matmuls (a prompt's many rows), the unfused graph copied each slice's bf16 product
into a float32 output, read it back for the SiLU-and-multiply, wrote that as float32 and
converted it to bf16 for the down matmul: ~3.5 ms of a 512-row layer of a Llama with 2048 ->
5632 (Zen 4, 2 threads), next to ~80 ms of matmul. Here each written-out slice holds matching
gate and up rows, and its bf16 product goes through the bf16 SiLU-and-multiply
(csrc/silu_mul.c) straight into the down matmul's bf16 input: the same bits (that product is
rounded to bf16 where the down matmul's input conversion rounded it before), without those
passes. ``swiglus_fused`` rewrites the MLPs ``dense_slices_pass`` left dense.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.passes.dead_code import eliminate_dead_code
from qbackend.llm.dense_weight_only import dense_slices, in_features, kernel_or_dense, slice_rows, written_out
from qbackend.kernels.weight_only_linear import unflatten_rows
from qbackend.patterns.base import constant_value
from qbackend.kernels.silu_mul import silu_mul, silu_mul_bf16_into

aten = torch.ops.aten


def _dense_bf16(x: torch.Tensor, gate_up: tuple) -> torch.Tensor:
    """silu(gate(x)) * up(x) as bf16 [M, N]: slices of matching gate and up rows multiplied
    densely, each product through the bf16 SiLU-and-multiply."""
    _, _, _, bits, *args = gate_up
    merged = args[0].shape[0]
    k = x.shape[1]
    if x.dim() != 2 or x.dtype != torch.float32 or merged % 2 or k != in_features(bits, args):
        raise ValueError(f"qbackend dense SwiGLU: float32 activations [M, K] for a merged gate / up weight of an even row "
                         f"count and K columns, got {x.dtype} {tuple(x.shape)} for {merged} rows")
    n = merged // 2
    half = max(16, slice_rows(x.shape[0], k, torch.bfloat16) // 2 // 16 * 16)
    x_bf16, out = x.to(torch.bfloat16), torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    both = torch.empty(2 * min(half, n), k, dtype=torch.bfloat16)
    for start in range(0, n, half):
        rows = min(half, n - start)
        part = both[:2 * rows]
        written_out(bits, args, start, part[:rows])
        written_out(bits, args, n + start, part[rows:])
        product = torch.mm(x_bf16, part.t())
        silu_mul_bf16_into(product[:, :rows], product[:, rows:], out[:, start:start + rows])
    return out


def swiglu(x: torch.Tensor, gate_up: tuple, down: tuple) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` for x [M, K] float32; ``gate_up`` / ``down``: each
    linear's ``kernel_or_dense`` arguments after x (from how many rows on the bf16 kernel, from
    how many dense, the dense dtype, bits, the weight), the merged weight's first half gate's
    rows, its second up's."""
    (_, gate_up_from, gate_up_dtype, *_), (_, down_from, down_dtype, down_bits, *down_args) = gate_up, down
    if gate_up_dtype == down_dtype == torch.bfloat16 and x.shape[0] >= max(gate_up_from, down_from):
        return dense_slices(_dense_bf16(x, gate_up), down_bits, torch.bfloat16, *down_args)
    y = kernel_or_dense(x, *gate_up)
    n = y.shape[1] // 2
    return kernel_or_dense(silu_mul(y[:, :n], y[:, n:]), *down)


def _is_reshape(node) -> bool:
    return isinstance(node, Node) and ((node.op == "call_function" and node.target in (aten.reshape.default, aten.view.default))
                                       or (node.op == "call_method" and node.target in ("reshape", "view")))


def _half(node, merged: Node, first: bool) -> Optional[Node]:
    """The ``like`` of ``unflatten_rows(merged[..., half], like)``: the first or second half of
    ``merged``'s columns, read there only; else None."""
    if not (isinstance(node, Node) and node.target is unflatten_rows and len(node.users) == 1):
        return None
    part, like = node.args
    if not (isinstance(part, Node) and part.target is aten.slice.Tensor and part.args[0] is merged and len(part.users) == 1):
        return None
    weight = constant_value(merged.graph.owning_module, merged.args[5])
    n = None if weight is None else weight.shape[0] // 2
    dim, start, end = (tuple(part.args[1:]) + (None, None, None))[:3]
    return like if dim in (1, -1) and (start, end) == ((0, n) if first else (n, 2 * n)) and n else None


def _mlp(down: Node) -> Optional[tuple[Node, Node, Node]]:
    """(the merged gate / up call, the SiLU-and-multiply, its rows' ``like``) where ``down`` is
    the dense down linear of ``silu(gate) * up`` of the halves of one dense merged call."""
    if down.op != "call_function" or down.target is not kernel_or_dense or not _is_reshape(down.args[0]):
        return None
    gated = down.args[0].args[0]
    if not (isinstance(gated, Node) and gated.target is silu_mul and len(gated.args) == 2):
        return None
    merged = gated.args[0]
    for _ in range(2):  # (through the gate half's unflatten_rows and slice)
        merged = merged.args[0] if isinstance(merged, Node) and merged.args else None
    if not (isinstance(merged, Node) and merged.target is kernel_or_dense and len(merged.users) == 2):
        return None
    like = _half(gated.args[0], merged, True)
    if like is None or _half(gated.args[1], merged, False) is not like:
        return None
    others = [user for user in gated.users if user is not down.args[0]]
    if not all(user.target is unflatten_rows and user.args[1] is gated and user.args[0] is not gated for user in others):
        return None  # (read elsewhere: kept)
    return merged, gated, like


def swiglus_fused(gm: GraphModule) -> Optional[str]:
    """Each dense merged gate / up linear, SiLU-and-multiply and dense down linear (see the
    module docstring) becomes one ``swiglu`` call; the report's note, or None."""
    fused = 0
    for down in list(gm.graph.nodes):
        found = _mlp(down)
        if found is None:
            continue
        merged, gated, like = found
        with gm.graph.inserting_before(down):
            call = gm.graph.call_function(swiglu, (merged.args[0], tuple(merged.args[1:]), tuple(down.args[1:])))
        call.meta = dict(down.meta)
        down.replace_all_uses_with(call)
        for user in list(gated.users):  # (an output's leading dims, read from the gate's input now)
            if user.target is unflatten_rows:
                user.replace_input_with(gated, like)
        fused += 1
    if not fused:
        return None
    eliminate_dead_code(gm)
    return (f"{fused} SwiGLU MLP(s) with dense gate / up and down linears run as one call, the SiLU-and-multiply on "
            "each bf16 slice of the gate / up product")
