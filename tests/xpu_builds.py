"""Simulated torch builds: which dispatch keys have a kernel for each op, per torch generation,
as read from torch's registrations (aten/src/ATen/native/quantized/cpu/qconv.cpp, qlinear.cpp;
aten/src/ATen/native/mkldnn/xpu/qconv.cpp, qlinear.cpp; torch/_meta_registrations.py). The
XPU kernels cannot run here, so an XPU build is simulated: resolution sees its kernels, and
its compile-time prepacks are emulated on CPU tensors."""
from __future__ import annotations

import pytest
import torch

from qbackend.ops import TorchRegistry

CPU, MKLDNN, XPU, META = "CPU", "MkldnnCPU", "XPU", "Meta"


def _ops(**names):
    return {f"onednn::{name.replace('__', '.')}" + ("" if "__" in name else ".default"): set(keys)
            for name, keys in names.items()}


# torch 2.1-2.7: one conv op per rank; the XPU int8 ops (2.6+) registered the per-rank names,
# no binary (residual) kernels on XPU yet.
PER_RANK_NAMES = _ops(
    qconv1d_pointwise={MKLDNN, XPU}, qconv2d_pointwise={MKLDNN, XPU, META}, qconv3d_pointwise={MKLDNN, XPU},
    qconv2d_pointwise__tensor={MKLDNN}, qconv2d_pointwise__binary={MKLDNN, META},
    qconv2d_pointwise__binary_tensor={MKLDNN, META}, qconv_prepack={CPU, XPU},
    qlinear_pointwise={MKLDNN, XPU, META}, qlinear_pointwise__tensor={MKLDNN, XPU, META},
    qlinear_pointwise__binary={MKLDNN, META}, qlinear_pointwise__binary_tensor={MKLDNN, META}, qlinear_prepack={CPU, XPU},
)

# torch 2.8+: the N-d qconv_pointwise joins (CPU, Meta), the per-rank names stay; an XPU build
# of that time still registered only the per-rank names (the rename that broke XPU lowering).
RENAMED_CPU_ONLY = {
    **PER_RANK_NAMES,
    **_ops(qconv_pointwise={CPU, MKLDNN, META}, qconv_pointwise__tensor={CPU, MKLDNN, META},
           qconv2d_pointwise__binary={CPU, MKLDNN, META}, qconv2d_pointwise__binary_tensor={CPU, MKLDNN, META}),
}

# current (2.13): XPU registers qconv_pointwise, qconv2d_pointwise.binary and the whole qlinear
# family as well; the CPU side is whatever the live torch says.
CURRENT_XPU = {
    "onednn::qconv_pointwise.default", "onednn::qconv1d_pointwise.default", "onednn::qconv2d_pointwise.default",
    "onednn::qconv3d_pointwise.default", "onednn::qconv2d_pointwise.binary", "onednn::qconv_prepack.default",
    "onednn::qlinear_pointwise.default", "onednn::qlinear_pointwise.tensor", "onednn::qlinear_pointwise.binary",
    "onednn::qlinear_pointwise.binary_tensor", "onednn::qlinear_prepack.default",
    "aten::cat.default",  # (every ATen op qbackend places has an XPU kernel in an XPU build)
    # weight-only (torch-xpu-ops packs int4)
    "aten::_convert_weight_to_int4pack.default", "aten::_weight_int4pack_mm_with_scales_and_zeros.default",
    "aten::_weight_int8pack_mm.default",
}


class Generation:
    """A registry of one simulated torch generation: listed ops exist with those kernels."""

    def __init__(self, kernels: dict):
        self.kernels = kernels

    def lookup(self, qualname):
        return (lambda *args: qualname) if qualname in self.kernels else None

    def has_kernel(self, qualname, key):
        return key in self.kernels.get(qualname, ())


# XPU's compile-time prepacks, from its kernels: conv returns the weight, linear its transpose;
# the int4 packer reinterprets the neutral uint8 [N, K/2] as int32 [N, K/8].
XPU_PREPACKS = {
    "onednn::qconv_prepack.default": lambda weight, *args: weight,
    "onednn::qlinear_prepack.default": lambda weight, input_shape: weight.transpose(0, 1),
    "aten::_convert_weight_to_int4pack.default": lambda nibbles, inner_k_tiles: nibbles.contiguous().view(torch.int32),
}


class SimulatedXpuBuild(TorchRegistry):
    """The live ops (so lowered graphs hold real OpOverloads), with the XPU kernels of
    ``xpu_kernels`` and XPU's prepacks emulated."""

    def __init__(self, xpu_kernels=frozenset(CURRENT_XPU)):
        self.xpu_kernels = xpu_kernels

    def lookup(self, qualname):
        return XPU_PREPACKS.get(qualname) or super().lookup(qualname)

    def has_kernel(self, qualname, dispatch_key):
        if dispatch_key == XPU:
            return qualname in self.xpu_kernels
        return TorchRegistry().has_kernel(qualname, dispatch_key)


requires_xpu = pytest.mark.skipif(not (hasattr(torch, "xpu") and torch.xpu.is_available()),
                                  reason="needs an Intel GPU (XPU): none on this machine")
