"""Quantized convolution: dq(x) -> conv{1,2,3}d -> [relu] -> [q]."""
from __future__ import annotations

import torch
from torch.fx import Node

from . import examples
from .base import ConvParams, GraphView, Match, NearMiss, Rule, per_dim, require
from .post_ops import unary_post_op
from .qdq import dequantized_activation, dequantized_weight, float_dtype, per_channel_bias, output_quantize, single_user

aten = torch.ops.aten

# ATen conv ops PT2E graphs contain -> spatial rank
CONV_OPS = {aten.conv1d.default: 1, aten.conv2d.default: 2, aten.conv3d.default: 3}
PADDING_STRING_CONV_OPS = {aten.conv1d.padding: 1, aten.conv2d.padding: 2, aten.conv3d.padding: 3}
TRANSPOSED_CONV_OPS = {aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input}
GENERIC_CONV_OPS = {aten.convolution.default, aten._convolution.default}
# Every op the report accounts for as "a conv" (torch-level names appear in non-PT2E graphs).
CONV_ANCHORS = (
    set(CONV_OPS) | set(PADDING_STRING_CONV_OPS) | TRANSPOSED_CONV_OPS | GENERIC_CONV_OPS
    | {torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d,
       torch.conv_transpose3d, torch.nn.functional.conv1d, torch.nn.functional.conv2d,
       torch.nn.functional.conv3d, torch.nn.functional.conv_transpose1d,
       torch.nn.functional.conv_transpose2d, torch.nn.functional.conv_transpose3d}
)


def conv_params(conv: Node) -> ConvParams:
    """Stride / padding / dilation / groups of an ATen conv node, or NoMatch with the reason."""
    require(conv.target not in TRANSPOSED_CONV_OPS, "transposed convolution (conv_transpose) is not a conv")
    if conv.target in GENERIC_CONV_OPS:
        transposed = conv.args[6] if len(conv.args) > 6 else conv.kwargs.get("transposed", False)
        require(not transposed, "transposed convolution (conv_transpose) is not a conv")
    require(
        conv.target in CONV_OPS or conv.target in PADDING_STRING_CONV_OPS,
        f"{getattr(conv.target, '__name__', conv.target)} is not an ATen conv1d/2d/3d call (not a PT2E graph)",
    )
    require(not conv.kwargs, f"conv arguments passed by keyword: {sorted(conv.kwargs)}")
    rank = CONV_OPS.get(conv.target) or PADDING_STRING_CONV_OPS[conv.target]
    defaults = [None, None, None, 1, 0, 1, 1]  # input, weight, bias, stride, padding, dilation, groups
    args = list(conv.args) + defaults[len(conv.args):]
    stride, padding, dilation, groups = args[3], args[4], args[5], args[6]
    if isinstance(padding, str):
        require(padding == "valid", f"padding={padding!r} (only explicit or 'valid' padding is lowered)")
        padding = 0
    return ConvParams(per_dim(stride, rank), per_dim(padding, rank), per_dim(dilation, rank), int(groups), rank)


def conv_core(graph: GraphView, conv: Node):
    """What every quantized-conv rule needs: params, int8 input, int8 weight, bias."""
    params = conv_params(conv)
    x = dequantized_activation(conv.args[0])
    weight = dequantized_weight(graph, conv.args[1])
    require(weight.int8.dim() == params.spatial_rank + 2, "weight rank does not match the conv rank")
    bias = per_channel_bias(graph, conv.args[2] if len(conv.args) > 2 else None, weight.int8.shape[0])
    return params, x, weight, bias


def fold_tail(node: Node):
    """[unary post-op] -> [q] after ``node``: (tail nodes, post-op or None, output QParams or None)."""
    tail, post_op = [], None
    folded = unary_post_op(single_user(node), node)
    if folded is not None:
        tail.append(folded[0])
        post_op = folded[1]
    quant = output_quantize(tail[-1] if tail else node)
    if quant is not None:
        tail.append(quant[0])
    return tail, post_op, quant[1] if quant else None


def select_qconv(graph: GraphView, conv: Node) -> Match:
    params, x, weight, bias = conv_core(graph, conv)
    tail, post_op, out_q = fold_tail(conv)
    return Match(None, conv, (conv, *tail), x, weight, bias, conv=params, post_op=post_op,
                 output_quant=out_q, float_dtype=float_dtype(conv), body_end=conv)


# --- example and near misses (tests and docs build them) --------------------------------------

QCONV = Rule(
    name="qconv",
    anchors="conv",
    pattern="dq(x) -> conv{1,2,3}d(dq_per_channel(w_int8), bias) -> [relu] -> [q]",
    doc="dequant + conv + post-op + quant => onednn qconv (int8 or float out, weight prepacked once)",
    select_fn=select_qconv,
    priority=0,
    example=examples.conv_relu,
    near_misses=(
        NearMiss(examples.conv_transpose, "transposed convolution"),
        NearMiss(examples.conv_per_tensor_weight, "weight is quantized per tensor"),
        NearMiss(examples.conv_asymmetric_weight, "asymmetric weight"),
        NearMiss(examples.conv_runtime_weight, "weight is not a constant"),
        NearMiss(examples.float_conv, "not produced by dequantize_per_tensor"),
    ),
)
