"""int8 convs of inputs with fewer than 4 channels (a network's stem): qbackend's own kernel
(qbackend/kernels/csrc/stem_conv_int8_vnni.c, AVX512-VNNI; stem_conv_int8.c, AVX2, on int16
pairs: exact for 8-bit weights too).

oneDNN runs ResNet-18's 7x7 stride-2 stem (3 -> 64 channels) at ~280 GMAC/s here against
420-490 for its 3x3 layers: a window row of 3 channels is 21 bytes, not a multiple of the 4
its dot products take. The kernel sums each row's first 20 bytes from the input and packs the
bytes left over (docs/benchmarks_gemm.md: 0.82x oneDNN's time at batch 1, 0.88x at 8; end to
end, ResNet-18 at batch 8 ran 1.8% faster with it, interleaved). The GEMM kernel
(lowering/gemm.py) takes multiples of 4 channels only.
"""
from __future__ import annotations

from typing import Optional

import torch

from qbackend.kernels import common, isa, registry
from qbackend.kernels import stem as stem_kernel
from qbackend.patterns.base import fake_value

from . import own_conv
from .base import EmitContext
from .common import ANCHOR, static_shape

# Measured against oneDNN (benchmarks/bench_gemm.py): 64 outputs per tile run 0.82-0.88x its
# time; with 32 output channels (MobileNetV2's 3x3 stem, 2-block tiles) 0.84x at 12544 output
# pixels (batch 1), 1.1-1.2x at 100352 (batch 8): those take the kernel up to this many pixels.
# The AVX2 build alike (Zen 3): 64 outputs 0.95-0.96x; 16 and 32 outputs 0.88-0.94x at batch 1,
# 0.99-1.24x at batch 8.
MAX_NARROW_PIXELS = 25088
WIDE = 64  # output channels of a full tile
UNPOOLED_ARGS = 14  # a qconv_stem call's arguments before the pool's (registry.OPS)


def stem_weight(weight_shape, groups: int) -> bool:
    """A 2-D conv's weight the kernel takes: fewer than 4 input channels, groups 1. The recipe
    asks it too (qbackend.pt2e_flow: which stems keep 8-bit weights)."""
    return len(weight_shape) == 4 and weight_shape[1] < 4 and groups == 1


def is_stem(match) -> bool:
    """A 2-D int8 conv (groups 1, no residual) of fewer than 4 input channels."""
    p, w = match.conv, match.weight
    return (p is not None and w is not None and p.spatial_rank == 2 and stem_weight(w.int8.shape, p.groups)
            and match.accum is None and match.accum_float is None)


def sizes_refusal(in_shape, weight_shape, stride, dilation) -> Optional[str]:
    """Why the kernel has no room for a stem conv of these sizes (None if it has): a static input
    (``in_shape`` None where it is not), dilation 1, what ``stem_refusal`` allows. The recipe
    asks it too (qbackend.pt2e_flow: which stems keep 8-bit weights)."""
    if in_shape is None:
        return "the input's shape is not static"
    if list(dilation) != [1, 1]:
        return f"dilation {dilation}: the kernel takes 1"
    return stem_kernel.stem_refusal(in_shape, weight_shape[0], tuple(weight_shape[2:]), tuple(stride))


def refusal(ctx: EmitContext, match) -> Optional[str]:
    """Why this stem conv is not for the kernel (None if it is)."""
    p = match.conv
    reason = sizes_refusal(static_shape(match.x.node), match.weight.int8.shape, p.stride, p.dilation)
    if reason is not None:
        return reason
    return own_conv.refusal(ctx, match, (match.x.qparams, match.output_quant), tuple(own_conv.ACTIVATIONS))


def prior(match) -> Optional[str]:
    """Why oneDNN runs it by the measurements above (narrow tiles at many pixels), or None."""
    shape, p, w = static_shape(match.x.node), match.conv, match.weight.int8
    oh, ow = common.output_hw(*shape[2:], tuple(w.shape[2:]), tuple(p.stride), tuple(p.padding))
    if w.shape[0] % WIDE and shape[0] * oh * ow > MAX_NARROW_PIXELS:
        return f"{w.shape[0]} output channels at {shape[0] * oh * ow} output pixels: oneDNN is faster (the kernel's tiles are {WIDE} wide)"
    return None


# The builds' packed weights: (dtype, outputs per block)
PACKINGS = {"avx512_vnni": (torch.int8, 16), "avx2": (torch.int16, 8)}


