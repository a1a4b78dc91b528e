"""Sibling linears: lowered qlinears that read the same int8 activation with the same output
arguments (a transformer's Q, K and V projections) run as one qlinear over their concatenated
weights; each sibling then reads its own columns as a view. The same holds for linears on
qbackend's own GEMM kernel (gemm.py): its per-channel constants concatenate as they are, and
the concatenated int8 weights are packed again (each member's packing pads its out_features to
a multiple of conv_gemm.GEMM_BLOCK).

Exact: every output column comes from its own weight row, scale and bias alone, so the merged
call gives bit for bit the columns of the separate calls (int32 accumulation; on CPUs without
VNNI each column's int16 pair limit was already checked on its own). Measured on this CPU: one
[64, 384] x [384, 1152] call 0.38 ms against 0.57 ms for three [384, 384] calls (MiniLM's
Q/K/V at batch 1), 2.25 against 2.50 ms for BERT-base's at seq 128.

Weight-only linears on qbackend's int16 kernels (a Llama block's Q / K / V and its gate / up
projections) merge the same way: their packed rows (int4 or int8 weights, scales, offsets)
concatenate as they are, and the activations are quantized once instead of once per sibling.

Inductor 2.13 merges only weight-only int8 / int4 linears this way, never static int8 ones.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch
from torch.fx import Node

from qbackend.kernels import registry
from qbackend.kernels.huge_pages import aligned_cat
from qbackend.patterns.base import constant_value, fake_value
from qbackend.patterns.inplace import schema_writes

from . import gemm, own_conv
from .base import EmitContext
from .common import SIBLING, record_fake_value, static_shape

aten = torch.ops.aten


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def _writes_into(user: Node, value: Node, binary_ops) -> bool:
    """Whether ``user`` may write into ``value`` or hand it out: a view of the merged output
    must never be updated in place (a binary kernel's ``sum`` wants a dense accumulator of its
    own), nor returned (the caller would get a strided view where it got a dense tensor)."""
    if user.target in binary_ops:
        return True
    if isinstance(user.target, torch._ops.OpOverload):
        return schema_writes(user, value)
    return user.op != "call_function" or getattr(user.target, "__name__", "").endswith("_")


def _bias(ctx: EmitContext, node, rows: int):
    """A sibling's bias as a tensor (zeros when it has none); None when it is not a constant."""
    return torch.zeros(rows) if node is None else constant_value(ctx.gm, node)


def _own_kernel_output(node: Node) -> Optional[Node]:
    """For an own-kernel linear (x -> [rows, in, 1, 1] -> kernel -> reshape): the final reshape."""
    users = list(node.users)
    return users[0] if len(users) == 1 and users[0].target is aten.reshape.default else None


def _weight_only_kernels() -> tuple:
    if registry.available() is not None:
        return ()
    return tuple(form for name in ("int4_mm_int16", "int8_mm_int16") for form in registry.own_kernel_forms(name))


def weight_only_input(node: Node) -> Node:
    """A weight-only kernel's activation rows: the linear's input, through its reshape to 2-D."""
    rows = node.args[0]
    return rows.args[0] if rows.target is aten.reshape.default else rows


def _group_key(node: Node, qlinear, own_kernels, weight_only) -> Optional[tuple]:
    """What siblings share (input and every argument but the weight's), or None for a node
    that is not a marked linear."""
    if SIBLING not in node.meta:
        return None
    if node.target in weight_only:  # (int4: weight, scale, offset, group size; int8: weight, scale)
        return (node.target, weight_only_input(node), *node.args[4:])
    if node.target is qlinear:
        x, x_scale, x_zp, _, _, _, _bias_node, *outputs = node.args
        return (qlinear, x, x_scale, x_zp, tuple(map(_hashable, outputs)))
    if node.target in own_kernels and node.args[4] is None and _own_kernel_output(node) is not None:
        pixels, _, _, _, *outputs = node.args
        return (node.target, pixels.args[0], tuple(map(_hashable, outputs)))
    return None


def _groups(ctx: EmitContext, weight_only: tuple) -> list[list[Node]]:
    qlinear = ctx.op("qlinear").op
    own_kernels = registry.own_kernel_forms("qconv") if registry.available() is None else ()
    binary_ops = {r.op for r in (ctx.op("qlinear_binary"), ctx.op("qconv_binary")) if r}
    groups = defaultdict(list)
    for node in ctx.gm.graph.nodes:
        key = _group_key(node, qlinear, own_kernels, weight_only)
        result = node if node.target is qlinear or node.target in weight_only else _own_kernel_output(node)
        if key is None or any(_writes_into(user, result, binary_ops) for user in result.users):
            continue
        groups[key].append(node)
    return [members for members in groups.values() if len(members) > 1]


def _slice_columns(graph, merged: Node, members: list[Node], outputs: list[Node], widths: list[int]) -> None:
    """Each member's output (``outputs``) replaced by its columns of ``merged``."""
    start, previous = 0, merged
    for member, output, n in zip(members, outputs, widths):
        with graph.inserting_after(previous):
            columns = record_fake_value(graph.call_function(aten.slice.Tensor, (merged, -1, start, start + n)))
        columns.meta.update({k: v for k, v in member.meta.items() if k not in ("example_value", "val", SIBLING)})
        output.replace_all_uses_with(columns)
        start, previous = start + n, columns


