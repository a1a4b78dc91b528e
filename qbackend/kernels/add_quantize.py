"""A residual add of two float32 tensors with the sum's quantize to uint8 in one pass
(``csrc/add_quantize.c``): ``qbackend::add_quantize`` (the uint8 copy and the float32 sum) and
``qbackend::add_quantize_`` (the sum written into its first operand)."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from qbackend.kernels import fast_qdq, isa, library
from qbackend.kernels.chain_step import StepCall, step_call
from qbackend.kernels.common import Kernel, uint8_grid_refusal
from qbackend.kernels.structs import AddQuantizeCall

SCHEMAS = {
    # (returns the uint8 copy and the float32 sum)
    "add_quantize": "add_quantize(Tensor a, Tensor b, float scale, int zero_point, int qmin, int qmax) -> (Tensor, Tensor)",
    # (the sum written into a, as ATen's add_: for an in-place residual add; returns the uint8 copy)
    "add_quantize_": "add_quantize_(Tensor(a!) a, Tensor b, float scale, int zero_point, int qmin, int qmax) -> Tensor",
}
# (threads, elements, a, b, 1 / scale, zero point, qmin, qmax, sum, y)
_SIGNATURE = (ctypes.c_int, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float) + (ctypes.c_int,) * 3 + (ctypes.c_void_p,) * 2


@library.once
def _kernel():
    """The C function (None where the own kernels are not built)."""
    return isa.c_function("qb_add_quantize", _SIGNATURE)


def add_quantize_refusal(a, b) -> Optional[str]:
    """Why add_quantize cannot take these (tensors or fake values), None if it can: two float32
    CPU tensors of one shape (a residual and a branch; any strides)."""
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (a, b)):
        return f"the kernel adds float32 CPU tensors, not {a.dtype} on {a.device} and {b.dtype} on {b.device}"
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} and {tuple(b.shape)} differ (no broadcasting)"
    return None


def _dense(t: torch.Tensor) -> bool:
    """Every element once, no gaps: a permutation of a contiguous tensor's strides."""
    expected = 1
    for extent, stride in sorted(zip(t.shape, t.stride()), key=lambda pair: pair[1]):
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


def _add_quantize(a, b, scale, zero_point, qmin, qmax, in_place=False):
    """(uint8 quantize of a + b, a + b), both in a's memory order where a is dense; with
    ``in_place`` the sum goes into a and only the uint8 copy is returned."""
    reason = add_quantize_refusal(a, b) or uint8_grid_refusal(scale, zero_point, qmin, qmax)
    if reason is not None:
        raise ValueError(f"qbackend::add_quantize: {reason}")
    if in_place and not _dense(a):  # (a strided target: ATen's add_, then the quantize)
        return fast_qdq.quantize_per_tensor(a.add_(b), scale, zero_point, qmin, qmax, torch.uint8, nan_as=qmin)
    a = a if _dense(a) else a.contiguous()  # (the kernel reads a, b, s and y as one flat memory order: a's)
    s, y = a if in_place else torch.empty_like(a), torch.empty_like(a, dtype=torch.uint8)
    # (a copy of b in a's order may go where the sum goes: each place is read before it is written)
    b = b if b.stride() == a.stride() else (torch.empty_like(a) if in_place else s).copy_(b)
    _kernel()(torch.get_num_threads(), a.numel(), a.data_ptr(), b.data_ptr(), 1.0 / scale, zero_point, qmin, qmax, s.data_ptr(),
              y.data_ptr())
    return y if in_place else (y, s)


def add_quantize(a, b, scale, zero_point, qmin, qmax):
    """``qbackend::add_quantize``'s implementation, also called as is by eager graphs (no dispatcher)."""
    return _add_quantize(a, b, scale, zero_point, qmin, qmax)


def add_quantize_(a, b, scale, zero_point, qmin, qmax):
    """``qbackend::add_quantize_``'s implementation, also called as is by eager graphs."""
    return _add_quantize(a, b, scale, zero_point, qmin, qmax, in_place=True)


def chain_call(args: tuple, y) -> Optional[StepCall]:
    """``add_quantize_`` as a kernel chain step (qb_add_quantize_call, the sum into a): where a
    is dense and b and y are in its memory order (the kernel reads all as one flat order)."""
    a, b, scale, zero_point, qmin, qmax = args
    if (add_quantize_refusal(a, b) or uint8_grid_refusal(scale, zero_point, qmin, qmax) or not _dense(a)
            or b.stride() != a.stride() or y.stride() != a.stride() or y.dtype != torch.uint8):
        return None
    call = AddQuantizeCall(a.numel(), 1.0 / scale, zero_point, qmin, qmax)
    return step_call(isa.c_address("qb_add_quantize_call"), call, (a, b, a, y))


KERNELS = {
    "add_quantize": Kernel(SCHEMAS["add_quantize"], add_quantize,
                           lambda a, b, *args: (torch.empty_like(a, dtype=torch.uint8), torch.empty_like(a)), add_quantize),
    "add_quantize_": Kernel(SCHEMAS["add_quantize_"], add_quantize_,
                            lambda a, b, *args: torch.empty_like(a, dtype=torch.uint8), add_quantize_),
}
add_quantize.fresh_output = add_quantize_.fresh_output = True  # (patterns/inplace.py)
