"""Weight-only int4 / int8 matmul with int16 activations (``csrc/weight_only_int16.c``):
``qbackend::int4_mm_int16`` and ``qbackend::int8_mm_int16``.

torch 2.13's packed kernels are fast only with bf16 activations and, without AVX512,
compute-bound at 3-4x their memory-bandwidth time; these quantize the activations per group
to int16 (finer than bf16 rounding) and multiply with integer instructions: 1.5 ms vs 3.5-4.2 ms
on a 4096x11008 int4 layer. Built again in the AVX512-VNNI library, where int4 sums take
``vpdpbusd`` (``_weight_only_library``).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from qbackend.kernels import isa, library
from qbackend.kernels.chain_step import SCRATCH, dense, plain_float32, step_call
from qbackend.kernels.common import Kernel, check_constants
from qbackend.kernels.scratch import thread_scratch
from qbackend.kernels.structs import WeightOnlyCall

SCHEMAS = {
    "int4_mm_int16": "int4_mm_int16(Tensor x, Tensor weight, Tensor scale, Tensor offset, int group_size) -> Tensor",
    "int8_mm_int16": "int8_mm_int16(Tensor x, Tensor weight, Tensor scale) -> Tensor",
}


BLOCK = 64  # columns per weight block (the kernel's unit: K must be a multiple)


GROUPS = (32,) + tuple(range(BLOCK, 4097, BLOCK))  # int4 group sizes the kernel takes


def refusal(bits: int, in_features: int, group_size: int) -> Optional[str]:
    """Why the weight-only kernels cannot take this weight shape (None if they can)."""
    if in_features % BLOCK:
        return f"in_features {in_features} is not a multiple of {BLOCK}"
    if bits == 4 and group_size not in GROUPS:
        return f"group size {group_size} is neither 32 nor a multiple of {BLOCK}"
    return None


def _weight_only_mm(kernel, name: str, x: torch.Tensor, n: int, k: int, weights: tuple, *sizes: int,
                    trusted: bool = False) -> torch.Tensor:
    """Run a weight-only kernel: ``kernel(threads, M, N, K, *sizes, x, *weights, scratch..., y)``;
    ``weights`` are (tensor, dtype, element count) as ``check_constants`` takes them (not
    checked when ``trusted``: the lowering's own packing)."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] != k:
        raise ValueError(f"qbackend::{name} takes float32 CPU activations [M, {k}], got {x.dtype} {tuple(x.shape)} on {x.device}")
    if not trusted:
        check_constants(name, *weights)
    x, m = x.contiguous(), x.shape[0]
    scales_at, sums_at, scratch_bytes = _weight_only_scratch(m, k)
    scratch, y = thread_scratch(scratch_bytes), torch.empty(m, n)
    kernel(torch.get_num_threads(), m, n, k, *sizes, x.data_ptr(), *(w.data_ptr() for w, _, _ in weights),
           scratch, scratch + scales_at, scratch + sums_at, y.data_ptr())
    return y


# int4_mm_int16's offsets: float32, or int8 codes c with offset c * scale (csrc/int4_offsets.h)
INT4_OFFSET_CODES = torch.int8


def _weight_only_scratch(m: int, k: int) -> tuple[int, int, int]:
    """The kernels' scratch for ``m`` rows of ``k``: int16 activations, then their per-group
    scales and sums (groups of 32 or more): (scales' byte offset, sums', total bytes)."""
    xq_bytes, groups = (2 * m * k + 63) // 64 * 64, m * (k // 32)
    return xq_bytes, xq_bytes + 4 * groups, xq_bytes + 8 * groups


def chain_call(args: tuple, y: torch.Tensor):
    """``int4_mm_int16`` / ``int8_mm_int16`` (the lowering's own packing: checked when the graph
    was built) as a kernel chain step, where x is dense float32 [M, K] as the call took it."""
    x, weight, scale, *rest = args
    bits = 4 if rest else 8
    k = weight.shape[1] * 2 if bits == 4 else weight.shape[1]
    if not plain_float32(x) or x.dim() != 2 or x.shape[1] != k or not dense(x, y):
        return None
    scales_at, sums_at, scratch_bytes = _weight_only_scratch(x.shape[0], k)
    offset, group, codes = (rest[0].data_ptr(), rest[1], rest[0].dtype == INT4_OFFSET_CODES) if bits == 4 else (None, k, False)
    struct = WeightOnlyCall(bits, x.shape[0], weight.shape[0], k, group, codes, weight.data_ptr(), scale.data_ptr(), offset,
                            scales_at, sums_at)
    address = isa.function_address(_weight_only_library().qb_weight_only_call)
    return step_call(address, struct, (x, SCRATCH, y, None), args[1:], scratch_bytes)


@library.once
def _weight_only_library() -> ctypes.CDLL:
    """weight_only_int16.c's build: the AVX512-VNNI one where it loads (int4 sums as vpdpbusd
    pairs; the same bits), else the AVX2 one."""
    return _declare(isa._vnni_library()[0] or isa._load()[0])


def _declare(lib: Optional[ctypes.CDLL]) -> Optional[ctypes.CDLL]:
    """``lib`` (either build, None: not built) with qb_int4_mm's and qb_int8_mm's signatures declared."""
    if lib is None:
        return None
    lib.qb_int4_mm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_void_p] * 8
    lib.qb_int8_mm.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p] * 7
    lib.qb_int4_mm.restype = lib.qb_int8_mm.restype = None
    return lib


