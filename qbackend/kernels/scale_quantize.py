"""A float32 NCHW tensor times per-channel factors, quantized to uint8 in one pass
(``csrc/scale_quantize.c``): ``qbackend::scale_quantize``. The factors' gate (squeeze-excitation's
sigmoid or hard sigmoid) may run in the same call, and the call is a kernel chain step."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from qbackend.kernels import isa, library
from qbackend.kernels.chain_step import StepCall, step_call
from qbackend.kernels.common import Kernel, uint8_grid_refusal
from qbackend.kernels.structs import ScaleQuantizeCall

SCHEMAS = {"scale_quantize": "scale_quantize(Tensor x, Tensor factors, float scale, int zero_point, int qmin, int qmax, "
                             "str gate='none') -> Tensor"}
GATES = {"none": 0, "sigmoid": 1, "hardsigmoid": 2}  # scale_quantize.c ``enum gate``: what the factors go through first
_FUNCTION = "qb_scale_quantize_call"  # (threads, call, x, factors, y, unused) -> 0 / -1 (no memory for the gated factors)


@library.once
def _kernel():
    """The C function (None where the own kernels are not built)."""
    return isa.c_function(_FUNCTION, (ctypes.c_int,) + (ctypes.c_void_p,) * 5, ctypes.c_int)


def scale_quantize_refusal(x, factors, gate: str = "none") -> Optional[str]:
    """Why scale_quantize cannot take these (tensors or fake values), None if it can."""
    if x.dim() != 4 or x.dtype != torch.float32 or x.device.type != "cpu":
        return f"the kernel takes a float32 CPU [N, C, H, W] tensor, not {x.dtype} of rank {x.dim()} on {x.device}"
    n, c = x.shape[:2]
    if factors.dtype != torch.float32 or factors.device.type != "cpu" or tuple(factors.shape) not in ((n, c, 1, 1), (1, c, 1, 1)):
        return f"factors {factors.dtype} {tuple(factors.shape)}: the kernel takes float32 [{n} or 1, {c}, 1, 1]"
    if gate not in GATES:
        return f"gate {gate!r}: the kernel applies {', '.join(GATES)}"
    return None


def _channels_last(x: torch.Tensor) -> bool:
    return not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)  # (a 1x1 image is both: read as contiguous)


def _call(x, factors, scale, zero_point, qmin, qmax, gate="none") -> ScaleQuantizeCall:
    n, c, h, w = x.shape
    return ScaleQuantizeCall(n, c, h * w, _channels_last(x), c if factors.shape[0] == n and n > 1 else 0, GATES[gate],
                             1.0 / scale, zero_point, qmin, qmax)


def scale_quantize(x, factors, scale, zero_point, qmin, qmax, gate="none"):
    """``qbackend::scale_quantize``'s implementation, also called as is by eager graphs (no dispatcher)."""
    reason = scale_quantize_refusal(x, factors, gate) or uint8_grid_refusal(scale, zero_point, qmin, qmax)
    if reason is not None:
        raise ValueError(f"qbackend::scale_quantize: {reason}")
    x = x if _channels_last(x) else x.contiguous()
    factors = factors.contiguous()
    y = torch.empty_like(x, dtype=torch.uint8)
    call = _call(x, factors, scale, zero_point, qmin, qmax, gate)
    if _kernel()(torch.get_num_threads(), ctypes.addressof(call), x.data_ptr(), factors.data_ptr(), y.data_ptr(), None):
        raise MemoryError("qbackend::scale_quantize: no memory for the gated factors")
    return y


def chain_call(args: tuple, y: torch.Tensor) -> Optional[StepCall]:
    """The kernel chain step of a call (the lowering's own arguments, checked when the graph was
    built), None where an operand lies other than the call reads it."""
    x, factors = args[:2]
    if not (x.is_contiguous() or _channels_last(x)) or not factors.is_contiguous() or y.stride() != x.stride():
        return None
    return step_call(isa.c_address(_FUNCTION), _call(*args), (x, factors, y, None))


KERNELS = {"scale_quantize": Kernel(SCHEMAS["scale_quantize"], scale_quantize,
                                    lambda x, factors, *args: torch.empty_like(x, dtype=torch.uint8), scale_quantize)}
scale_quantize.fresh_output = True  # (patterns/inplace.py: a later kernel may write into its output)
