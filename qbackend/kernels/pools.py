"""uint8 pools: a max pool (``csrc/max_pool_uint8.c``; torch's quantized::max_pool2d runs on one
thread), an average pool and a global one (``csrc/avg_pool_uint8.c``, ``csrc/global_avg_pool_uint8.c``;
torch's need a quantized-tensor copy): ``qbackend::max_pool_u8``, ``qbackend::avg_pool_u8``,
``qbackend::global_avg_pool_u8``, and the last of a quantized float32 tensor in one pass,
``qbackend::global_avg_pool_quantize``."""
from __future__ import annotations

import ctypes
import functools
import math

import torch

from qbackend.kernels import isa
from qbackend.kernels.chain_step import X_TO_Y
from qbackend.kernels.common import (X_TO_Y_SIGNATURE, Kernel, Prepared, channels_last_like, check_levels, check_nchw_uint8,
                                     checked_window, make_prepared, output_hw, prepared_chain_call, run_x_to_y)
from qbackend.kernels.structs import AvgPoolCall, GlobalAvgPoolCall, MaxPoolCall

SCHEMAS = {
    "max_pool_u8": "max_pool_u8(Tensor x, int[2] kernel_size, int[2] stride, int[2] padding, int[2] dilation, bool ceil_mode=False) -> Tensor",
    # (avg_pool2d's arguments, divisor 0: no override; the output keeps the input's zero point)
    "avg_pool_u8": "avg_pool_u8(Tensor x, int[2] kernel_size, int[2] stride, int[2] padding, bool ceil_mode, "
                   "bool count_include_pad, int divisor, int zero_point, int qmin, int qmax) -> Tensor",
    "global_avg_pool_u8": "global_avg_pool_u8(Tensor x, int zero_point, int qmin, int qmax) -> Tensor",
    # (global_avg_pool_u8 of quantize_per_tensor(x) for a float32 x, without the uint8 tensor)
    "global_avg_pool_quantize": "global_avg_pool_quantize(Tensor x, float scale, int x_zero_point, int x_qmin, int x_qmax, "
                                "int nan_as, int zero_point, int qmin, int qmax) -> Tensor",
}


@functools.lru_cache(maxsize=256)  # per input shape and pool geometry (the graph passes tuples)
def _max_pool_prepared_for(shape, kernel_size, stride, padding, dilation, ceil_mode=False) -> Prepared:
    """(ceil_mode: the kernel clips each window to the image, so a last, partial one is as any other)"""
    n, c, h, w = shape
    oh, ow = checked_window("max_pool_u8", h, w, kernel_size, stride, padding, dilation, bool(ceil_mode))
    if any(2 * p > k for p, k in zip(padding, kernel_size)):
        raise ValueError(f"qbackend::max_pool_u8: padding {list(padding)} over half the kernel {list(kernel_size)}")
    call = MaxPoolCall(n, h, w, c, *kernel_size, *stride, *padding, *dilation, oh, ow)
    return make_prepared(call, (n, c, oh, ow), torch.uint8, isa.c_function("qb_max_pool_u8_call", X_TO_Y_SIGNATURE, ctypes.c_int), ())


def _max_pool_prepared(x, kernel_size, stride, padding, dilation, ceil_mode=False, *, trusted=False) -> Prepared:
    check_nchw_uint8(x, None, "max_pool_u8")
    return _max_pool_prepared_for(tuple(x.shape), *(tuple(a) for a in (kernel_size, stride, padding, dilation)),
                                  bool(ceil_mode))


def _max_pool_fake(x, kernel_size, stride, padding, dilation, ceil_mode=False):
    n, c, h, w = x.shape
    oh, ow = output_hw(h, w, kernel_size, stride, padding, dilation, ceil_mode)
    return channels_last_like(x, (n, c, oh, ow), torch.uint8)


def max_pool_u8(x, kernel_size, stride, padding, dilation, ceil_mode=False):
    """``qbackend::max_pool_u8``'s implementation, also called as is by eager graphs (no dispatcher)."""
    return run_x_to_y(_max_pool_prepared(x, kernel_size, stride, padding, dilation, ceil_mode), x, "max_pool_u8")


