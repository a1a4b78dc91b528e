"""Quantize / dequantize for the q/dq that stay in a lowered graph (model boundaries, ops left
unlowered), much faster than ``quantized_decomposed``.

On CPU, quantize runs qbackend's kernel (``quantize.quantize_dense``: one pass, bit-exact,
a NaN stored as the reference's 0, as fast as ATen's quantize) where it is built; else ATen's
vectorised quantized-tensor kernels, whose integer tensor is a view of the quantized tensor's
bytes (no copy), 5x faster than the step-by-step float path below, but a NaN lands on qmax and
a value exactly on a rounding tie may land one step away (its inverse scale is rounded
differently: 3 of 786k elements on a BERT activation). Dequantize runs ATen's (bit-exact,
1.6x faster). Without either (another device, a torch without quantized tensors) the
reference's own float32 sequence runs in place on one buffer: bit-exact, 2-6x faster than
the reference.
"""
from __future__ import annotations

import functools
import warnings

from typing import Optional

import torch

from qbackend.kernels import quantize
from qbackend.ops import resolve

QUANTIZED_DTYPE = {torch.uint8: torch.quint8, torch.int8: torch.qint8}
FULL_RANGE = {torch.uint8: (0, 255), torch.int8: (-128, 127)}


@functools.lru_cache(maxsize=None)
def _quantized_tensor_kernels() -> bool:
    """Whether this torch quantizes / dequantizes through CPU quantized tensors. The first
    call goes through the Python binding under a filter: it takes torch's once-per-process
    deprecation warning for quantized tensors, which users never asked for."""
    if not (resolve("quantize_to_quantized_tensor", "cpu") and resolve("dequantize_quantized_tensor", "cpu")):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.quantize_per_tensor(torch.zeros(1), 1.0, 0, torch.quint8).dequantize()
        except (RuntimeError, AttributeError):
            return False
    return True


