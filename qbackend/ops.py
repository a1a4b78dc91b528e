"""The alias table: the only module that spells versioned op names.

torch renames its quantized ops between releases (``onednn::qconv2d_pointwise`` became
``onednn::qconv_pointwise``; ``aten::_weight_int4pack_mm`` lost its CPU kernel to
``aten::_weight_int4pack_mm_for_cpu``). Everything else in qbackend asks for a *logical* op
and gets the real overload that exists on this torch AND has a kernel for the device, or a
reason why there is none. Nothing here raises at import time.
"""
from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from qbackend.weight_only.legacy_int4 import unpack_old_cpu_int4

# Dispatch keys a tensor of that device can reach. The CPU list holds MkldnnCPU because the
# prepacked oneDNN weight is an Mkldnn tensor: ops like qconv2d_pointwise register only there;
# and QuantizedCPU for the int8 pools that run on a quantized view of a uint8 tensor.
DEVICE_DISPATCH_KEYS: dict[str, tuple[str, ...]] = {
    "cpu": ("CPU", "MkldnnCPU", "QuantizedCPU"),
    "xpu": ("XPU",),
}
# A composite op has no kernel of its own: it runs on any device whose ops it calls have one.
COMPOSITE_KEYS = ("CompositeImplicitAutograd",)

# Logical op -> candidate real overloads, newest name first.
ALIASES: dict[str, tuple[str, ...]] = {
    # int8 conv / linear (oneDNN). torch 2.1-2.7 named the conv per rank; 2.8+ has one N-d
    # qconv_pointwise and keeps the old names (in 2.13 qconv1d/qconv3d have no Meta kernel).
    "qconv": ("onednn::qconv_pointwise", "onednn::qconv2d_pointwise"),
    "qconv1d": ("onednn::qconv_pointwise", "onednn::qconv1d_pointwise"),
    "qconv3d": ("onednn::qconv_pointwise", "onednn::qconv3d_pointwise"),
    "qconv_tensor": ("onednn::qconv_pointwise.tensor", "onednn::qconv2d_pointwise.tensor"),
    "qconv_binary": ("onednn::qconv_pointwise.binary", "onednn::qconv2d_pointwise.binary"),
    "qconv_binary_tensor": (
        "onednn::qconv_pointwise.binary_tensor",
        "onednn::qconv2d_pointwise.binary_tensor",
    ),
    "qconv_prepack": ("onednn::qconv_prepack",),
    "qlinear": ("onednn::qlinear_pointwise",),
    "qlinear_tensor": ("onednn::qlinear_pointwise.tensor",),
    "qlinear_binary": ("onednn::qlinear_pointwise.binary",),
    "qlinear_binary_tensor": ("onednn::qlinear_pointwise.binary_tensor",),
    "qlinear_prepack": ("onednn::qlinear_prepack",),
    # int8 pooling on plain uint8 tensors (50 us vs 350 us for dq + float pool + q here)
    "qmaxpool2d": ("quantized::max_pool2d",),
    # int8 average pools: the ATen pool on a quantized-tensor copy of the uint8 tensor, then
    # its integer values (2-5x faster than dequantize + float pool + quantize here). Quantized
    # tensors are deprecated: when these go, the rule is disabled with this reason.
    "to_quantized_tensor": ("aten::_make_per_tensor_quantized_tensor",),
    "int_repr": ("aten::int_repr",),
    # boundary q/dq in one vectorised pass (qbackend/passes/fast_qdq.py), same deprecation caveat
    "quantize_to_quantized_tensor": ("aten::quantize_per_tensor",),
    "dequantize_quantized_tensor": ("aten::dequantize.self",),
    # int8 data movement on plain integer tensors
    "cat": ("aten::cat",),
    # float attention, fused (composite: picks the device's flash / math kernel itself)
    "sdpa": ("aten::scaled_dot_product_attention",),
    # float linears with a constant weight (the quantizer left them float: ViT's attention
    # projections) on a weight packed once: MKL's sgemm, as Inductor's freezing runs them, or
    # oneDNN's, whichever measures faster (qbackend/passes/float_linear.py)
    "float_linear_packed": ("mkl::_mkl_linear",),
    "float_linear_pack": ("mkl::_mkl_reorder_linear_weight",),
    "float_linear_onednn": ("mkldnn::_linear_pointwise",),
    "float_linear_onednn_pack": ("mkldnn::_reorder_linear_weight",),
    # weight-only int4 / int8
    "int4_pack": ("aten::_convert_weight_to_int4pack_for_cpu", "aten::_convert_weight_to_int4pack"),
    "int4_mm": ("aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int4pack_mm"),
    "int4_mm_scales_zeros": ("aten::_weight_int4pack_mm_with_scales_and_zeros",),
    "int8_weight_only_mm": ("aten::_weight_int8pack_mm",),
}

