"""Depthwise 3x3, 5x5 and 7x7 int8 convs on CPU: qbackend's own kernels
(qbackend/kernels/csrc/depthwise_conv_int8.c, AVX2; depthwise_conv_int8_vnni.c, AVX512-VNNI).

torch 2.13's onednn::qconv_pointwise cost ~50 us per call before any compute and ran
depthwise 3x3 convs at 3-11 GMAC/s on an AVX2 EPYC: 100 us for a 384-channel 14x14 layer,
320 us for 32 channels at 112x112. The kernels here take int8 in, int8 out after a clamp
post-op, SiLU / hardswish before it, or a float32 output (what EfficientNet's and
MobileNetV3's squeeze-excitation blocks and ConvNeXt's LayerNorm read), and 5x5 / 7x7 windows
(their later stages, ConvNeXt's blocks). Every other conv keeps oneDNN, and
the kernel choice times each layer against oneDNN (lowering/choice.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from qbackend.kernels import depthwise, isa, registry

from . import own_conv
from .base import EmitContext

LANES = 16  # channels per vector step of the kernel
MAX_CHANNELS = 1 << 14  # the kernel keeps a row of zero-point bytes per channel on its stack


def is_depthwise(match) -> bool:
    """A 2-D conv with one input channel per group, multiplier 1, a square window the kernels
    take (depthwise.DEPTHWISE_WINDOWS), no residual."""
    p, w = match.conv, match.weight
    return (p is not None and w is not None and p.spatial_rank == 2 and match.accum is None and match.accum_float is None
            and p.groups == w.int8.shape[0] and tuple(w.int8.shape[1:]) in {(1, k, k) for k in depthwise.DEPTHWISE_WINDOWS})


def _window(match) -> int:
    return match.weight.int8.shape[-1]


def refusal(ctx: EmitContext, match) -> Optional[str]:
    """Why this conv is not for the depthwise kernel (None if it is)."""
    if not is_depthwise(match):
        return f"not a depthwise conv with a {' or '.join(f'{k}x{k}' for k in depthwise.DEPTHWISE_WINDOWS)} window"
    p, w, k = match.conv, match.weight, _window(match)
    channels = w.int8.shape[0]
    if list(p.dilation) != [1, 1] or any(s not in depthwise.DEPTHWISE_STRIDES for s in p.stride) \
            or any(not 0 <= q <= k // 2 for q in p.padding):
        return (f"stride {p.stride}, padding {p.padding}, dilation {p.dilation}: the kernel takes stride 1-2, padding"
                f" 0-{k // 2}")
    if channels > MAX_CHANNELS:
        return f"{channels} channels: the kernel takes up to {MAX_CHANNELS}"
    if match.output_quant is None and match.float_dtype != torch.float32:
        return f"the kernel writes uint8 or float32, not {match.float_dtype}"
    return own_conv.refusal(ctx, match, (match.x.qparams,) + ((match.output_quant,) if match.output_quant else ()),
                            tuple(own_conv.ACTIVATIONS))


def vnni_built() -> bool:
    return isa.int8_build() == "avx512_vnni"


def pack(weight: torch.Tensor, mult: torch.Tensor, add: torch.Tensor, vnni: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed weights, multiplier, addend) in the order of the kernel that runs the conv:
    int16 pairs of two kernel rows for AVX2, int8 quads of a kernel row's taps for
    AVX512-VNNI; channels padded to a multiple of LANES with zeros (the AVX2 kernel runs a
    last partial group in place, the VNNI kernel such layers on padded copies)."""
    pad = -weight.shape[0] % LANES
    weight, mult, add = (torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (weight, mult, add))
    return (pack_vnni if vnni else pack_avx2)(weight, mult, add)


def pack_avx2(weight: torch.Tensor, mult: torch.Tensor, add: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Int16 pairs of two kernel rows' weights at one column (vpmaddwd), rows 2 rp and 2 rp + 1
    (an odd window's last row with a zero one), pair (rp, column) in order, in the AVX2 kernel's
    lane order."""
    channels, window = weight.shape[0], weight.shape[-1]
    groups, rows = channels // LANES, -(-window // 2) * 2
    taps = torch.nn.functional.pad(weight.reshape(channels, window, window).to(torch.int16), (0, 0, 0, rows - window))
    taps = taps.reshape(channels, rows // 2, 2, window).transpose(2, 3)  # [C, row pair, column, 2]
    # channel = 16 g + 8 half + 4 part + i with part 0 -> "lo" sums, 1 -> "hi" (vpunpck order)
    pairs = taps.reshape(groups, 2, 2, 4, -1, 2).permute(4, 0, 2, 1, 3, 5).contiguous()
    order = lambda v: v.float().reshape(groups, 2, 2, 4).permute(0, 2, 1, 3).contiguous().reshape(-1)  # noqa: E731
    return pairs.reshape(-1), order(mult), order(add)


def pack_vnni(weight: torch.Tensor, mult: torch.Tensor, add: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each kernel row's K weights, zero-padded to whole quads of 4 bytes; in a group of 32
    channels, channel 32 g + 16 half + 4 vector + i sits in lane 4 half + i of its vector
    (vpunpck order); a last group of 16 has only the low halves."""
    channels, group, window = weight.shape[0], depthwise.DEPTHWISE_VNNI_GROUP, weight.shape[-1]
    quads = -(-window // 4)
    rows = torch.nn.functional.pad(weight.reshape(channels, window, window), (0, 4 * quads - window))
    rows = rows.reshape(channels, window, quads, 4)  # [C, kernel row, quad, 4 bytes]
    full = channels // group * group

    def order(values: torch.Tensor) -> torch.Tensor:  # [C, ...] -> per group [vector, half, i, ...]
        parts = [values[start:stop].reshape(-1, halves, 4, 4, *values.shape[1:]).transpose(1, 2).flatten(0, 3)
                 for start, stop, halves in ((0, full, 2), (full, channels, 1)) if stop > start]
        return torch.cat(parts)

    return order(rows).permute(1, 2, 0, 3).contiguous().reshape(-1), order(mult.float()), order(add.float())


def emit(ctx: EmitContext, match):
    p, out = match.conv, match.output_quant
    activation, low, high = own_conv.epilogue(match.post_op)
    weight, mult, add = pack(match.weight.int8, *own_conv.requantize_constants(ctx, match), vnni_built())
    ctx.kernel = f"{registry.NAMESPACE}::qconv_depthwise.default"
    ctx.notes.append("qbackend's depthwise kernel")
    requantize = (out.scale, out.zero_point, out.qmin, out.qmax) if out is not None else (1.0, 0, 0, 255)
    return own_conv.call_kernel(ctx, "qconv_depthwise", (
        match.x.node, match.x.qparams.zero_point, ctx.constant(weight, "dw_w"), ctx.constant(mult, "dw_mult"),
        ctx.constant(add, "dw_add"), tuple(p.stride), tuple(p.padding), low, high, *requantize,
        *((out is None, activation) if out is None or activation != "none" or _window(match) != 3 else ()),
        *((_window(match),) if _window(match) != 3 else ())))


KERNEL = own_conv.OwnKernel("depthwise", is_depthwise, refusal, emit, prior=lambda match: None)
