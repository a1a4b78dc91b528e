"""Grouped 3x3 int8 convs, as many outputs as inputs per group (``csrc/grouped_conv_int8.c``):
``qbackend::qconv_grouped``. int8 weights: the AVX512-VNNI build where it runs (exact), else the
AVX2 one, whose int16 pair sums saturate for weights the lowering does not give it; int16
weights: the exact AVX2 build on int16 pairs (``grouped_conv_int8_exact16.c``,
``lowering/grouped.py`` packs for it where the pairs could saturate)."""
from __future__ import annotations

import ctypes
import math
from typing import Optional

import torch

from qbackend.kernels import isa
from qbackend.kernels.chain_step import X_TO_Y
from qbackend.kernels.common import (FOUR_SIGNATURE, Kernel, Prepared, cached_prepared, channels_last_like, check_constants,
                                     check_levels, check_nchw_uint8, checked_window, make_prepared, output_hw, prepared_chain_call,
                                     run_x_to_y)
from qbackend.kernels.depthwise import DEPTHWISE_STRIDES
from qbackend.kernels.structs import GroupedCall

SCHEMAS = {
    # (grouped 3x3, as many outputs as inputs per group)
    "qconv_grouped": "qconv_grouped(Tensor x, int x_zero_point, Tensor weight, Tensor mult, Tensor add, int groups, "
                     "int stride, float low, float high, float out_scale, int out_zero_point, int qmin, int qmax, "
                     "bool float_out=False) -> Tensor",
}


GROUPED_LANES = 8  # grouped_conv_int8_vnni.c: output channels per vector


def grouped_refusal(channels: int, groups: int) -> Optional[str]:
    """Why the grouped kernel cannot take ``channels`` in and out in ``groups`` (None if it can)."""
    per_group = channels // groups if groups and channels % groups == 0 else 0
    if channels % GROUPED_LANES or not (per_group == 4 or (per_group and per_group % GROUPED_LANES == 0)) or groups < 2:
        return (f"{channels} channels in {groups} groups: the kernel takes groups of 4 or a multiple of {GROUPED_LANES} "
                f"channels, {GROUPED_LANES} channels at a time")
    return None


def _prepare_grouped_conv(x, x_zero_point, weight, mult, add, groups, stride, low, high, out_scale, out_zero_point, qmin,
                          qmax, float_out=False) -> Prepared:
    check_nchw_uint8(x, None, "qconv_grouped")
    n, c, h, w = x.shape
    # (threads, call, x, y, scratch, None); its scratch bytes (the int16 build's padded input, else 0): name + "_scratch"
    if weight.dtype == torch.int16:
        name, find = "qb_grouped_conv_exact16", isa.c_function
    elif isa.int8_build() == "avx512_vnni":
        name, find = "qb_grouped_conv_vnni", isa.vnni_function
    else:
        name, find = "qb_grouped_conv_avx2", isa.c_function
    function, scratch_bytes = find(name, FOUR_SIGNATURE, ctypes.c_int), find(name + "_scratch", (ctypes.c_void_p,), ctypes.c_size_t)
    reason = grouped_refusal(c, groups)
    if reason is not None:
        raise ValueError(f"qbackend::qconv_grouped: {reason}")
    dtype = torch.int16 if weight.dtype == torch.int16 else torch.int8  # (another dtype: check_constants names it)
    check_constants("qconv_grouped", (weight, dtype, c * 9 * (c // groups)), (mult, torch.float32, c),
                     (add, torch.float32, c))
    oh, ow = checked_window("qconv_grouped", h, w, (3, 3), (stride, stride), (1, 1))
    if stride not in DEPTHWISE_STRIDES:
        raise ValueError(f"qbackend::qconv_grouped: stride {stride}; the kernel takes {DEPTHWISE_STRIDES}")
    if not (math.isfinite(out_scale) and out_scale > 0) or math.isnan(low) or math.isnan(high):
        raise ValueError(f"qbackend::qconv_grouped: out scale {out_scale}, clamp [{low}, {high}]")
    check_levels("qconv_grouped", x_zero_point, out_zero_point, qmin, qmax)
    call = GroupedCall(n, h, w, c, c // groups, stride, oh, ow, x_zero_point, weight.data_ptr(), mult.data_ptr(),
                       add.data_ptr(), low, high, 1.0 / out_scale, out_zero_point, qmin, qmax, bool(float_out))
    return make_prepared(call, (n, c, oh, ow), torch.float32 if float_out else torch.uint8, function, (mult, add),
                         scratch_bytes(ctypes.addressof(call)))


def _grouped_prepared(x, x_zero_point, weight, *args, trusted=False) -> Prepared:
    return cached_prepared(weight, trusted, x, (x_zero_point, *args), lambda: _prepare_grouped_conv(x, x_zero_point, weight, *args))


def _grouped_conv(x, *args, trusted=False):
    return run_x_to_y(_grouped_prepared(x, *args, trusted=trusted), x, "qconv_grouped")


def _grouped_conv_fake(x, x_zero_point, weight, mult, add, groups, stride, low, high, out_scale, out_zero_point, qmin, qmax,
                       float_out=False):
    n, c, h, w = x.shape
    shape = (n, c, *output_hw(h, w, (3, 3), (stride, stride), (1, 1)))
    return channels_last_like(x, shape, torch.float32 if float_out else torch.uint8)


def qconv_grouped(*args):
    """``qbackend::qconv_grouped`` without the dispatcher round trip; its constants are the
    lowering's own packing (checked once per input shape, as the depthwise conv's)."""
    return _grouped_conv(*args, trusted=True)


chain_call = prepared_chain_call(_grouped_prepared, X_TO_Y)
KERNELS = {"qconv_grouped": Kernel(SCHEMAS["qconv_grouped"], _grouped_conv, _grouped_conv_fake, qconv_grouped)}
qconv_grouped.fresh_output = True  # (patterns/inplace.py: a later kernel may write into its output)
