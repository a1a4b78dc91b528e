"""What the int8 conv and pool families share: argument checks, output geometry, and the
prepared call (a ctypes struct per call site and input shape) with its per-weight cache."""
from __future__ import annotations

import ctypes
import math
import weakref
from typing import Callable, NamedTuple, Optional

import torch

from qbackend.kernels import isa
from qbackend.kernels.chain_step import FOUR, SCRATCH, X_TO_Y, StepCall
from qbackend.kernels.scratch import thread_scratch

# qconv's and qconv_depthwise's unary post-ops besides their clamp (vec_math.h ``enum activation``)
ACTIVATIONS = {"none": 0, "gelu": 1, "gelu_tanh": 2, "swish": 3, "hardswish": 4}
X_TO_Y_SIGNATURE = (ctypes.c_int,) + (ctypes.c_void_p,) * 3  # (threads, call, x, y) -> 0 / -1 (scratch not allocated)
FOUR_SIGNATURE = (ctypes.c_int,) + (ctypes.c_void_p,) * 5  # (threads, call, a, b, c, d) -> 0 / -1


class Kernel(NamedTuple):
    """One ``qbackend::`` op of a kernel family, as ``registry`` registers it."""

    schema: str
    impl: Callable  # the checked implementation (the op's CPU kernel)
    fake: Callable  # its meta implementation (fake tensors under tracing)
    plain: Callable  # what eager graphs call: the op without the dispatcher (the lowering's own constants trusted)


def check_nchw_uint8(x: torch.Tensor, channels: Optional[int], name: str) -> None:
    """uint8 CPU [N, C, H, W] activations, with ``channels`` channels (None: any)."""
    if x.dim() != 4 or x.dtype != torch.uint8 or x.device.type != "cpu" or channels not in (None, x.shape[1]):
        raise ValueError(f"qbackend::{name} takes uint8 CPU activations [N, {'C' if channels is None else channels}, H, W], "
                         f"got {x.dtype} {tuple(x.shape)} on {x.device}")


def check_constants(name: str, *expected) -> None:
    """The packed constants the C code reads as raw memory: (tensor, dtype, element count)."""
    for tensor, dtype, numel in expected:
        if tensor.dtype != dtype or tensor.numel() != numel or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"qbackend::{name}: expected a contiguous CPU {dtype} constant of {numel} elements, "
                             f"got {tensor.dtype} {tuple(tensor.shape)}")


def conv_output_size(size: int, stride: int, padding: int, kernel: int = 3, dilation: int = 1, ceil_mode: bool = False) -> int:
    """torch's: with ``ceil_mode`` (pools) a last, partial window too, unless it would start in the padding."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1
    out = (span + (stride - 1 if ceil_mode else 0)) // stride + 1
    return out - 1 if ceil_mode and (out - 1) * stride >= size + padding else out


def output_hw(h: int, w: int, kernel_size, stride, padding, dilation=(1, 1), ceil_mode=False) -> tuple[int, int]:
    """A conv's / pool's output height and width (``conv_output_size`` per dim)."""
    return tuple(conv_output_size(size, *args, ceil_mode) for size, args in zip((h, w), zip(stride, padding, kernel_size, dilation)))


WINDOW_LIMIT = 1 << 15  # kernel sizes, strides, paddings and dilations the C kernels take (int arithmetic)


def check_levels(name: str, x_zero_point: int, out_zero_point: int, qmin: int, qmax: int) -> None:
    """uint8 zero points and an output clamp within uint8 (the C kernels store bytes)."""
    if not (0 <= x_zero_point <= 255 and 0 <= out_zero_point <= 255 and 0 <= qmin <= qmax <= 255):
        raise ValueError(f"qbackend::{name}: zero points {x_zero_point}, {out_zero_point} and clamp [{qmin}, {qmax}] "
                         "must lie within 0..255")


def checked_window(name: str, h: int, w: int, kernel_size, stride, padding, dilation=(1, 1), ceil_mode=False) -> tuple[int, int]:
    """``output_hw`` for a C kernel: each argument two ints in range (kernel, stride and
    dilation from 1, padding from 0), and an output of at least one pixel; else ValueError."""
    lowest = {"kernel_size": 1, "stride": 1, "padding": 0, "dilation": 1}
    for (what, low), value in zip(lowest.items(), (kernel_size, stride, padding, dilation)):
        if len(value) != 2 or not all(isinstance(v, int) and low <= v < WINDOW_LIMIT for v in value):
            raise ValueError(f"qbackend::{name}: {what} {list(value)}: two ints from {low} to {WINDOW_LIMIT - 1} expected")
    oh, ow = output_hw(h, w, kernel_size, stride, padding, dilation, ceil_mode)
    if oh < 1 or ow < 1:
        raise ValueError(f"qbackend::{name}: kernel {list(kernel_size)}, stride {list(stride)}, padding {list(padding)}, "
                         f"dilation {list(dilation)} on a {h}x{w} input: no output")
    return oh, ow


def uint8_grid_refusal(scale, zero_point, qmin, qmax) -> Optional[str]:
    """Why a float -> uint8 quantize cannot write to this grid, None if it can."""
    if not (0 <= qmin <= qmax <= 255 and qmin <= zero_point <= qmax):
        return f"uint8 range [{qmin}, {qmax}] with zero point {zero_point}"
    if not (math.isfinite(scale) and scale > 0):
        return f"scale {scale}"
    return None


class Prepared(NamedTuple):
    """One call site's kernel arguments for one input shape (a ctypes struct passed by
    pointer), with what the call needs besides, and the other constants the struct points to."""

    struct: ctypes.Structure
    shape: tuple  # of the output
    strides: tuple  # of the output: channels last
    dtype: torch.dtype  # of the output
    function: ctypes._CFuncPtr
    constants: tuple  # held here so that their memory, and their ids in the key, stay theirs
    address: int  # of ``struct``
    # None: the kernel is (threads, call, x, y); else (threads, call, x, y, scratch, None)
    # (FOUR_SIGNATURE) and takes this many bytes of scratch: a chain's scratch region, or this
    # thread's (scratch.py)
    scratch: Optional[int] = None


def make_prepared(struct: ctypes.Structure, shape: tuple, dtype: torch.dtype, function, constants: tuple,
                  scratch: Optional[int] = None) -> Prepared:
    n, c, h, w = shape
    return Prepared(struct, shape, (h * w * c, 1, w * c, c), dtype, function, constants, ctypes.addressof(struct), scratch)


def new_output(x: torch.Tensor, prepared: Prepared) -> torch.Tensor:
    """The kernel's empty output (x.new_empty_strided: 1.0 us, torch.empty with a memory format 1.7)."""
    return x.new_empty_strided(prepared.shape, prepared.strides, dtype=prepared.dtype)


