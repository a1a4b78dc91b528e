"""Weight-only int4 / int8 linears: how each device packs the weight and calls its kernel.

One sequence of steps serves both users: the graph emitter (lowering/weight_only.py, nodes)
and the quantized-weight tensor run eagerly (qbackend/quantized_tensor.py, tensors), so the two
can never run different math.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from qbackend.kernels import registry, weight_only_mm
from qbackend.ops import Resolved, resolve
from qbackend.weight_only.weight_quant import GroupQuantized

aten = torch.ops.aten

# How activations meet the kernels (option): "int16" quantizes them per group for qbackend's own
# kernels (qbackend/kernels/weight_only_mm.py), "bf16" / "activation" run torch's kernels in that dtype, "auto"
# picks int16 where the device has those kernels and they build, else the device's auto_compute.
COMPUTE_CHOICES = ("auto", "int16", "bf16", "activation")


def compute_dtype(device: str, activation: torch.dtype, choice: str = "auto") -> torch.dtype:
    """The dtype torch's kernels compute in (the int16 kernels take float32)."""
    if choice not in COMPUTE_CHOICES:
        raise ValueError(f"weight_only_compute must be one of {COMPUTE_CHOICES}, got {choice!r}")
    if choice == "activation":
        return activation
    if choice == "bf16":
        return torch.bfloat16
    return DEVICES[device].auto_compute.get(activation, activation)


@dataclass(frozen=True)
class PackedLinear:
    """A weight packed for one device and compute dtype: ``op(x2d, *args)`` computes x @ w.T."""

    op: str  # logical op (qbackend.ops)
    args: tuple  # packed tensors and ints, after the activation
    in_features: int
    compute_dtype: torch.dtype
    note: Optional[str] = None  # what the report should say about the kernel choice


def _cpu_refusal(weight: GroupQuantized) -> Optional[str]:
    """Shapes torch 2.13's CPU kernels cannot run. The int4 limits are the kernel's own
    errors; the int8 one is measured: K = 8, 24 or 40 give wrong values, NaN or a crash."""
    n, k = weight.shape
    if weight.bits == 4 and weight.group_size not in (32, 64, 128, 256):
        return f"the CPU int4 kernel takes group sizes 32, 64, 128, 256, not {weight.group_size}"
    if weight.bits == 4 and n % 16:
        return f"the CPU int4 kernel needs out_features divisible by 16, got {n}"
    if weight.bits == 8 and k % 16:
        return f"in_features {k} is not a multiple of 16: the CPU int8 weight-only kernel computes wrong values for it"
    return None


# Rows packed per call. The CPU int4 layout is blocks of 32 or 64 output channels laid end to
# end, so packing row chunks (a multiple of 64) into one output gives the same bytes while the
# int32 input the packer wants stays at a few MB instead of the size of the fp32 weight.
PACK_ROWS = 64


def _cpu_int4(weight: GroupQuantized, dtype: torch.dtype, op: Callable) -> PackedLinear:
    # The kernel reads w = (u - 8) * scale + zero with u = q + 8 in [0, 15], scales and
    # zeros as [K / group, N, 2] in the activation's dtype.
    n, packed = weight.shape[0], None
    for start in range(0, n, PACK_ROWS):
        chunk = op("int4_pack")(weight.rows(start, start + PACK_ROWS).to(torch.int32).add_(8), 8)
        if packed is None:  # the output's first dim is proportional to the rows (N or N / 8)
            per_row = chunk.shape[0] / min(PACK_ROWS, n)
            packed = chunk if n <= PACK_ROWS else chunk.new_empty((int(n * per_row), *chunk.shape[1:]))
        packed[int(start * per_row):int(start * per_row) + chunk.shape[0]] = chunk
    scales_zeros = torch.stack((weight.scale.float().t(), weight.float_offset().t()), dim=-1)
    return PackedLinear("int4_mm", (packed, weight.group_size, scales_zeros.to(dtype).contiguous()),
                        weight.shape[1], dtype)


def _int8(weight: GroupQuantized, dtype: torch.dtype, op: Callable) -> PackedLinear:
    return PackedLinear("int8_weight_only_mm", (weight.rows(), weight.scale[:, 0].to(dtype)),
                        weight.shape[1], dtype)


