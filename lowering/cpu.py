"""CPU (x86, oneDNN): the common emitters plus CPU kernel limits."""
from __future__ import annotations

import dataclasses

import torch

from qbackend.patterns.base import fake_value

from .capabilities import (INT16_MAX, conv_binary_post_op_refusal, conv_post_op_refusal, grouped_conv_inexact, int8_pairs_saturate,
                           linear_binary_post_op_refusal, linear_post_op_refusal, quantized_tensor_pool_refusal)
from . import add_quantize, attention, choice, depthwise, gemm, grouped, layer_norm, pools, scale, stem
from .base import Lowering
from .common import (COMMON, NO_POST_OP, clamp_after, emit_qavgpool, emit_qconv, emit_qconv_add, emit_qlinear, emit_qlinear_add,
                     emit_qmaxpool2d, emit_sdpa, output_args)
from .layer_scale import fold_layer_scale
from .signed_int8 import signed_activations_as_unsigned
from .weight_only import emit_weight_only, limits_for


def _uint8_activations(match):
    # The CPU int8 conv/linear kernels read unsigned activations only (signed int8 raises
    # "Input tensor should have uint8 ... data type"). PREPARE turns signed activations into
    # unsigned ones wherever only dequantizes read them; this catches the rest.
    if match.x.qparams.dtype != torch.uint8:
        return (f"CPU int8 kernels take uint8 activations, this one is {match.x.qparams.dtype}"
                " (and not convertible: something other than a dequantize reads the signed tensor)")
    return None


def _post_op(match):
    post = match.post_op or NO_POST_OP
    binary = match.accum is not None or match.accum_float is not None
    if match.conv is not None and binary:
        return conv_binary_post_op_refusal("cpu", post.name, post.scalars, post.algorithm)
    if match.conv is not None:
        return None if clamp_after("cpu", match) else conv_post_op_refusal("cpu", match.conv.spatial_rank, post.name,
                                                                           post.scalars, post.algorithm)
    if binary:
        return linear_binary_post_op_refusal("cpu", post.name, post.scalars, post.algorithm,
                                             fake_value(match.accum_float).dtype, output_args(match)[2])
    return linear_post_op_refusal("cpu", post.name, post.scalars, post.algorithm)


def _largest_pair_sum(weight: torch.Tensor) -> int:
    """A bound on what oneDNN's kernel adds in int16 per unit of uint8 activation (``gemm.
    largest_pair_sums``: a pair of one sign adds up, of opposite signs never passes its larger
    member): with whole groups of 4 input channels, over the adjacent pairs it adds (input
    channels 2j, 2j + 1 at one kernel position, as the GEMM: measured on Zen 3's convs and
    linears, 1x1 / 3x3, 32-3072 inputs: exact with every such pair within 128 and a larger other
    pair, or opposite signs up to 254); else over any two input channels meeting the same output
    (channel and kernel position): its two largest positive or two largest negative weights."""
    if gemm.pairs_of_whole_words(weight.shape):
        return gemm.largest_adjacent_pair_sum(weight)
    ints = weight.to(torch.int32)
    if ints.shape[1] == 1:  # one input channel per group (depthwise): no pairs
        return int(ints.abs().amax())

    def two_largest(values):
        return values.clamp(min=0).topk(2, dim=1).values.sum(dim=1)
    return int(torch.maximum(two_largest(ints), two_largest(-ints)).amax())


def _int16_pairs_overflow(match):
    # Without VNNI, oneDNN adds pairs of uint8 x int8 products in int16 and saturates: full
    # 8-bit activations times full-range weights come out wrong (measured: off by 18445 on a
    # random 64-wide dot). No pair can overflow with 7-bit weights (255 x 128) or 7-bit
    # activations (127 x 256): both <= 32767.
    if match.weight is None or not int8_pairs_saturate("cpu", "conv" if match.conv is not None else "linear"):
        return None
    bound = match.x.qparams.qmax * _largest_pair_sum(match.weight.int8)
    if bound <= INT16_MAX:
        return None
    return f"this CPU's oneDNN int8 kernel adds pairs of products in int16 (no VNNI) and this layer's can reach {bound} > {INT16_MAX}"


def _inexact_groups(match):
    # oneDNN's grouped conv misses the exact sums at some group widths on some CPUs (probed)
    p, w = match.conv, match.weight
    if p is None or w is None or not 1 < p.groups < w.int8.shape[0]:
        return None
    per_group = w.int8.shape[0] // p.groups
    if not grouped_conv_inexact("cpu", per_group):
        return None
    return f"this CPU's oneDNN grouped int8 conv misses the exact sums at {per_group} channels a group (probed)"


def _exact_int8_products(match):
    """Why a match stays float where no own kernel runs it exactly (_conv_linear_row), or None."""
    overflow = _int16_pairs_overflow(match)
    if overflow:
        return (f"{overflow}: kept so its result stays exact; quantize with weights whose pairs fit "
                "(qbackend.pt2e_flow.quantize_x86's default on such a CPU, reduce_range='pairs'), 7-bit "
                "weights ([-64, 63]) or 7-bit activations to lower it")
    inexact = _inexact_groups(match)
    return inexact and f"{inexact}: kept so its result stays exact"


