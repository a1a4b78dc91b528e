"""A BatchNorm between a dequantize and a quantize in one pass (csrc/batch_norm_quantize.c): the
kernel, its checks and the function lowered graphs call. The graph rewrite:
qbackend/passes/batch_norm_quantize.py."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from qbackend.kernels import fast_qdq
from qbackend.kernels import isa
from qbackend.kernels.chain_step import LIST, StepCall, step_call
from qbackend.kernels.channel_shuffle import pixel_stride
from qbackend.kernels.structs import BatchNormCall, Operand


# (csrc/batch_norm_quantize.c: threads, pixels, pieces, channels, strides, inputs, in zero point, in scale, alpha,
# beta, relu, out inverse scale, out zero point, qmin, qmax, out)
_SIGNATURE = ((ctypes.c_int, ctypes.c_long, ctypes.c_int) + (ctypes.c_void_p,) * 3 + (ctypes.c_int, ctypes.c_float)
              + (ctypes.c_void_p,) * 2 + (ctypes.c_int, ctypes.c_float) + (ctypes.c_int,) * 3 + (ctypes.c_void_p,))


def kernel():
    """The C function, or None where the own kernels are not built."""
    return isa.c_function("qb_batch_norm_quantize", _SIGNATURE)


def _reference(pieces, in_scale, in_zero_point, alpha, beta, relu, out_scale, out_zero_point, qmin, qmax):
    x = fast_qdq.dequantize_per_tensor(torch.cat(list(pieces), 1), in_scale, in_zero_point, 0, 255, torch.uint8)
    y = x * alpha.view(1, -1, 1, 1) + beta.view(1, -1, 1, 1)
    return fast_qdq.quantize_per_tensor_channels_last(torch.relu(y) if relu else y, out_scale, out_zero_point, qmin, qmax,
                                                      torch.uint8, nan_as=qmin)


def _layout(pieces, channels: int) -> Optional[tuple[list, list, list]]:
    """(channels, pixel stride, data pointer) of each piece where the kernel applies: plain uint8
    CPU [N, C_p, H, W] tensors of one N, H, W, channels contiguous in each pixel, ``channels`` in
    all. (Read for every piece of every call: DenseNet passes ~600 a call.)"""
    if kernel() is None or not pieces:
        return None
    counts, strides, pointers = [], [], []
    grid = None
    for piece in pieces:
        if type(piece) is not torch.Tensor or piece.dtype is not torch.uint8 or not piece.is_cpu or piece.dim() != 4:
            return None
        n, c, h, w = piece.shape
        if grid is None:
            grid = (n, h, w)
        elif grid != (n, h, w):
            return None
        stride = pixel_stride(piece)
        if stride is None:
            return None
        counts.append(c)
        strides.append(stride)
        pointers.append(piece.data_ptr())
    return (counts, strides, pointers) if sum(counts) == channels else None


def _kernel_layout(pieces, in_zero_point: int, alpha: torch.Tensor, qmin: int, qmax: int) -> Optional[tuple[list, list, list]]:
    """_layout where the kernel runs these arguments, else None (torch's ops run them)."""
    if not (0 <= qmin <= qmax <= 255) or not 0 <= in_zero_point <= 255:
        return None
    return _layout(pieces, alpha.numel())


def batch_norm_quantize(pieces, in_scale: float, in_zero_point: int, alpha: torch.Tensor, beta: torch.Tensor, relu: bool,
                        out_scale: float, out_zero_point: int, qmin: int, qmax: int) -> torch.Tensor:
    """quantize(relu?(dequantize(cat(pieces, 1)) * alpha + beta)) per channel, uint8 channels-last;
    torch's ops where the kernel does not apply (the same values)."""
    layout = _kernel_layout(pieces, in_zero_point, alpha, qmin, qmax)
    if layout is None:
        return _reference(pieces, in_scale, in_zero_point, alpha, beta, relu, out_scale, out_zero_point, qmin, qmax)
    counts, strides, pointers = layout
    n, _, h, w = pieces[0].shape
    out = torch.empty((n, alpha.numel(), h, w), dtype=torch.uint8, memory_format=torch.channels_last)
    if out.numel():
        count = len(pieces)
        kernel()(torch.get_num_threads(), n * h * w, count, (ctypes.c_long * count)(*counts), (ctypes.c_long * count)(*strides),
                  (ctypes.c_void_p * count)(*pointers), in_zero_point, in_scale, alpha.data_ptr(), beta.data_ptr(), relu,
                  1.0 / out_scale, out_zero_point, qmin, qmax, out.data_ptr())
    return out


def chain_call(args: tuple, y) -> Optional[StepCall]:
    """``batch_norm_quantize`` as a kernel chain step (qb_batch_norm_quantize_call): where the kernel
    ran this call. Its pieces are listed operands: the chain places each (an input, a step's value)
    once per signature, where the graph's call read ~10 tensors' layouts at every call (DenseNet:
    ~7 us a piece, ~600 pieces an image)."""
    pieces, in_scale, in_zero_point, alpha, beta, relu, out_scale, out_zero_point, qmin, qmax = args
    layout = _kernel_layout(pieces, in_zero_point, alpha, qmin, qmax)
    if layout is None:
        return None
    n, _, h, w = pieces[0].shape
    if y.shape != (n, alpha.numel(), h, w) or not y.is_contiguous(memory_format=torch.channels_last):
        return None
    counts, strides, _ = layout
    count = len(pieces)
    channels, steps, inputs = (ctypes.c_long * count)(*counts), (ctypes.c_long * count)(*strides), (Operand * count)()
    call = BatchNormCall(n * h * w, count, in_zero_point, in_scale, relu, 1.0 / out_scale, out_zero_point, qmin, qmax,
                         ctypes.addressof(channels), ctypes.addressof(steps), ctypes.addressof(inputs), alpha.data_ptr(),
                         beta.data_ptr())
    return step_call(isa.c_address("qb_batch_norm_quantize_call"), call, (y,), (channels, steps, inputs, alpha, beta),
                     kind=LIST, listed=tuple(pieces), listed_into=inputs)


batch_norm_quantize.fresh_output = True  # (patterns/inplace.py: a later kernel may write into it)
