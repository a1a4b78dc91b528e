"""Emitters shared by every device: weights are prepacked here, once, at compile time."""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch
from torch.fx import Node

from qbackend.kernels import fast_qdq
from qbackend.ops import qconv_for_rank
from qbackend.patterns.attention import ScaledQueries, WindowedMask, combined
from qbackend.patterns.base import Match, PostOp, QuantizedValue, fake_value

from . import capabilities
from .base import EmitContext, Lowering
from .signed_int8 import NAN_AS, nan_as

aten = torch.ops.aten
NO_POST_OP = PostOp("none")


def static_shape(node: Node) -> Optional[list[int]]:
    """The activation shape the prepack may tune for; None when it is symbolic."""
    value = fake_value(node)
    if value is None or not all(isinstance(d, int) for d in value.shape):
        return None
    return list(value.shape)


def output_args(match: Match) -> tuple:
    """(output scale, output zero point, output dtype) for the onednn int8 ops."""
    q = match.output_quant
    return (q.scale, q.zero_point, q.dtype) if q is not None else (1.0, 0, match.float_dtype)


CLIP_PROBE = (0.0, 6.0)  # the kernels' acceptance of hardtanh does not depend on its bounds


def _takes_clip(ctx: EmitContext, match: Match) -> bool:
    """Whether this kernel (rank, binary or not, dtypes) accepts a hardtanh post-op."""
    binary = match.accum is not None or match.accum_float is not None
    if match.conv is not None:
        refusal = (capabilities.conv_binary_post_op_refusal(ctx.device, "hardtanh", CLIP_PROBE, "") if binary else
                   capabilities.conv_post_op_refusal(ctx.device, match.conv.spatial_rank, "hardtanh", CLIP_PROBE, ""))
    elif binary:
        refusal = capabilities.linear_binary_post_op_refusal(ctx.device, "hardtanh", CLIP_PROBE, "",
                                                             fake_value(match.accum_float).dtype, match.output_quant.dtype)
    else:
        refusal = capabilities.linear_post_op_refusal(ctx.device, "hardtanh", CLIP_PROBE, "")
    return refusal is None


def _reduced_range(match: Match) -> bool:
    q = match.output_quant
    return q is not None and (q.qmin, q.qmax) != fast_qdq.FULL_RANGE[q.dtype]


def kernel_post_op(ctx: EmitContext, match: Match) -> PostOp:
    """The unary post-op the kernel runs. The kernels clamp an int8 output to the dtype's full
    range only; for a reduced output range (reduce_range=True: [0, 127]) none / relu / hardtanh
    become one hardtanh that also clips at the range's float bounds, which quantize to exactly
    qmin / qmax (rounding of an in-range value is unchanged). Other post-ops, or a kernel
    refusing hardtanh, get a clamp after the call (``within_output_range``)."""
    post = match.post_op or NO_POST_OP
    if clamp_after(ctx.device, match) is not None:
        return NO_POST_OP
    if not _reduced_range(match) or post.name not in ("none", "relu", "hardtanh"):
        return post
    q = match.output_quant
    low, high = (q.qmin - q.zero_point) * q.scale, (q.qmax - q.zero_point) * q.scale
    if post.name == "relu":
        low = max(low, 0.0)
    elif post.name == "hardtanh":
        low, high = max(low, post.scalars[0]), min(high, post.scalars[1])
    if low > high or not _takes_clip(ctx, match):
        return post
    return PostOp("hardtanh", (low, high), "")


CLAMPING_TABLES = ("cpu",)  # whose limits accept such a post-op (lowering/cpu.py); XPU's refuse it