def _limits(match):
    return _uint8_activations(match) or _exact_int8_products(match) or _post_op(match)


# The rows that run an int8 kernel; the data-movement rows (cat, views) run plain ATen ops.
KERNEL_ROWS = ("qconv", "qconv_add", "qlinear", "qlinear_add", "qlinear_dynamic", "qlinear_add_dynamic", "qmaxpool2d")
TABLE = {**COMMON, **{name: dataclasses.replace(COMMON[name], limits=_limits) for name in KERNEL_ROWS}}


def _own_kernel_or(onednn_emit, *kernels, fallback="oneDNN"):
    """An emitter that runs the first of qbackend's own kernels (own_conv.OwnKernel) that
    takes the match, else ``fallback`` (oneDNN), saying in the report why each that applies did not."""
    def emit(ctx, match):
        for kernel in kernels:
            if not kernel.applies(match):
                continue
            reason = kernel.refusal(ctx, match)
            if reason is None:
                return kernel.emit(ctx, match) if kernel.prior is None else choice.choose(ctx, match, kernel, onednn_emit, fallback)
            ctx.notes.append(f"{fallback}, not qbackend's {kernel.name} kernel: {reason}")
        return onednn_emit(ctx, match)
    return emit


def _conv_linear_row(row: str, onednn_emit, *kernels) -> Lowering:
    """A conv / linear row: ``_own_kernel_or``, and a match oneDNN cannot run (its post-op: GELU
    after a conv, MaxViT; its int16 pair sums, which saturate: 8-bit weights on a CPU without
    VNNI; a grouped conv whose sums it misses, probed) runs on the first own kernel that takes
    it, unmeasured."""
    def taker(ctx, match):
        return next((k for k in kernels if k.applies(match) and k.refusal(ctx, match) is None), None)

    def onednn_refusal(match):
        post_op = _post_op(match)
        return f"oneDNN refuses the post-op: {post_op}" if post_op else _int16_pairs_overflow(match) or _inexact_groups(match)

    def runs_anyway(ctx, match) -> bool:
        return onednn_refusal(match) is not None and not _uint8_activations(match) and taker(ctx, match) is not None

    either = _own_kernel_or(onednn_emit, *kernels)

    def emit(ctx, match):
        refused = onednn_refusal(match)
        if refused is None:
            return either(ctx, match)
        kernel = taker(ctx, match)  # (lower.py emits such a match only where runs_anyway found one)
        ctx.notes.append(f"qbackend's {kernel.name} kernel, not oneDNN: {refused}")
        return kernel.emit(ctx, match)

    return dataclasses.replace(TABLE[row], emit=emit, runs_anyway=runs_anyway)


TABLE["qconv"] = _conv_linear_row("qconv", emit_qconv, depthwise.KERNEL, stem.KERNEL, grouped.KERNEL, gemm.CONV_KERNEL)
TABLE["qconv_add"] = _conv_linear_row("qconv_add", emit_qconv_add, gemm.CONV_KERNEL)
TABLE["qlinear"] = _conv_linear_row("qlinear", emit_qlinear, gemm.LINEAR_KERNEL)
TABLE["qlinear_add"] = _conv_linear_row("qlinear_add", emit_qlinear_add, gemm.LINEAR_KERNEL)
TABLE["qmaxpool2d"] = dataclasses.replace(TABLE["qmaxpool2d"], emit=_own_kernel_or(emit_qmaxpool2d, pools.MAX_POOL,
                                                                                  fallback="quantized::max_pool2d"))
_ATTENTION = _own_kernel_or(emit_sdpa, attention.KERNEL, fallback="torch's fused attention")
TABLE["sdpa"] = dataclasses.replace(TABLE["sdpa"], emit=_ATTENTION)
TABLE["sdpa_fused"] = dataclasses.replace(TABLE["sdpa_fused"], emit=_ATTENTION)
TABLE["qavgpool"] = dataclasses.replace(
    COMMON["qavgpool"], limits=lambda match: _uint8_activations(match) or quantized_tensor_pool_refusal("cpu"),
    emit=_own_kernel_or(emit_qavgpool, pools.GLOBAL_AVERAGE_POOL, pools.AVERAGE_POOL, fallback="torch's quantized-tensor pool"))
TABLE["qscale"] = dataclasses.replace(COMMON["qscale"], emit=_own_kernel_or(COMMON["qscale"].emit, scale.KERNEL,
                                                                         fallback="the graph's multiply, then quantize"))
TABLE["qlayernorm"] = dataclasses.replace(COMMON["qlayernorm"], emit=_own_kernel_or(
    COMMON["qlayernorm"].emit, layer_norm.KERNEL, fallback="ATen's LayerNorm, then quantize"))
TABLE["qadd"] = Lowering(add_quantize.emit, (), limits=add_quantize.limits)
TABLE["int4_weight_linear"] = Lowering(emit_weight_only, ("int4_pack", "int4_mm"), limits_for("cpu"))
TABLE["int8_weight_linear"] = Lowering(emit_weight_only, ("int8_weight_only_mm",), limits_for("cpu"))

# Graph rewrites run before the rules (each returns a report note or None).
PREPARE = (signed_activations_as_unsigned, fold_layer_scale)