def _vectorised(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """(Not while a compiler traces the graph with fake tensors: quantized tensors do not
    trace, the float steps do and fuse.)"""
    return type(t) is torch.Tensor and t.device.type == "cpu" and dtype in FULL_RANGE and _quantized_tensor_kernels()


def _quantized(x: torch.Tensor, scale: float, zero_point: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.quantize_per_tensor(x if x.dtype == torch.float32 else x.float(), scale, zero_point,
                                     QUANTIZED_DTYPE[dtype])


def _integer_view(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The integers of a quantized tensor, sharing its bytes (int_repr would copy them)."""
    return torch.empty(0, dtype=dtype, device=q.device).set_(q.untyped_storage(), q.storage_offset(), q.size(), q.stride())


def _quantized_integers(x: torch.Tensor, scale: float, zero_point: int, qmin: int, qmax: int, dtype: torch.dtype):
    """(quantized tensor, its integer view); a reduced range (reduce_range's [0, 127]) is
    clamped in place: clamp(clamp(v, 0, 255), qmin, qmax) == clamp(v, qmin, qmax)."""
    q = _quantized(x, scale, zero_point, dtype)
    integers = _integer_view(q, dtype)
    if (qmin, qmax) != FULL_RANGE[dtype]:
        integers.clamp_(qmin, qmax)
    return q, integers


def _scaled_rounded(x: torch.Tensor, scale: float, zero_point: int, qmin: int, qmax: int) -> torch.Tensor:
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.to(torch.float32)
    return _to_grid_(x * (1.0 / scale), zero_point, qmin, qmax)  # (times the inverse scale, as the reference)


def _to_grid_(y: torch.Tensor, zero_point: int, qmin: int, qmax: int) -> torch.Tensor:
    y.round_()
    y.add_(zero_point)
    return y.clamp_(qmin, qmax)


def _own_kernel(x, scale: float, zero_point: int, qmin: int, qmax: int, dtype: torch.dtype, nan_as: int) -> Optional[torch.Tensor]:
    """quantize.quantize_dense's result, None where it does not apply (a fake tensor under
    tracing, another device or dtype, a non-dense view, the kernels not built)."""
    return quantize.quantize_dense(x, scale, zero_point, qmin, qmax, dtype, nan_as) if type(x) is torch.Tensor else None


def _nan_stored_as(q: torch.Tensor, x: torch.Tensor, nan_as: int) -> torch.Tensor:
    """The other paths store a NaN as 0 (the float steps) or qmax (ATen's quantize): put
    ``nan_as`` there. (A sum is 2-20x cheaper than isnan().any(); inf - inf also gives NaN,
    which costs only the fill.)"""
    if type(x) is torch.Tensor and bool(x.sum().isnan()):
        q.masked_fill_(x.isnan(), nan_as)
    return q


def quantize_per_tensor(x, scale: float, zero_point: int, qmin: int, qmax: int, dtype: torch.dtype, nan_as: int = 0):
    """``nan_as``: a NaN's integer (the reference's 0; lowering/signed_int8.py asks for 128)."""
    y = _own_kernel(x, scale, zero_point, qmin, qmax, dtype, nan_as)
    if y is not None:
        return y
    return _nan_stored_as(_quantize_without_own_kernel(x, scale, zero_point, qmin, qmax, dtype), x, nan_as)


def _quantize_without_own_kernel(x, scale: float, zero_point: int, qmin: int, qmax: int, dtype: torch.dtype):
    if _vectorised(x, dtype):
        # ATen's quantize writes a contiguous result from a contiguous copy of its input: a
        # permuted input is quantized in its memory order and the result permuted back, so
        # the integers keep the input's strides (measured: 1.3 ms of copies per BERT-base
        # encoder call at batch 8, attention's output and the reshape after its quantize)
        order = quantize.memory_order(x)
        if order is not None:
            inverse = sorted(range(x.dim()), key=order.__getitem__)
            return _quantized_integers(x.permute(order), scale, zero_point, qmin, qmax, dtype)[1].permute(inverse)
        return _quantized_integers(x, scale, zero_point, qmin, qmax, dtype)[1]
    return _scaled_rounded(x, scale, zero_point, qmin, qmax).to(dtype)


def quantize_per_tensor_channels_last(x, scale: float, zero_point: int, qmin: int, qmax: int, dtype: torch.dtype,
                                      nan_as: int = 0):
    """``quantize_per_tensor`` for a conv's input: a channels-last result, which the conv
    kernels read without a transpose of their own. A float32 NCHW input is quantized and laid
    out in one pass (qbackend's kernel: the reference's arithmetic, bit-exact); otherwise a CPU
    input is made channels-last first."""
    if dtype == torch.uint8 and type(x) is torch.Tensor and nan_as == qmin:  # (the kernel stores a NaN as qmin)
        y = quantize.quantize_channels_last(x, scale, zero_point, qmin, qmax)
        if y is not None:
            return y
    if x.dim() == 4 and x.device.type == "cpu":  # (elsewhere the device's own conv picks its layout)
        x = x.contiguous(memory_format=torch.channels_last)
    return quantize_per_tensor(x, scale, zero_point, qmin, qmax, dtype, nan_as)


def dequantize_per_tensor(q, scale: float, zero_point: int, qmin: int, qmax: int, dtype: torch.dtype, *, out_dtype=None):
    if out_dtype in (None, torch.float32) and q.dtype == dtype and _vectorised(q, dtype):
        return torch._make_per_tensor_quantized_tensor(q, scale, zero_point).dequantize()
    if q.dtype != dtype:  # (the reference asserts it: a graph from a file may say another dtype)
        raise AssertionError(f"Expecting input to have dtype {dtype}, but got dtype: {q.dtype}")
    y = q.to(out_dtype or torch.float32)
    y.sub_(zero_point)
    return y.mul_(scale)


def scale_quantize_per_tensor(x, factors: torch.Tensor, scale: float, zero_point: int, qmin: int, qmax: int,
                              dtype: torch.dtype, nan_as: int = 0):
    """quantize_per_tensor(x * factors): the graph's float32 product, then the one-pass
    quantize (2-3x faster than the float steps: 33 vs 58 us on MiniLM's [64, 384] at batch 1,
    198 vs 565 us on [512, 1536])."""
    return quantize_per_tensor(torch.mul(x, factors), scale, zero_point, qmin, qmax, dtype, nan_as)


def layer_norm_quantize_per_tensor(x, weight: torch.Tensor, bias: torch.Tensor, eps: float, scale: float, zero_point: int,
                                   qmin: int, qmax: int, dtype: torch.dtype, nan_as: int = 0):
    """quantize_per_tensor(layer_norm(x)) over the last dimension: ATen's LayerNorm, then the
    one-pass quantize (where qbackend's kernel does not take it: lowering/layer_norm.py)."""
    return quantize_per_tensor(torch.ops.aten.layer_norm.default(x, [x.shape[-1]], weight, bias, eps), scale, zero_point,
                               qmin, qmax, dtype, nan_as)


def quantize_dequantize_per_tensor(x, scale: float, zero_point: int, qmin: int, qmax: int, dtype: torch.dtype, out_dtype=None,
                                   nan_as: int = 0):
    """dq(q(x)) for a quantize whose readers all dequantize it alike: qbackend's quantize, or
    else the float steps without the integer tensor (exact: the rounded, clamped value is an
    integer-valued float32 the integer cast would keep; a NaN is the integer it is stored as)."""
    q = _own_kernel(x, scale, zero_point, qmin, qmax, dtype, nan_as)
    if q is not None:
        return dequantize_per_tensor(q, scale, zero_point, qmin, qmax, dtype, out_dtype=out_dtype)
    y = _scaled_rounded(x, scale, zero_point, qmin, qmax).nan_to_num_(nan=float(nan_as))
    if out_dtype not in (None, torch.float32):
        y = y.to(out_dtype)
    y.sub_(zero_point)
    return y.mul_(scale)


def quantize_per_tensor_tensor(x, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int, dtype: torch.dtype):
    """The .tensor overload (dynamic quantization): the reference reads the one-element
    scale / zero point with .item() and runs the scalar version, and so does this."""
    return quantize_per_tensor(x, scale.item(), zero_point.item(), qmin, qmax, dtype)


def dequantize_per_tensor_tensor(q, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int, dtype: torch.dtype, *, out_dtype=None):
    return dequantize_per_tensor(q, scale.item(), zero_point.item(), qmin, qmax, dtype, out_dtype=out_dtype)


def clamp_to_range_(q: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """An int8 kernel's own fresh output, clamped in place to a reduced range: the kernels
    clamp to the dtype's full range only."""
    return q.clamp_(qmin, qmax)


# Each returns a tensor it allocated (clamp_to_range_: its input, the kernel's fresh buffer): the in-place safety analysis may treat it as fresh.
for _fn in (quantize_per_tensor, quantize_per_tensor_channels_last, dequantize_per_tensor, quantize_dequantize_per_tensor, scale_quantize_per_tensor,
            quantize_per_tensor_tensor, dequantize_per_tensor_tensor, clamp_to_range_):
    _fn.fresh_output = True