def _offset_codes(weight: GroupQuantized) -> Optional[torch.Tensor]:
    """An integer zero point z as the int16 kernel's int8 code -8 - z (its offset is code *
    scale: 5 bytes a group instead of 8, and (u + code) * scale is the reference's weight);
    None for float offsets, or codes past int8."""
    if weight.offset is not None:
        return None
    zero = weight.zero_point if weight.zero_point is not None else torch.zeros_like(weight.scale, dtype=torch.int32)
    codes = -8 - zero.to(torch.int32)
    if codes.numel() and (int(codes.min()) < -128 or int(codes.max()) > 127):
        return None
    return codes.to(weight_only_mm.INT4_OFFSET_CODES).contiguous()


def _cpu_int4_int16(weight: GroupQuantized) -> PackedLinear:
    # The kernel reads the neutral storage (uint8 [N, K/2], u = q + 8): no packed copy.
    # w = q * scale + offset = u * scale + (offset - 8 * scale)
    k, scale = weight.shape[1], weight.scale.float()
    offset = _offset_codes(weight)
    if offset is None:
        offset = (weight.float_offset() - 8 * scale).contiguous()
    return PackedLinear("int4_mm_int16", (weight.nibble_storage(PACK_ROWS).contiguous(), scale.contiguous(), offset,
                                          weight.group_size), k, torch.float32)


def _cpu_int8_int16(weight: GroupQuantized) -> PackedLinear:
    return PackedLinear("int8_mm_int16", (weight.rows().contiguous(), weight.scale[:, 0].float().contiguous()),
                        weight.shape[1], torch.float32)


def _xpu_refusal(weight: GroupQuantized) -> Optional[str]:
    """XPU's int4 kernel (oneDNN weight decompression) takes integer zero points and groups
    that are a multiple of 32 (read from torch's XPU sources: no XPU here to run it)."""
    if weight.bits == 4 and weight.group_size % 32:
        return f"the XPU int4 kernel takes group sizes that are a multiple of 32, not {weight.group_size}"
    if weight.bits == 4 and weight.offset is not None:
        return "the XPU int4 kernel takes integer zero points; this weight has float offsets"
    return None


def _xpu_int4(weight: GroupQuantized, dtype: torch.dtype, op: Callable) -> PackedLinear:
    # The XPU packer takes uint8 [N, K/2] with the even column in the low nibble (the neutral
    # layout) and reads w = (u - zero) * scale with u and zero unsigned; scales / zeros [K/g, N].
    packed = op("int4_pack")(weight.nibble_storage(PACK_ROWS), 8)
    zero = torch.zeros_like(weight.scale) if weight.zero_point is None else weight.zero_point
    zeros = (zero.to(torch.int16) + 8).to(torch.int8).t().contiguous()
    return PackedLinear("int4_mm_scales_zeros", (packed, weight.group_size, weight.scale.t().to(dtype).contiguous(), zeros),
                        weight.shape[1], dtype)


@dataclass(frozen=True)
class WeightOnlyDevice:
    """What one device's weight-only kernels need: a packer per bit width, the shapes they
    refuse, and the dtype they compute in for each activation dtype under "auto"."""

    packers: dict  # bits -> packer(weight, compute dtype, op) -> PackedLinear, on the weight's own device
    refusal: Callable  # weight -> reason or None
    auto_compute: dict  # activation dtype -> compute dtype
    int16_packers: dict = dataclasses.field(default_factory=dict)  # bits -> packer(weight): qbackend's own kernels


DEVICES = {
    # CPU, one 4096x11008 layer, 1 row: int4 0.64 ms with bf16 activations vs 80 ms fp32 / 50 ms
    # fp16; int8 1.3 ms vs 40 ms (avx512_bf16). AVX2 only: int4 3.6 vs 47 ms, int8 4.7 vs 28 ms.
    # So every activation dtype computes in bf16. qbackend's int16 kernels beat both on AVX2
    # (int4 1.5 vs 3.5-4.2 ms, int8 1.9 vs 3.2 ms; docs/benchmarks_weight_only.md): "auto" takes them.
    "cpu": WeightOnlyDevice({4: _cpu_int4, 8: _int8}, _cpu_refusal,
                            {torch.float32: torch.bfloat16, torch.float16: torch.bfloat16},
                            {4: _cpu_int4_int16, 8: _cpu_int8_int16}),
    # XPU's int4 kernel asserts on fp32 activations (fp16 / bf16 only, from its sources)
    "xpu": WeightOnlyDevice({4: _xpu_int4, 8: _int8}, _xpu_refusal, {torch.float32: torch.bfloat16}),
}


def _int16_refusal(weight: GroupQuantized, device: str) -> Optional[str]:
    """Why qbackend's int16 kernels cannot run this weight on ``device`` (None if they can)."""
    if weight.bits not in DEVICES[device].int16_packers:
        return f"qbackend has no int{weight.bits} int16 kernel for {device}"
    return weight_only_mm.refusal(weight.bits, weight.shape[1], weight.group_size) or registry.available()