# Ops qbackend runs once at compile time (weight packing) and never places in a graph: a
# graph traced with fake tensors does not need their Meta kernels.
COMPILE_TIME = frozenset({"qconv_prepack", "qlinear_prepack", "int4_pack", "float_linear_pack", "float_linear_onednn_pack"})

# Ops qbackend *matches* in PT2E graphs. They are registered by torchao / torch.ao when a PT2E
# flow runs; qbackend never imports those modules itself, so an unregistered op simply means
# the graph cannot contain it.
GRAPH_OPS: dict[str, str] = {
    "quantize_per_tensor": "quantized_decomposed::quantize_per_tensor",
    "dequantize_per_tensor": "quantized_decomposed::dequantize_per_tensor",
    "quantize_per_tensor_tensor": "quantized_decomposed::quantize_per_tensor.tensor",
    "dequantize_per_tensor_tensor": "quantized_decomposed::dequantize_per_tensor.tensor",
    "quantize_per_channel": "quantized_decomposed::quantize_per_channel",
    "dequantize_per_channel": "quantized_decomposed::dequantize_per_channel",
    "dequantize_per_channel_group": "quantized_decomposed::dequantize_per_channel_group",
    "dequantize_affine": "torchao::dequantize_affine",
}


@dataclass(frozen=True)
class Resolved:
    """The outcome of resolving one logical op for one device."""

    logical: str
    device: str
    qualname: Optional[str]  # e.g. "onednn::qconv_pointwise.default"; None if nothing resolved
    op: Optional[Callable]  # the OpOverload to call
    reason: str  # why this candidate was chosen, or why none was

    def __bool__(self) -> bool:
        return self.op is not None


def _split(qualname: str) -> tuple[str, str, str]:
    namespace, rest = qualname.split("::")
    name, _, overload = rest.partition(".")
    return namespace, name, overload or "default"


class TorchRegistry:
    """Asks the live dispatcher. Tests substitute a fake registry to simulate other torch versions."""

    def lookup(self, qualname: str):
        namespace, name, overload = _split(qualname)
        try:
            packet = getattr(getattr(torch.ops, namespace), name)
        except (AttributeError, RuntimeError):
            return None
        return getattr(packet, overload) if overload in packet.overloads() else None

    def has_kernel(self, qualname: str, dispatch_key: str) -> bool:
        op = self.lookup(qualname)
        return op is not None and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), dispatch_key)


_REGISTRY = TorchRegistry()


def _full(qualname: str) -> str:
    namespace, name, overload = _split(qualname)
    return f"{namespace}::{name}.{overload}"


def resolve(logical: str, device: str, registry=None, *, need_meta: bool = False) -> Resolved:
    """The newest candidate of ``logical`` that exists and has a kernel for ``device``.

    ``need_meta`` also demands a Meta kernel, for graphs that will be traced with fake tensors
    (torch 2.13's legacy qconv1d/qconv3d/qconv2d.tensor names have none); compile-time ops
    (COMPILE_TIME) are exempt, as they never reach the graph.
    """
    need_meta = need_meta and logical not in COMPILE_TIME
    if registry is None:
        return _resolve_cached(logical, device, need_meta)
    return _resolve(logical, device, registry, need_meta)


@functools.lru_cache(maxsize=None)
def _resolve_cached(logical: str, device: str, need_meta: bool) -> Resolved:
    return _resolve(logical, device, _REGISTRY, need_meta)


