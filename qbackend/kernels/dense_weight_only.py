"""Weight-only linears over many rows: the weight written out as dense float slices
(csrc/weight_dequantize.c) and the AVX512-BF16 matmul (csrc/weight_only_bf16.c), with their
checks. When and how they are used: qbackend/llm/dense_weight_only.py."""
from __future__ import annotations

import ctypes
import functools

import torch

from qbackend.kernels import isa, registry, weight_only_mm


@functools.lru_cache(maxsize=None)
def _kernels():
    """(int4, int8) C functions, or None where the own kernels are not built."""
    int4 = isa.c_function("qb_int4_dequantize", (ctypes.c_int,) * 5 + (ctypes.c_void_p,) * 3 + (ctypes.c_int, ctypes.c_void_p))
    int8 = isa.c_function("qb_int8_dequantize", (ctypes.c_int,) * 3 + (ctypes.c_void_p,) * 2 + (ctypes.c_int, ctypes.c_void_p))
    return None if int4 is None else (int4, int8)


def _check(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple) -> None:
    if tensor.dtype != dtype or tuple(tensor.shape) != shape or not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError(f"qbackend dense weight-only: {name} must be a contiguous CPU {dtype} tensor of shape {shape}, "
                         f"got {tensor.dtype} {tuple(tensor.shape)}")


def _checked_weight(bits: int, args: tuple, k: int) -> tuple[int, bool]:
    """(group size, whether the int4 offsets are int8 codes) of the weight ``args`` hold (int4:
    storage, scale, offset, group size; int8: weight, scale; a group of K), its tensors checked."""
    n = args[0].shape[0]
    if bits == 8:
        _check("the int8 weight", args[0], torch.int8, (n, k))
        _check("the scales", args[1], torch.float32, (n,))
        return k, False
    group, codes = args[3], args[2].dtype == weight_only_mm.INT4_OFFSET_CODES
    _check("the int4 storage", args[0], torch.uint8, (n, k // 2))
    _check("the scales", args[1], torch.float32, (n, k // group))
    _check("the offsets", args[2], weight_only_mm.INT4_OFFSET_CODES if codes else torch.float32, (n, k // group))
    return group, codes


def written_out(bits: int, args: tuple, start: int, out: torch.Tensor) -> torch.Tensor:
    """Rows [start, start + len(out)) of the weight the int16 kernel's ``args`` hold (int4:
    storage, scale, offset, group size; int8: weight, scale), as ``out``'s dtype (bf16 or
    float32), into ``out``."""
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError(registry.available())
    rows, k = out.shape
    weight = args[0]
    n = weight.shape[0]
    if out.dtype not in (torch.bfloat16, torch.float32) or not out.is_contiguous() or not 0 <= start <= start + rows <= n:
        raise ValueError(f"qbackend dense weight-only: rows [{start}, {start + rows}) of {n} into a contiguous bf16 / "
                         f"float32 buffer, got {out.dtype} {tuple(out.shape)}")
    bf16 = int(out.dtype == torch.bfloat16)
    if bits == 4:
        group = args[3]
        if k % 16 or group % 16 or k % group:
            raise ValueError(f"qbackend dense weight-only: int4 K {k} and group {group} must be multiples of 16, K of group")
        _, codes = _checked_weight(bits, args, k)
        kernels[0](torch.get_num_threads(), rows, k, group, int(codes), weight[start:].data_ptr(), args[1][start:].data_ptr(),
                   args[2][start:].data_ptr(), bf16, out.data_ptr())
    else:
        if k % 16:
            raise ValueError(f"qbackend dense weight-only: int8 K {k} must be a multiple of 16")
        _checked_weight(bits, args, k)
        kernels[1](torch.get_num_threads(), rows, k, weight[start:].data_ptr(), args[1][start:].data_ptr(), bf16,
                   out.data_ptr())
    return out


@functools.lru_cache(maxsize=None)
def _bf16_kernel():
    """csrc/weight_only_bf16.c's qb_weight_only_bf16_mm where the CPU has AVX512-BF16, else None."""
    lib = isa._vnni_library()[0]
    if lib is None or not lib.qb_has_avx512_bf16():
        return None
    function = lib.qb_weight_only_bf16_mm
    function.argtypes = [ctypes.c_int] * 7 + [ctypes.c_void_p] * 5 + [ctypes.c_long]
    function.restype = ctypes.c_int
    return function


def bf16_kernel_takes(bits: int, args: tuple) -> bool:
    """Whether the AVX512-BF16 kernel runs this weight-only weight here."""
    return _bf16_kernel() is not None and in_features(bits, args) % 32 == 0 and (bits == 8 or args[3] % 32 == 0)


def bf16_mm(x: torch.Tensor, bits: int, *args) -> torch.Tensor:
    """x [M, K] (float32, rounded to bf16, or bf16) times the weight ``args`` hold (int4:
    storage, scale, offset, group size; int8: weight, scale), transposed: float32 [M, N], on the
    AVX512-BF16 kernel (csrc/weight_only_bf16.c)."""
    kernel = _bf16_kernel()
    if kernel is None:
        raise RuntimeError("qbackend's AVX512-BF16 weight-only kernel needs a CPU with AVX512-BF16 and the VNNI kernels")
    n, k = args[0].shape[0], in_features(bits, args)
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        raise ValueError(f"qbackend bf16 weight-only kernel: float32 or bf16 CPU activations [M, {k}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    group = args[3] if bits == 4 else k
    if k % 32 or group % 32 or k % group:
        raise ValueError(f"qbackend bf16 weight-only kernel: K {k} and group {group} must be multiples of 32, K of group")
    _, codes = _checked_weight(bits, args, k)
    offset = args[2].data_ptr() if bits == 4 else None
    x_bf16, y = x.to(torch.bfloat16).contiguous(), torch.empty(x.shape[0], n)
    if x.shape[0] and kernel(torch.get_num_threads(), bits, x.shape[0], n, k, group, int(codes), x_bf16.data_ptr(),
                             args[0].data_ptr(), args[1].data_ptr(), offset, y.data_ptr(), n):
        raise MemoryError("qbackend bf16 weight-only kernel: a thread could not allocate its buffer of weight rows")
    return y


def in_features(bits: int, args: tuple) -> int:
    """K of the weight ``args`` hold (int4 storage: two columns a byte)."""
    return args[0].shape[1] * (2 if bits == 4 else 1)
