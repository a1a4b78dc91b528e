"""float32 attention (``csrc/attention_f32.c``; AVX2, and AVX-512 in the VNNI library):
``qbackend::attention_f32``, ``qbackend::attention_quantize`` (its output quantized to uint8,
the heads merged), and ``attention_from_projection`` (queries, keys and values read from one
projection)."""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from qbackend.kernels import isa, library
from qbackend.kernels.chain_step import SIX, At, KeyLength, plain_float32, step_call
from qbackend.kernels.common import Kernel, uint8_grid_refusal
from qbackend.kernels.structs import AttentionCall

SCHEMAS = {
    "attention_f32": "attention_f32(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool is_causal=False) -> Tensor",
    # (uint8 [batch, length, heads, head dim]: the heads merged, as the out-projection reads them)
    "attention_quantize": "attention_quantize(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, float out_scale, "
                          "int zero_point, int qmin, int qmax) -> Tensor",
}


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


def _attention(q, k, v, mask, scale, is_causal=False, kv_int8=None):
    """(The kernel's build is ``_attention_function``'s.) ``kv_int8``:
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
    return reason or uint8_grid_refusal(out_scale, zero_point, qmin, qmax)


def attention_quantize(q, k, v, mask, scale, out_scale, zero_point, qmin, qmax):
    """``qbackend::attention_quantize``'s implementation, also called as is by eager graphs (no dispatcher)."""
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
    lib = _declare(isa._vnni_library()[0] or isa._load()[0])
    return lib.qb_attention_f32, lib.qb_attention_kv_int8, isa.function_address(lib.qb_attention_call)


def _declare(lib: Optional[ctypes.CDLL]) -> Optional[ctypes.CDLL]:
    """``lib`` (either build, None: not built) with the attention entries' signatures declared
    (0; -1 when a thread could not allocate its scratch)."""
    if lib is None:
        return None
    lib.qb_attention_f32.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 6
    lib.qb_attention_kv_int8.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 8
    lib.qb_attention_f32.restype = lib.qb_attention_kv_int8.restype = ctypes.c_int
    return lib


def chain_call(args: tuple, out: torch.Tensor):
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


def projection_chain_call(args: tuple, result: torch.Tensor):
    """``attention_from_projection`` as a kernel chain step (qb_attention_call): q, k and v at
    their offsets in the projection, the key length fixed by the geometry; a mask (an additive
    float32 one) is an operand, its strides fixed by the signature."""
    projection, (projection_shape, shape, s, offsets, strides), mask, scale, *quantize = args
    quantize = quantize[0] if quantize else None
    if (not plain_float32(projection, mask) or tuple(projection.shape) != projection_shape or not projection.is_contiguous()
            or (mask is not None and mask.dim() > 4)):
        return None
    out = result if quantize is not None else result.transpose(1, 2)  # (the kernel's [B, L, H, D] writes)
    mask_stride = (0, 0, 0, 0) if mask is None else mask.expand(shape[0], shape[1], shape[2], s).stride()
    call = _attention_call(shape, strides, tuple(mask_stride), out.stride()[:3], scale, quantize)
    keys = projection.as_strided((shape[0], shape[1], s, shape[3]), (*strides[1], 1), offsets[1])
    return step_call(_attention_function()[2], call, (*(At(projection, 4 * offset) for offset in offsets), mask, result,
                                                      KeyLength(keys)), kind=SIX)


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


def attention_f32(q, k, v, mask, scale, is_causal=False):
    """``qbackend::attention_f32`` without the dispatcher round trip."""
    return _attention(q, k, v, mask, scale, is_causal)


KERNELS = {
    "attention_f32": Kernel(SCHEMAS["attention_f32"], attention_f32, _attention_fake, attention_f32),
    "attention_quantize": Kernel(SCHEMAS["attention_quantize"], attention_quantize, _attention_quantize_fake, attention_quantize),
}
# (they return tensors they allocated, or a view of one: patterns/inplace.py may let a later kernel write into them)
attention_f32.fresh_output = attention_quantize.fresh_output = attention_from_projection.fresh_output = True
