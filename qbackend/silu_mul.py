"""SwiGLU's gate, ``silu(gate) * up``, in one pass (csrc/silu_mul_f32.c).

Llama's MLP (Mistral's, Qwen2's the same) computes ``act_fn(gate_proj(x)) * up_proj(x)``; with
gate and up merged into one weight-only call, both operands are slices of its output. The graph's
two ops read and write the intermediate twice (a 512-token prompt: 4 x 11.5 MB per layer); the
kernel reads the slices in place and writes the product once. ``silu_muls_fused`` rewrites
each ``silu(a) * b`` of two float32 tensors of one shape.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.patterns.base import fake_value

from . import native
from .float_ops import calls_in_place_of, float32, is_op, operands, single_user


# (csrc/silu_mul_f32.c: threads, rows, n, a, a's row stride, b, b's row stride, out)
_SIGNATURE = (ctypes.c_int, ctypes.c_long, ctypes.c_long) + (ctypes.c_void_p, ctypes.c_long) * 2 + (ctypes.c_void_p,)


def _kernel():
    """The C function, or None where the own kernels are not built."""
    return native.c_function("qb_silu_mul_f32", _SIGNATURE)


def _row_stride(t: torch.Tensor) -> Optional[int]:
    """The distance between t's rows (its last dim contiguous, the dims before it one evenly
    strided run of rows), else None."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return None
    if t.dim() == 1:
        return t.shape[0]
    for d in range(t.dim() - 2):
        if t.shape[d] > 1 and t.stride(d) != t.stride(d + 1) * t.shape[d + 1]:
            return None
    return t.stride(-2)


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``F.silu(a) * b``, dense; torch's ops where the kernel does not apply (other dtypes,
    shapes that broadcast, fake tensors under tracing, rows not evenly strided)."""
    if (_kernel() is None or type(a) is not torch.Tensor or type(b) is not torch.Tensor or a.dtype != torch.float32
            or b.dtype != torch.float32 or a.device.type != "cpu" or b.device.type != "cpu" or a.shape != b.shape
            or a.dim() == 0 or a.numel() == 0):
        return torch.nn.functional.silu(a) * b
    strides = _row_stride(a), _row_stride(b)
    if None in strides:
        return torch.nn.functional.silu(a) * b
    n = a.shape[-1]
    out = torch.empty(a.shape, dtype=torch.float32)
    _kernel()(torch.get_num_threads(), a.numel() // n, n, a.data_ptr(), strides[0], b.data_ptr(), strides[1], out.data_ptr())
    return out


silu_mul.fresh_output = True  # (patterns/inplace.py: a later kernel may write into it)


def _gated(node: Node) -> Optional[tuple[Node, Node]]:
    """(a, b) when ``node`` is ``silu(a) * b`` (either order) of float32 tensors of one shape."""
    for gate, up in [] if operands(node, "mul") is None else [operands(node, "mul"), operands(node, "mul")[::-1]]:
        if is_op(gate, "silu") and single_user(gate) and len(gate.args) == 1 and not gate.kwargs.get("inplace", False) \
                and float32(gate.args[0]) and float32(up) and fake_value(gate.args[0]).shape == fake_value(up).shape:
            return gate.args[0], up
    return None


def silu_muls_fused(gm: GraphModule) -> Optional[str]:
    """Rewrite each ``silu(a) * b`` (see the module docstring) into one call."""
    return None if _kernel() is None else calls_in_place_of(gm, _gated, silu_mul, "SiLU-and-multiply(s)")