AVG_POOL_MAX_WINDOW = 1 << 16  # pixels a window and a divisor hold: the window's sum is then exact as a float32


@functools.lru_cache(maxsize=256)  # per input shape, pool geometry and zero point (the graph passes tuples)
def _avg_pool_prepared_for(shape, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor, zero_point, qmin,
                           qmax) -> Prepared:
    n, c, h, w = shape
    name = "avg_pool_u8"
    oh, ow = checked_window(name, h, w, kernel_size, stride, padding, (1, 1), bool(ceil_mode))
    if any(2 * p > k for p, k in zip(padding, kernel_size)) or kernel_size[0] * kernel_size[1] > AVG_POOL_MAX_WINDOW:
        raise ValueError(f"qbackend::{name}: kernel {list(kernel_size)}, padding {list(padding)}: padding over half the "
                         f"kernel, or a window over {AVG_POOL_MAX_WINDOW} pixels")
    if not (isinstance(divisor, int) and 0 <= divisor <= AVG_POOL_MAX_WINDOW):
        raise ValueError(f"qbackend::{name}: divisor {divisor}: 0 (none) to {AVG_POOL_MAX_WINDOW} expected")
    check_levels(name, zero_point, zero_point, qmin, qmax)
    call = AvgPoolCall(n, h, w, c, *kernel_size, *stride, *padding, oh, ow, bool(count_include_pad), divisor, zero_point, qmin,
                       qmax)
    return make_prepared(call, (n, c, oh, ow), torch.uint8, isa.c_function("qb_avg_pool_u8_call", X_TO_Y_SIGNATURE, ctypes.c_int), ())


def _avg_pool_prepared(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor, zero_point, qmin, qmax, *,
                       trusted=False) -> Prepared:
    check_nchw_uint8(x, None, "avg_pool_u8")
    return _avg_pool_prepared_for(tuple(x.shape), *(tuple(a) for a in (kernel_size, stride, padding)), bool(ceil_mode),
                                  bool(count_include_pad), divisor, zero_point, qmin, qmax)


def _avg_pool_fake(x, kernel_size, stride, padding, ceil_mode, *quantization):
    n, c, h, w = x.shape
    oh, ow = output_hw(h, w, kernel_size, stride, padding, (1, 1), ceil_mode)
    return channels_last_like(x, (n, c, oh, ow), torch.uint8)


def avg_pool_u8(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor, zero_point, qmin, qmax):
    """``qbackend::avg_pool_u8``'s implementation, also called as is by eager graphs: what
    avg_pool2d gives for the uint8 ``x`` dequantized with ``zero_point`` (any scale), quantized
    again with it, within one step (see csrc/avg_pool_uint8.c)."""
    prepared = _avg_pool_prepared(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor, zero_point, qmin, qmax)
    return run_x_to_y(prepared, x, "avg_pool_u8")


GLOBAL_POOL_MAX_PIXELS = 1 << 23  # the kernel sums 8-bit values in int32


def _check_pixels(name: str, h: int, w: int) -> None:
    if not 0 < h * w <= GLOBAL_POOL_MAX_PIXELS:
        raise ValueError(f"qbackend::{name} takes 1 to {GLOBAL_POOL_MAX_PIXELS} pixels, got {h}x{w}")


@functools.lru_cache(maxsize=256)  # per input shape and zero point
def _global_avg_pool_prepared_for(shape, zero_point, qmin, qmax) -> Prepared:
    n, c, h, w = shape
    check_levels("global_avg_pool_u8", zero_point, zero_point, qmin, qmax)
    _check_pixels("global_avg_pool_u8", h, w)
    call = GlobalAvgPoolCall(n, h * w, c, zero_point, qmin, qmax)
    return make_prepared(call, (n, c, 1, 1), torch.uint8, isa.c_function("qb_global_avg_pool_u8_call", X_TO_Y_SIGNATURE, ctypes.c_int), ())


def _global_avg_pool_prepared(x, zero_point, qmin, qmax, *, trusted=False) -> Prepared:
    check_nchw_uint8(x, None, "global_avg_pool_u8")
    return _global_avg_pool_prepared_for(tuple(x.shape), zero_point, qmin, qmax)


