"""A float32 NCHW tensor times per-channel factors, quantized to uint8 in one pass
(``csrc/scale_quantize.c``): ``qbackend::scale_quantize``."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from qbackend.kernels import isa, library
from qbackend.kernels.common import Kernel, uint8_grid_refusal

SCHEMAS = {"scale_quantize": "scale_quantize(Tensor x, Tensor factors, float scale, int zero_point, int qmin, int qmax) -> Tensor"}
# (threads, n, c, pixels, channels_last, x, factors, factor stride, 1 / scale, zero point, qmin, qmax, y)
_SIGNATURE = ((ctypes.c_int,) * 3 + (ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_float)
              + (ctypes.c_int,) * 3 + (ctypes.c_void_p,))


@library.once
def _kernel():
    """The C function (None where the own kernels are not built)."""
    return isa.c_function("qb_scale_quantize", _SIGNATURE)


def scale_quantize_refusal(x, factors) -> Optional[str]:
    """Why scale_quantize cannot take these (tensors or fake values), None if it can."""
    if x.dim() != 4 or x.dtype != torch.float32 or x.device.type != "cpu":
        return f"the kernel takes a float32 CPU [N, C, H, W] tensor, not {x.dtype} of rank {x.dim()} on {x.device}"
    n, c = x.shape[:2]
    if factors.dtype != torch.float32 or factors.device.type != "cpu" or tuple(factors.shape) not in ((n, c, 1, 1), (1, c, 1, 1)):
        return f"factors {factors.dtype} {tuple(factors.shape)}: the kernel takes float32 [{n} or 1, {c}, 1, 1]"
    return None


def scale_quantize(x, factors, scale, zero_point, qmin, qmax):
    """``qbackend::scale_quantize``'s implementation, also called as is by eager graphs (no dispatcher)."""
    reason = scale_quantize_refusal(x, factors) or uint8_grid_refusal(scale, zero_point, qmin, qmax)
    if reason is not None:
        raise ValueError(f"qbackend::scale_quantize: {reason}")
    channels_last = not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    x = x if channels_last else x.contiguous()  # (a 1x1 image is both: read as contiguous)
    factors = factors.contiguous()
    n, c, h, w = x.shape
    y = torch.empty_like(x, dtype=torch.uint8)
    _kernel()(torch.get_num_threads(), n, c, h * w, channels_last, x.data_ptr(), factors.data_ptr(),
              c if factors.shape[0] == n and n > 1 else 0, 1.0 / scale, zero_point, qmin, qmax, y.data_ptr())
    return y


KERNELS = {"scale_quantize": Kernel(SCHEMAS["scale_quantize"], scale_quantize,
                                    lambda x, factors, *args: torch.empty_like(x, dtype=torch.uint8), scale_quantize)}
scale_quantize.fresh_output = True  # (patterns/inplace.py: a later kernel may write into its output)
