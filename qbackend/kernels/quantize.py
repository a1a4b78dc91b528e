"""float32 -> uint8 / int8 quantize in one pass: to channels-last uint8 (``csrc/quantize_nhwc.c``,
the model input's) and in a dense tensor's own dim order (``csrc/quantize_dense.c``, what
``fast_qdq`` runs). Plain functions, no ops: None where the kernel does not apply."""
from __future__ import annotations

import ctypes
import functools
import math
from typing import Optional

import torch

from qbackend.kernels import isa, library
from qbackend.kernels.chain_step import X_TO_Y, StepCall, step_call
from qbackend.kernels.structs import QuantizeCall

_i32, _f32, _pointer = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_NHWC = (_i32,) * 4 + (_pointer, _f32) + (_i32,) * 3 + (_pointer,)  # (threads, n, c, pixels, x, 1 / scale, zp, qmin, qmax, y)
_DENSE = (_i32, ctypes.c_long, _pointer, _f32) + (_i32,) * 6 + (_pointer,)  # (threads, n, x, 1 / scale, zp, qmin, qmax, int8, nan_as, wide, y)


@library.once
def _nhwc_kernel():
    return isa.c_function("qb_quantize_nchw_to_nhwc", _NHWC)


@library.once
def _dense_kernel():
    return isa.c_function("qb_quantize_dense", _DENSE)


def quantize_channels_last(x: torch.Tensor, scale: float, zero_point: int, qmin: int, qmax: int) -> Optional[torch.Tensor]:
    """uint8 channels-last quantize of a float32 NCHW-contiguous CPU tensor (quantize_nhwc.c,
    the reference's arithmetic), or None where the kernel does not apply or is not built."""
    kernel = _nhwc_kernel()
    if kernel is None or x.dim() != 4 or x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        return None
    n, c, h, w = x.shape
    y = torch.empty((n, c, h, w), dtype=torch.uint8, memory_format=torch.channels_last)
    # (ctypes passes 1 / scale as a float32: what the reference multiplies by)
    kernel(torch.get_num_threads(), n, c, h * w, x.data_ptr(), 1.0 / scale, zero_point, qmin, qmax, y.data_ptr())
    return y


INTEGER_RANGE = {torch.uint8: (0, 255), torch.int8: (-128, 127)}


def quantize_dense(x: torch.Tensor, scale: float, zero_point: int, qmin: int, qmax: int, dtype: torch.dtype,
                   nan_as: int = 0) -> Optional[torch.Tensor]:
    """uint8 / int8 quantize of a dense float32 CPU tensor in its own dim order
    (quantize_dense.c: the reference's arithmetic, a NaN stored as ``nan_as``), or None where the kernel
    does not apply (other tensors, a range beyond the dtype's, a scale or zero point whose
    float32 arithmetic the kernel does not reproduce) or is not built."""
    kernel = _dense_kernel()
    if kernel is None or not _dense_applies(x, scale, zero_point, qmin, qmax, dtype, nan_as):
        return None
    y = torch.empty_like(x, dtype=dtype)  # (a dense input's strides)
    kernel(torch.get_num_threads(), x.numel(), x.data_ptr(), *_dense_arguments(scale, zero_point, qmin, qmax, dtype, nan_as),
           y.data_ptr())
    return y


def _dense_applies(x: torch.Tensor, scale: float, zero_point: int, qmin: int, qmax: int, dtype: torch.dtype,
                   nan_as: int) -> bool:
    """Whether quantize_dense.c takes this call (a dense float32 CPU tensor, a range within the dtype's,
    a scale and zero point whose float32 arithmetic it reproduces)."""
    if (x.dtype != torch.float32 or x.device.type != "cpu" or dtype not in INTEGER_RANGE
            or not dense(x)):
        return False
    low, high = INTEGER_RANGE[dtype]
    return (low <= qmin <= qmax <= high and low <= nan_as <= high and abs(zero_point) <= 1 << 24 and scale > 0
            and math.isfinite(scale))


def _dense_arguments(scale: float, zero_point: int, qmin: int, qmax: int, dtype: torch.dtype, nan_as: int) -> tuple:
    return 1.0 / scale, zero_point, qmin, qmax, dtype == torch.int8, nan_as & 0xFF, _wide_quantize()


def dense_chain_call(args: tuple, y: torch.Tensor) -> Optional[StepCall]:
    """``fast_qdq.quantize_per_tensor``'s kernel chain step: quantize_dense.c on the values in
    their memory order, where the call ran it (its result has the input's strides), else None."""
    x, (scale, zero_point, qmin, qmax, dtype, *nan_as) = args[0], args[1:]
    nan_as = nan_as[0] if nan_as else 0
    if (type(x) is not torch.Tensor or not _dense_applies(x, scale, zero_point, qmin, qmax, dtype, nan_as) or y.dtype != dtype
            or y.stride() != x.stride() or x.numel() == 0):
        return None
    call = QuantizeCall(x.numel(), *_dense_arguments(scale, zero_point, qmin, qmax, dtype, nan_as))
    return step_call(isa.c_address("qb_quantize_dense_call"), call, (x, y), kind=X_TO_Y)


@functools.lru_cache(maxsize=None)
def _wide_quantize() -> bool:
    """quantize_dense.c's AVX512 step: where ATen finds AVX512 and $QBACKEND_KERNELS is not avx2."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and library.switch() != "avx2"


def dense(x: torch.Tensor) -> bool:
    """Whether ``x``'s elements fill its memory in some dim order (what quantize_dense.c walks)."""
    return x.is_contiguous() or memory_order(x) is not None


def memory_order(x: torch.Tensor) -> Optional[list]:
    """The dim order that makes a dense, non-contiguous ``x`` contiguous (None: it is contiguous,
    or not dense): e.g. attention's output, a [B, H, L, D] view of [B, L, H, D] memory."""
    if x.is_contiguous():
        return None
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))
    return order if x.permute(order).is_contiguous() else None