def _global_avg_pool_fake(x, zero_point, qmin, qmax):
    return channels_last_like(x, (x.shape[0], x.shape[1], 1, 1), torch.uint8)


def global_avg_pool_u8(x, zero_point, qmin, qmax):
    """``qbackend::global_avg_pool_u8``'s implementation, also called as is by eager graphs."""
    return run_x_to_y(_global_avg_pool_prepared(x, zero_point, qmin, qmax), x, "global_avg_pool_u8")


@functools.lru_cache(maxsize=256)  # per input shape and quantization
def _global_avg_pool_quantize_prepared_for(shape, scale, x_zero_point, x_qmin, x_qmax, nan_as, zero_point, qmin,
                                           qmax) -> Prepared:
    n, c, h, w = shape
    name = "global_avg_pool_quantize"
    check_levels(name, x_zero_point, zero_point, x_qmin, x_qmax)
    check_levels(name, x_zero_point, zero_point, qmin, qmax)
    if not (math.isfinite(scale) and scale > 0 and 0 <= nan_as <= 255):
        raise ValueError(f"qbackend::{name}: scale {scale}, a NaN's value {nan_as} (a positive finite scale, a NaN in 0..255)")
    _check_pixels(name, h, w)
    call = GlobalAvgPoolCall(n, h * w, c, zero_point, qmin, qmax, 1.0 / scale, x_zero_point, x_qmin, x_qmax, nan_as)
    function = isa.c_function("qb_global_avg_pool_quantize_call", X_TO_Y_SIGNATURE, ctypes.c_int)
    return make_prepared(call, (n, c, 1, 1), torch.uint8, function, ())


def _global_avg_pool_quantize_prepared(x, *args, trusted=False) -> Prepared:
    if x.dim() != 4 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"qbackend::global_avg_pool_quantize takes float32 CPU activations [N, C, H, W], got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    return _global_avg_pool_quantize_prepared_for(tuple(x.shape), *args)


def _global_avg_pool_quantize_fake(x, *args):
    return channels_last_like(x, (x.shape[0], x.shape[1], 1, 1), torch.uint8)


def global_avg_pool_quantize(x, scale, x_zero_point, x_qmin, x_qmax, nan_as, zero_point, qmin, qmax):
    """``qbackend::global_avg_pool_quantize``: what global_avg_pool_u8 gives for
    quantize_per_tensor(x, scale, x_zero_point, x_qmin, x_qmax, uint8) (a NaN as ``nan_as``)."""
    prepared = _global_avg_pool_quantize_prepared(x, scale, x_zero_point, x_qmin, x_qmax, nan_as, zero_point, qmin, qmax)
    return run_x_to_y(prepared, x, "global_avg_pool_quantize")


max_pool_chain_call = prepared_chain_call(_max_pool_prepared, X_TO_Y)
avg_pool_chain_call = prepared_chain_call(_avg_pool_prepared, X_TO_Y)
global_avg_pool_chain_call = prepared_chain_call(_global_avg_pool_prepared, X_TO_Y)
global_avg_pool_quantize_chain_call = prepared_chain_call(_global_avg_pool_quantize_prepared, X_TO_Y)
KERNELS = {
    "max_pool_u8": Kernel(SCHEMAS["max_pool_u8"], max_pool_u8, _max_pool_fake, max_pool_u8),
    "avg_pool_u8": Kernel(SCHEMAS["avg_pool_u8"], avg_pool_u8, _avg_pool_fake, avg_pool_u8),
    "global_avg_pool_u8": Kernel(SCHEMAS["global_avg_pool_u8"], global_avg_pool_u8, _global_avg_pool_fake,
                                 global_avg_pool_u8),
    "global_avg_pool_quantize": Kernel(SCHEMAS["global_avg_pool_quantize"], global_avg_pool_quantize,
                                       _global_avg_pool_quantize_fake, global_avg_pool_quantize),
}
max_pool_u8.fresh_output = avg_pool_u8.fresh_output = True  # (patterns/inplace.py)
global_avg_pool_u8.fresh_output = global_avg_pool_quantize.fresh_output = True
