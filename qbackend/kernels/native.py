"""qbackend's own CPU kernels (``csrc/*.c``, AVX2), for what torch's kernels do slowly here.

- Weight-only int4 / int8 matmul with int16 activations (``weight_only_int16.c``): torch
  2.13's packed kernels are fast only with bf16 activations and, without AVX512,
  compute-bound at 3-4x their memory-bandwidth time; these quantize the activations per group
  to int16 (finer than bf16 rounding) and multiply with integer instructions: 1.5 ms vs
  3.5-4.2 ms on a 4096x11008 int4 layer. Built again in the AVX512-VNNI library, where int4
  sums take ``vpdpbusd`` (``_weight_only_library``).
- Depthwise 3x3 / 5x5 / 7x7 int8 convs (``depthwise_conv_int8.c``) and an int8 GEMM for other convs up
  to 3x3 and linears (``conv_gemm_int8.c``): onednn::qconv_pointwise / qlinear_pointwise
  spend ~50 us per call before computing, run depthwise convs at 3-11 GMAC/s here, and their
  AVX2 int8 kernels are slower than this GEMM's below a few thousand output rows. Both are
  built a second time for AVX512-VNNI (``conv_gemm_int8_vnni.c``, ``depthwise_conv_int8_vnni.c``:
  a library of their own), used where the CPU has it: ``int8_build``; the GEMM a third time on
  zmm registers (``conv_gemm_int8_vnni512.c``), used where this core runs zmm ``vpdpbusd`` fast
  (``zmm_speedup``, ``gemm_build``). That library also holds a conv for inputs of few channels
  (``stem_conv_int8_vnni.c``: a network's stem, optionally with the max pool after it), VNNI only.
- An int8 max pool (``max_pool_uint8.c``; torch's quantized::max_pool2d runs on one thread)
  and global average pool (``global_avg_pool_uint8.c``; torch's needs a quantized-tensor copy),
  the model input's quantize to channels-last uint8 (``quantize_nhwc.c``), float32 attention
  (``attention_f32.c``), LayerNorm with its quantize (``layer_norm_quantize.c``), and the runner of own-kernel chains (``kernel_chain.c``).

The sources are compiled once per machine with the system C compiler (as Inductor does for
its own kernels) into one library, cached by a hash of sources, flags and compiler
(``kernel_build``: only libraries this user built and no one else could touch), loaded with ctypes,
and registered as ops in qbackend's own ``qbackend::`` namespace so graphs (and Inductor,
under ``remainder="inductor"``) can call them. No AVX2, no compiler, or a failed build:
``available`` says why and the lowering keeps torch's kernels.
"""
from __future__ import annotations

import ctypes
import functools
import math
import threading
import weakref
from typing import NamedTuple, Optional

import torch

from qbackend.kernels.chain_step import SCRATCH, SIX, KeyLength, dense, plain_float32, step_call
from qbackend.kernels import library
from qbackend.kernels.structs import AttentionCall, ConvCall, DepthwiseCall, GlobalAvgPoolCall, GroupedCall, MaxPoolCall, StemCall, WeightOnlyCall

MAX_TAPS = 9  # kernel positions qconv takes (conv_gemm_int8.c MAX_TAPS): up to 3x3
BLOCK = 64  # columns per weight block (the kernel's unit: K must be a multiple)
GROUPS = (32,) + tuple(range(BLOCK, 4097, BLOCK))  # int4 group sizes the kernel takes
NAMESPACE = "qbackend"
OPS = {
    "int4_mm_int16": "int4_mm_int16(Tensor x, Tensor weight, Tensor scale, Tensor offset, int group_size) -> Tensor",
    "int8_mm_int16": "int8_mm_int16(Tensor x, Tensor weight, Tensor scale) -> Tensor",
    "qconv_depthwise": "qconv_depthwise(Tensor x, int x_zero_point, Tensor weight, Tensor mult, Tensor add, int[] stride, "
                   "int[] padding, float low, float high, float out_scale, int out_zero_point, int qmin, int qmax, "
                   "bool float_out=False, str activation='none', int window=3) -> Tensor",
    # (ConvNeXt's depthwise conv, the LayerNorm over its channels and the quantize after it: uint8
    # [N, OH, OW, C], what layer_norm_quantize gives for the conv's float result seen as NHWC)
    "qconv_depthwise_layer_norm": "qconv_depthwise_layer_norm(Tensor x, int x_zero_point, Tensor weight, Tensor mult, "
                                  "Tensor add, int[] stride, int[] padding, float low, float high, str activation, "
                                  "int window, Tensor norm_weight, Tensor norm_bias, float eps, float scale, "
                                  "int zero_point, int qmin, int qmax) -> Tensor",
    "qconv": "qconv(Tensor x, Tensor weight, Tensor mult, Tensor add, Tensor? residual, float residual_scale, "
             "float low, float high, float out_scale, int out_zero_point, int qmin, int qmax, bool float_out=False, "
             "str activation='none', int[2] kernel_size=[1, 1], int[2] stride=[1, 1], int[2] padding=[0, 0], "
             "int[2] dilation=[1, 1], int x_zero_point=0) -> Tensor",
    "attention_f32": "attention_f32(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool is_causal=False) -> Tensor",
    # (uint8 [batch, length, heads, head dim]: the heads merged, as the out-projection reads them)
    "attention_quantize": "attention_quantize(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, float out_scale, "
                          "int zero_point, int qmin, int qmax) -> Tensor",
    # (grouped 3x3, as many outputs as inputs per group; AVX512-VNNI only)
    "qconv_grouped": "qconv_grouped(Tensor x, int x_zero_point, Tensor weight, Tensor mult, Tensor add, int groups, "
                     "int stride, float low, float high, float out_scale, int out_zero_point, int qmin, int qmax) -> Tensor",
    "qconv_stem": "qconv_stem(Tensor x, int x_zero_point, Tensor weight, Tensor mult, Tensor add, int[2] kernel_size, "
                  "int[2] stride, int[2] padding, float low, float high, float out_scale, int out_zero_point, int qmin, "
                  "int qmax, int[2] pool_kernel=[0, 0], int[2] pool_stride=[1, 1], int[2] pool_padding=[0, 0]) -> Tensor",
    "max_pool_u8": "max_pool_u8(Tensor x, int[2] kernel_size, int[2] stride, int[2] padding, int[2] dilation, bool ceil_mode=False) -> Tensor",
    "global_avg_pool_u8": "global_avg_pool_u8(Tensor x, int zero_point, int qmin, int qmax) -> Tensor",
    "scale_quantize": "scale_quantize(Tensor x, Tensor factors, float scale, int zero_point, int qmin, int qmax) -> Tensor",
    "layer_norm_quantize": "layer_norm_quantize(Tensor x, Tensor weight, Tensor bias, float eps, float scale, int zero_point, "
                           "int qmin, int qmax) -> Tensor",
    # (returns the uint8 copy and the float32 sum)
    "add_quantize": "add_quantize(Tensor a, Tensor b, float scale, int zero_point, int qmin, int qmax) -> (Tensor, Tensor)",
    # (the sum written into a, as ATen's add_: for an in-place residual add; returns the uint8 copy)
    "add_quantize_": "add_quantize_(Tensor(a!) a, Tensor b, float scale, int zero_point, int qmin, int qmax) -> Tensor",
    # (the same, and the float32 rows it quantized: for a norm that other ops read too)
    "layer_norm_and_quantize": "layer_norm_and_quantize(Tensor x, Tensor weight, Tensor bias, float eps, float scale, "
                               "int zero_point, int qmin, int qmax) -> (Tensor, Tensor)",
}
# qconv's unary post-ops besides its clamp (conv_gemm_int8.c ``enum activation``)
ACTIVATIONS = {"none": 0, "gelu": 1, "gelu_tanh": 2, "swish": 3, "hardswish": 4}


_library = None  # the torch.library.Library that holds the op registrations (alive while the process is)


@library.once
def _load() -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    global _library
    if library.switch() == "off":
        return None, f"qbackend's own kernels are unavailable: switched off by ${library.SWITCH}=off"
    try:
        lib = library.loaded()
    except (RuntimeError, OSError) as error:
        return None, f"qbackend's own kernels are unavailable: {error}"
    pointer, i32, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.qb_dwconv_call.argtypes = [i32] + [pointer] * 3
    lib.qb_attention_f32.argtypes = [i32] + [pointer] * 6
    _declare_weight_only(lib)
    lib.qb_quantize_nchw_to_nhwc.argtypes = [i32] * 4 + [pointer, f32] + [i32] * 3 + [pointer]
    lib.qb_quantize_dense.argtypes = [i32, ctypes.c_long, pointer, f32] + [i32] * 6 + [pointer]
    lib.qb_scale_quantize.argtypes = [i32, i32, i32, ctypes.c_long, i32, pointer, pointer, ctypes.c_long, f32] + [i32] * 3 + [pointer]
    lib.qb_layer_norm_quantize.argtypes = [i32, ctypes.c_long, i32] + [pointer] * 3 + [f32, f32] + [i32] * 3 + [pointer] * 2
    lib.qb_layer_norm_quantize.restype = ctypes.c_long
    lib.qb_add_quantize.argtypes = [i32, ctypes.c_long, pointer, pointer, f32] + [i32] * 3 + [pointer] * 2
    lib.qb_add_quantize.restype = None
    _declare_gemm(lib.qb_conv_call)
    lib.qb_run_chain.argtypes = [i32, i32, pointer, pointer]
    lib.qb_max_pool_u8_call.argtypes = lib.qb_global_avg_pool_u8_call.argtypes = [i32] + [pointer] * 3
    # (0; -1 when the depthwise conv could not allocate its padding row: the pools always 0)
    lib.qb_dwconv_call.restype = lib.qb_run_chain.restype = i32
    lib.qb_max_pool_u8_call.restype = lib.qb_global_avg_pool_u8_call.restype = i32
    lib.qb_quantize_nchw_to_nhwc.restype = lib.qb_quantize_dense.restype = lib.qb_scale_quantize.restype = None
    lib.qb_attention_f32.restype = i32  # (0; -1 when a thread could not allocate its scratch)
    lib.qb_has_avx512_vnni.restype = i32
    _library = torch.library.Library(NAMESPACE, "FRAGMENT")
    for name, schema in OPS.items():
        _library.define(schema)
        _library.impl(name, functools.partial(_IMPLS[name], lib), "CPU")
        torch.library.register_fake(f"{NAMESPACE}::{name}", FAKES[name], lib=_library)
    return lib, None