def _merge_own(ctx: EmitContext, members: list[Node]) -> bool:
    """One own-kernel call for ``members``: their int8 weights concatenated and packed (for the
    exact int16 build where any member's were), their multipliers and offsets concatenated; the
    first member's input rows."""
    graph, first = ctx.gm.graph, members[0]
    outputs = [_own_kernel_output(m) for m in members]
    weights = [m.meta[SIBLING][1].int8 for m in members]
    widths = [w.shape[0] for w in weights]
    exact16 = any(constant_value(ctx.gm, m.args[1]).dtype == torch.int16 for m in members)
    with graph.inserting_before(first):
        constants = [ctx.constant(gemm.pack(torch.cat(weights), exact16), "gemm_w")]
        constants += [ctx.constant(torch.cat([constant_value(ctx.gm, m.args[i]) for m in members]), hint)
                      for i, hint in ((2, "gemm_mult"), (3, "gemm_add"))]
        kernel = own_conv.call_kernel(ctx, "qconv", (first.args[0], *constants, *first.args[4:]))
    with graph.inserting_after(kernel):
        merged = record_fake_value(graph.call_function(aten.reshape.default, (kernel, [*outputs[0].args[1][:-1], sum(widths)])))
    _slice_columns(graph, merged, members, outputs, widths)
    for member, output in zip(members, outputs):
        pixels = member.args[0]
        graph.erase_node(output)
        graph.erase_node(member)
        if not pixels.users:
            graph.erase_node(pixels)
    return True


def _merge_weight_only(ctx: EmitContext, members: list[Node]) -> bool:
    """One weight-only kernel call for ``members``: their packed rows concatenated (every packed
    tensor is [out_features, ...]), reading the first member's activation rows."""
    graph, first = ctx.gm.graph, members[0]
    tensors = [i for i, a in enumerate(first.args) if i > 0 and isinstance(a, Node)]
    values = {i: [constant_value(ctx.gm, m.args[i]) for m in members] for i in tensors}
    if any(v is None for vs in values.values() for v in vs) or any(len({v.dtype for v in vs}) > 1 for vs in values.values()):
        return False  # (a cat would promote one's int4 offset codes to float offsets)
    widths = [v.shape[0] for v in values[1]]
    with graph.inserting_before(first):
        constants = {i: ctx.constant(aligned_cat(values[i]), f"merged_{i}") for i in tensors}  # (on 2 MB pages: streamed)
        merged = graph.call_function(first.target, tuple(constants.get(i, a) for i, a in enumerate(first.args)))
    outputs = [fake_value(m) for m in members]
    if all(v is not None for v in outputs):
        merged.meta["example_value"] = torch.cat(outputs, -1)
    _slice_columns(graph, merged, members, members, widths)
    for member in members:
        rows = member.args[0]
        graph.erase_node(member)
        if rows is not first.args[0] and not rows.users:
            graph.erase_node(rows)
    return True


def _merge(ctx: EmitContext, members: list[Node]) -> bool:
    """One qlinear for ``members`` (in graph order), if every bias is a constant."""
    graph, first = ctx.gm.graph, members[0]
    weights = [m.meta[SIBLING][1] for m in members]
    rows = [w.int8.shape[0] for w in weights]
    biases = [_bias(ctx, m.args[6], n) for m, n in zip(members, rows)]
    if any(b is None for b in biases) or len({b.dtype for b in biases}) > 1:
        return False
    int8 = torch.cat([w.int8 for w in weights])
    packed = ctx.call_now("qlinear_prepack", int8, static_shape(first.args[0]))
    with graph.inserting_before(first):
        constants = [ctx.constant(packed, "qlinear_w"),
                     ctx.constant(torch.cat([w.scales for w in weights]), "qlinear_w_scale"),
                     ctx.constant(torch.cat([w.zero_points for w in weights]), "qlinear_w_zp")]
        bias = None if all(m.args[6] is None for m in members) else ctx.constant(torch.cat(biases), "qlinear_bias")
        x, x_scale, x_zp = first.args[:3]
        merged = graph.call_function(first.target, (x, x_scale, x_zp, *constants, bias, *first.args[7:]))
    values = [fake_value(m) for m in members]
    if all(v is not None for v in values):  # (the kernel's meta function cannot read a new constant)
        merged.meta["example_value"] = torch.cat(values, -1)
    _slice_columns(graph, merged, members, members, rows)
    for member in members:
        graph.erase_node(member)
    return True


def merge_sibling_linears(ctx: EmitContext, report) -> None:
    by_name = {d.node: d for d in report.decisions}
    qlinear, weight_only = ctx.op("qlinear").op, _weight_only_kernels()
    for members in _groups(ctx, weight_only):
        anchors = [m.meta[SIBLING][0] for m in members]
        target = members[0].target
        merge = _merge if target is qlinear else _merge_weight_only if target in weight_only else _merge_own
        if not merge(ctx, members):
            continue
        for name in anchors:
            note = f"one call with {', '.join(a for a in anchors if a != name)} (same input, weights concatenated)"
            decision = by_name[name]
            decision.reason = "; ".join(filter(None, (decision.reason, note)))