def refusal(weight: GroupQuantized, device: str, choice: str = "auto") -> Optional[str]:
    """Why ``device`` cannot run this weight with ``choice`` (None if it can)."""
    kernels = DEVICES.get(device)
    if kernels is None or weight.bits not in kernels.packers:
        return f"no int{weight.bits} weight-only kernel for device {device!r}"
    if weight.bits == 8 and not weight.is_symmetric():  # every int8 weight-only kernel takes scales only
        return "the int8 weight-only kernel has no zero point (asymmetric weight)"
    if choice == "int16":
        return _int16_refusal(weight, device)
    if choice == "auto" and _int16_refusal(weight, device) is None:
        return None
    return kernels.refusal(weight)


def pack(weight: GroupQuantized, device: str, activation: torch.dtype, choice: str = "auto",
         op: Optional[Callable] = None) -> PackedLinear:
    """Pack for ``device``; ``op(logical)`` resolves torch's ops (default: the live registry).
    Raises ValueError with the reason when the device cannot run this weight."""
    reason = refusal(weight, device, choice)
    if reason is not None:
        raise ValueError(reason)
    compute, note = compute_dtype(device, activation, choice), None  # (validates the choice)
    if choice in ("auto", "int16"):
        why_not = _int16_refusal(weight, device)
        if why_not is None:
            return DEVICES[device].int16_packers[weight.bits](weight)
        if DEVICES[device].int16_packers:
            note = f"torch's kernel: {why_not}"
    op = op or (lambda logical: resolve(logical, device).op)
    packed = DEVICES[device].packers[weight.bits](weight, compute, op)
    return dataclasses.replace(packed, note=note)


def kernel_of(logical: str, resolve_op: Callable) -> Resolved:
    """The op a PackedLinear calls: qbackend's own, or torch's through ``resolve_op``."""
    if logical in registry.OPS:
        return Resolved(logical, "cpu", f"{registry.NAMESPACE}::{logical}.default", registry.op(logical), "qbackend's own kernel")
    return resolve_op(logical)


def unflatten_rows(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[M, N] -> [*like.shape[:-1], N]: the packed kernels take 2-D activations only."""
    return y.reshape(*like.shape[:-1], y.shape[-1])


def packed_or_dense(rows: torch.Tensor, dense: torch.Tensor, dense_rows: int, kernel, *args) -> torch.Tensor:
    """The packed kernel for few rows; from ``dense_rows`` rows on, a dense matmul on the
    dequantized weight. The packed kernels are compute-bound there: measured on one 4096x11008
    layer, int4 takes 9.0 ms for 32 rows, dense bf16 5.5 ms (crossover 12-16 rows)."""
    return torch.mm(rows, dense.t()) if rows.shape[0] >= dense_rows else kernel(rows, *args)


def linear_steps(call: Callable, x, x_rank: int, x_dtype: torch.dtype, packed: PackedLinear, kernel, bias=None,
                 dense=None, dense_rows: Optional[int] = None):
    """The weight-only linear as a sequence of ``call(fn, *args, **kwargs)``: run eagerly
    (call = apply) or recorded as graph nodes (call = graph.call_function)."""
    rows = x if x_rank == 2 else call(aten.reshape.default, x, [-1, packed.in_features])
    # (torch's packed kernels raise on strided rows, e.g. a transposed input: "expect A to be
    # contiguous"; qbackend's take any)
    if packed.compute_dtype != x_dtype:
        rows = call(aten._to_copy.default, rows, dtype=packed.compute_dtype, memory_format=torch.contiguous_format)
    elif packed.op not in registry.OPS:
        rows = call(aten.contiguous.default, rows)
    if dense is None:
        y = call(kernel, rows, *packed.args)
    else:
        y = call(packed_or_dense, rows, dense, dense_rows, kernel, *packed.args)
    if packed.compute_dtype != x_dtype:
        y = call(aten._to_copy.default, y, dtype=x_dtype)
    if x_rank != 2:
        y = call(unflatten_rows, y, x)
    return y if bias is None else call(aten.add.Tensor, y, bias)


def run(x: torch.Tensor, packed: PackedLinear, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Eager weight-only linear (used by the quantized-weight tensor)."""
    kernel = kernel_of(packed.op, lambda logical: resolve(logical, x.device.type)).op
    return linear_steps(lambda fn, *a, **k: fn(*a, **k), x, x.dim(), x.dtype, packed, kernel, bias)