def _resolve(logical: str, device: str, registry, need_meta: bool) -> Resolved:
    if logical not in ALIASES:
        raise KeyError(f"unknown logical op {logical!r}; known: {sorted(ALIASES)}")
    keys = DEVICE_DISPATCH_KEYS.get(device)
    if keys is None:
        return Resolved(logical, device, None, None, f"no dispatch keys known for device {device!r}")
    missing = []
    for candidate in ALIASES[logical]:
        qualname = _full(candidate)
        op = registry.lookup(qualname)
        if op is None:
            missing.append(f"{qualname} does not exist")
            continue
        if not any(registry.has_kernel(qualname, key) for key in keys + COMPOSITE_KEYS):
            missing.append(f"{qualname} has no {device} kernel")
            continue
        if need_meta and not any(registry.has_kernel(qualname, key) for key in ("Meta",) + COMPOSITE_KEYS):
            missing.append(f"{qualname} has no Meta kernel")
            continue
        return Resolved(logical, device, qualname, op, f"{qualname} has a {device} kernel")
    return Resolved(logical, device, None, None, f"no {logical} op for {device}: " + "; ".join(missing))


_graph_ops: dict[str, object] = {}


def graph_op(name: str):
    """The OpOverload of a matched PT2E op, or None while this process has not registered it
    (found ops are cached; missing ones are asked again, as a later import may register them)."""
    op = _graph_ops.get(name)
    if op is None:
        op = _REGISTRY.lookup(_full(GRAPH_OPS[name]))
        if op is not None:
            _graph_ops[name] = op
    return op


def resolve_all(device: str, registry=None, *, need_meta: bool = False) -> dict[str, Resolved]:
    return {logical: resolve(logical, device, registry, need_meta=need_meta) for logical in ALIASES}


def qconv_for_rank(spatial_rank: int) -> str:
    """The logical qconv op for a conv of this rank (each has its own legacy name)."""
    return {1: "qconv1d", 2: "qconv", 3: "qconv3d"}[spatial_rank]


# Old call sites. torch <= 2.5 code calls aten._convert_weight_to_int4pack and
# aten._weight_int4pack_mm on CPU; torch >= 2.6 has CPU kernels only under the _for_cpu names.
# Replace ``torch.ops.aten.X`` by ``qbackend.ops.X`` and such code runs again; weights packed
# by the old op (int32 4-D) are re-packed once and cached.
_repacked: dict[int, tuple] = {}  # id(old packed tensor) -> (version, new packed tensor), while it lives


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"qbackend.ops.{old} runs {new}: call it (or qbackend.quantize_weights) directly",
                  DeprecationWarning, stacklevel=3)


def _convert_weight_to_int4pack(weight: torch.Tensor, inner_k_tiles: int = 8) -> torch.Tensor:
    """Old-name int4 packing on CPU. Takes the 2.3/2.4 input (int32 [N, K], values 0..15) or
    the 2.5 one (uint8 [N, K/2], even column in the high nibble); returns the layout the
    current ``int4_mm`` reads."""
    pack = resolve("int4_pack", weight.device.type)
    _deprecated("_convert_weight_to_int4pack", str(pack.qualname))
    if weight.dtype == torch.uint8:
        weight = torch.stack((weight >> 4, weight & 0xF), dim=-1).reshape(weight.shape[0], -1).to(torch.int32)
    return pack.op(weight, inner_k_tiles)


def _weight_int4pack_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int,
                        scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """Old-name int4 matmul on CPU; ``packed`` may be an old-format (int32 4-D) weight."""
    mm = resolve("int4_mm", x.device.type)
    _deprecated("_weight_int4pack_mm", str(mm.qualname))
    if packed.dim() == 4 and packed.dtype == torch.int32:
        packed = _repack_old(packed, x.shape[-1])
    return mm.op(x, packed, group_size, scales_and_zeros)


def _repack_old(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    cached = _repacked.get(id(packed))
    if cached is not None and cached[0] == packed._version:
        return cached[1]
    unsigned = unpack_old_cpu_int4(packed, in_features).to(torch.int32) + 8
    new = resolve("int4_pack", packed.device.type).op(unsigned, 8)
    if id(packed) not in _repacked:  # dropped with the old weight, so its id cannot be reused stale
        weakref.finalize(packed, _repacked.pop, id(packed), None)
    _repacked[id(packed)] = (packed._version, new)
    return new
