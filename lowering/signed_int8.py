"""Signed int8 activations for kernels that read uint8 only (the CPU int8 conv / linear).

XPUInductorQuantizer quantizes activations to int8 [-128, 127]; the CPU kernels refuse them.
The rewrite is exact: for any float x,

    clamp(round(x / s) + z, -128, 127) + 128 == clamp(round(x / s) + z + 128, 0, 255)

and both dequantize to the same value ((q - z) * s). A NaN is the exception: the reference's
integer conversion stores it as 0 (128 once shifted), where a uint8 quantize stores 0; the
rewritten quantize carries ``NAN_AS`` in its meta, which fast_qdq's quantizes take (cleanup.py,
common.py). So a signed quantize whose every reader
is a dequantize with the same qparams becomes an unsigned quantize with zero point z + 128,
its dequantizes likewise, and every rule that takes uint8 then applies. A signed tensor that
anything else reads (a graph output, an op that is not a dequantize) stays signed.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.patterns.base import fake_value
from qbackend.patterns.qdq import FULL_RANGE, is_op

SHIFT = 128
NAN_AS = "qbackend_nan_as"  # node meta: the integer a NaN quantizes to, where not the reference's 0


def nan_as(quantize: Node) -> dict:
    """The keyword fast_qdq's quantizes take for ``quantize``'s NaN (none: the reference's 0)."""
    return {"nan_as": quantize.meta[NAN_AS]} if NAN_AS in quantize.meta else {}


def _signed_qparams(node: Node) -> Optional[tuple]:
    """(scale, zero point) of a static per-tensor int8 quantize / dequantize over the full range."""
    _, scale, zero_point, qmin, qmax, dtype = node.args[:6]
    if dtype is not torch.int8 or (qmin, qmax) != FULL_RANGE[torch.int8]:
        return None
    if not isinstance(scale, float) or not isinstance(zero_point, int):
        return None
    return scale, zero_point


def _as_unsigned(node: Node) -> None:
    value, scale, zero_point = node.args[:3]
    node.args = (value, scale, zero_point + SHIFT, *FULL_RANGE[torch.uint8], torch.uint8, *node.args[6:])


def _retype(node: Node) -> None:
    """The recorded example value of a quantize, now uint8 (later rules read its dtype)."""
    value = fake_value(node)
    if value is not None and value.dtype is torch.int8:
        node.meta["example_value"] = value.to(torch.uint8)


def signed_activations_as_unsigned(gm: GraphModule) -> Optional[str]:
    """Rewrite every convertible signed quantize -> dequantize group; a report note, or None."""
    converted = 0
    for node in gm.graph.nodes:
        if not is_op(node, "quantize_per_tensor") or _signed_qparams(node) is None:
            continue
        readers = list(node.users)
        if not readers or not all(is_op(r, "dequantize_per_tensor") and r.args[0] is node
                                  and tuple(r.args[1:6]) == tuple(node.args[1:6]) for r in readers):
            continue
        _as_unsigned(node)
        node.meta[NAN_AS] = SHIFT
        _retype(node)
        for reader in readers:
            _as_unsigned(reader)
        converted += 1
    if not converted:
        return None
    return (f"signed int8 activations: {converted} quantize(s) run as uint8 with zero point + {SHIFT} "
            "(exact; the kernels here read uint8)")
