"""Float attention on CPU (the SDPA rule's match): qbackend's own kernel
(qbackend/kernels/csrc/attention_f32.c) where it takes the operands, else torch's fused
scaled-dot-product attention.

torch 2.13's CPU flash attention ran BERT-base's 128 x 128 heads (head dim 64) at ~25% of this
CPU's float32 FMA rate; the kernel here took 0.7-0.8x its time at batch 1 and 8
(benchmarks/bench_int8.py measures the encoder end to end).
"""
from __future__ import annotations

from typing import Optional

import torch

from qbackend.kernels import attention, registry
from qbackend.patterns.base import fake_value

from . import own_conv
from .base import EmitContext
from .common import additive_mask, attention_operand_values, attention_operands, record_fake_value

aten = torch.ops.aten


def _heads_batched(q, k, v, mask, make, value) -> tuple:
    """Operands of rank above 4 (MaxViT: [batch, grid, heads, length, dim]) with their leading
    dims as one batch dim, the mask to match: the kernel takes [batch, heads, length, dim]. As
    they are otherwise, or where a size is symbolic. ``make(target, *args)`` makes each step
    (a graph node, or a value); ``value`` gives an operand's example value."""
    queries = value(q)
    if queries.dim() <= 4 or not all(isinstance(n, int) for n in queries.shape):
        return q, k, v, mask
    flat = lambda t: make(aten.reshape.default, t, [-1, *value(t).shape[-3:]])  # noqa: E731
    if mask is not None and value(mask).dim() > 3:
        scores = value(mask)
        if all(n == 1 for n in scores.shape[:-3]):
            mask = make(aten.reshape.default, mask, list(scores.shape[-3:]))
        else:
            mask = flat(make(aten.expand.default, mask, [*queries.shape[:-3], *scores.shape[-3:]]))
    return flat(q), flat(k), flat(v), mask


def refusal(ctx: EmitContext, match) -> Optional[str]:
    """Why the kernel cannot run this attention (None if it can)."""
    reason = registry.available()
    if reason is not None:
        return reason
    values = attention_operand_values(match)
    if values is None or (match.op_args[3] is not None and values[3] is None):
        return "the operands have no example values (shapes unknown)"
    q, k, v, mask, _, is_causal = values
    q, k, v, mask = _heads_batched(q, k, v, mask, lambda target, *args: target(*args), lambda t: t)
    return attention.attention_refusal(q, k, v, mask, mask_dtypes=(torch.float32, torch.bool), is_causal=is_causal)


ADDITIVE = "qbackend_additive_mask"  # node meta of a bool mask: its additive form, once made


def _additive(ctx: EmitContext, mask):
    """The bool mask as an additive float32 one (True takes part, as in SDPA), made once for
    every attention reading it (BERT-style models pass a bool mask once a batch has padding:
    torch's fused attention then ran 4 ms a layer on all-MiniLM-L6-v2 at batch 8)."""
    made = mask.meta.get(ADDITIVE)
    if made is None or made.graph is not ctx.gm.graph or made._erased:  # (a copied node's meta names the old graph's)
        made = mask.meta[ADDITIVE] = additive_mask(ctx.gm.graph, mask)
    return made


def emit(ctx: EmitContext, match):
    q, k, v, mask, scale, is_causal = attention_operands(ctx.gm.graph, match)
    leading = fake_value(q).shape[:-3]
    q, k, v, mask = _heads_batched(q, k, v, mask, lambda target, *args: record_fake_value(ctx.gm.graph.call_function(target, args)),
                                   fake_value)
    if mask is not None and fake_value(mask).dtype == torch.bool:
        mask = _additive(ctx, mask)
        ctx.notes.append("bool mask as an additive one")
    ctx.kernel = f"{registry.NAMESPACE}::attention_f32.default"
    ctx.notes.append("qbackend's float32 attention kernel")
    if is_causal:
        ctx.notes.append("causal: each block of query rows reads the keys up to its last position")
    out = own_conv.call_kernel(ctx, "attention_f32", (q, k, v, mask, scale) + ((True,) if is_causal else ()))
    if len(leading) > 1:
        ctx.notes.append(f"its {len(leading)} leading dims as one batch dim")
        out = record_fake_value(ctx.gm.graph.call_function(aten.reshape.default, (out, [*leading, *fake_value(out).shape[-3:]])))
    return out


KERNEL = own_conv.OwnKernel("attention", lambda match: True, refusal, emit)
