"""qbackend's own kernels as ops of its ``qbackend::`` namespace, so graphs (and Inductor, under
``remainder="inductor"``) can call them: each family module's ops (schema, implementation,
fake, plain function) defined and registered on first use (``available``, ``op``), and what a
graph calls for one (``own_kernel``: the op if the graph will be traced, else the plain
function, which skips the dispatcher).

The kernel families (one module each, beside its C source in ``csrc/``): ``weight_only_mm``,
``depthwise``, ``grouped``, ``conv_gemm``, ``stem``, ``pools``, ``attention``,
``scale_quantize``, ``layer_norm_quantize``, ``add_quantize``. No AVX2, no compiler, or a failed
build: ``available`` says why and the lowering keeps torch's kernels.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from qbackend.kernels import (add_quantize, attention, conv_gemm, depthwise, grouped, isa, layer_norm_quantize, library, pools,
                              scale_quantize, stem, weight_only_mm)

NAMESPACE = "qbackend"
# op name -> its family's Kernel (schema, implementation, fake, plain function)
KERNELS = {**weight_only_mm.KERNELS, **depthwise.KERNELS, **conv_gemm.KERNELS, **attention.KERNELS, **grouped.KERNELS,
           **stem.KERNELS, **pools.KERNELS, **scale_quantize.KERNELS, **layer_norm_quantize.KERNELS, **add_quantize.KERNELS}
OPS = {name: kernel.schema for name, kernel in KERNELS.items()}
FAKES = {name: kernel.fake for name, kernel in KERNELS.items()}
# own kernel -> the plain function eager graphs call
PLAIN = {name: kernel.plain for name, kernel in KERNELS.items()}

_library = None  # the torch.library.Library that holds the op registrations (alive while the process is)


@library.once
def _registered() -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    """The kernels' library with every op registered, else (None, why not)."""
    global _library
    lib, reason = isa._load()
    if lib is None:
        return None, reason
    _library = torch.library.Library(NAMESPACE, "FRAGMENT")
    for name, kernel in KERNELS.items():
        _library.define(kernel.schema)
        _library.impl(name, kernel.impl, "CPU")
        torch.library.register_fake(f"{NAMESPACE}::{name}", kernel.fake, lib=_library)
    return lib, None


def available() -> Optional[str]:
    """None when the kernels are built and registered, else why they cannot be."""
    return _registered()[1]


def op(name: str):
    """The registered OpOverload; RuntimeError with the reason when the kernels are unavailable."""
    reason = available()
    if reason is not None:
        raise RuntimeError(reason)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def own_kernel_forms(name: str) -> tuple:
    """Both forms a graph may call an own kernel in (``own_kernel``)."""
    return own_kernel(name, traced=True), own_kernel(name, traced=False)


def own_kernel(name: str, traced: bool):
    """What a graph calls for an own kernel: the op if the graph will be traced (fake tensors
    need its fake kernel), else the plain function. Loads the kernels first."""
    registered = op(name)
    return registered if traced else PLAIN[name]
