"""A conv for inputs of few channels, a network's stem, optionally with the max pool after it:
``qbackend::qconv_stem``. Two builds, chosen by the packed weights' dtype: int8 quads for
AVX512-VNNI (``csrc/stem_conv_int8_vnni.c``), int16 pairs for AVX2 (``csrc/stem_conv_int8.c``:
exact for any int8 weights)."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from qbackend.kernels import isa
from qbackend.kernels.chain_step import X_TO_Y
from qbackend.kernels.common import (ACTIVATIONS, X_TO_Y_SIGNATURE, Kernel, Prepared, cached_prepared, channels_last_like,
                                     check_constants, check_levels, check_nchw_uint8, checked_window, make_prepared,
                                     output_hw, prepared_chain_call, run_x_to_y)
from qbackend.kernels.structs import StemCall

SCHEMAS = {
    "qconv_stem": "qconv_stem(Tensor x, int x_zero_point, Tensor weight, Tensor mult, Tensor add, int[2] kernel_size, "
                  "int[2] stride, int[2] padding, float low, float high, float out_scale, int out_zero_point, int qmin, "
                  "int qmax, int[2] pool_kernel=[0, 0], int[2] pool_stride=[1, 1], int[2] pool_padding=[0, 0], "
                  "str activation='none') -> Tensor",
}


# Both builds: output pixels of a row per step, the input values under them, and the leftover
# values (KW * C % WORD per window row) per pixel they have room for
STEM_PIECE, STEM_MAX_STRIP, STEM_MAX_LEFTOVER = 64, 16384, 64
# Input values per step of the sum: vpdpbusd's 4 bytes (VNNI), vpmaddwd's 2 int16 (AVX2)
WORD = {torch.int8: 4, torch.int16: 2}


def stem_steps(kernel_h: int, kernel_w: int, channels: int, word: int = 4) -> tuple[int, int, int, int]:
    """The stem conv's sum: (F, L, LQ, K): F words of ``word`` values from each window row, L
    values left over per row, LQ words they make, K = KH * F + LQ steps."""
    run = kernel_w * channels
    leftover_words = -(-kernel_h * (run % word) // word)
    return run // word, run % word, leftover_words, kernel_h * (run // word) + leftover_words


def stem_refusal(in_shape, out_channels: int, kernel_size, stride) -> Optional[str]:
    """Why the stem conv kernel cannot take this conv (None if it can): the sizes it has room for
    (the VNNI build's leftover bound, the stricter: KW * C % 2 <= KW * C % 4)."""
    n, c, h, w = in_shape
    kh, kw = kernel_size
    if out_channels % 16:
        return f"{out_channels} output channels: the kernel takes a multiple of 16"
    if kh * (kw * c % 4) > STEM_MAX_LEFTOVER:
        return f"a {kh}x{kw} kernel of {c} channels leaves {kh * (kw * c % 4)} bytes over its 4-byte steps (at most {STEM_MAX_LEFTOVER})"
    strip = kh * ((STEM_PIECE - 1) * stride[1] + kw) * c  # (for a whole piece: rows may be shorter)
    if strip > STEM_MAX_STRIP:
        return f"the input under {STEM_PIECE} output pixels is {strip} bytes (at most {STEM_MAX_STRIP})"
    return None


STEM_MAX_POOL_ROWS = 8  # a fused max pool's kernel height, at most (both builds' MAX_POOL_ROWS)


NO_POOL = ((0, 0), (1, 1), (0, 0))  # qconv_stem's pool_kernel, pool_stride, pool_padding when no pool is fused


def _pooled_hw(conv_hw, pool_kernel, pool_stride, pool_padding) -> tuple[int, int]:
    """The stem call's output height and width: the conv's, or its fused pool's."""
    return conv_hw if tuple(pool_kernel) == NO_POOL[0] else output_hw(*conv_hw, pool_kernel, pool_stride, pool_padding)


def stem_pool_refusal(conv_hw, pool_kernel, pool_stride, pool_padding) -> Optional[str]:
    """Why the stem conv kernel cannot fuse this max pool (dilation 1, floor mode) of its
    output (None if it can)."""
    if not 1 <= pool_kernel[0] <= STEM_MAX_POOL_ROWS or pool_kernel[1] < 1:
        return f"pool kernel {list(pool_kernel)}: the kernel keeps 1 to {STEM_MAX_POOL_ROWS} conv rows"
    if any(not 0 <= 2 * p <= k for p, k in zip(pool_padding, pool_kernel)) or min(pool_stride) < 1:
        return f"pool kernel {list(pool_kernel)}, stride {list(pool_stride)}, padding {list(pool_padding)}: not a max_pool2d's"
    if min(output_hw(*conv_hw, pool_kernel, pool_stride, pool_padding)) < 1:
        return f"a {list(pool_kernel)} pool of a {list(conv_hw)} conv output has no output"
    return None


def _prepare_stem_conv(x, x_zero_point, weight, mult, add, kernel_size, stride, padding, low, high, out_scale,
                       out_zero_point, qmin, qmax, pool_kernel=NO_POOL[0], pool_stride=NO_POOL[1],
                       pool_padding=NO_POOL[2], activation="none") -> Prepared:
    check_nchw_uint8(x, None, "qconv_stem")
    if weight.dtype == torch.int8:
        function = isa.vnni_function("qb_stem_conv_vnni_call", X_TO_Y_SIGNATURE, ctypes.c_int)
        if function is None:
            raise ValueError(f"qbackend::qconv_stem: int8 weights are packed for AVX512-VNNI: {isa.vnni_unavailable()}")
    else:
        function = isa.c_function("qb_stem_conv_call", X_TO_Y_SIGNATURE, ctypes.c_int)
    if activation not in ACTIVATIONS:
        raise ValueError(f"qbackend::qconv_stem: activation {activation!r} is not one of {list(ACTIVATIONS)}")
    n, c, h, w = x.shape
    cout = mult.numel()
    oh, ow = checked_window("qconv_stem", h, w, kernel_size, stride, padding)
    check_levels("qconv_stem", x_zero_point, out_zero_point, qmin, qmax)
    reason = stem_refusal(x.shape, cout, kernel_size, stride)
    pooled = tuple(pool_kernel) != NO_POOL[0]
    if reason is None and pooled:
        reason = stem_pool_refusal((oh, ow), pool_kernel, pool_stride, pool_padding)
    if reason is not None:
        raise ValueError(f"qbackend::qconv_stem: {reason}")
    dtype = weight.dtype if weight.dtype in WORD else torch.int16  # (another dtype: check_constants names it)
    steps = stem_steps(*kernel_size, c, WORD[dtype])[3]
    check_constants("qconv_stem", (weight, dtype, cout * steps * WORD[dtype]), (mult, torch.float32, cout),
                    (add, torch.float32, cout))
    ph, pw = _pooled_hw((oh, ow), pool_kernel, pool_stride, pool_padding)
    call = StemCall(n, h, w, c, oh, ow, *kernel_size, *stride, *padding, cout, x_zero_point, weight.data_ptr(),
                    mult.data_ptr(), add.data_ptr(), low, high, 1.0 / out_scale, out_zero_point, qmin, qmax,
                    *pool_kernel, *pool_stride, *pool_padding, ph, pw, ACTIVATIONS[activation])
    return make_prepared(call, (n, cout, ph, pw), torch.uint8, function, (mult, add))


def _stem_conv_prepared(x, x_zero_point, weight, mult, add, *args, trusted=False) -> Prepared:
    args = (x_zero_point, mult, add, *args)
    return cached_prepared(weight, trusted, x, args, lambda: _prepare_stem_conv(x, x_zero_point, weight, *args[1:]))


def _stem_conv(x, *args, trusted=False):
    return run_x_to_y(_stem_conv_prepared(x, *args, trusted=trusted), x, "qconv_stem")


def _stem_conv_fake(x, x_zero_point, weight, mult, add, kernel_size, stride, padding, low, high, out_scale,
                    out_zero_point, qmin, qmax, pool_kernel=NO_POOL[0], pool_stride=NO_POOL[1], pool_padding=NO_POOL[2],
                    activation="none"):
    n, _, h, w = x.shape
    hw = _pooled_hw(output_hw(h, w, kernel_size, stride, padding), pool_kernel, pool_stride, pool_padding)
    return channels_last_like(x, (n, mult.numel(), *hw), torch.uint8)


def qconv_stem(*args):
    """``qbackend::qconv_stem`` without the dispatcher round trip (see ``qconv_depthwise``)."""
    return _stem_conv(*args, trusted=True)


chain_call = prepared_chain_call(_stem_conv_prepared, X_TO_Y)
KERNELS = {"qconv_stem": Kernel(SCHEMAS["qconv_stem"], _stem_conv, _stem_conv_fake, qconv_stem)}
qconv_stem.fresh_output = True  # (patterns/inplace.py: a later kernel may write into its output)