def clamp_after(device: str, match: Match) -> Optional[tuple[int, int]]:
    """Where the conv kernel refuses a relu / hardtanh (torch 2.13's CPU conv3d takes no post-op)
    but the output is quantized: the integers the post-op's bounds quantize to, as
    ``quantize_per_tensor`` rounds. The kernel then runs without it and its output is clamped to
    them: quantizing is monotone, so that gives the bytes of quantizing the clipped floats.
    None otherwise."""
    post, q = match.post_op, match.output_quant
    unary_conv = match.conv is not None and match.accum is None and match.accum_float is None
    if (device not in CLAMPING_TABLES or post is None or post.name not in ("relu", "hardtanh") or q is None or not unary_conv
            or capabilities.conv_post_op_refusal(device, match.conv.spatial_rank, post.name, post.scalars,
                                                 post.algorithm) is None):
        return None
    bounds = torch.tensor([0.0, float("inf")] if post.name == "relu" else list(post.scalars), dtype=torch.float32)
    low, high = torch.clamp(torch.round(bounds * (1.0 / q.scale)) + q.zero_point, q.qmin, q.qmax).tolist()
    return int(low), int(high)


def within_output_range(ctx: EmitContext, match: Match, kernel: Node, post: PostOp) -> Node:
    """The kernel's int8 output, clamped to a reduced output range unless ``post`` (from
    ``kernel_post_op``) already clips it, or to a refused post-op's bounds (``clamp_after``)."""
    bounds = clamp_after(ctx.device, match)
    if bounds is not None:
        ctx.notes.append(f"{match.post_op.name} as a clamp of the int8 output to {list(bounds)} (the kernel refuses it)")
    elif _reduced_range(match) and post == (match.post_op or NO_POST_OP):
        bounds = (match.output_quant.qmin, match.output_quant.qmax)
    if bounds is None or bounds == fast_qdq.FULL_RANGE[match.output_quant.dtype]:  # (the kernel clamps to that)
        return kernel
    ctx.kernel = kernel.target.name()
    return ctx.gm.graph.call_function(fast_qdq.clamp_to_range_, (kernel, *bounds))


def weight_constants(ctx: EmitContext, match: Match, packed: torch.Tensor, hint: str) -> tuple[Node, Node, Node]:
    return (
        ctx.constant(packed, hint),
        ctx.constant(match.weight.scales, f"{hint}_scale"),
        ctx.constant(match.weight.zero_points, f"{hint}_zp"),
    )


def _prepacked_conv_weight(ctx: EmitContext, match: Match):
    p, x = match.conv, match.x.qparams
    packed = ctx.call_now(
        "qconv_prepack", match.weight.int8, match.weight.scales, x.scale, x.zero_point,
        p.stride, p.padding, p.dilation, p.groups, static_shape(match.x.node),
    )
    return weight_constants(ctx, match, packed, "qconv_w")


def emit_qconv(ctx: EmitContext, match: Match) -> Node:
    p, x = match.conv, match.x.qparams
    w, w_scale, w_zp = _prepacked_conv_weight(ctx, match)
    post = kernel_post_op(ctx, match)
    return within_output_range(ctx, match, ctx.call(qconv_for_rank(p.spatial_rank), (
        match.x.node, x.scale, x.zero_point, w, w_scale, w_zp, match.bias,
        p.stride, p.padding, p.dilation, p.groups, *output_args(match),
        post.name, list(post.scalars), post.algorithm,
    )), post)


def _accumulator(ctx: EmitContext, match: Match) -> Node:
    """The buffer the in-place sum writes into: the residual itself when nobody else needs it,
    else a copy. The kernel wants it dense in channels-last order."""
    source = match.accum.node if match.accum is not None else match.accum_float
    if match.accum_clobber_safe:
        ctx.notes.append("residual updated in place")
        if source.op == "call_function" and source.target in (ctx.op("qconv").op, ctx.op("qconv_binary").op):
            return source  # a 4-D oneDNN conv output is already dense channels-last
        return ctx.gm.graph.call_function(aten.contiguous.default, (source,), {"memory_format": torch.channels_last})
    ctx.notes.append(f"residual copied: {match.accum_clobber_reason}")
    return ctx.gm.graph.call_function(aten.clone.default, (source,), {"memory_format": torch.channels_last})


