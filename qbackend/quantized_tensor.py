"""A Linear weight stored weight-only quantized (int4 / int8) that behaves like a plain tensor.

``quantize_weights(model, bits=4, group_size=128)`` swaps every eligible ``nn.Linear`` weight
for a ``QuantizedLinearWeight``: device-neutral integers + scales + zero points (the
state_dict holds exactly these), packed for a device's kernel on first use and cached.

- ``F.linear(x, w)``, ``x @ w.T``, ``torch.matmul(x, w.t())`` run the packed kernel;
  ``w.t()`` is a transposed view, so ``w.t().t()`` is ``w`` again.
- Any other op sees the dequantized float weight: slower, never wrong.
- ``__tensor_flatten__`` lets torch.compile see through it; with ``backend="qbackend"`` the
  weight becomes a frozen constant and the linear lowers to the same kernel.
"""
from __future__ import annotations

import logging
import warnings
from typing import Callable, Optional

import torch
from torch.utils._pytree import tree_map

from qbackend.weight_only.legacy_int4 import unpack_old_cpu_int4
from qbackend.kernels.weight_only_linear import pack, run
from qbackend.weight_only.weight_quant import GroupQuantized, pack_int4, quantize

aten = torch.ops.aten
log = logging.getLogger("qbackend")


def _check_layout(qdata, scale, zero, bits, group_size, shape, dtype) -> None:
    """The stored tensors hold the declared [out, in] weight (ValueError otherwise): a declared
    (128, 256) over 64 stored rows had run and returned 64 columns."""
    if bits not in (4, 8) or len(shape) != 2 or not all(isinstance(d, int) and d > 0 for d in shape):
        raise ValueError(f"QuantizedLinearWeight: {bits}-bit weight of shape {tuple(shape)}; expected 4 or 8 bits, [out, in]")
    n, k = shape
    if not (isinstance(group_size, int) and group_size > 0 and k % group_size == 0) or (bits == 4 and k % 2):
        raise ValueError(f"QuantizedLinearWeight: group size {group_size} does not divide in_features {k}"
                         + (" (int4: in_features must be even)" if bits == 4 else ""))
    expected = {"qdata": ((n, k // 2), torch.uint8) if bits == 4 else ((n, k), torch.int8), "scale": ((n, k // group_size), None),
                "zero": ((n, k // group_size), None)}
    for name, value in (("qdata", qdata), ("scale", scale), ("zero", zero)):
        size, wanted = expected[name]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != size or (wanted is not None and value.dtype != wanted):
            got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"QuantizedLinearWeight: {name} of a {bits}-bit [{n}, {k}] weight (group {group_size}) must be "
                             f"{wanted or 'a'} {size}, got {got}")
    if not (scale.is_floating_point() and dtype.is_floating_point):
        raise ValueError(f"QuantizedLinearWeight: float scales and a float model dtype expected, got {scale.dtype}, {dtype}")
    if qdata.device != scale.device or qdata.device != zero.device:
        raise ValueError("QuantizedLinearWeight: qdata, scale and zero must be on one device")


class QuantizedLinearWeight(torch.Tensor):
    """Logical shape [out, in] (or [in, out] when ``transposed``), dtype of the float model."""

    @staticmethod
    def __new__(cls, qdata, scale, zero, bits, group_size, shape, dtype, transposed=False, compute="auto"):
        _check_layout(qdata, scale, zero, bits, group_size, shape, dtype)
        logical = tuple(reversed(shape)) if transposed else tuple(shape)
        return torch.Tensor._make_wrapper_subclass(cls, logical, dtype=dtype, device=qdata.device, requires_grad=False)

    def __init__(self, qdata, scale, zero, bits, group_size, shape, dtype, transposed=False, compute="auto"):
        self.qdata = qdata  # int4: uint8 [N, K/2] (weight_quant neutral layout); int8: int8 [N, K]
        self.scale = scale  # float32 [N, K / group_size]
        # int8 zero points, w = (q - zero) * scale; or float offsets, w = q * scale + zero
        self.zero = zero  # [N, K / group_size]
        self.bits, self.group_size, self.weight_shape = bits, group_size, tuple(shape)
        self.transposed, self.compute = transposed, compute
        self._packed: dict = {}  # (device, activation dtype) -> kernels.weight_only_linear.PackedLinear
        # (made once: Dynamo's guard on each weight flattens it before every compiled call)
        self._flat_meta = self._meta()

    def __getstate__(self):
        """What torch.save writes: the neutral data only, never a device's packed layout."""
        return {k: v for k, v in self.__dict__.items() if k != "_packed"}

    def _cache(self) -> dict:
        return self.__dict__.setdefault("_packed", {})  # absent on a tensor torch.load rebuilt

    @classmethod
    def from_float(cls, weight: torch.Tensor, bits: int, group_size: Optional[int], compute: str = "auto"):
        q = quantize(weight, bits, group_size)
        qdata = pack_int4(q.stored) if bits == 4 else q.stored
        zero = q.zero_point if q.zero_point is not None else torch.zeros_like(q.scale, dtype=torch.int8)
        return cls(qdata, q.scale, zero, bits, q.group_size, weight.shape, weight.dtype, compute=compute)

    def _meta(self) -> tuple:
        return (self.bits, self.group_size, self.weight_shape, self.dtype, self.transposed, self.compute)

    def __tensor_flatten__(self):
        meta = self.__dict__.get("_flat_meta")  # (absent on a tensor torch.load rebuilt)
        return ["qdata", "scale", "zero"], meta if meta is not None else self._meta()

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return QuantizedLinearWeight(inner["qdata"], inner["scale"], inner["zero"], *meta)

    def _with(self, fn: Optional[Callable] = None, **changes) -> "QuantizedLinearWeight":
        """A view (``fn`` None: same data, same packed cache, so F.linear's w.t() never
        re-packs) or a copy with ``fn`` applied to the inner tensors."""
        meta = dict(zip(("bits", "group_size", "shape", "dtype", "transposed", "compute"), self._meta()))
        meta.update(changes)
        inner = (self.qdata, self.scale, self.zero) if fn is None else (fn(self.qdata), fn(self.scale), fn(self.zero))
        result = QuantizedLinearWeight(*inner, **meta)
        if fn is None:
            result._packed = self._cache()
        return result

    def group_quantized(self) -> GroupQuantized:
        """The stored [out, in] weight (ignores ``transposed``)."""
        offset = self.zero.is_floating_point()
        return GroupQuantized(self.bits, self.qdata, self.scale, self.group_size, zero_point=None if offset else self.zero,
                              offset=self.zero if offset else None, nibbles=self.bits == 4)

    def dequantize(self) -> torch.Tensor:
        dense = self.group_quantized().dequantize(self.dtype)
        return dense.t() if self.transposed else dense

    def __repr__(self) -> str:
        return (f"QuantizedLinearWeight(int{self.bits}, group_size={self.group_size}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, device={self.device}{', transposed' if self.transposed else ''})")

    def packed_for(self, x: torch.Tensor):
        """The weight packed for x's device and dtype (cached)."""
        key, cache = (x.device.type, x.dtype), self._cache()
        if key not in cache:
            cache[key] = pack(self.group_quantized(), x.device.type, x.dtype, self.compute)
        return cache[key]

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            result = handler(*args, **kwargs)
            if result is not NotImplemented:
                return result
        return _dense_fallback(func, args, kwargs)


def _is_fake(t: torch.Tensor) -> bool:
    """Traced by another backend (AOTAutograd / Inductor) rather than run."""
    return isinstance(t, (torch._subclasses.FakeTensor, torch._subclasses.functional_tensor.FunctionalTensor)) \
        or t.device.type == "meta" or torch.compiler.is_compiling()


def _dense(value):
    return value.dequantize() if isinstance(value, QuantizedLinearWeight) else value


def _dense_fallback(func, args, kwargs):
    log.debug("QuantizedLinearWeight: %s runs on the dequantized weight", func)
    return func(*tree_map(_dense, args), **tree_map(_dense, kwargs))


def _linear(x: torch.Tensor, weight_t, bias=None):
    """x @ weight_t (+ bias) where weight_t is the transposed view of a stored [out, in] weight."""
    if not isinstance(weight_t, QuantizedLinearWeight) or not weight_t.transposed or isinstance(x, QuantizedLinearWeight):
        return NotImplemented
    if _is_fake(weight_t.qdata):  # other compilers get dequantize + matmul, which they can fold and fuse
        return NotImplemented
    try:
        packed = weight_t.packed_for(x)
    except (NotImplementedError, ValueError) as why:  # no kernel for this device / shape
        log.debug("QuantizedLinearWeight runs dequantized: %s", why)
        return NotImplemented
    return run(x, packed, bias)


def _mm(x, weight_t):
    return _linear(x, weight_t)


def _addmm(bias, x, weight_t, *, beta=1, alpha=1):
    return _linear(x, weight_t, bias) if beta == 1 and alpha == 1 else NotImplemented


def _transpose(w, dim0=0, dim1=1):
    return w._with(transposed=not w.transposed) if {dim0 % 2, dim1 % 2} == {0, 1} else NotImplemented


def _permute(w, dims):
    return w._with(transposed=not w.transposed) if [d % 2 for d in dims] == [1, 0] else NotImplemented


def _to_copy(w, *, dtype=None, device=None, layout=None, pin_memory=None, non_blocking=False, memory_format=None):
    if layout not in (None, torch.strided):
        return NotImplemented
    return w._with(lambda t: t.to(device=device, non_blocking=non_blocking), dtype=dtype or w.dtype)


def _copy_(dst, src, non_blocking=False):
    same = isinstance(dst, QuantizedLinearWeight) and isinstance(src, QuantizedLinearWeight)
    if not same or dst._meta()[:3] != src._meta()[:3] or (dst.transposed, dst.zero.dtype) != (src.transposed, src.zero.dtype):
        return NotImplemented  # a dense destination gets the dequantized values
    for name in ("qdata", "scale", "zero"):
        getattr(dst, name).copy_(getattr(src, name), non_blocking)
    dst._cache().clear()
    return dst


_HANDLERS = {
    aten.detach.default: lambda w: w._with(),
    aten.alias.default: lambda w: w._with(),
    aten.clone.default: lambda w, memory_format=None: w._with(torch.clone),
    aten.t.default: _transpose,
    aten.transpose.int: _transpose,
    aten.permute.default: _permute,
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
}



# torch.load(weights_only=True) rebuilds only classes it was told are safe: a state_dict holding
# these weights loads as is once qbackend is imported (torchao registers its tensor classes the
# same way). Only this class is added; torch's own list is otherwise untouched.
torch.serialization.add_safe_globals([QuantizedLinearWeight])

def quantize_weights(model: torch.nn.Module, bits: int = 4, group_size: Optional[int] = None, *,
                     compute: str = "auto", filter_fn: Optional[Callable[[torch.nn.Module, str], bool]] = None,
                     include: Optional[Callable[[str, torch.nn.Linear], bool]] = None):
    """Replace the weight of every ``nn.Linear`` (for which ``filter_fn(module, name)``, torchao's
    order) by a weight-only quantized one, in place; returns ``model``. int4: asymmetric per
    group of ``group_size`` input columns (default 128); int8: symmetric per output channel
    (a ``group_size`` is refused: there are no groups). ``compute``: "auto" (the device's fast
    path: on CPU qbackend's int16 kernels, else bf16), "int16", "bf16" or "activation" (the
    input's own dtype; qbackend/kernels/weight_only_linear.py). Linears whose in_features is not a multiple of
    ``group_size`` are kept float, with a warning naming them. ``include(name, module)``: the
    former spelling of ``filter_fn``."""
    if bits not in (4, 8):
        raise ValueError(f"quantize_weights: bits must be 4 or 8, got {bits!r}")
    if bits == 8 and group_size is not None:
        raise ValueError(f"quantize_weights: int8 weights are per output channel; group_size={group_size} has no meaning")
    if include is not None:
        if filter_fn is not None:
            raise ValueError("quantize_weights: pass filter_fn (module, name) or include (name, module), not both")
        warnings.warn("quantize_weights(include=(name, module)) is deprecated: use filter_fn=(module, name), torchao's "
                      "order", DeprecationWarning, stacklevel=2)
        filter_fn = lambda module, name: include(name, module)  # noqa: E731
    if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"quantize_weights: group_size must be a positive int, got {group_size!r}")
    group, misfits = None if bits == 8 else (group_size or 128), []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or isinstance(module.weight, QuantizedLinearWeight):
            continue
        if filter_fn is not None and not filter_fn(module, name):
            continue
        if group and module.in_features % group:
            misfits.append(f"{name} (in_features {module.in_features})")
            continue
        weight = QuantizedLinearWeight.from_float(module.weight.detach(), bits, group, compute)
        module.weight = torch.nn.Parameter(weight, requires_grad=False)
    if misfits:
        warnings.warn(f"quantize_weights: {len(misfits)} linear(s) kept float, their in_features not a multiple of "
                      f"group_size {group}: {', '.join(misfits[:4])}{', ...' if len(misfits) > 4 else ''}", stacklevel=2)
    return model


def from_old_cpu_int4(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                      dtype: torch.dtype = torch.float32, isa: Optional[str] = None) -> QuantizedLinearWeight:
    """A checkpoint's (old packed weight, qScaleAndZeros [K/group, N, 2], group size) -> a
    device-neutral QuantizedLinearWeight with the same values (w = (u - 8) * scale + zero)."""
    groups, n_out, _ = scales_and_zeros.shape
    in_features = groups * group_size
    values = unpack_old_cpu_int4(packed, in_features, isa)
    if values.shape[0] != n_out:
        raise ValueError(f"packed weight has {values.shape[0]} output channels, scales_and_zeros {n_out}")
    scale = scales_and_zeros[..., 0].t().float().contiguous()
    offset = scales_and_zeros[..., 1].t().float().contiguous()
    return QuantizedLinearWeight(pack_int4(values), scale, offset, 4, group_size, (n_out, in_features), dtype)
