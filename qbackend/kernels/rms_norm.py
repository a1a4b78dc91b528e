"""Llama-style RMSNorm, and the residual add before it, in one pass (csrc/rms_norm_f32.c): the
kernel, its checks, the functions lowered graphs call and its kernel chain step. The graph
rewrite that finds the ops: qbackend/llm/rms_norm.py."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from qbackend.kernels import isa
from qbackend.kernels.chain_step import StepCall, dense, step_call
from qbackend.kernels.structs import RmsNormCall


# (csrc/rms_norm_f32.c: threads, rows, n, a, b, weight, eps, sum, out)
_SIGNATURE = (ctypes.c_int, ctypes.c_long, ctypes.c_long) + (ctypes.c_void_p,) * 3 + (ctypes.c_float,) + (ctypes.c_void_p,) * 2


def kernel():
    """The C function, or None where the own kernels are not built."""
    return isa.c_function("qb_rms_norm_f32", _SIGNATURE)


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _applies(weight: torch.Tensor, *rows: torch.Tensor) -> bool:
    """The kernel computes this call: plain float32 CPU tensors (not fake ones under tracing),
    rows of weight's length, of one shape when two are added."""
    tensors = (weight, *rows)
    return (kernel() is not None and all(type(t) is torch.Tensor and t.dtype == torch.float32 and t.device.type == "cpu"
                                          for t in tensors)
            and weight.dim() == 1 and rows[0].dim() >= 1 and rows[0].shape[-1] == weight.numel() > 0
            and rows[0].numel() > 0 and all(t.shape == rows[0].shape for t in rows))


def _run(weight: torch.Tensor, eps: float, a: torch.Tensor, b: Optional[torch.Tensor]) -> tuple:
    """(sum or None, norm) by the kernel; the inputs made contiguous (rows n apart)."""
    a, weight = a.contiguous(), weight.contiguous()
    b = None if b is None else b.contiguous()
    out, total = torch.empty_like(a), None if b is None else torch.empty_like(a)
    n = weight.numel()
    kernel()(torch.get_num_threads(), a.numel() // n, n, a.data_ptr(), 0 if b is None else b.data_ptr(), weight.data_ptr(),
              eps, 0 if total is None else total.data_ptr(), out.data_ptr())
    return total, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))`` over x's last dim; torch's ops where the
    kernel does not apply."""
    if not _applies(weight, x):
        return _reference(x, weight, eps)
    return _run(weight, eps, x, None)[1]


def add_rms_norm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a + b, rms_norm(a + b, weight, eps))``."""
    if not _applies(weight, a, b):
        total = a + b
        return total, _reference(total, weight, eps)
    return _run(weight, eps, a, b)


def chain_call(args: tuple, result) -> Optional[StepCall]:
    """``rms_norm`` / ``add_rms_norm`` as a kernel chain step: where the kernel computed it
    and its operands are dense (the step reads them in place)."""
    add = len(args) == 4
    (a, b, weight, eps), (total, out) = (args if add else (args[0], None, *args[1:])), (result if add else (None, result))
    if not (_applies(weight, a, *([b] if add else [])) and dense(a, b, weight, total, out)):
        return None
    n = weight.numel()
    struct = RmsNormCall(a.numel() // n, n, weight.data_ptr(), eps)
    return step_call(isa.c_address("qb_rms_norm_call"), struct, (a, b, total, out), weight)


rms_norm.fresh_output = add_rms_norm.fresh_output = True  # (patterns/inplace.py: a later kernel may write into them)
