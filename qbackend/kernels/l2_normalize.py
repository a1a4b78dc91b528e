"""``F.normalize(x, p=2, dim=-1, eps)`` in one pass (csrc/l2_normalize_f32.c): the kernel, its
checks and the function lowered graphs call. The graph rewrite: qbackend/passes/l2_normalize.py."""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from qbackend.kernels import isa


LEADING = 3  # leading dims the kernel indexes rows by


# (csrc/l2_normalize_f32.c: threads, sizes[3], strides[3], n, eps, x, out)
_SIGNATURE = (ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p)


def kernel():
    """The C function, or None where the own kernels are not built."""
    return isa.c_function("qb_l2_normalize_f32", _SIGNATURE)


@functools.lru_cache(maxsize=256)
def _rows(shape: tuple, stride: tuple) -> Optional[tuple]:
    """The kernel's (sizes, strides) of the leading dims for one call site (made once), or None
    where it does not take the tensor: more than LEADING leading dims, the last not contiguous."""
    if not 1 <= len(shape) <= LEADING + 1 or 0 in shape or (stride[-1] != 1 and shape[-1] > 1):
        return None
    pad = LEADING + 1 - len(shape)
    return (ctypes.c_long * LEADING)(*(1,) * pad, *shape[:-1]), (ctypes.c_long * LEADING)(*(0,) * pad, *stride[:-1])


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.normalize(x, dim=-1, eps=eps)``, dense; torch's ops where the kernel does not apply
    (other dtypes or devices, fake tensors under tracing, ranks above 4)."""
    rows = None
    if kernel() is not None and type(x) is torch.Tensor and x.dtype == torch.float32 and x.device.type == "cpu":
        rows = _rows(tuple(x.shape), x.stride())
    if rows is None:
        return torch.nn.functional.normalize(x, dim=-1, eps=eps)
    out = torch.empty(x.shape, dtype=torch.float32)
    kernel()(torch.get_num_threads(), *rows, x.shape[-1], eps, x.data_ptr(), out.data_ptr())
    return out


l2_normalize.fresh_output = True  # (patterns/inplace.py: a later kernel may write into it)
