"""Rotary position embedding in one pass (csrc/rotary_f32.c): the kernel, its checks, the function
lowered graphs call and its kernel chain step. The graph rewrite: qbackend/llm/rotary.py."""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from qbackend.kernels import isa
from qbackend.kernels.chain_step import StepCall, plain_float32, step_call


_SIGNATURE = (ctypes.c_int,) + (ctypes.c_void_p,) * 5  # (csrc/rotary_f32.c: threads, geometry, q, cos, sin, out)


def kernel():
    """The C function, or None where the own kernels are not built."""
    return isa.c_function("qb_rotary_f32", _SIGNATURE)


def _reference(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = q.shape[-1] // 2
    return q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin


def _broadcast_strides(shape: tuple, size: tuple, stride: tuple) -> Optional[tuple]:
    """The strides of a tensor of ``size`` / ``stride`` expanded to ``shape`` (0 where it
    broadcasts), or None where it does not broadcast."""
    if len(size) > len(shape):
        return None
    size, stride = (1,) * (len(shape) - len(size)) + size, (0,) * (len(shape) - len(stride)) + stride
    if any(s not in (1, n) for s, n in zip(size, shape)):
        return None
    return tuple(0 if s == 1 and n != 1 else t for s, n, t in zip(size, shape, stride))


@functools.lru_cache(maxsize=256)
def _geometry(shape: tuple, q_stride: tuple, cos_size: tuple, cos_stride: tuple, sin_size: tuple, sin_stride: tuple):
    """The kernel's geometry argument for one call site's sizes and strides (made once: ~10 us
    of a decode call's ~16 were expand views and the ctypes array), or None where it does not
    apply: q 4-D with an even last dim, cos and sin broadcasting to it, every last dim contiguous."""
    if len(shape) != 4 or shape[-1] % 2 or 0 in shape:
        return None
    strides = [q_stride, _broadcast_strides(shape, cos_size, cos_stride), _broadcast_strides(shape, sin_size, sin_stride)]
    if None in strides or any(s[-1] != 1 for s in strides):
        return None
    return (ctypes.c_long * 16)(*shape, *strides[0], *strides[1], *strides[2])


def _kernel_geometry(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The kernel's geometry for these operands, or None where the kernel does not apply (other
    dtypes or devices, fake tensors under tracing, shapes or layouts it does not take)."""
    if kernel() is None or not plain_float32(q, cos, sin):
        return None
    return _geometry(tuple(q.shape), q.stride(), tuple(cos.shape), cos.stride(), tuple(sin.shape), sin.stride())


def rotary(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``q * cos + rotate_half(q) * sin``, dense; torch's ops where the kernel does not apply."""
    geometry = _kernel_geometry(q, cos, sin)
    if geometry is None:
        return _reference(q, cos, sin)
    out = torch.empty(q.shape, dtype=torch.float32)
    kernel()(torch.get_num_threads(), geometry, q.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr())
    return out


def chain_call(args: tuple, out: torch.Tensor) -> Optional[StepCall]:
    """``rotary`` as a kernel chain step, where the kernel computed it (the call is its geometry)."""
    geometry = _kernel_geometry(*args)
    if geometry is None or not out.is_contiguous():
        return None
    return step_call(isa.c_address("qb_rotary_call"), geometry, (*args, out))


rotary.fresh_output = True  # (patterns/inplace.py: a later kernel may write into it)
