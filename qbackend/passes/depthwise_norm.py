"""ConvNeXt's depthwise conv, the LayerNorm over its channels and the quantize after it, as
one kernel call.

The block's depthwise 7x7 writes float32 NCHW (channels-last), a permute shows it as NHWC and
``layer_norm_quantize`` reads it back to normalize each pixel's channels for the int8 linear.
The VNNI depthwise kernel can normalize each output row while its floats are still in a
thread's scratch row (``qconv_depthwise_layer_norm``, the same bytes): the float tensor is
never written and the second pass goes.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.patterns.base import constant_value, fake_value
from qbackend.patterns.qdq import single_user

from qbackend.kernels import depthwise, layer_norm_quantize

aten = torch.ops.aten
# qconv_depthwise's positional arguments: (x, x_zero_point, weight, mult, add, stride, padding,
# low, high, out_scale, out_zero_point, qmin, qmax, float_out, activation="none", window=3)
_FLOAT_OUT, _DEFAULTS = 13, ("none", 3)


def _fusable(gm: GraphModule, conv: Node) -> Optional[Node]:
    """The ``layer_norm_quantize`` that alone reads ``conv``'s float result through a permute to
    NHWC, where the fused kernel takes them; else None."""
    if conv.op != "call_function" or conv.target is not depthwise.qconv_depthwise or conv.kwargs \
            or len(conv.args) <= _FLOAT_OUT or conv.args[_FLOAT_OUT] is not True:
        return None
    permute = single_user(conv)
    if permute is None or permute.target is not aten.permute.default or list(permute.args[1:]) != [[0, 2, 3, 1]]:
        return None
    norm = single_user(permute)
    if norm is None or norm.target is not layer_norm_quantize.layer_norm_quantize or norm.args[0] is not permute or norm.kwargs:
        return None
    x, weight = fake_value(conv.args[0]), constant_value(gm, conv.args[2])
    norm_weight, norm_bias = (constant_value(gm, a) if isinstance(a, Node) else None for a in norm.args[1:3])
    if x is None or weight is None or depthwise.dwconv_layer_norm_refusal(x, weight, norm_weight, norm_bias, norm.args[3]):
        return None
    return norm


def depthwise_norms_fused(gm: GraphModule) -> Optional[str]:
    fused = 0
    for conv in list(gm.graph.nodes):
        norm = _fusable(gm, conv)
        if norm is None:
            continue
        conv_args = (*conv.args, *_DEFAULTS[len(conv.args) - _FLOAT_OUT - 1:])
        with gm.graph.inserting_before(norm):
            call = gm.graph.call_function(depthwise.qconv_depthwise_layer_norm,
                                          (*conv_args[:9], *conv_args[_FLOAT_OUT + 1:], *norm.args[1:]))
        call.meta = dict(norm.meta)
        permute = norm.args[0]
        norm.replace_all_uses_with(call)
        for node in (norm, permute, conv):
            gm.graph.erase_node(node)
        fused += 1
    return f"{fused} depthwise conv(s) normalize and quantize their own output (LayerNorm fused)" if fused else None
