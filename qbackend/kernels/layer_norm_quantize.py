"""LayerNorm over the last dim with its quantize to uint8 (``csrc/layer_norm_quantize.c``):
``qbackend::layer_norm_quantize``, and ``qbackend::layer_norm_and_quantize`` (the float32 rows
too, for a norm that other ops read as well)."""
from __future__ import annotations

import ctypes
import math
from typing import Optional

import torch

from qbackend.kernels import fast_qdq, isa, library
from qbackend.kernels.chain_step import StepCall, dense, step_call
from qbackend.kernels.common import Kernel, uint8_grid_refusal
from qbackend.kernels.structs import LayerNormCall

SCHEMAS = {
    "layer_norm_quantize": "layer_norm_quantize(Tensor x, Tensor weight, Tensor bias, float eps, float scale, int zero_point, "
                           "int qmin, int qmax) -> Tensor",
    # (the same, and the float32 rows it quantized: for a norm that other ops read too)
    "layer_norm_and_quantize": "layer_norm_and_quantize(Tensor x, Tensor weight, Tensor bias, float eps, float scale, "
                               "int zero_point, int qmin, int qmax) -> (Tensor, Tensor)",
}
# (threads, rows, c, x, weight, bias, eps, 1 / scale, zero point, qmin, qmax, y, yf) -> rows the kernel left to ATen
_SIGNATURE = ((ctypes.c_int, ctypes.c_long, ctypes.c_int) + (ctypes.c_void_p,) * 3 + (ctypes.c_float,) * 2 + (ctypes.c_int,) * 3
              + (ctypes.c_void_p,) * 2)


@library.once
def _kernel():
    """The C function (None where the own kernels are not built)."""
    return isa.c_function("qb_layer_norm_quantize", _SIGNATURE, ctypes.c_long)


def layer_norm_quantize_refusal(x, weight, bias, eps) -> Optional[str]:
    """Why layer_norm_quantize cannot take these (tensors or fake values), None if it can."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() == 0 or x.numel() == 0:
        return f"the kernel takes a non-empty float32 CPU tensor, not {x.dtype} of shape {tuple(x.shape)} on {x.device}"
    return norm_parameters_refusal(x.shape[-1], weight, bias, eps)


def norm_parameters_refusal(c: int, weight, bias, eps) -> Optional[str]:
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None or t.dtype != torch.float32 or t.device.type != "cpu" or tuple(t.shape) != (c,):
            return f"{name} {None if t is None else (t.dtype, tuple(t.shape))}: the kernel takes float32 [{c}]"
    if not (math.isfinite(eps) and eps >= 0):
        return f"eps {eps}"
    return None


def _layer_norm_quantize(x, weight, bias, eps, scale, zero_point, qmin, qmax, keep_float=False):
    """The uint8 rows, or (uint8 rows, float32 rows) with ``keep_float``."""
    reason = layer_norm_quantize_refusal(x, weight, bias, eps) or uint8_grid_refusal(scale, zero_point, qmin, qmax)
    if reason is not None:
        raise ValueError(f"qbackend::layer_norm_quantize: {reason}")
    x, weight, bias = x.contiguous(), weight.contiguous(), bias.contiguous()
    y, yf = torch.empty(x.shape, dtype=torch.uint8), torch.empty(x.shape) if keep_float else None
    c = x.shape[-1]
    if _kernel()(torch.get_num_threads(), x.numel() // c, c, x.data_ptr(), weight.data_ptr(), bias.data_ptr(), eps,
                 1.0 / scale, zero_point, qmin, qmax, y.data_ptr(), None if yf is None else yf.data_ptr()):
        # rows of huge, infinite or NaN values: ATen's own float32 statistics decide them
        yf = torch.ops.aten.layer_norm.default(x, [c], weight, bias, eps)
        y = fast_qdq.quantize_per_tensor(yf, scale, zero_point, qmin, qmax, torch.uint8, nan_as=qmin)
    return (y, yf) if keep_float else y


def layer_norm_quantize(x, weight, bias, eps, scale, zero_point, qmin, qmax):
    """``qbackend::layer_norm_quantize``'s implementation, also called as is by eager graphs (no dispatcher)."""
    return _layer_norm_quantize(x, weight, bias, eps, scale, zero_point, qmin, qmax)


def layer_norm_and_quantize(x, weight, bias, eps, scale, zero_point, qmin, qmax):
    """``qbackend::layer_norm_and_quantize``'s implementation, also called as is by eager graphs."""
    return _layer_norm_quantize(x, weight, bias, eps, scale, zero_point, qmin, qmax, keep_float=True)


def chain_call(args: tuple, result) -> Optional[StepCall]:
    """``layer_norm_quantize`` / ``layer_norm_and_quantize`` as a kernel chain step
    (qb_layer_norm_quantize_call): where the kernel takes the call and its operands are dense. A
    call with rows past the kernel's range refuses at run time: the chain's nodes then run."""
    x, weight, bias, eps, scale, zero_point, qmin, qmax = args
    y, yf = result if isinstance(result, tuple) else (result, None)
    if (layer_norm_quantize_refusal(x, weight, bias, eps) or uint8_grid_refusal(scale, zero_point, qmin, qmax)
            or _kernel() is None or not dense(x, weight, bias, y, yf) or y.shape != x.shape):
        return None
    c = x.shape[-1]
    call = LayerNormCall(x.numel() // c, c, weight.data_ptr(), bias.data_ptr(), eps, 1.0 / scale, zero_point, qmin, qmax)
    return step_call(isa.c_address("qb_layer_norm_quantize_call"), call, (x, y, yf, None), (weight, bias))


KERNELS = {
    "layer_norm_quantize": Kernel(SCHEMAS["layer_norm_quantize"], layer_norm_quantize,
                                  lambda x, *args: x.new_empty(x.shape, dtype=torch.uint8), layer_norm_quantize),
    "layer_norm_and_quantize": Kernel(SCHEMAS["layer_norm_and_quantize"], layer_norm_and_quantize,
                                      lambda x, *args: (x.new_empty(x.shape, dtype=torch.uint8), x.new_empty(x.shape)),
                                      layer_norm_and_quantize),
}
layer_norm_quantize.fresh_output = layer_norm_and_quantize.fresh_output = True  # (patterns/inplace.py)
