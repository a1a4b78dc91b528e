"""ShuffleNet's channel shuffle in one pass (csrc/channel_shuffle.c): the kernels, their checks
and the functions lowered graphs call. The graph rewrite: qbackend/passes/channel_shuffle.py."""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from qbackend.kernels import fast_qdq
from qbackend.kernels import isa


_PAIR = (ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p)
_HALVES = _PAIR[:-1] + (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_float) + (ctypes.c_int,) * 3


@functools.lru_cache(maxsize=None)
def kernel():
    """The C functions (pair, halves), or None where the own kernels are not built."""
    pair = isa.c_function("qb_shuffle_pair_f32", _PAIR)
    return None if pair is None else (pair, isa.c_function("qb_shuffle_halves_f32", _HALVES))


def pixel_stride(x: torch.Tensor) -> Optional[int]:
    """The distance between x's pixel rows when each holds its channels contiguously and the
    rows lie on an [N, H, W] grid (channels-last, or a channel slice of it); else None. (Read
    on every call of the kernels that use it, for dozens of tensors a call: one shape and one
    stride read, ~0.3 us, where per-dimension reads took ~4 us.)"""
    n, c, h, w = x.shape
    stride_n, stride_c, stride_h, stride_w = x.stride()
    step = stride_w if w > 1 else stride_h if h > 1 else stride_n if n > 1 else c
    if (c > 1 and stride_c != 1) or step < c or (h > 1 and stride_h != step * w) or (n > 1 and stride_n != step * w * h):
        return None
    return step


def _reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    n, half, h, w = a.shape
    shuffled = torch.cat([a, b], 1).reshape(n, 2, half, h, w).transpose(1, 2)
    return shuffled.reshape(n, 2 * half, h, w).contiguous(memory_format=torch.channels_last)


def _strides(a: torch.Tensor, b: torch.Tensor) -> Optional[tuple[int, int]]:
    """The inputs' pixel strides where the kernels apply, else None: the kernels built, plain
    float32 CPU tensors of one 4-D shape (not fake ones under tracing), channels contiguous in
    each pixel (read in place: no slice tensors, ~4 us each)."""
    if (kernel() is None or type(a) is not torch.Tensor or type(b) is not torch.Tensor or a.dim() != 4
            or a.shape != b.shape or a.dtype != torch.float32 or b.dtype != torch.float32
            or a.device.type != "cpu" or b.device.type != "cpu"):
        return None
    a_stride, b_stride = pixel_stride(a), pixel_stride(b)
    return None if a_stride is None or b_stride is None else (a_stride, b_stride)


def _channels_last(n: int, c: int, h: int, w: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty((n, c, h, w), dtype=dtype, memory_format=torch.channels_last)


def shuffle_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The channels-last [N, 2 * half, H, W] tensor whose channel 2k + g is ``(a, b)[g]``'s
    channel k: ShuffleNet's shuffle of ``cat([a, b], 1)`` in two groups; ATen's ops where the
    kernel does not apply (the same values)."""
    strides = _strides(a, b)
    if strides is None:
        return _reference(a, b)
    n, half, h, w = a.shape
    out = _channels_last(n, 2 * half, h, w, torch.float32)
    if out.numel():
        kernel()[0](torch.get_num_threads(), n * h * w, half, a.data_ptr(), strides[0], b.data_ptr(), strides[1], out.data_ptr())
    return out


def _halves(a: torch.Tensor, b: torch.Tensor, quantized: Optional[tuple]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The kernel's two halves (the second uint8 when ``quantized`` gives (scale, zero point,
    qmin, qmax)), or None where it does not apply."""
    strides = _strides(a, b)
    if strides is None:
        return None
    n, half, h, w = a.shape
    quarter = half // 2
    first = _channels_last(n, 2 * quarter, h, w, torch.float32)
    second = _channels_last(n, 2 * (half - quarter), h, w, torch.float32 if quantized is None else torch.uint8)
    scale, zero_point, qmin, qmax = quantized or (1.0, 0, 0, 0)
    if first.numel() or second.numel():
        kernel()[1](torch.get_num_threads(), n * h * w, half, a.data_ptr(), strides[0], b.data_ptr(), strides[1],
                     first.data_ptr(), second.data_ptr(), quantized is not None, 1.0 / scale, zero_point, qmin, qmax)
    return first, second


def shuffle_halves(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``shuffle_pair(a, b).chunk(2, 1)`` as two dense channels-last tensors (the chunk's
    halves would be strided slices, copied again by what reads them), in one kernel call: the
    first half shuffles the first half of each input's channels, the second half the rest."""
    found = _halves(a, b, None)
    if found is None:
        return tuple(t.contiguous(memory_format=torch.channels_last) for t in _reference(a, b).chunk(2, 1))
    return found


def shuffle_halves_quantized(a: torch.Tensor, b: torch.Tensor, scale: float, zero_point: int, qmin: int,
                             qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``shuffle_halves`` whose second half is quantized to uint8 as
    ``fast_qdq.quantize_per_tensor_channels_last`` does it (the same bytes; a NaN as qmin)."""
    if 0 <= qmin <= qmax <= 255 and scale > 0:
        found = _halves(a, b, (scale, zero_point, qmin, qmax))
        if found is not None:
            return found
    first, second = shuffle_halves(a, b)
    return first, fast_qdq.quantize_per_tensor_channels_last(second, scale, zero_point, qmin, qmax, torch.uint8, nan_as=qmin)


shuffle_pair.fresh_output = shuffle_halves.fresh_output = shuffle_halves_quantized.fresh_output = True  # (patterns/inplace.py: a later kernel may write into them)