def _int4_mm(x, weight, scale, offset, group_size, trusted=False):
    """(The kernel's build is ``_weight_only_library``'s.)"""
    n, k = weight.shape[0], weight.shape[1] * 2  # the neutral int4 storage: two columns per byte
    if (reason := refusal(4, k, group_size)) is not None:
        raise ValueError(f"qbackend::int4_mm_int16: {reason}")
    groups, codes = n * (k // group_size), offset.dtype == INT4_OFFSET_CODES
    return _weight_only_mm(_weight_only_library().qb_int4_mm, "int4_mm_int16", x, n, k, ((weight, torch.uint8, n * k // 2),
                           (scale, torch.float32, groups), (offset, INT4_OFFSET_CODES if codes else torch.float32, groups)),
                           group_size, int(codes), trusted=trusted)


def _int8_mm(x, weight, scale, trusted=False):
    n, k = weight.shape
    if (reason := refusal(8, k, k)) is not None:
        raise ValueError(f"qbackend::int8_mm_int16: {reason}")
    return _weight_only_mm(_weight_only_library().qb_int8_mm, "int8_mm_int16", x, n, k,
                           ((weight, torch.int8, n * k), (scale, torch.float32, n)), trusted=trusted)


def int4_mm_int16(*args):
    """``qbackend::int4_mm_int16`` without the dispatcher round trip (see ``qconv_depthwise``):
    measured 50 -> 24 us per call of a small layer, 17 calls per token of a 4-layer Llama."""
    return _int4_mm(*args, trusted=True)


def int8_mm_int16(*args):
    """``qbackend::int8_mm_int16`` without the dispatcher round trip (``int4_mm_int16``)."""
    return _int8_mm(*args, trusted=True)


KERNELS = {
    "int4_mm_int16": Kernel(SCHEMAS["int4_mm_int16"], _int4_mm,
                            lambda x, weight, scale, offset, group_size: x.new_empty(x.shape[0], weight.shape[0]), int4_mm_int16),
    "int8_mm_int16": Kernel(SCHEMAS["int8_mm_int16"], _int8_mm, lambda x, weight, scale: x.new_empty(x.shape[0], weight.shape[0]),
                            int8_mm_int16),
}
# (the plain functions return tensors they allocated: the in-place safety analysis, patterns/inplace.py,
# may let a later kernel write into them)
int4_mm_int16.fresh_output = int8_mm_int16.fresh_output = True