@functools.lru_cache(maxsize=None)
def c_function(name: str, argtypes: tuple, restype=None):
    """The own-kernel library's C function ``name`` declared with ``argtypes`` / ``restype``, or
    None where the kernels are not built (for a kernel family's own module)."""
    lib = _load()[0]
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


def _declare_gemm(function) -> None:
    """qb_conv_call's and qb_conv_call_vnni's signature: (threads, call, x, residual, y, yf) -> 0 /
    -1 (a scratch buffer could not be allocated)."""
    function.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 5
    function.restype = ctypes.c_int


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
    _declare_gemm(vnni.qb_conv_call_vnni)
    _declare_gemm(vnni.qb_conv_call_vnni512)
    vnni.qb_vnni_zmm_speedup.argtypes, vnni.qb_vnni_zmm_speedup.restype = [ctypes.c_int], ctypes.c_double
    vnni.qb_dwconv_vnni_call.argtypes = vnni.qb_stem_conv_vnni_call.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 3
    vnni.qb_grouped_conv_vnni.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 3
    vnni.qb_attention_f32.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 6
    _declare_weight_only(vnni)
    # -1: a thread's scratch could not be allocated (the depthwise conv; the stem conv with a fused
    # pool; the grouped conv's zero-point pixel)
    vnni.qb_dwconv_vnni_call.restype = vnni.qb_stem_conv_vnni_call.restype = vnni.qb_grouped_conv_vnni.restype = ctypes.c_int
    vnni.qb_attention_f32.restype = ctypes.c_int  # (0; -1 when a thread could not allocate its scratch)
    return vnni, None


GEMM_BLOCK = 16  # output channels per packed weight row, every build (conv_gemm_int8.c PACKED; Cout padded)
DEPTHWISE_VNNI_GROUP = 32  # channels per step of the VNNI depthwise kernel (and a last one of 16)
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
    from qbackend.kernels import choice_cache  # (it hashes this module's sources)
    return choice_cache.shared().remembered("zmm_speedup", lambda: vnni.qb_vnni_zmm_speedup(1),
                                            choice_cache.number(*ZMM_SPEEDUPS))


def gemm_build() -> str:
    """The build of qbackend::qconv's GEMM that runs here: int8_build's, and for AVX512-VNNI the
    register width this core runs faster ("avx512_vnni": ymm, "avx512_vnni_zmm"). All take the
    same packed weights; lowering/gemm.py LIMITS holds where each beats oneDNN."""
    build, forced = int8_build(), library.switch()
    if forced in library.GEMM_BUILDS:
        needed = library.GEMM_BUILDS[forced][0]
        if needed != build:
            raise RuntimeError(f"qbackend: ${library.SWITCH}={forced} needs the {needed} kernels: {vnni_unavailable()}")
        return forced
    return "avx512_vnni_zmm" if build == "avx512_vnni" and zmm_speedup() >= ZMM_MIN_SPEEDUP else build


def vnni_unavailable() -> Optional[str]:
    """None where the AVX512-VNNI kernels run here, else why not."""
    return _vnni_library()[1]


def available() -> Optional[str]:
    """None when the kernels are built and registered, else why they cannot be."""
    return _load()[1]


def op(name: str):
    """The registered OpOverload; RuntimeError with the reason when the kernels are unavailable."""
    reason = available()
    if reason is not None:
        raise RuntimeError(reason)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def _weight_only_mm(kernel, name: str, x: torch.Tensor, n: int, k: int, weights: tuple, *sizes: int,
                    trusted: bool = False) -> torch.Tensor:
    """Run a weight-only kernel: ``kernel(threads, M, N, K, *sizes, x, *weights, scratch..., y)``;
    ``weights`` are (tensor, dtype, element count) as ``_check_constants`` takes them (not
    checked when ``trusted``: the lowering's own packing)."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] != k:
        raise ValueError(f"qbackend::{name} takes float32 CPU activations [M, {k}], got {x.dtype} {tuple(x.shape)} on {x.device}")
    if not trusted:
        _check_constants(name, *weights)
    x, m = x.contiguous(), x.shape[0]
    scales_at, sums_at, scratch_bytes = _weight_only_scratch(m, k)
    scratch, y = _scratch(scratch_bytes), torch.empty(m, n)
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


def weight_only_chain_call(args: tuple, y: torch.Tensor):
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
    address = function_address(_weight_only_library().qb_weight_only_call)
    return step_call(address, struct, (x, SCRATCH, y, None), args[1:], scratch_bytes)


_SCRATCH = threading.local()


def _scratch(size: int) -> int:
    """The address of ``size`` bytes of this thread's scratch, kept between calls (two of a
    decode step's three allocations per weight-only call: ~3 of its ~12 us)."""
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.numel() < size:
        buffer = _SCRATCH.buffer = torch.empty(max(size, 1 << 16), dtype=torch.uint8)
    return buffer.data_ptr()


@library.once
def _weight_only_library() -> ctypes.CDLL:
    """weight_only_int16.c's build: the AVX512-VNNI one where it loads (int4 sums as vpdpbusd
    pairs; the same bits), else the AVX2 one."""
    return _vnni_library()[0] or _load()[0]


def _declare_weight_only(lib: ctypes.CDLL) -> None:
    """qb_int4_mm's and qb_int8_mm's signatures (either build)."""
    lib.qb_int4_mm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_void_p] * 8
    lib.qb_int8_mm.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p] * 7
    lib.qb_int4_mm.restype = lib.qb_int8_mm.restype = None


