"""Int8 concatenation: cat(dq(x1), dq(x2), ...) -> q, all with the same qparams => cat on the
int8 tensors.

Concatenation only moves elements, so when every input and the output share one scale / zero
point the int8 result is exactly the reference's (q(dq(x)) == x), with a quarter of the bytes
moved and no float temporaries. X86InductorQuantizer makes every cat input share the first
input's qparams, so this is the case PT2E graphs hold.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from . import examples
from .base import GraphView, Match, NearMiss, Rule, require
from .qdq import dequantized_activation, quantized_output, same_qparams

aten = torch.ops.aten
CAT_OPS = {aten.cat.default}
CAT_ANCHORS = CAT_OPS | {torch.cat, torch.concat, torch.concatenate}


def select_qcat(graph: GraphView, cat: Node) -> Match:
    require(cat.target in CAT_OPS, "cat is not an ATen cat call (not a PT2E graph)")
    require(not cat.kwargs, f"cat arguments passed by keyword: {sorted(cat.kwargs)}")
    tensors = cat.args[0]
    require(isinstance(tensors, (list, tuple)) and tensors, "cat has no list of tensors")
    inputs = tuple(dequantized_activation(t, f"cat input {i}") for i, t in enumerate(tensors))
    qparams = inputs[0].qparams
    differing = [i for i, x in enumerate(inputs) if x.qparams != qparams]
    require(not differing, f"cat inputs {differing} have other qparams than input 0 (a requantize, not a pure int8 cat)")
    quant = quantized_output(cat, "cat")
    same_qparams(quant[1], qparams, "cat")
    dim = cat.args[1] if len(cat.args) > 1 else 0
    return Match(None, cat, (cat, quant[0]), inputs[0], inputs=inputs, op_args=(dim,), output_quant=quant[1])


QCAT = Rule(
    name="qcat",
    anchors="cat",
    pattern="cat([dq(x1), dq(x2), ...]) -> q, every scale / zero point equal",
    doc="dequant each input + cat + quant => cat on the int8 tensors (exact)",
    select_fn=select_qcat,
    priority=0,
    example=examples.two_branch_cat,
    near_misses=(
        NearMiss(examples.cat_mixed_qparams, "have other qparams than input 0"),
        NearMiss(examples.cat_requantize, "output qparams differ"),
    ),
)