def emit_qconv_add(ctx: EmitContext, match: Match) -> Node:
    p, x = match.conv, match.x.qparams
    w, w_scale, w_zp = _prepacked_conv_weight(ctx, match)
    accum = _accumulator(ctx, match)
    acc_q = match.accum.qparams if match.accum is not None else None
    unary = kernel_post_op(ctx, match)
    return within_output_range(ctx, match, ctx.call("qconv_binary", (
        match.x.node, x.scale, x.zero_point, w, w_scale, w_zp, accum, match.bias,
        p.stride, p.padding, p.dilation, p.groups, *output_args(match),
        acc_q.scale if acc_q else 1.0, acc_q.zero_point if acc_q else 0,
        "sum", 1.0, unary.name, list(unary.scalars), unary.algorithm,
    )), unary)


def _prepacked_linear_weight(ctx: EmitContext, match: Match):
    packed = ctx.call_now("qlinear_prepack", match.weight.int8, static_shape(match.x.node))
    if not packed.is_mkldnn:
        # XPU's prepack is a transposed view ([K, N] over the [N, K] weight) that its kernel
        # makes contiguous on every call: store it contiguous once (the same values).
        packed = packed.contiguous()
    return weight_constants(ctx, match, packed, "qlinear_w")


SIBLING = "qbackend_sibling"  # node meta on an emitted qlinear: (anchor name, QuantizedWeight, or None on a weight-only kernel)
ANCHOR = "qbackend_anchor"  # node meta on every emitted node: the anchor (report line) it lowers


def mark_sibling(node: Node, anchor: Node, weight) -> Node:
    """Let the sibling merge (sibling_linears.py) find this qlinear and the int8 weight it was
    packed from; the merge drops the mark, which keeps that weight alive."""
    node.meta[SIBLING] = (anchor.name, weight)
    return node


def emit_qlinear(ctx: EmitContext, match: Match, op: str = "qlinear") -> Node:
    x = match.x.qparams
    w, w_scale, w_zp = _prepacked_linear_weight(ctx, match)
    post = kernel_post_op(ctx, match)
    return within_output_range(ctx, match, mark_sibling(ctx.call(op, (
        match.x.node, x.scale, x.zero_point, w, w_scale, w_zp, match.bias, *output_args(match),
        post.name, list(post.scalars), post.algorithm,
    )), match.anchor, match.weight), post)


def emit_qlinear_2d(ctx: EmitContext, match: Match) -> Node:
    """For kernels that take 2-D input only (XPU): the leading dims are flattened into rows
    before the kernel and restored after it (the limits require a static input shape)."""
    shape = static_shape(match.x.node)
    if len(shape) == 2:
        return emit_qlinear(ctx, match)
    graph = ctx.gm.graph
    rows = record_fake_value(graph.call_function(aten.reshape.default, (match.x.node, [-1, shape[-1]])))
    out = emit_qlinear(ctx, dataclasses.replace(match, x=QuantizedValue(rows, match.x.qparams)))
    ctx.kernel = ctx.op("qlinear").op.name()
    return graph.call_function(aten.reshape.default, (out, [*shape[:-1], match.weight.int8.shape[0]]))


def emit_qlinear_add(ctx: EmitContext, match: Match, op: str = "qlinear_binary") -> Node:
    """'sum' writes into the float residual (no new buffer) when it is dead and dense, as the
    kernel requires; 'add' otherwise."""
    x = match.x.qparams
    residual = fake_value(match.accum_float)
    in_place = match.output_quant is None and match.accum_clobber_safe and residual.is_contiguous()
    ctx.notes.append("residual updated in place" if in_place else
                     "residual added out of place" + (f" ({match.accum_clobber_reason})" if match.accum_clobber_reason else ""))
    w, w_scale, w_zp = _prepacked_linear_weight(ctx, match)
    unary = kernel_post_op(ctx, match)
    # The kernel reads 'add''s residual as dense: a strided one (a transposed view; a graph input)
    # gave garbage rows (vit_b_16 at batch 8). A no-op when it is contiguous.
    residual = match.accum_float if in_place else record_fake_value(ctx.gm.graph.call_function(
        aten.contiguous.default, (match.accum_float,)))
    return within_output_range(ctx, match, ctx.call(op, (
        match.x.node, x.scale, x.zero_point, w, w_scale, w_zp, residual, match.bias, *output_args(match),
        1.0, 0, "sum" if in_place else "add", 1.0, unary.name, list(unary.scalars), unary.algorithm,
    )), unary)