def _int4_mm(lib, x, weight, scale, offset, group_size, trusted=False):
    """(``lib``: the registration's; the kernel's build is ``_weight_only_library``'s.)"""
    n, k = weight.shape[0], weight.shape[1] * 2  # the neutral int4 storage: two columns per byte
    if (reason := refusal(4, k, group_size)) is not None:
        raise ValueError(f"qbackend::int4_mm_int16: {reason}")
    groups, codes = n * (k // group_size), offset.dtype == INT4_OFFSET_CODES
    return _weight_only_mm(_weight_only_library().qb_int4_mm, "int4_mm_int16", x, n, k, ((weight, torch.uint8, n * k // 2),
                           (scale, torch.float32, groups), (offset, INT4_OFFSET_CODES if codes else torch.float32, groups)),
                           group_size, int(codes), trusted=trusted)


def _int8_mm(lib, x, weight, scale, trusted=False):
    n, k = weight.shape
    if (reason := refusal(8, k, k)) is not None:
        raise ValueError(f"qbackend::int8_mm_int16: {reason}")
    return _weight_only_mm(_weight_only_library().qb_int8_mm, "int8_mm_int16", x, n, k,
                           ((weight, torch.int8, n * k), (scale, torch.float32, n)), trusted=trusted)


def _check_nchw_uint8(x: torch.Tensor, channels: Optional[int], name: str) -> None:
    """uint8 CPU [N, C, H, W] activations, with ``channels`` channels (None: any)."""
    if x.dim() != 4 or x.dtype != torch.uint8 or x.device.type != "cpu" or channels not in (None, x.shape[1]):
        raise ValueError(f"qbackend::{name} takes uint8 CPU activations [N, {'C' if channels is None else channels}, H, W], "
                         f"got {x.dtype} {tuple(x.shape)} on {x.device}")


def _check_constants(name: str, *expected) -> None:
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


def _output_hw(h: int, w: int, kernel_size, stride, padding, dilation=(1, 1), ceil_mode=False) -> tuple[int, int]:
    """A conv's / pool's output height and width (``conv_output_size`` per dim)."""
    return tuple(conv_output_size(size, *args, ceil_mode) for size, args in zip((h, w), zip(stride, padding, kernel_size, dilation)))


WINDOW_LIMIT = 1 << 15  # kernel sizes, strides, paddings and dilations the C kernels take (int arithmetic)


def _check_levels(name: str, x_zero_point: int, out_zero_point: int, qmin: int, qmax: int) -> None:
    """uint8 zero points and an output clamp within uint8 (the C kernels store bytes)."""
    if not (0 <= x_zero_point <= 255 and 0 <= out_zero_point <= 255 and 0 <= qmin <= qmax <= 255):
        raise ValueError(f"qbackend::{name}: zero points {x_zero_point}, {out_zero_point} and clamp [{qmin}, {qmax}] "
                         "must lie within 0..255")


def _window(name: str, h: int, w: int, kernel_size, stride, padding, dilation=(1, 1), ceil_mode=False) -> tuple[int, int]:
    """``_output_hw`` for a C kernel: each argument two ints in range (kernel, stride and
    dilation from 1, padding from 0), and an output of at least one pixel; else ValueError."""
    lowest = {"kernel_size": 1, "stride": 1, "padding": 0, "dilation": 1}
    for (what, low), value in zip(lowest.items(), (kernel_size, stride, padding, dilation)):
        if len(value) != 2 or not all(isinstance(v, int) and low <= v < WINDOW_LIMIT for v in value):
            raise ValueError(f"qbackend::{name}: {what} {list(value)}: two ints from {low} to {WINDOW_LIMIT - 1} expected")
    oh, ow = _output_hw(h, w, kernel_size, stride, padding, dilation, ceil_mode)
    if oh < 1 or ow < 1:
        raise ValueError(f"qbackend::{name}: kernel {list(kernel_size)}, stride {list(stride)}, padding {list(padding)}, "
                         f"dilation {list(dilation)} on a {h}x{w} input: no output")
    return oh, ow


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


def _prepare(struct: ctypes.Structure, shape: tuple, dtype: torch.dtype, function, constants: tuple) -> Prepared:
    n, c, h, w = shape
    return Prepared(struct, shape, (h * w * c, 1, w * c, c), dtype, function, constants, ctypes.addressof(struct))


def _output(x: torch.Tensor, prepared: Prepared) -> torch.Tensor:
    """The kernel's empty output (x.new_empty_strided: 1.0 us, torch.empty with a memory format 1.7)."""
    return x.new_empty_strided(prepared.shape, prepared.strides, dtype=prepared.dtype)


# id(packed weight) -> {key: Prepared}. An entry goes when its weight does (a finalizer: the
# weight's id cannot be reused before), so a dropped model's calls and constants go with it.
# (Not an attribute of the weight: its ctypes structs would make the tensor uncopyable.)
_PREPARED: dict = {}


def _prepared(weight: torch.Tensor, trusted: bool, x: torch.Tensor, args: tuple, prepare) -> Prepared:
    """The call for input ``x`` and the other ``args``. ``trusted`` (the lowering's own
    constants): cached per packed ``weight``, keyed by the input's shape and kind, the kernel
    build and the other arguments (tensors by identity: the entry holds them; the graph gives
    sizes as tuples, so the key is built without a conversion: ~0.8 us, not 2). Else
    ``prepare()`` checks every argument, every call."""
    if not trusted:
        return prepare()
    cache = _PREPARED.get(id(weight))
    if cache is None:
        cache = _PREPARED[id(weight)] = {}
        weakref.finalize(weight, _PREPARED.pop, id(weight), None)
    key = (x.shape, x.dtype, x.device, gemm_build(), args)
    try:
        prepared = cache.get(key)
    except TypeError:  # a list among the arguments (a direct caller's)
        key = key[:-1] + (tuple(tuple(a) if isinstance(a, list) else a for a in args),)
        prepared = cache.get(key)
    if prepared is None:
        prepared = cache[key] = prepare()
    return prepared


DEPTHWISE_WINDOWS = (3, 5, 7)  # square windows the kernels take
DEPTHWISE_STRIDES = (1, 2)


def _prepare_dwconv(lib, x, x_zero_point, weight, mult, add, stride, padding, low, high, out_scale, out_zero_point,
                    qmin, qmax, float_out=False, activation="none", window=3) -> Prepared:
    """The AVX2 kernel for int16 packed weights, the VNNI one for int8 (``lowering/depthwise.py``)."""
    _check_nchw_uint8(x, None, "qconv_depthwise")
    n, c, h, w = x.shape
    packed = -(-c // 16) * 16  # (the packing pads the channels with zeros)
    if activation not in ACTIVATIONS:
        raise ValueError(f"qbackend::qconv_depthwise: activation {activation!r} is not one of {list(ACTIVATIONS)}")
    if window not in DEPTHWISE_WINDOWS:
        raise ValueError(f"qbackend::qconv_depthwise: a {window}x{window} window; the kernel takes {DEPTHWISE_WINDOWS}")
    if weight.dtype == torch.int8:
        vnni = _vnni_library()[0]
        if vnni is None:
            raise ValueError(f"qbackend::qconv_depthwise: int8 weights are packed for AVX512-VNNI: {_vnni_library()[1]}")
        function, dtype, taps = vnni.qb_dwconv_vnni_call, torch.int8, window * -(-window // 4) * 4  # rows of 4-byte quads
    else:
        function, dtype, taps = lib.qb_dwconv_call, torch.int16, (window * window + 1) // 2 * 2  # pairs of int16
    if mult.numel() != packed:
        raise ValueError(f"qbackend::qconv_depthwise: activations of {c} channels for constants packed for {mult.numel()} "
                         f"({c} channels pack as {packed})")
    _check_constants("qconv_depthwise", (weight, dtype, taps * packed), (mult, torch.float32, packed), (add, torch.float32, packed))
    oh, ow = _window("qconv_depthwise", h, w, (window, window), stride, padding)
    if any(s not in DEPTHWISE_STRIDES for s in stride):  # (the VNNI kernel shares a row's quads: 4 / stride columns apart)
        raise ValueError(f"qbackend::qconv_depthwise: stride {list(stride)}; the kernels take {DEPTHWISE_STRIDES}")
    _check_levels("qconv_depthwise", x_zero_point, out_zero_point, qmin, qmax)
    call = DepthwiseCall(n, h, w, c, *stride, *padding, oh, ow, x_zero_point, weight.data_ptr(), mult.data_ptr(),
                         add.data_ptr(), low, high, 1.0 / out_scale, out_zero_point, qmin, qmax, ACTIVATIONS[activation],
                         bool(float_out), window)
    return _prepare(call, (n, c, oh, ow), torch.float32 if float_out else torch.uint8, function, (mult, add))


def _dwconv_prepared(lib, x, x_zero_point, weight, mult, add, stride, padding, low, high, out_scale, out_zero_point,
                     qmin, qmax, float_out=False, activation="none", window=3, *, trusted=False) -> Prepared:
    args = (x_zero_point, mult, add, stride, padding, low, high, out_scale, out_zero_point, qmin, qmax, float_out, activation,
            window)
    return _prepared(weight, trusted, x, args, lambda: _prepare_dwconv(lib, x, x_zero_point, weight, *args[1:]))


def dwconv_layer_norm_refusal(x, weight, norm_weight, norm_bias, eps) -> Optional[str]:
    """Why qconv_depthwise_layer_norm cannot take these (tensors or fake values), None if it can."""
    if weight.dtype != torch.int8:
        return "the LayerNorm is fused into the AVX512-VNNI depthwise kernel only (int8 packed weights)"
    if x.dim() != 4 or x.shape[1] % 16:
        return f"input of shape {tuple(x.shape)}: the fused LayerNorm takes NCHW with whole groups of 16 channels"
    return _norm_parameters_refusal(x.shape[1], norm_weight, norm_bias, eps)


def _dwconv_layer_norm(lib, x, x_zero_point, weight, mult, add, stride, padding, low, high, activation, window, norm_weight,
                       norm_bias, eps, scale, zero_point, qmin, qmax, *, trusted=False):
    reason = dwconv_layer_norm_refusal(x, weight, norm_weight, norm_bias, eps) or _uint8_grid_refusal(scale, zero_point, qmin, qmax)
    if reason is not None:
        raise ValueError(f"qbackend::qconv_depthwise_layer_norm: {reason}")
    norm_weight, norm_bias = norm_weight.contiguous(), norm_bias.contiguous()
    args = (x_zero_point, mult, add, stride, padding, low, high, scale, zero_point, qmin, qmax, True, activation, window)

    def prepare():
        prepared = _prepare_dwconv(lib, x, x_zero_point, weight, *args[1:])
        prepared.struct.norm_weight, prepared.struct.norm_bias = norm_weight.data_ptr(), norm_bias.data_ptr()
        prepared.struct.norm_eps = eps
        return prepared._replace(constants=prepared.constants + (norm_weight, norm_bias))

    prepared = _prepared(weight, trusted, x, args + (norm_weight, norm_bias, eps), prepare)
    x = x.contiguous(memory_format=torch.channels_last)
    n, c, oh, ow = prepared.shape
    y = x.new_empty((n, oh, ow, c))
    status = prepared.function(torch.get_num_threads(), prepared.address, x.data_ptr(), y.data_ptr())
    if status < 0:
        raise MemoryError("qbackend::qconv_depthwise_layer_norm: a thread could not allocate its scratch")
    if status:  # pixels of huge, infinite or NaN values: the conv's floats, then layer_norm_quantize (ATen's statistics)
        floats = _dwconv(lib, x, x_zero_point, weight, *args[1:], trusted=trusted)
        y = _layer_norm_quantize(lib, floats.permute(0, 2, 3, 1), norm_weight, norm_bias, eps, scale, zero_point, qmin, qmax)
    return y


def _dwconv_layer_norm_fake(x, x_zero_point, weight, mult, add, stride, padding, low, high, activation, window, *args):
    n, c, h, w = x.shape
    return x.new_empty((n, *_output_hw(h, w, (window, window), stride, padding), c), dtype=torch.uint8)


def _x_to_y(prepared: Prepared, x: torch.Tensor, name: str) -> torch.Tensor:
    """Run a prepared (threads, call, x, y) -> 0 / failure kernel: the depthwise conv, the pools."""
    x = x.contiguous(memory_format=torch.channels_last)
    y = _output(x, prepared)
    if prepared.function(torch.get_num_threads(), prepared.address, x.data_ptr(), y.data_ptr()):
        raise MemoryError(f"qbackend::{name}: a thread could not allocate its scratch")
    return y


def _dwconv(lib, x, *args, trusted=False):
    return _x_to_y(_dwconv_prepared(lib, x, *args, trusted=trusted), x, "qconv_depthwise")


GROUPED_LANES = 8  # grouped_conv_int8_vnni.c: output channels per vector


def grouped_refusal(channels: int, groups: int) -> Optional[str]:
    """Why the grouped kernel cannot take ``channels`` in and out in ``groups`` (None if it can)."""
    per_group = channels // groups if groups and channels % groups == 0 else 0
    if channels % GROUPED_LANES or not (per_group == 4 or (per_group and per_group % GROUPED_LANES == 0)) or groups < 2:
        return (f"{channels} channels in {groups} groups: the kernel takes groups of 4 or a multiple of {GROUPED_LANES} "
                f"channels, {GROUPED_LANES} channels at a time")
    return None


def _prepare_grouped_conv(x, x_zero_point, weight, mult, add, groups, stride, low, high, out_scale, out_zero_point, qmin,
                     qmax) -> Prepared:
    _check_nchw_uint8(x, None, "qconv_grouped")
    n, c, h, w = x.shape
    vnni, unavailable = _vnni_library()
    if vnni is None:
        raise ValueError(f"qbackend::qconv_grouped: {unavailable}")
    reason = grouped_refusal(c, groups)
    if reason is not None:
        raise ValueError(f"qbackend::qconv_grouped: {reason}")
    _check_constants("qconv_grouped", (weight, torch.int8, c * 9 * (c // groups)), (mult, torch.float32, c),
                     (add, torch.float32, c))
    oh, ow = _window("qconv_grouped", h, w, (3, 3), (stride, stride), (1, 1))
    if stride not in DEPTHWISE_STRIDES:
        raise ValueError(f"qbackend::qconv_grouped: stride {stride}; the kernel takes {DEPTHWISE_STRIDES}")
    if not (math.isfinite(out_scale) and out_scale > 0) or math.isnan(low) or math.isnan(high):
        raise ValueError(f"qbackend::qconv_grouped: out scale {out_scale}, clamp [{low}, {high}]")
    _check_levels("qconv_grouped", x_zero_point, out_zero_point, qmin, qmax)
    call = GroupedCall(n, h, w, c, c // groups, stride, oh, ow, x_zero_point, weight.data_ptr(), mult.data_ptr(),
                       add.data_ptr(), low, high, 1.0 / out_scale, out_zero_point, qmin, qmax)
    return _prepare(call, (n, c, oh, ow), torch.uint8, vnni.qb_grouped_conv_vnni, (mult, add))


def _grouped_conv(lib, x, x_zero_point, weight, *args, trusted=False):
    prepared = _prepared(weight, trusted, x, (x_zero_point, *args),
                         lambda: _prepare_grouped_conv(x, x_zero_point, weight, *args))
    return _x_to_y(prepared, x, "qconv_grouped")


def _grouped_conv_fake(x, x_zero_point, weight, mult, add, groups, stride, *args):
    n, c, h, w = x.shape
    return _channels_last_like(x, (n, c, *_output_hw(h, w, (3, 3), (stride, stride), (1, 1))), torch.uint8)


def _channels_last_like(x: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    """An empty NHWC-strided tensor of x's kind (fake under tracing): the kernels' output layout."""
    n, c, h, w = shape
    return x.new_empty_strided(shape, (h * w * c, 1, w * c, c), dtype=dtype)


def _dwconv_fake(x, x_zero_point, weight, mult, add, stride, padding, low, high, out_scale, out_zero_point, qmin, qmax,
                 float_out=False, activation="none", window=3):
    n, c, h, w = x.shape
    shape = (n, c, *_output_hw(h, w, (window, window), stride, padding))
    return _channels_last_like(x, shape, torch.float32 if float_out else torch.uint8)


def _prepare_conv(lib, x, weight, mult, add, residual, residual_scale, low, high, out_scale, out_zero_point,
                  qmin, qmax, float_out, activation, kernel_size, stride, padding, dilation, x_zero_point) -> Prepared:
    """Check one call site's arguments and make its ConvCall."""
    _check_nchw_uint8(x, None, "qconv")
    oh, ow = _window("qconv", x.shape[2], x.shape[3], kernel_size, stride, padding, dilation)
    _check_levels("qconv", x_zero_point, out_zero_point, qmin, qmax)
    cout, taps = mult.numel(), kernel_size[0] * kernel_size[1]
    if not 1 <= taps <= MAX_TAPS:
        raise ValueError(f"qbackend::qconv takes up to {MAX_TAPS} kernel positions, got kernel {list(kernel_size)}")
    n, cin, h, w = x.shape
    packed_cin, packed_cout = -(-cin // 4) * 4, -(-cout // GEMM_BLOCK) * GEMM_BLOCK  # (the packing pads both with zero weights)
    if weight.numel() != taps * packed_cin * packed_cout:
        raise ValueError(f"qbackend::qconv: {weight.numel()} packed weights are not {cin} -> {cout} channels x {taps} "
                         f"kernel positions ({taps * packed_cin * packed_cout}: Cin and Cout padded)")
    _check_constants("qconv", (weight, torch.int8, weight.numel()), (mult, torch.float32, cout), (add, torch.float32, cout))
    if activation not in ACTIVATIONS:
        raise ValueError(f"qbackend::qconv: activation {activation!r} is not one of {list(ACTIVATIONS)}")
    if residual is not None and residual.dtype != torch.float32:  # a float32 residual, or a uint8 one checked like the input
        _check_nchw_uint8(residual, cout, "qconv (residual)")
    call = ConvCall(n, h, w, cin, oh, ow, *kernel_size, *stride, *padding, *dilation, cout, x_zero_point,
                    weight.data_ptr(), mult.data_ptr(), add.data_ptr(), residual is not None and residual.dtype == torch.float32,
                    residual_scale, ACTIVATIONS[activation], low, high, 1.0 / out_scale, out_zero_point, qmin, qmax)
    build = gemm_build()
    isa, function = library.GEMM_BUILDS[build]
    gemm = getattr(lib if isa == "avx2" else _vnni_library()[0], function)
    return _prepare(call, (n, cout, oh, ow), torch.float32 if float_out else torch.uint8, gemm, (mult, add))


def _conv_prepared(lib, x, weight, mult, add, residual, residual_scale, low, high, out_scale, out_zero_point, qmin, qmax,
                   float_out=False, activation="none", kernel_size=(1, 1), stride=(1, 1), padding=(0, 0), dilation=(1, 1),
                   x_zero_point=0, *, trusted=False) -> Prepared:
    """``trusted``: the constants are the lowering's own, so a prepared call is taken unchecked;
    the registered op (any caller) checks every call."""
    args = (mult, add, None if residual is None else residual.dtype, residual_scale, low, high, out_scale, out_zero_point,
            qmin, qmax, float_out, activation, kernel_size, stride, padding, dilation, x_zero_point)  # (a residual: its dtype)
    return _prepared(weight, trusted, x, args, lambda: _prepare_conv(lib, x, weight, mult, add, residual, *args[3:]))


def _conv(lib, x, weight, mult, add, residual, *args, trusted=False):
    prepared = _conv_prepared(lib, x, weight, mult, add, residual, *args, trusted=trusted)
    shape, float_out = prepared.shape, prepared.dtype == torch.float32
    x = x.contiguous(memory_format=torch.channels_last)
    y = _output(x, prepared)
    if residual is not None:
        if residual.shape != shape or residual.device.type != "cpu":
            raise ValueError(f"qbackend::qconv: residual {tuple(residual.shape)} on {residual.device} for output {shape}")
        residual = residual.contiguous(memory_format=torch.channels_last)
    if prepared.function(torch.get_num_threads(), prepared.address, x.data_ptr(),
                         None if residual is None else residual.data_ptr(), None if float_out else y.data_ptr(),
                         y.data_ptr() if float_out else None):
        raise MemoryError("qbackend::qconv: a thread could not allocate its scratch")
    return y


def _conv_fake(x, weight, mult, add, residual, residual_scale, low, high, out_scale, out_zero_point, qmin, qmax,
               float_out=False, activation="none", kernel_size=(1, 1), stride=(1, 1), padding=(0, 0), dilation=(1, 1),
               x_zero_point=0):
    n, _, h, w = x.shape
    oh, ow = _output_hw(h, w, kernel_size, stride, padding, dilation)
    return _channels_last_like(x, (n, mult.numel(), oh, ow), torch.float32 if float_out else torch.uint8)


# stem_conv_int8_vnni.c: output pixels of a row per step, the input bytes under them, and the
# leftover bytes (KW * C % 4 per window row) per pixel it has room for
STEM_PIECE, STEM_MAX_STRIP, STEM_MAX_LEFTOVER = 64, 16384, 64


def stem_steps(kernel_h: int, kernel_w: int, channels: int) -> tuple[int, int, int, int]:
    """The stem conv's sum (stem_conv_int8_vnni.c): (F, L, LQ, K4): F words of 4 bytes from
    each window row, L bytes left over per row, LQ words they make, K4 = KH * F + LQ steps."""
    run = kernel_w * channels
    leftover_words = (kernel_h * (run % 4) + 3) // 4
    return run // 4, run % 4, leftover_words, kernel_h * (run // 4) + leftover_words


def stem_refusal(in_shape, out_channels: int, kernel_size, stride) -> Optional[str]:
    """Why the stem conv kernel cannot take this conv (None if it can): the sizes it has room for."""
    n, c, h, w = in_shape
    kh, kw = kernel_size
    if out_channels % 16:
        return f"{out_channels} output channels: the kernel takes a multiple of 16"
    if kh * (kw * c % 4) > STEM_MAX_LEFTOVER:
        return f"a {kh}x{kw} kernel of {c} channels leaves {kh * (kw * c % 4)} bytes over its 4-byte steps (at most {STEM_MAX_LEFTOVER})"
    strip = kh * ((STEM_PIECE - 1) * stride[1] + kw) * c  # (for a whole piece: rows may be shorter)
    if strip > STEM_MAX_STRIP:
        return f"the input under {STEM_PIECE} output pixels is {strip} bytes (at most {STEM_MAX_STRIP})"
    return None


STEM_MAX_POOL_ROWS = 8  # a fused max pool's kernel height, at most (stem_conv_int8_vnni.c MAX_POOL_ROWS)
NO_POOL = ((0, 0), (1, 1), (0, 0))  # qconv_stem's pool_kernel, pool_stride, pool_padding when no pool is fused


def _pooled_hw(conv_hw, pool_kernel, pool_stride, pool_padding) -> tuple[int, int]:
    """The stem call's output height and width: the conv's, or its fused pool's."""
    return conv_hw if tuple(pool_kernel) == NO_POOL[0] else _output_hw(*conv_hw, pool_kernel, pool_stride, pool_padding)


def stem_pool_refusal(conv_hw, pool_kernel, pool_stride, pool_padding) -> Optional[str]:
    """Why the stem conv kernel cannot fuse this max pool (dilation 1, floor mode) of its
    output (None if it can)."""
    if not 1 <= pool_kernel[0] <= STEM_MAX_POOL_ROWS or pool_kernel[1] < 1:
        return f"pool kernel {list(pool_kernel)}: the kernel keeps 1 to {STEM_MAX_POOL_ROWS} conv rows"
    if any(not 0 <= 2 * p <= k for p, k in zip(pool_padding, pool_kernel)) or min(pool_stride) < 1:
        return f"pool kernel {list(pool_kernel)}, stride {list(pool_stride)}, padding {list(pool_padding)}: not a max_pool2d's"
    if min(_output_hw(*conv_hw, pool_kernel, pool_stride, pool_padding)) < 1:
        return f"a {list(pool_kernel)} pool of a {list(conv_hw)} conv output has no output"
    return None


def _prepare_stem_conv(x, x_zero_point, weight, mult, add, kernel_size, stride, padding, low, high, out_scale,
                       out_zero_point, qmin, qmax, pool_kernel=NO_POOL[0], pool_stride=NO_POOL[1],
                       pool_padding=NO_POOL[2]) -> Prepared:
    _check_nchw_uint8(x, None, "qconv_stem")
    vnni = _vnni_library()[0]
    if vnni is None:
        raise ValueError(f"qbackend::qconv_stem needs the AVX512-VNNI kernels: {vnni_unavailable()}")
    n, c, h, w = x.shape
    cout = mult.numel()
    oh, ow = _window("qconv_stem", h, w, kernel_size, stride, padding)
    _check_levels("qconv_stem", x_zero_point, out_zero_point, qmin, qmax)
    reason = stem_refusal(x.shape, cout, kernel_size, stride)
    pooled = tuple(pool_kernel) != NO_POOL[0]
    if reason is None and pooled:
        reason = stem_pool_refusal((oh, ow), pool_kernel, pool_stride, pool_padding)
    if reason is not None:
        raise ValueError(f"qbackend::qconv_stem: {reason}")
    steps = stem_steps(*kernel_size, c)[3]
    _check_constants("qconv_stem", (weight, torch.int8, cout * steps * 4), (mult, torch.float32, cout), (add, torch.float32, cout))
    ph, pw = _pooled_hw((oh, ow), pool_kernel, pool_stride, pool_padding)
    call = StemCall(n, h, w, c, oh, ow, *kernel_size, *stride, *padding, cout, x_zero_point, weight.data_ptr(),
                    mult.data_ptr(), add.data_ptr(), low, high, 1.0 / out_scale, out_zero_point, qmin, qmax,
                    *pool_kernel, *pool_stride, *pool_padding, ph, pw)
    return _prepare(call, (n, cout, ph, pw), torch.uint8, vnni.qb_stem_conv_vnni_call, (mult, add))


def _stem_conv_prepared(lib, x, x_zero_point, weight, mult, add, *args, trusted=False) -> Prepared:
    args = (x_zero_point, mult, add, *args)
    return _prepared(weight, trusted, x, args, lambda: _prepare_stem_conv(x, x_zero_point, weight, *args[1:]))


def _stem_conv(lib, x, *args, trusted=False):
    return _x_to_y(_stem_conv_prepared(lib, x, *args, trusted=trusted), x, "qconv_stem")


def _stem_conv_fake(x, x_zero_point, weight, mult, add, kernel_size, stride, padding, low, high, out_scale,
                    out_zero_point, qmin, qmax, pool_kernel=NO_POOL[0], pool_stride=NO_POOL[1], pool_padding=NO_POOL[2]):
    n, _, h, w = x.shape
    hw = _pooled_hw(_output_hw(h, w, kernel_size, stride, padding), pool_kernel, pool_stride, pool_padding)
    return _channels_last_like(x, (n, mult.numel(), *hw), torch.uint8)


@functools.lru_cache(maxsize=256)  # per input shape and pool geometry (the graph passes tuples)
def _max_pool_prepared_for(lib, shape, kernel_size, stride, padding, dilation, ceil_mode=False) -> Prepared:
    """(ceil_mode: the kernel clips each window to the image, so a last, partial one is as any other)"""
    n, c, h, w = shape
    oh, ow = _window("max_pool_u8", h, w, kernel_size, stride, padding, dilation, bool(ceil_mode))
    if any(2 * p > k for p, k in zip(padding, kernel_size)):
        raise ValueError(f"qbackend::max_pool_u8: padding {list(padding)} over half the kernel {list(kernel_size)}")
    call = MaxPoolCall(n, h, w, c, *kernel_size, *stride, *padding, *dilation, oh, ow)
    return _prepare(call, (n, c, oh, ow), torch.uint8, lib.qb_max_pool_u8_call, ())


def _max_pool_prepared(lib, x, kernel_size, stride, padding, dilation, ceil_mode=False, *, trusted=False) -> Prepared:
    _check_nchw_uint8(x, None, "max_pool_u8")
    return _max_pool_prepared_for(lib, tuple(x.shape), *(tuple(a) for a in (kernel_size, stride, padding, dilation)),
                                  bool(ceil_mode))


def _max_pool(lib, x, *args):
    return _x_to_y(_max_pool_prepared(lib, x, *args), x, "max_pool_u8")


def _max_pool_fake(x, kernel_size, stride, padding, dilation, ceil_mode=False):
    n, c, h, w = x.shape
    oh, ow = _output_hw(h, w, kernel_size, stride, padding, dilation, ceil_mode)
    return _channels_last_like(x, (n, c, oh, ow), torch.uint8)


GLOBAL_POOL_MAX_PIXELS = 1 << 23  # the kernel sums 8-bit values in int32


@functools.lru_cache(maxsize=256)  # per input shape and zero point
def _global_avg_pool_prepared_for(lib, shape, zero_point, qmin, qmax) -> Prepared:
    n, c, h, w = shape
    _check_levels("global_avg_pool_u8", zero_point, zero_point, qmin, qmax)
    if not 0 < h * w <= GLOBAL_POOL_MAX_PIXELS:
        raise ValueError(f"qbackend::global_avg_pool_u8 takes 1 to {GLOBAL_POOL_MAX_PIXELS} pixels, got {h}x{w}")
    call = GlobalAvgPoolCall(n, h * w, c, zero_point, qmin, qmax)
    return _prepare(call, (n, c, 1, 1), torch.uint8, lib.qb_global_avg_pool_u8_call, ())


def _global_avg_pool_prepared(lib, x, zero_point, qmin, qmax, *, trusted=False) -> Prepared:
    _check_nchw_uint8(x, None, "global_avg_pool_u8")
    return _global_avg_pool_prepared_for(lib, tuple(x.shape), zero_point, qmin, qmax)


def _global_avg_pool(lib, x, *args):
    return _x_to_y(_global_avg_pool_prepared(lib, x, *args), x, "global_avg_pool_u8")


def _global_avg_pool_fake(x, zero_point, qmin, qmax):
    return _channels_last_like(x, (x.shape[0], x.shape[1], 1, 1), torch.uint8)


ATTENTION_HEAD_DIM_STEP = 16  # attention_f32.c: head dims in 16-column vector pairs


def attention_refusal(q, k, v, mask, mask_dtypes=(torch.float32,), is_causal=False) -> Optional[str]:
    """Why attention_f32 cannot take these (tensors or fake values), None if it can. Keys and
    values may have fewer heads than the queries (grouped-query attention), each shared by
    ``heads / kv_heads`` consecutive query heads. ``mask_dtypes``: the lowering also takes a
    bool mask, which it turns into an additive one first. ``is_causal``: torch's (query row i
    sees keys j <= i), without a mask (torch raises on both)."""
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 4 for t in (q, k, v)):
        return "the kernel takes float32 CPU [batch, heads, length, head dim] queries, keys and values"
    (b, h, length, d), (kv_heads, s, dv) = q.shape, v.shape[1:]
    if tuple(k.shape) != (b, kv_heads, s, d) or v.shape[0] != b or dv != d or h % kv_heads:
        return f"queries {tuple(q.shape)}, keys {tuple(k.shape)} and values {tuple(v.shape)} differ in batch, heads or head dim"
    if d % ATTENTION_HEAD_DIM_STEP or length == 0 or s == 0:
        return f"head dim {d}: the kernel takes a multiple of {ATTENTION_HEAD_DIM_STEP}"
    if mask is not None and is_causal:
        return "a mask and is_causal both given"
    if mask is not None:
        if mask.dtype not in mask_dtypes or mask.device.type != "cpu" or mask.dim() > 4:
            return f"the mask is {mask.dtype} of rank {mask.dim()}, not an additive float32 one"
        padded = (1,) * (4 - mask.dim()) + tuple(mask.shape)
        if any(m not in (1, n) for m, n in zip(padded, (b, h, length, s))):
            return f"the mask {tuple(mask.shape)} does not broadcast to the scores {(b, h, length, s)}"
        if kv_heads != h and length > 1 and (padded[1] != 1 or padded[2] != 1):
            return "grouped-query attention with a mask per head or per query row (only one broadcast over both)"
    return None


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, L, D] queries as [B, kv_heads, H / kv_heads * L, D]: the query rows of each key /
    value head's group as one head's rows (a view where the heads are evenly strided)."""
    b, h, length, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads * length, d)


def _attention(lib, q, k, v, mask, scale, is_causal=False, kv_int8=None):
    """(``lib``: the registration's; the kernel's build is ``_attention_function``'s.) ``kv_int8``:
    (int8 keys, their row scales, int8 values, theirs) that ``k`` / ``v`` are the dequantized
    values of, read instead (qbackend/llm/kv_int8.py: shapes and layouts checked there)."""
    reason = attention_refusal(q, k, v, mask, is_causal=is_causal)
    if reason is not None:
        raise ValueError(f"qbackend::attention_f32: {reason}")
    (b, h, length, d), kv_heads = q.shape, k.shape[1]
    causal_rows = length if is_causal else 0  # (grouped: each query head's positions one after another)
    if kv_heads == h:
        return _checked_attention(q, k, v, mask, scale, causal_rows=causal_rows, kv_int8=kv_int8).transpose(1, 2)
    # grouped: each key / value head read once for all its query heads, whose rows go straight to their place
    if mask is not None:  # (a view: refusal leaves one query row, or a mask the same for all heads and rows)
        mask = mask.expand(b, h, length, k.shape[2]).reshape(b, kv_heads, h // kv_heads * length, k.shape[2])
    out = torch.empty(b, h, length, d)
    _checked_attention(_grouped(q, kv_heads), k, v, mask, scale, causal_rows=causal_rows, kv_int8=kv_int8,
                       out=_grouped(out, kv_heads).transpose(1, 2))
    return out


def attention_quantize_refusal(q, k, v, mask, out_scale, zero_point, qmin, qmax) -> Optional[str]:
    """Why attention_quantize cannot take these (tensors or fake values), None if it can."""
    reason = attention_refusal(q, k, v, mask)
    if reason is None and k.shape[1] != q.shape[1]:
        reason = "grouped-query attention (its rows come out in another order)"
    return reason or _uint8_grid_refusal(out_scale, zero_point, qmin, qmax)


def _attention_quantize(lib, q, k, v, mask, scale, out_scale, zero_point, qmin, qmax):
    reason = attention_quantize_refusal(q, k, v, mask, out_scale, zero_point, qmin, qmax)
    if reason is not None:
        raise ValueError(f"qbackend::attention_quantize: {reason}")
    return _checked_attention(q, k, v, mask, scale, (out_scale, zero_point, qmin, qmax))


@functools.lru_cache(maxsize=256)
def _attention_call(shape: tuple, strides: tuple, mask_stride: tuple, out_stride: tuple, scale: float,
                    quantize, causal_rows: int = 0, scale_strides=None) -> "AttentionCall":
    """The kernel's arguments for one call site, but the key length (made once: ~15 us of
    ctypes per call otherwise; a decode step's key length is new at every step). ``out_stride``:
    the output's batch, row and head strides."""
    out_scale, zero_point, qmin, qmax = quantize or (1.0, 0, 0, 0)
    return AttentionCall(*shape[:3], 0, shape[3], *((ctypes.c_long * 3)(*stride) for stride in strides),
                         (ctypes.c_long * 4)(*mask_stride), (ctypes.c_long * 3)(*out_stride), scale, quantize is not None,
                         1.0 / out_scale, zero_point, qmin, qmax, causal_rows,
                         *((ctypes.c_long * 2)(*stride) for stride in scale_strides or ((0, 0), (0, 0))))


@library.once
def _attention_function():
    """attention_f32.c's entries (float32 keys and values, int8 ones, the chain step's address):
    the AVX-512 build's where the AVX512-VNNI library loads (tiles of 12 query rows; the same
    bits), else the AVX2 one."""
    lib = _vnni_library()[0] or _load()[0]
    lib.qb_attention_kv_int8.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 8
    lib.qb_attention_kv_int8.restype = ctypes.c_int
    return lib.qb_attention_f32, lib.qb_attention_kv_int8, function_address(lib.qb_attention_call)


def attention_chain_call(args: tuple, out: torch.Tensor):
    """``attention_f32`` without a mask as a kernel chain step (qb_attention_call): the key
    length is an operand (KeyLength), so a decode step's growing KV cache keeps one program."""
    q, k, v, mask, scale, *causal = args
    if mask is not None or not plain_float32(q, k, v, out) or attention_refusal(q, k, v, None) is not None \
            or q.shape != out.shape or any(t.stride(-1) != 1 for t in (q, k, v, out)):
        return None
    kv_heads = k.shape[1]
    rows, out_rows = _grouped(q, kv_heads), _grouped(out, kv_heads)  # (the kernel's heads and rows: views, or refused)
    if any(t.untyped_storage().data_ptr() != u.untyped_storage().data_ptr() for t, u in ((q, rows), (out, out_rows))):
        return None
    causal_rows = q.shape[2] if causal and causal[0] else 0
    call = _attention_call(tuple(rows.shape), (rows.stride()[:3], k.stride()[:3], v.stride()[:3]), (0, 0, 0, 0),
                           out_rows.transpose(1, 2).stride()[:3], scale, None, causal_rows)
    return step_call(_attention_function()[2], call, (q, k, v, None, out, KeyLength(k)), kind=SIX)


def _checked_attention(q, k, v, mask, scale, quantize=None, causal_rows=0, kv_int8=None, out=None):
    """The kernel on operands ``attention_refusal`` took, heads equal (a decode step's hot path:
    checked once): [B, L, H, D], float32, or uint8 on ``quantize``'s (scale, zero point, qmin,
    qmax) grid. ``kv_int8``: see ``_attention``. ``out``: see ``_attention_kernel``."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if kv_int8 is not None:
        k, k_scales, v, v_scales = kv_int8
        kv_int8 = (k_scales.data_ptr(), v_scales.data_ptr(), k_scales.stride()[:2], v_scales.stride()[:2])
    return _attention_kernel(tuple(q.shape), k.shape[2], (q.data_ptr(), k.data_ptr(), v.data_ptr()),
                             (q.stride()[:3], k.stride()[:3], v.stride()[:3]), mask, scale, quantize, causal_rows=causal_rows,
                             kv_int8=kv_int8, out=out)


def _attention_kernel(shape: tuple, s: int, pointers: tuple, strides: tuple, mask, scale, quantize,
                      length_first: bool = False, causal_rows: int = 0, kv_int8=None, out=None):
    """attention_f32.c on q / k / v at ``pointers``, [B, H, L or S, D] with ``strides`` for their first
    three dims (the last contiguous), all checked by the caller; the mask broadcasts. Returns
    [B, L, H, D], in [L, B, H, D] memory where ``length_first``; or writes ``out``, a float32
    [B, L, H, D] view the caller made (grouped queries: rows in their query heads' places).
    ``kv_int8``: k / v are int8, (k scales' pointer, v scales', their batch and head strides)."""
    b, h, length, d = shape
    mask_stride = (0, 0, 0, 0)
    if mask is not None:
        mask = mask.expand(b, h, length, s)
        mask_stride = mask.stride()
    dtype = torch.float32 if quantize is None else torch.uint8
    if out is None:
        out = torch.empty(length, b, h, d, dtype=dtype).transpose(0, 1) if length_first else torch.empty(b, length, h, d, dtype=dtype)
    call = AttentionCall.from_buffer_copy(_attention_call(shape, strides, tuple(mask_stride), out.stride()[:3], scale,
                                                           quantize, causal_rows, kv_int8 and kv_int8[2:]))
    call.S = s  # (on a copy: another thread may run the same call site meanwhile)
    floats, int8, _ = _attention_function()
    scales = () if kv_int8 is None else kv_int8[:2]
    if (floats if kv_int8 is None else int8)(torch.get_num_threads(), ctypes.byref(call), *pointers, *scales,
                                             None if mask is None else mask.data_ptr(), out.data_ptr()):
        raise MemoryError("qbackend attention: a thread could not allocate its packed keys and scores")
    return out


def attention_from_projection(projection, geometry: tuple, mask, scale, quantize=None):
    """``attention_f32`` (``quantize`` None) or ``attention_quantize`` (``quantize``: its out scale,
    zero point, qmin, qmax) of queries, keys and values that are fixed views of one float32
    projection, as attention's own inputs usually are (a merged q / k / v linear, split into
    heads): ``geometry`` is what the lowering found them to be in a contiguous projection of
    its shape, (projection shape, query shape [B, H, L, D], key length S, element offsets of
    q / k / v, strides of their first three dims). One call instead of nine views and the
    operand checks of each call; checked here: the projection (the views' validity) and the mask."""
    projection_shape, shape, s, offsets, strides = geometry
    if projection.dtype != torch.float32 or projection.device.type != "cpu" or tuple(projection.shape) != projection_shape:
        raise ValueError(f"qbackend attention: the projection is {projection.dtype} {tuple(projection.shape)} on "
                         f"{projection.device}, not float32 {projection_shape} on CPU")
    if mask is not None and (mask.dtype != torch.float32 or mask.device.type != "cpu" or mask.dim() > 4):
        raise ValueError(f"qbackend attention: the mask is {mask.dtype} of rank {mask.dim()}, not an additive float32 one")
    projection = projection.contiguous()  # (the geometry's layout; a no-op when it already is)
    base = projection.data_ptr()
    # a length-major projection (MultiheadAttention's [L, B, 3E] rows) gets a length-major result:
    # its head merge (permute(2, 0, 1, 3).reshape(L * B, E)) is then a view, not a copy
    length_first = quantize is None and shape[0] > 1 and strides[0][2] > strides[0][0]
    out = _attention_kernel(shape, s, tuple(base + 4 * offset for offset in offsets), strides, mask, scale, quantize,
                            length_first)
    return out if quantize is not None else out.transpose(1, 2)


def _attention_fake(q, k, v, mask, scale, is_causal=False):
    b, h, length, d = q.shape
    if k.shape[1] != h:  # (grouped: the result's rows come back in query-head order, contiguous)
        return q.new_empty(b, h, length, d)
    return q.new_empty(b, length, h, d).transpose(1, 2)


def _attention_quantize_fake(q, k, v, mask, scale, *quantize):
    b, h, length, d = q.shape
    return q.new_empty(b, length, h, d, dtype=torch.uint8)


def scale_quantize_refusal(x, factors) -> Optional[str]:
    """Why scale_quantize cannot take these (tensors or fake values), None if it can."""
    if x.dim() != 4 or x.dtype != torch.float32 or x.device.type != "cpu":
        return f"the kernel takes a float32 CPU [N, C, H, W] tensor, not {x.dtype} of rank {x.dim()} on {x.device}"
    n, c = x.shape[:2]
    if factors.dtype != torch.float32 or factors.device.type != "cpu" or tuple(factors.shape) not in ((n, c, 1, 1), (1, c, 1, 1)):
        return f"factors {factors.dtype} {tuple(factors.shape)}: the kernel takes float32 [{n} or 1, {c}, 1, 1]"
    return None


def _uint8_grid_refusal(scale, zero_point, qmin, qmax) -> Optional[str]:
    """Why a float -> uint8 quantize cannot write to this grid, None if it can."""
    if not (0 <= qmin <= qmax <= 255 and qmin <= zero_point <= qmax):
        return f"uint8 range [{qmin}, {qmax}] with zero point {zero_point}"
    if not (math.isfinite(scale) and scale > 0):
        return f"scale {scale}"
    return None


def _scale_quantize(lib, x, factors, scale, zero_point, qmin, qmax):
    reason = scale_quantize_refusal(x, factors) or _uint8_grid_refusal(scale, zero_point, qmin, qmax)
    if reason is not None:
        raise ValueError(f"qbackend::scale_quantize: {reason}")
    channels_last = not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    x = x if channels_last else x.contiguous()  # (a 1x1 image is both: read as contiguous)
    factors = factors.contiguous()
    n, c, h, w = x.shape
    y = torch.empty_like(x, dtype=torch.uint8)
    lib.qb_scale_quantize(torch.get_num_threads(), n, c, h * w, channels_last, x.data_ptr(), factors.data_ptr(),
                          c if factors.shape[0] == n and n > 1 else 0, 1.0 / scale, zero_point, qmin, qmax, y.data_ptr())
    return y


def layer_norm_quantize_refusal(x, weight, bias, eps) -> Optional[str]:
    """Why layer_norm_quantize cannot take these (tensors or fake values), None if it can."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() == 0 or x.numel() == 0:
        return f"the kernel takes a non-empty float32 CPU tensor, not {x.dtype} of shape {tuple(x.shape)} on {x.device}"
    return _norm_parameters_refusal(x.shape[-1], weight, bias, eps)


def _norm_parameters_refusal(c: int, weight, bias, eps) -> Optional[str]:
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None or t.dtype != torch.float32 or t.device.type != "cpu" or tuple(t.shape) != (c,):
            return f"{name} {None if t is None else (t.dtype, tuple(t.shape))}: the kernel takes float32 [{c}]"
    if not (math.isfinite(eps) and eps >= 0):
        return f"eps {eps}"
    return None


def _layer_norm_quantize(lib, x, weight, bias, eps, scale, zero_point, qmin, qmax, keep_float=False):
    """The uint8 rows, or (uint8 rows, float32 rows) with ``keep_float``."""
    reason = layer_norm_quantize_refusal(x, weight, bias, eps) or _uint8_grid_refusal(scale, zero_point, qmin, qmax)
    if reason is not None:
        raise ValueError(f"qbackend::layer_norm_quantize: {reason}")
    x, weight, bias = x.contiguous(), weight.contiguous(), bias.contiguous()
    y, yf = torch.empty(x.shape, dtype=torch.uint8), torch.empty(x.shape) if keep_float else None
    c = x.shape[-1]
    if lib.qb_layer_norm_quantize(torch.get_num_threads(), x.numel() // c, c, x.data_ptr(), weight.data_ptr(),
                                  bias.data_ptr(), eps, 1.0 / scale, zero_point, qmin, qmax, y.data_ptr(),
                                  None if yf is None else yf.data_ptr()):
        # rows of huge, infinite or NaN values: ATen's own float32 statistics decide them
        yf = torch.ops.aten.layer_norm.default(x, [c], weight, bias, eps)
        from qbackend.passes import fast_qdq

        y = fast_qdq.quantize_per_tensor(yf, scale, zero_point, qmin, qmax, torch.uint8, nan_as=qmin)
    return (y, yf) if keep_float else y


def add_quantize_refusal(a, b) -> Optional[str]:
    """Why add_quantize cannot take these (tensors or fake values), None if it can: two float32
    CPU tensors of one shape (a residual and a branch; any strides)."""
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (a, b)):
        return f"the kernel adds float32 CPU tensors, not {a.dtype} on {a.device} and {b.dtype} on {b.device}"
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} and {tuple(b.shape)} differ (no broadcasting)"
    return None


def _dense(t: torch.Tensor) -> bool:
    """Every element once, no gaps: a permutation of a contiguous tensor's strides."""
    expected = 1
    for extent, stride in sorted(zip(t.shape, t.stride()), key=lambda pair: pair[1]):
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


def _add_quantize(lib, a, b, scale, zero_point, qmin, qmax, in_place=False):
    """(uint8 quantize of a + b, a + b), both in a's memory order where a is dense; with
    ``in_place`` the sum goes into a and only the uint8 copy is returned."""
    reason = add_quantize_refusal(a, b) or _uint8_grid_refusal(scale, zero_point, qmin, qmax)
    if reason is not None:
        raise ValueError(f"qbackend::add_quantize: {reason}")
    if in_place and not _dense(a):  # (a strided target: ATen's add_, then the quantize)
        from qbackend.passes import fast_qdq

        return fast_qdq.quantize_per_tensor(a.add_(b), scale, zero_point, qmin, qmax, torch.uint8, nan_as=qmin)
    a = a if _dense(a) else a.contiguous()  # (the kernel reads a, b, s and y as one flat memory order: a's)
    s, y = a if in_place else torch.empty_like(a), torch.empty_like(a, dtype=torch.uint8)
    # (a copy of b in a's order may go where the sum goes: each place is read before it is written)
    b = b if b.stride() == a.stride() else (torch.empty_like(a) if in_place else s).copy_(b)
    lib.qb_add_quantize(torch.get_num_threads(), a.numel(), a.data_ptr(), b.data_ptr(), 1.0 / scale, zero_point, qmin, qmax,
                        s.data_ptr(), y.data_ptr())
    return y if in_place else (y, s)


_IMPLS = {"int4_mm_int16": _int4_mm, "int8_mm_int16": _int8_mm, "qconv_depthwise": _dwconv,
          "qconv_depthwise_layer_norm": _dwconv_layer_norm, "qconv": _conv, "qconv_stem": _stem_conv,
          "qconv_grouped": _grouped_conv, "attention_f32": _attention, "attention_quantize": _attention_quantize, "max_pool_u8": _max_pool, "global_avg_pool_u8": _global_avg_pool,
          "scale_quantize": _scale_quantize, "layer_norm_quantize": _layer_norm_quantize,
          "layer_norm_and_quantize": functools.partial(_layer_norm_quantize, keep_float=True), "add_quantize": _add_quantize,
          "add_quantize_": functools.partial(_add_quantize, in_place=True)}
FAKES = {
    "int4_mm_int16": lambda x, weight, scale, offset, group_size: x.new_empty(x.shape[0], weight.shape[0]),
    "int8_mm_int16": lambda x, weight, scale: x.new_empty(x.shape[0], weight.shape[0]),
    "qconv_depthwise": _dwconv_fake,
    "qconv_depthwise_layer_norm": _dwconv_layer_norm_fake,
    "qconv": _conv_fake,
    "qconv_stem": _stem_conv_fake,
    "qconv_grouped": _grouped_conv_fake,
    "attention_f32": _attention_fake,
    "attention_quantize": _attention_quantize_fake,
    "max_pool_u8": _max_pool_fake,
    "global_avg_pool_u8": _global_avg_pool_fake,
    "scale_quantize": lambda x, factors, *args: torch.empty_like(x, dtype=torch.uint8),
    "layer_norm_quantize": lambda x, *args: x.new_empty(x.shape, dtype=torch.uint8),
    "layer_norm_and_quantize": lambda x, *args: (x.new_empty(x.shape, dtype=torch.uint8), x.new_empty(x.shape)),
    "add_quantize": lambda a, b, *args: (torch.empty_like(a, dtype=torch.uint8), torch.empty_like(a)),
    "add_quantize_": lambda a, b, *args: torch.empty_like(a, dtype=torch.uint8),
}


def int4_mm_int16(*args):
    """``qbackend::int4_mm_int16`` without the dispatcher round trip (see ``qconv_depthwise``):
    measured 50 -> 24 us per call of a small layer, 17 calls per token of a 4-layer Llama."""
    return _int4_mm(_load()[0], *args, trusted=True)


def int8_mm_int16(*args):
    """``qbackend::int8_mm_int16`` without the dispatcher round trip (``int4_mm_int16``)."""
    return _int8_mm(_load()[0], *args, trusted=True)


def qconv_grouped(*args):
    """``qbackend::qconv_grouped`` without the dispatcher round trip; its constants are the
    lowering's own packing (checked once per input shape, as the depthwise conv's)."""
    return _grouped_conv(_load()[0], *args, trusted=True)


def qconv_depthwise(*args):
    """``qbackend::qconv_depthwise`` without the dispatcher round trip (~8 us per call, ~40% of a
    small conv's): what graphs that run eagerly call. Traced graphs need the op. Its constants
    are the lowering's own packing, so their checks (~4 us) are skipped; the activation's stay."""
    return _dwconv(_load()[0], *args, trusted=True)


def qconv_depthwise_layer_norm(*args):
    """``qbackend::qconv_depthwise_layer_norm`` without the dispatcher round trip (as ``qconv_depthwise``)."""
    return _dwconv_layer_norm(_load()[0], *args, trusted=True)


def qconv(*args):
    """``qbackend::qconv`` without the dispatcher round trip (see ``qconv_depthwise``)."""
    return _conv(_load()[0], *args, trusted=True)


def quantize_channels_last(x: torch.Tensor, scale: float, zero_point: int, qmin: int, qmax: int) -> Optional[torch.Tensor]:
    """uint8 channels-last quantize of a float32 NCHW-contiguous CPU tensor (quantize_nhwc.c,
    the reference's arithmetic), or None where the kernel does not apply or is not built."""
    lib = _load()[0]
    if lib is None or x.dim() != 4 or x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        return None
    n, c, h, w = x.shape
    y = torch.empty((n, c, h, w), dtype=torch.uint8, memory_format=torch.channels_last)
    # (ctypes passes 1 / scale as a float32: what the reference multiplies by)
    lib.qb_quantize_nchw_to_nhwc(torch.get_num_threads(), n, c, h * w, x.data_ptr(), 1.0 / scale, zero_point, qmin, qmax,
                                 y.data_ptr())
    return y


INTEGER_RANGE = {torch.uint8: (0, 255), torch.int8: (-128, 127)}


def quantize_dense(x: torch.Tensor, scale: float, zero_point: int, qmin: int, qmax: int, dtype: torch.dtype,
                   nan_as: int = 0) -> Optional[torch.Tensor]:
    """uint8 / int8 quantize of a dense float32 CPU tensor in its own dim order
    (quantize_dense.c: the reference's arithmetic, a NaN stored as ``nan_as``), or None where the kernel
    does not apply (other tensors, a range beyond the dtype's, a scale or zero point whose
    float32 arithmetic the kernel does not reproduce) or is not built."""
    lib = _load()[0]
    if (lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or dtype not in INTEGER_RANGE
            or not (x.is_contiguous() or memory_order(x) is not None)):
        return None
    low, high = INTEGER_RANGE[dtype]
    if not (low <= qmin <= qmax <= high and low <= nan_as <= high and abs(zero_point) <= 1 << 24 and scale > 0
            and math.isfinite(scale)):
        return None
    y = torch.empty_like(x, dtype=dtype)  # (a dense input's strides)
    lib.qb_quantize_dense(torch.get_num_threads(), x.numel(), x.data_ptr(), 1.0 / scale, zero_point, qmin, qmax,
                          dtype == torch.int8, nan_as & 0xFF, _wide_quantize(), y.data_ptr())
    return y


@functools.lru_cache(maxsize=None)
def _wide_quantize() -> bool:
    """quantize_dense.c's AVX512 step: where ATen finds AVX512 and $QBACKEND_KERNELS is not avx2."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and library.switch() != "avx2"


def memory_order(x: torch.Tensor) -> Optional[list]:
    """The dim order that makes a dense, non-contiguous ``x`` contiguous (None: it is contiguous,
    or not dense): e.g. attention's output, a [B, H, L, D] view of [B, L, H, D] memory."""
    if x.is_contiguous():
        return None
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))
    return order if x.permute(order).is_contiguous() else None


def qconv_stem(*args):
    """``qbackend::qconv_stem`` without the dispatcher round trip (see ``qconv_depthwise``)."""
    return _stem_conv(_load()[0], *args, trusted=True)


def attention_f32(q, k, v, mask, scale, is_causal=False):
    """``qbackend::attention_f32`` without the dispatcher round trip."""
    return _attention(_load()[0], q, k, v, mask, scale, is_causal)


def attention_quantize(q, k, v, mask, scale, out_scale, zero_point, qmin, qmax):
    """``qbackend::attention_quantize`` without the dispatcher round trip."""
    return _attention_quantize(_load()[0], q, k, v, mask, scale, out_scale, zero_point, qmin, qmax)


def max_pool_u8(x, kernel_size, stride, padding, dilation, ceil_mode=False):
    """``qbackend::max_pool_u8`` without the dispatcher round trip."""
    return _max_pool(_load()[0], x, kernel_size, stride, padding, dilation, ceil_mode)


def global_avg_pool_u8(x, zero_point, qmin, qmax):
    """``qbackend::global_avg_pool_u8`` without the dispatcher round trip."""
    return _global_avg_pool(_load()[0], x, zero_point, qmin, qmax)


def scale_quantize(x, factors, scale, zero_point, qmin, qmax):
    """``qbackend::scale_quantize`` without the dispatcher round trip."""
    return _scale_quantize(_load()[0], x, factors, scale, zero_point, qmin, qmax)


def layer_norm_quantize(x, weight, bias, eps, scale, zero_point, qmin, qmax):
    """``qbackend::layer_norm_quantize`` without the dispatcher round trip."""
    return _layer_norm_quantize(_load()[0], x, weight, bias, eps, scale, zero_point, qmin, qmax)


def layer_norm_and_quantize(x, weight, bias, eps, scale, zero_point, qmin, qmax):
    """``qbackend::layer_norm_and_quantize`` without the dispatcher round trip."""
    return _layer_norm_quantize(_load()[0], x, weight, bias, eps, scale, zero_point, qmin, qmax, keep_float=True)


def add_quantize(a, b, scale, zero_point, qmin, qmax):
    """``qbackend::add_quantize`` without the dispatcher round trip."""
    return _add_quantize(_load()[0], a, b, scale, zero_point, qmin, qmax)


def add_quantize_(a, b, scale, zero_point, qmin, qmax):
    """``qbackend::add_quantize_`` without the dispatcher round trip."""
    return _add_quantize(_load()[0], a, b, scale, zero_point, qmin, qmax, in_place=True)


# own kernel -> the plain function eager graphs call
PLAIN = {"int4_mm_int16": int4_mm_int16, "int8_mm_int16": int8_mm_int16, "qconv_depthwise": qconv_depthwise,
         "qconv_depthwise_layer_norm": qconv_depthwise_layer_norm, "qconv": qconv, "qconv_stem": qconv_stem, "qconv_grouped": qconv_grouped, "attention_f32": attention_f32,
         "attention_quantize": attention_quantize, "max_pool_u8": max_pool_u8,
         "global_avg_pool_u8": global_avg_pool_u8, "scale_quantize": scale_quantize, "layer_norm_quantize": layer_norm_quantize,
         "layer_norm_and_quantize": layer_norm_and_quantize, "add_quantize": add_quantize,
         "add_quantize_": add_quantize_}
# They return tensors they allocated (attention: a view of one): the in-place safety analysis
# (patterns/inplace.py) may let a later kernel write into them.
for _fn in (*PLAIN.values(), attention_from_projection):
    _fn.fresh_output = True

# own kernel a chain may run -> its prepared call for given arguments (kernel_chain.py)
PREPARED_CALLS = {"qconv_depthwise": _dwconv_prepared, "qconv": _conv_prepared, "qconv_stem": _stem_conv_prepared,
                  "max_pool_u8": _max_pool_prepared, "global_avg_pool_u8": _global_avg_pool_prepared}


def own_kernel_forms(name: str) -> tuple:
    """Both forms a graph may call an own kernel in (``own_kernel``)."""
    return own_kernel(name, traced=True), own_kernel(name, traced=False)


def own_kernel(name: str, traced: bool):
    """What a graph calls for an own kernel: the op if the graph will be traced (fake tensors
    need its fake kernel), else the plain function. Loads the kernels first."""
    registered = op(name)
    return registered if traced else PLAIN[name]


def refusal(bits: int, in_features: int, group_size: int) -> Optional[str]:
    """Why the weight-only kernels cannot take this weight shape (None if they can)."""
    if in_features % BLOCK:
        return f"in_features {in_features} is not a multiple of {BLOCK}"
    if bits == 4 and group_size not in GROUPS:
        return f"group size {group_size} is neither 32 nor a multiple of {BLOCK}"
    return None