def pack(weight: torch.Tensor, build: str = "avx512_vnni") -> torch.Tensor:
    """[Cout, C, KH, KW] -> [Cout / B][K][B][word] in ``build``'s order (stem_kernel.stem_steps):
    each window row's first F words (column, channel), then the rows' leftover values,
    zero-padded; int8 quads for AVX512-VNNI (B = 16), int16 pairs for AVX2 (B = 8)."""
    dtype, block = PACKINGS[build]
    word = stem_kernel.WORD[dtype]
    cout, channels, kh, kw = weight.shape
    full, _, leftover_words, steps = stem_kernel.stem_steps(kh, kw, channels, word)
    rows = weight.to(dtype).permute(0, 2, 3, 1).reshape(cout, kh, kw * channels)
    leftover = rows[..., word * full:].reshape(cout, -1)
    ordered = torch.cat([rows[..., :word * full].reshape(cout, -1),
                         torch.nn.functional.pad(leftover, (0, word * leftover_words - leftover.shape[1]))], 1)
    return ordered.reshape(cout // block, block, steps, word).permute(0, 2, 1, 3).contiguous().reshape(-1)


def emit(ctx: EmitContext, match):
    p, out, w = match.conv, match.output_quant, match.weight.int8
    activation, low, high = own_conv.epilogue(match.post_op)
    mult, add = own_conv.requantize_constants(ctx, match)
    ctx.kernel = f"{registry.NAMESPACE}::qconv_stem.default"
    ctx.notes.append(f"qbackend's stem conv kernel ({w.shape[1]} input channels: oneDNN pads each window row)")
    return own_conv.call_kernel(ctx, "qconv_stem", (
        match.x.node, match.x.qparams.zero_point, ctx.constant(pack(w, isa.int8_build()), "stem_w"),
        ctx.constant(mult.float(), "stem_mult"), ctx.constant(add.float(), "stem_add"), tuple(w.shape[2:]), tuple(p.stride),
        tuple(p.padding), low, high, out.scale, out.zero_point, out.qmin, out.qmax,
        *((*stem_kernel.NO_POOL, activation) if activation != "none" else ())))


KERNEL = own_conv.OwnKernel("stem conv", is_stem, refusal, emit, prior=prior)


def fuse_max_pool(ctx: EmitContext, report) -> None:
    """A max pool (own kernel, dilation 1) of a stem conv's output that nothing else reads runs
    inside the stem conv's call: each thread pools the conv rows it has just computed, so the
    conv output (6.4 MB for ResNet-18 at batch 8) is never written out and read back
    (docs/benchmarks_gemm.md: 0.95x the two calls' time alone; in ResNet-18's graph at batch 8,
    1.50 ms where the two took 1.81). Graphs of plain-function calls (not traced again), as
    the kernel chain pass."""
    stem, pool = registry.PLAIN["qconv_stem"], registry.PLAIN["max_pool_u8"]
    decisions = {d.node: d for d in report.decisions}
    graph = ctx.gm.graph
    for conv in [n for n in graph.nodes if n.op == "call_function" and n.target is stem]:
        readers = [u for u in conv.users if u.users or u.op == "output" or u.target is pool]  # (dead dequantizes go later)
        pooled = conv.args[UNPOOLED_ARGS:UNPOOLED_ARGS + 3]  # (none, or NO_POOL before an activation)
        if len(readers) != 1 or readers[0].target is not pool or readers[0].args[0] is not conv or pooled not in ((), stem_kernel.NO_POOL):
            continue
        user = readers[0]
        if user.args[5:6] == (True,):  # (ceil mode: a pool call of its own)
            continue
        kernel, stride, padding, dilation = user.args[1:5]
        conv_hw = tuple(fake_value(conv).shape[2:])
        if tuple(dilation) != (1, 1) or stem_kernel.stem_pool_refusal(conv_hw, kernel, stride, padding) is not None:
            continue
        with graph.inserting_before(user):
            fused = own_conv.call_kernel(ctx, "qconv_stem", (*conv.args[:UNPOOLED_ARGS], tuple(kernel), tuple(stride),
                                                             tuple(padding), *conv.args[UNPOOLED_ARGS + 3:]))
        fused.meta.update({k: v for k, v in user.meta.items() if k not in ("example_value", "val")})
        user.replace_all_uses_with(fused)
        graph.erase_node(user)
        for dead in [u for u in conv.users]:
            graph.erase_node(dead)
        graph.erase_node(conv)
        conv_line, pool_line = decisions.get(conv.meta.get(ANCHOR)), decisions.get(user.meta.get(ANCHOR))
        if conv_line is not None and pool_line is not None:
            conv_line.reason = "; ".join(filter(None, (conv_line.reason, f"{pool_line.node} pooled in its kernel")))
            pool_line.op = conv_line.op
            pool_line.reason = f"in {conv_line.node}'s stem conv kernel (its output pooled as computed)"