def emit_qmaxpool2d(ctx: EmitContext, match: Match) -> Node:
    return ctx.call("qmaxpool2d", (match.x.node, *match.op_args))


def emit_qavgpool(ctx: EmitContext, match: Match) -> Node:
    """The graph's own pool op on a quantized-tensor copy of the int8 input (the ATen pools
    have int8 kernels only for quantized tensors), then back to a plain integer tensor."""
    x = match.x.qparams
    ctx.kernel = f"{match.anchor.target.name()} (quantized tensor)"
    quantized = ctx.call("to_quantized_tensor", (match.x.node, x.scale, x.zero_point))
    pooled = ctx.gm.graph.call_function(match.anchor.target, (quantized, *match.op_args))
    return ctx.call("int_repr", (pooled,))


def _attention_operands(match: Match, make: Callable, value: Callable) -> tuple:
    """The SDPA match's (q, k, v, mask, scale, is_causal) with the queries' per-head factor and
    Swin's windowed mask pair made by ``make(target, *args)``; ``value(node)`` its example value."""
    q, k, v, mask, scale, is_causal = match.op_args
    if isinstance(q, ScaledQueries):
        q = make(aten.mul.Tensor, q.queries, q.factor)
    if isinstance(mask, WindowedMask):
        queries, keys = value(q), value(k)
        mask = combined(mask, [*queries.shape[:-1], keys.shape[-2]], make)
    return q, k, v, mask, scale, is_causal


def attention_operands(graph, match: Match) -> tuple:
    """``_attention_operands`` as graph nodes, emitted at the graph's insertion point."""
    return _attention_operands(match, lambda target, *args: record_fake_value(graph.call_function(target, args)), fake_value)


def attention_operand_values(match: Match) -> Optional[tuple]:
    """``_attention_operands``' example values (None where one is unknown)."""
    value = lambda a: fake_value(a) if isinstance(a, Node) else a  # noqa: E731
    q, k, v = match.op_args[:3]
    if any(fake_value(n) is None for n in (q.queries if isinstance(q, ScaledQueries) else q, k, v)):
        return None
    q, k, v, mask, scale, is_causal = _attention_operands(match, lambda target, *args: target(*map(value, args)), value)
    return value(q), value(k), value(v), value(mask), scale, is_causal


def emit_sdpa(ctx: EmitContext, match: Match) -> Node:
    q, k, v, mask, scale, is_causal = attention_operands(ctx.gm.graph, match)
    grouped = fake_value(q).shape[1] != fake_value(k).shape[1]  # (grouped-query: fewer key / value heads)
    return ctx.gm.graph.call_function(ctx.op("sdpa").op, (q, k, v), {"attn_mask": mask, "scale": scale,
                                                                      **({"is_causal": True} if is_causal else {}),
                                                                      **({"enable_gqa": True} if grouped else {})})


def record_fake_value(node: Node) -> Node:
    """Give a node the emitter made the example value Dynamo records for the others (shape,
    dtype, strides): later rules read it, e.g. the prepack of the next conv reads its shape."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), fake_value)
    try:
        node.meta["example_value"] = node.target(*args, **kwargs)
    except Exception:  # an input without a recorded value: the node simply has none either
        pass
    return node


def additive_mask(graph, mask: Node) -> Node:
    """The float32 mask SDPA makes of a bool one (0 where True, -inf where False: ATen's own
    conversion), emitted at the graph's insertion point."""
    zeros = record_fake_value(graph.call_function(aten.zeros_like.default, (mask,), {"dtype": torch.float32}))
    hidden = record_fake_value(graph.call_function(aten.logical_not.default, (mask,)))
    return record_fake_value(graph.call_function(aten.masked_fill.Scalar, (zeros, hidden, float("-inf"))))


