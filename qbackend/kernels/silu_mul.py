"""SwiGLU's gate, ``silu(gate) * up``, in one pass (csrc/silu_mul.c): the kernels (float32, bf16),
their checks, the functions lowered graphs call and the kernel chain step. The graph rewrite:
qbackend/llm/silu_mul.py."""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from qbackend.kernels import isa, registry
from qbackend.kernels.chain_step import StepCall, plain_float32, step_call
from qbackend.kernels.structs import SiluMulCall


# (csrc/silu_mul.c: threads, rows, n, a, a's row stride, b, b's row stride, out)
_SIGNATURE = (ctypes.c_int, ctypes.c_long, ctypes.c_long) + (ctypes.c_void_p, ctypes.c_long) * 2 + (ctypes.c_void_p,)


def kernel():
    """The C function, or None where the own kernels are not built."""
    return isa.c_function("qb_silu_mul_f32", _SIGNATURE)


def _bf16_kernel():
    """The bf16 variant (its signature: ``_SIGNATURE`` and out's row stride), or None."""
    return isa.c_function("qb_silu_mul_bf16", _SIGNATURE + (ctypes.c_long,))


def _row_stride(shape: tuple, stride: tuple) -> Optional[int]:
    """The distance between the rows of a tensor of ``shape`` / ``stride`` (its last dim
    contiguous, the dims before it one evenly strided run of rows), else None."""
    if stride[-1] != 1 and shape[-1] > 1:
        return None
    if len(shape) == 1:
        return shape[0]
    for d in range(len(shape) - 2):
        if shape[d] > 1 and stride[d] != stride[d + 1] * shape[d + 1]:
            return None
    return stride[-2]


@functools.lru_cache(maxsize=256)
def _row_strides(shape: tuple, a_stride: tuple, b_stride: tuple) -> Optional[tuple[int, int]]:
    """Both operands' row strides for one call site (made once: half of a decode call's ~11 us),
    or None where the kernel does not take them."""
    if not shape or 0 in shape:
        return None
    strides = _row_stride(shape, a_stride), _row_stride(shape, b_stride)
    return None if None in strides else strides


def _kernel_strides(a: torch.Tensor, b: torch.Tensor) -> Optional[tuple[int, int]]:
    """Both operands' row strides, or None where the kernel does not apply (other dtypes,
    shapes that broadcast, fake tensors under tracing, rows not evenly strided)."""
    if kernel() is None or not plain_float32(a, b) or a.shape != b.shape:
        return None
    return _row_strides(tuple(a.shape), a.stride(), b.stride())


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``F.silu(a) * b``, dense; torch's ops where the kernel does not apply."""
    strides = _kernel_strides(a, b)
    if strides is None:
        return torch.nn.functional.silu(a) * b
    n = a.shape[-1]
    out = torch.empty(a.shape, dtype=torch.float32)
    kernel()(torch.get_num_threads(), a.numel() // n, n, a.data_ptr(), strides[0], b.data_ptr(), strides[1], out.data_ptr())
    return out


def silu_mul_bf16_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = F.silu(a) * b`` for bf16 matrices of one shape whose rows are contiguous (each
    with its own row stride: column slices of wider ones), computed in float32 and rounded as
    torch's conversion to bf16 rounds; ``out``."""
    kernel = _bf16_kernel()
    if kernel is None:
        raise RuntimeError(registry.available())
    for name, t in (("a", a), ("b", b), ("out", out)):
        if t.dtype != torch.bfloat16 or t.dim() != 2 or t.shape != a.shape or t.device.type != "cpu" \
                or (t.stride(1) != 1 and t.shape[1] > 1) or t.stride(0) < t.shape[1]:
            raise ValueError(f"qbackend silu_mul_bf16: {name} must be a CPU bf16 matrix of a's shape {tuple(a.shape)} with "
                             f"contiguous rows, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
    if a.numel():
        kernel(torch.get_num_threads(), a.shape[0], a.shape[1], a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0),
               out.data_ptr(), out.stride(0))
    return out


def chain_call(args: tuple, out: torch.Tensor) -> Optional[StepCall]:
    """``silu_mul`` as a kernel chain step, where the kernel computed it."""
    a, b = args
    strides = _kernel_strides(a, b)
    if strides is None or not out.is_contiguous():
        return None
    n = a.shape[-1]
    return step_call(isa.c_address("qb_silu_mul_call"), SiluMulCall(a.numel() // n, n, *strides), (a, b, out, None))


silu_mul.fresh_output = True  # (patterns/inplace.py: a later kernel may write into it)
