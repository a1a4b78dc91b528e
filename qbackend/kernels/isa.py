"""Which of qbackend's own kernel libraries load here and which build runs: the AVX2 library
(``_load``), the AVX512-VNNI one (``_vnni_library``), the int8 build and the GEMM's register
width (``int8_build``, ``gemm_build``, ``zmm_speedup``), and C functions of either declared
for a kernel family (``c_function``, ``vnni_function``). The op registrations are
``registry``'s; each family module declares and calls its own C functions.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

from qbackend.kernels import choice_cache, library


@library.once
def _load() -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    """The AVX2 library (its structs checked), else (None, why not): what ``registry.available`` reports."""
    if library.switch() == "off":
        return None, f"qbackend's own kernels are unavailable: switched off by ${library.SWITCH}=off"
    try:
        lib = library.loaded()
    except (RuntimeError, OSError) as error:
        return None, f"qbackend's own kernels are unavailable: {error}"
    lib.qb_has_avx512_vnni.restype = ctypes.c_int
    return lib, None


@functools.lru_cache(maxsize=None)
def c_function(name: str, argtypes: tuple, restype=None):
    """The own-kernel library's C function ``name`` declared with ``argtypes`` / ``restype``, or
    None where the kernels are not built (for a kernel family's own module)."""
    return _declared(_load()[0], name, argtypes, restype)


@functools.lru_cache(maxsize=None)
def vnni_function(name: str, argtypes: tuple, restype=None):
    """The AVX512-VNNI library's C function ``name`` declared (``c_function``), or None where
    that library does not load here."""
    return _declared(_vnni_library()[0], name, argtypes, restype)


def _declared(lib: Optional[ctypes.CDLL], name: str, argtypes: tuple, restype):
    """(ctypes keeps one function object per name and library: declared once, for every caller)"""
    if lib is None:
        return None
    function = getattr(lib, name)
    function.argtypes, function.restype = list(argtypes), restype
    return function


def function_address(function) -> int:
    """The address of a loaded C function (a kernel chain step's entry)."""
    return ctypes.cast(function, ctypes.c_void_p).value


def c_address(name: str) -> int:
    """The address of the own-kernel library's C function ``name``."""
    return function_address(getattr(_load()[0], name))


@library.once
def _vnni_library() -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    """The AVX512-VNNI kernels' library (the GEMM's qb_conv_call_vnni, the depthwise
    qb_dwconv_vnni_call, the stem conv's qb_stem_conv_vnni_call, attention's AVX-512 build)
    where this CPU and compiler can run it, else (None, why not)."""
    lib, reason = _load()
    if lib is None:
        return None, reason
    if library.switch() == "avx2":
        return None, f"the AVX512-VNNI kernels are switched off by ${library.SWITCH}=avx2"
    if not lib.qb_has_avx512_vnni():
        return None, "the CPU has no AVX512-VNNI"
    try:
        vnni = library.loaded("qbackend_vnni")
    except (RuntimeError, OSError) as error:
        return None, f"the AVX512-VNNI kernels could not be built or loaded: {error}"
    vnni.qb_vnni_zmm_speedup.argtypes, vnni.qb_vnni_zmm_speedup.restype = [ctypes.c_int], ctypes.c_double
    vnni.qb_amx_ready.argtypes, vnni.qb_amx_ready.restype = [], ctypes.c_int
    return vnni, None


@functools.lru_cache(maxsize=None)
def amx_ready() -> bool:
    """Whether the GEMM's AMX build runs here: the CPU has AMX-INT8 and Linux lets this process
    use the tile registers (qb_amx_ready asks once, as oneDNN does)."""
    vnni = _vnni_library()[0]
    return vnni is not None and bool(vnni.qb_amx_ready())


# zmm over ymm products per second above which the VNNI GEMM runs on zmm: a Zen 4 EPYC measured
# 0.63 (zmm vpdpbusd at a third of ymm's rate), a Zen 5 EPYC 1.9-2.0; between, ymm (its tiles
# were tuned longer).
ZMM_MIN_SPEEDUP = 1.3


ZMM_SPEEDUPS = (0.0, 16.0)  # what a kept probe may hold: well past the 2x of zmm's width over ymm's


def int8_build() -> str:
    """The build of the int8 kernels (qbackend::qconv's GEMM, qbackend::qconv_depthwise) that runs
    here: "avx512_vnni" (vpdpbusd: exact for any int8 weights) or "avx2" (vpmaddubsw /
    vpmaddwd: the GEMM's int16 pair sums saturate, so the lowering checks each weight against
    the activation range). The lowering packs weights for it."""
    return "avx512_vnni" if _vnni_library()[0] is not None else "avx2"


@functools.lru_cache(maxsize=None)
def zmm_speedup() -> float:
    """How many more int8 products per second this core does with zmm vpdpbusd than with ymm
    (qb_vnni_zmm_speedup: under 1 ms); 0 without the VNNI kernels. Measured once per machine
    and kept (qbackend/kernels/choice_cache.py): a timing race measured per process lowered the same
    model to different kernels in different processes."""
    vnni = _vnni_library()[0]
    if vnni is None:
        return 0.0
    return choice_cache.shared().remembered("zmm_speedup", lambda: vnni.qb_vnni_zmm_speedup(1),
                                            choice_cache.number(*ZMM_SPEEDUPS))


def gemm_build() -> str:
    """The build of qbackend::qconv's GEMM that runs here: int8_build's, and for AVX512-VNNI
    "avx512_amx" where the CPU has AMX-INT8 (the zmm build, 1x1 convs and linears on tiles), else
    the register width this core runs faster ("avx512_vnni": ymm, "avx512_vnni_zmm"). All take
    the same packed weights; lowering/gemm.py LIMITS holds where each beats oneDNN."""
    build, forced = int8_build(), library.switch()
    if forced in library.GEMM_BUILDS:
        needed = library.GEMM_BUILDS[forced][0]
        if needed != build:
            raise RuntimeError(f"qbackend: ${library.SWITCH}={forced} needs the {needed} kernels: {vnni_unavailable()}")
        if forced == "avx512_amx" and not amx_ready():
            raise RuntimeError(f"qbackend: ${library.SWITCH}={forced} needs AMX-INT8, which this CPU or Linux does not give")
        return forced
    if build != "avx512_vnni":
        return build
    return "avx512_amx" if amx_ready() else "avx512_vnni_zmm" if zmm_speedup() >= ZMM_MIN_SPEEDUP else build


ZMM_BUILDS = ("avx512_vnni_zmm", "avx512_amx")  # GEMM builds on zmm registers


def on_zmm() -> bool:
    """Whether the int8 kernels built for both widths (the GEMM, the depthwise conv) run their
    zmm build here: gemm_build's choice, so a forced build tests both kernels' paths."""
    return gemm_build() in ZMM_BUILDS


def vnni_unavailable() -> Optional[str]:
    """None where the AVX512-VNNI kernels run here, else why not."""
    return _vnni_library()[1]