# id(packed weight) -> {key: Prepared}. An entry goes when its weight does (a finalizer: the
# weight's id cannot be reused before), so a dropped model's calls and constants go with it.
# (Not an attribute of the weight: its ctypes structs would make the tensor uncopyable.)
PREPARED: dict = {}


def cached_prepared(weight: torch.Tensor, trusted: bool, x: torch.Tensor, args: tuple, prepare) -> Prepared:
    """The call for input ``x`` and the other ``args``. ``trusted`` (the lowering's own
    constants): cached per packed ``weight``, keyed by the input's shape and kind, the kernel
    build and the other arguments (tensors by identity: the entry holds them; the graph gives
    sizes as tuples, so the key is built without a conversion: ~0.8 us, not 2). Else
    ``prepare()`` checks every argument, every call."""
    if not trusted:
        return prepare()
    cache = PREPARED.get(id(weight))
    if cache is None:
        cache = PREPARED[id(weight)] = {}
        weakref.finalize(weight, PREPARED.pop, id(weight), None)
    key = (x.shape, x.dtype, x.device, isa.gemm_build(), args)
    try:
        prepared = cache.get(key)
    except TypeError:  # a list among the arguments (a direct caller's)
        key = key[:-1] + (tuple(tuple(a) if isinstance(a, list) else a for a in args),)
        prepared = cache.get(key)
    if prepared is None:
        prepared = cache[key] = prepare()
    return prepared


def run_x_to_y(prepared: Prepared, x: torch.Tensor, name: str) -> torch.Tensor:
    """Run a prepared (threads, call, x, y) -> 0 / failure kernel: the depthwise conv, the pools."""
    x = x.contiguous(memory_format=torch.channels_last)
    y = new_output(x, prepared)
    scratch = () if prepared.scratch is None else (thread_scratch(prepared.scratch) if prepared.scratch else None, None)
    if prepared.function(torch.get_num_threads(), prepared.address, x.data_ptr(), y.data_ptr(), *scratch):
        raise MemoryError(f"qbackend::{name}: the kernel failed: a thread could not allocate its scratch (or it "
                          "refused arguments its checks should have)")
    return y


def channels_last_like(x: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    """An empty NHWC-strided tensor of x's kind (fake under tracing): the kernels' output layout."""
    n, c, h, w = shape
    return x.new_empty_strided(shape, (h * w * c, 1, w * c, c), dtype=dtype)


def prepared_chain_call(prepared_call: Callable, kind: int) -> Callable:
    """A conv or pool family's kernel chain step (kernel_chain.py): its prepared call for the
    call's arguments, the lowering's own constants (checked when the graph was built)."""
    def chain_call(args: tuple, y: torch.Tensor) -> Optional[StepCall]:
        # (the plain call copies x and a residual to channels-last; a step reads them where they
        # lie: a transposed view of rows, fuzz seed 61, gave other values from the second call)
        if not all(t is None or t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
                   for t in (args[0], args[4] if kind != X_TO_Y else None)):
            return None
        call = prepared_call(*args, trusted=True)
        if kind == X_TO_Y and call.scratch is not None:
            return StepCall(FOUR, isa.function_address(call.function), call.address, (args[0], y, SCRATCH, None), call,
                            call.scratch)
        if kind == X_TO_Y:
            operands = (args[0], y)
        else:  # (x, residual, uint8 y, float32 y: the call knows its output's dtype)
            float_out = call.dtype == torch.float32
            operands = (args[0], args[4], None if float_out else y, y if float_out else None)
        return StepCall(kind, isa.function_address(call.function), call.address, operands, call)
    return chain_call
