"""Loading qbackend's own kernel libraries: which may run (``$QBACKEND_KERNELS``), a library
loaded with its structs checked (``loaded``), and the once-per-process guard the loaders share.
Building and caching them is ``qbackend/kernels/kernel_build.py``'s."""
from __future__ import annotations

import ctypes
import functools
import os
import threading

import torch

from qbackend.kernels import kernel_build

from .structs import check_layouts

# $QBACKEND_KERNELS: which of the own kernels may run ("auto", the default: the best this CPU
# has). "off": none (torch's kernels only); otherwise a GEMM build forced (GEMM_BUILDS below;
# "avx2" also keeps the AVX512-VNNI library unloaded). For tests and for ruling the kernels out.
# Read once per process, as the libraries are loaded once (isa.gemm_build runs on every
# own-kernel call: reading the environment there cost 0.7 of its 0.9 us).
SWITCH = "QBACKEND_KERNELS"
# isa.gemm_build's values -> the isa.int8_build they belong to and their C function
GEMM_BUILDS = {"avx2": ("avx2", "qb_conv_call"), "avx512_vnni": ("avx512_vnni", "qb_conv_call_vnni"),
               "avx512_vnni_zmm": ("avx512_vnni", "qb_conv_call_vnni512"), "avx512_amx": ("avx512_vnni", "qb_conv_call_amx")}


@functools.lru_cache(maxsize=None)
def switch() -> str:
    chosen = os.environ.get(SWITCH) or "auto"
    if chosen not in ("auto", "off") + tuple(GEMM_BUILDS):
        raise ValueError(f"qbackend: ${SWITCH}={chosen!r}; valid: 'auto', 'off', {', '.join(map(repr, GEMM_BUILDS))}")
    return chosen


def loaded(name: str = "qbackend_kernels") -> ctypes.CDLL:
    """``kernel_build.load`` of library ``name`` on a CPU that can run the kernels, its structs
    checked against their ctypes mirrors (RuntimeError or OSError with the reason)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise RuntimeError(f"the CPU (capability {torch.backends.cpu.get_cpu_capability()}) has no AVX2")
    lib = kernel_build.load(name, *kernel_build.LIBRARIES[name])
    check_layouts(lib)
    return lib


def once(function):
    """``function()``'s result, computed by one thread once (two threads loading at once had
    registered the ops twice: "Tried to register an operator ... with the same name")."""
    lock, result = threading.Lock(), []

    @functools.wraps(function)
    def computed():
        if not result:
            with lock:
                if not result:
                    result.append(function())
        return result[0]

    return computed