def emit_int8_cat(ctx: EmitContext, match: Match) -> Node:
    return ctx.call("cat", ([x.node for x in match.inputs], *match.op_args))


def emit_int8_views(ctx: EmitContext, match: Match) -> Node:
    """The chain's own view ops, re-applied to the int8 tensor: the dequantized input's, or
    the float source quantized first (the quantize hoisted above the chain)."""
    graph = ctx.gm.graph
    if match.float_source is None:
        value = match.x.node
    else:
        quant = match.result
        value = record_fake_value(graph.call_function(quant.target, (match.float_source, *quant.args[1:]), dict(quant.kwargs)))
        if NAN_AS in quant.meta:
            value.meta[NAN_AS] = quant.meta[NAN_AS]
        ctx.notes.append("quantize moved above the views")
    for op in match.op_args:
        value = record_fake_value(graph.call_function(op.target, (value, *op.args[1:]), dict(op.kwargs)))
    return value


def emit_smooth_quantize(ctx: EmitContext, match: Match) -> Node:
    q = match.output_quant
    return ctx.gm.graph.call_function(fast_qdq.scale_quantize_per_tensor, (
        match.float_source, match.op_args[0], q.scale, q.zero_point, q.qmin, q.qmax, q.dtype), nan_as(match.result))


def emit_layer_norm_quantize(ctx: EmitContext, match: Match) -> Node:
    """LayerNorm, then the one-pass quantize; where other ops read the normed rows too, the
    graph's LayerNorm stays for them and only its quantize changes."""
    q, norm = match.output_quant, match.anchor
    qparams = (q.scale, q.zero_point, q.qmin, q.qmax, q.dtype)
    if len(norm.users) > 1:
        return ctx.gm.graph.call_function(fast_qdq.quantize_per_tensor, (norm, *qparams), nan_as(match.result))
    return ctx.gm.graph.call_function(fast_qdq.layer_norm_quantize_per_tensor, (match.float_source, *match.op_args, *qparams),
                                      nan_as(match.result))


COMMON: dict[str, Lowering] = {
    "qconv": Lowering(emit_qconv, ("qconv", "qconv_prepack"), needs_for=lambda match: (qconv_for_rank(match.conv.spatial_rank),)),
    "qconv_add": Lowering(emit_qconv_add, ("qconv_binary", "qconv_prepack")),
    "qlinear": Lowering(emit_qlinear, ("qlinear", "qlinear_prepack")),
    "qlinear_add": Lowering(emit_qlinear_add, ("qlinear_binary", "qlinear_prepack")),
    "qlinear_dynamic": Lowering(functools.partial(emit_qlinear, op="qlinear_tensor"), ("qlinear_tensor", "qlinear_prepack")),
    "qlinear_add_dynamic": Lowering(functools.partial(emit_qlinear_add, op="qlinear_binary_tensor"),
                                    ("qlinear_binary_tensor", "qlinear_prepack")),
    "qmaxpool2d": Lowering(emit_qmaxpool2d, ("qmaxpool2d",)),
    "qavgpool": Lowering(emit_qavgpool, ("to_quantized_tensor", "int_repr")),
    "qcat": Lowering(emit_int8_cat, ("cat",)),
    "qview": Lowering(emit_int8_views, ()),
    "sdpa": Lowering(emit_sdpa, ("sdpa",)),
    "sdpa_fused": Lowering(emit_sdpa, ("sdpa",)),
    "qsmooth": Lowering(emit_smooth_quantize, ()),
    "qscale": Lowering(emit_smooth_quantize, ()),
    "qlayernorm": Lowering(emit_layer_norm_quantize, ()),
}
