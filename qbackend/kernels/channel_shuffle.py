"""ShuffleNet's channel shuffle in one pass (csrc/channel_shuffle.c): the kernel's checks, the
functions lowered graphs call and their kernel chain step. The graph rewrite:
qbackend/passes/channel_shuffle.py.

``shuffle_pair(a, b, dequantized, quantized)`` is the whole shuffle of ``cat([a, b], 1)`` in two
groups, ``shuffle_halves`` (same arguments) its two halves as the next ShuffleNetV2 block
splits it. ``dequantized``: None for float32 inputs, or (scale, zero point) of uint8 ones, read
as the reference's dequantize gives them; ``quantized``: None, or (scale, zero point, qmin,
qmax) to write the whole shuffle (the second half) as quantize_per_tensor gives it, uint8.
ATen's ops run what the kernel does not take (the same values)."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from qbackend.kernels import fast_qdq
from qbackend.kernels import isa
from qbackend.kernels.chain_step import StepCall, step_call
from qbackend.kernels.structs import ShuffleCall

_SIGNATURE = (ctypes.c_int,) + (ctypes.c_void_p,) * 5  # (threads, the call, a, b, first, second)


def kernel():
    """The C function, or None where the own kernels are not built."""
    return isa.c_function("qb_shuffle_call", _SIGNATURE, ctypes.c_int)


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


def _dequantized(t: torch.Tensor, dequantized: Optional[tuple]) -> torch.Tensor:
    return t if dequantized is None else (t.float() - dequantized[1]) * dequantized[0]  # (the reference's formula)


def _quantized(t: torch.Tensor, quantized: Optional[tuple]) -> torch.Tensor:
    return t if quantized is None else fast_qdq.quantize_per_tensor_channels_last(t, *quantized, torch.uint8, nan_as=quantized[2])


def _reference(a: torch.Tensor, b: torch.Tensor, dequantized: Optional[tuple] = None) -> torch.Tensor:
    n, half, h, w = a.shape
    both = torch.cat([_dequantized(a, dequantized), _dequantized(b, dequantized)], 1)
    return both.reshape(n, 2, half, h, w).transpose(1, 2).reshape(n, 2 * half, h, w).contiguous(memory_format=torch.channels_last)


def _call(a: torch.Tensor, b: torch.Tensor, halves: bool, dequantized: Optional[tuple],
          quantized: Optional[tuple]) -> Optional[ShuffleCall]:
    """The kernel's call where it applies, else None: the kernels built, plain CPU tensors of
    one 4-D shape (not fake ones under tracing) of the dtype ``dequantized`` says, channels
    contiguous in each pixel (read in place: no slice tensors, ~4 us each), a uint8 range."""
    dtype = torch.float32 if dequantized is None else torch.uint8
    if (kernel() is None or type(a) is not torch.Tensor or type(b) is not torch.Tensor or a.dim() != 4
            or a.shape != b.shape or a.dtype != dtype or b.dtype != dtype or a.device.type != "cpu" or b.device.type != "cpu"
            or (quantized is not None and not (0 <= quantized[2] <= quantized[3] <= 255 and quantized[0] > 0))):
        return None
    a_stride, b_stride = pixel_stride(a), pixel_stride(b)
    if a_stride is None or b_stride is None:
        return None
    n, half, h, w = a.shape
    in_scale, in_zp = dequantized or (1.0, 0)
    scale, zero_point, qmin, qmax = quantized or (1.0, 0, 0, 0)
    return ShuffleCall(n * h * w, a_stride, b_stride, half, halves, dequantized is not None, in_scale, in_zp,
                       quantized is not None, 1.0 / scale, zero_point, qmin, qmax)


def _channels_last(n: int, c: int, h: int, w: int, quantized: bool) -> torch.Tensor:
    return torch.empty((n, c, h, w), dtype=torch.uint8 if quantized else torch.float32, memory_format=torch.channels_last)


def _run(call: ShuffleCall, a: torch.Tensor, b: torch.Tensor, first: torch.Tensor, second: Optional[torch.Tensor]) -> None:
    if call.pixels and call.half:
        kernel()(torch.get_num_threads(), ctypes.addressof(call), a.data_ptr(), b.data_ptr(), first.data_ptr(),
                 None if second is None else second.data_ptr())


def shuffle_pair(a: torch.Tensor, b: torch.Tensor, dequantized: Optional[tuple] = None,
                 quantized: Optional[tuple] = None) -> torch.Tensor:
    """The channels-last [N, 2 * half, H, W] tensor whose channel 2k + g is ``(a, b)[g]``'s
    channel k: ShuffleNet's shuffle of ``cat([a, b], 1)`` in two groups."""
    call = _call(a, b, False, dequantized, quantized)
    if call is None:
        return _quantized(_reference(a, b, dequantized), quantized)
    n, half, h, w = a.shape
    out = _channels_last(n, 2 * half, h, w, quantized is not None)
    _run(call, a, b, out, None)
    return out


def shuffle_halves(a: torch.Tensor, b: torch.Tensor, dequantized: Optional[tuple] = None,
                   quantized: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``shuffle_pair(a, b).chunk(2, 1)`` as two dense channels-last tensors (the chunk's
    halves would be strided slices, copied again by what reads them), in one kernel call: the
    first half shuffles the first half of each input's channels, the second half the rest;
    ``quantized`` applies to the second half."""
    call = _call(a, b, True, dequantized, quantized)
    if call is None:
        first, second = (t.contiguous(memory_format=torch.channels_last) for t in _reference(a, b, dequantized).chunk(2, 1))
        return first, _quantized(second, quantized)
    n, half, h, w = a.shape
    quarter = half // 2
    first, second = _channels_last(n, 2 * quarter, h, w, False), _channels_last(n, 2 * (half - quarter), h, w, quantized is not None)
    _run(call, a, b, first, second)
    return first, second


def chain_call(args: tuple, result) -> Optional[StepCall]:
    """``shuffle_pair`` / ``shuffle_halves`` as a kernel chain step, where the kernel ran it."""
    a, b, *options = args
    halves = isinstance(result, tuple)
    call = _call(a, b, halves, *(options + [None] * (2 - len(options))))
    outputs = result if halves else (result, None)
    if call is None or not all(t is None or t.is_contiguous(memory_format=torch.channels_last) for t in outputs):
        return None
    return step_call(isa.c_address("qb_shuffle_call"), call, (a, b, *outputs))


shuffle_pair.fresh_output = shuffle_halves.fresh_output = True  # (patterns/inplace.py: a later kernel may write into them)
