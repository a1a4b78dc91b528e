"""torchao's ``convert_pt2e`` for a post-training graph, without its QAT conv-BatchNorm fold.

``convert_pt2e`` always runs ``_fold_conv_bn_qat`` when a BatchNorm is left in the graph: it
exports ~96 pattern graphs (every conv kind, bias, ReLU, train / eval) to look for QAT's fused
conv-BN fake quantization, 42 s on a Zen 3 EPYC for each convert. A post-training graph cannot
hold that pattern, yet keeps BatchNorms: those after a cat (DenseNet's) and those quantize_x86
keeps off a conv with other readers (``pt2e_flow._batch_norms_off_shared_convs``), and
quantize_x86 converts up to three times (``activation_ranges``). So the BatchNorm calls are
renamed for the convert (a plain function calling the same op) and named again after it.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

aten = torch.ops.aten
# what torchao's _is_bn_node recognizes (torchao/quantization/pt2e/utils.py)
BATCH_NORMS = (aten._native_batch_norm_legit_no_training.default, aten.batch_norm.default, aten._native_batch_norm_legit.default,
               aten.cudnn_batch_norm.default, aten.miopen_batch_norm.default)


def _batch_norm_during_convert(op, *args, **kwargs):
    """What a renamed BatchNorm node calls while convert_pt2e runs (its own op)."""
    return op(*args, **kwargs)


def convert(prepared: GraphModule, is_qat: bool = False) -> GraphModule:
    """``convert_pt2e(prepared)``; for a post-training graph (``is_qat`` False) its BatchNorm
    calls are out of sight of the QAT fold (module docstring), the same calls after it."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    if is_qat:
        return convert_pt2e(prepared)
    renamed = [node for node in prepared.graph.nodes if node.op == "call_function" and node.target in BATCH_NORMS]
    for node in renamed:
        node.target, node.args = _batch_norm_during_convert, (node.target, *node.args)
    try:
        converted = convert_pt2e(prepared)
    finally:
        _named_again(prepared)  # (whether convert_pt2e changed it in place or copied it)
    _named_again(converted)
    return converted


def _named_again(gm: GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _batch_norm_during_convert:
            node.target, node.args = node.args[0], node.args[1:]
    gm.recompile()  # (also where convert_pt2e's module shares the graph just named again)
