"""An int8 KV cache for attention: ``options={"kv_cache": "int8"}``.

At long contexts a decode step's attention reads the whole cache (4 layers of a Llama-shaped
model at 2048 positions: 16 MB of float32 keys and values a token, read at ~11 GB/s). With the
option, each KV cache append (``kv_append.append``) also keeps the buffer's rows as int8, one
float32 scale per row of a head (``csrc/kv_int8.c``), and attention reads those: a quarter of
the bytes (``csrc/attention_f32.c`` ``qb_attention_kv_int8``). The float32 cache stays as it
was, exact, for everything else that reads it (transformers' cache object, a crop, another
compiler): the option costs a quarter more cache memory, and its values are attention's on
the dequantized keys and values, not the reference's (the benchmark reports the logits
cosine). A view the int8 rows do not cover (a cache that did not grow by appends) runs
float attention.
"""
from __future__ import annotations

import ctypes
import dataclasses
from typing import Optional

import torch
from torch.fx import GraphModule

from qbackend.llm import kv_append
from qbackend.kernels import native

KV_CACHES = ("float", "int8")  # the option's values
_INT8_ROWS = "_qbackend_kv_int8"  # an append buffer's attribute: its Int8Rows


@dataclasses.dataclass
class Int8Rows:
    """A KV append buffer's rows as int8 and their scales, quantized up to ``rows``."""

    values: torch.Tensor  # int8, the buffer's shape
    scales: torch.Tensor  # float32, the buffer's shape without its last dim
    rows: int = 0


# (csrc/kv_int8.c: blocks, block stride, scale block stride, first row, last row, D, x, q, scales)
_SIGNATURE = (ctypes.c_int, ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int) + (ctypes.c_void_p,) * 3


def _quantize_rows(buffer: torch.Tensor, int8: Int8Rows, last: int) -> None:
    """csrc/kv_int8.c on rows int8.rows .. last - 1 of every head of ``buffer`` (contiguous
    [B, H, rows, D], checked by ``_int8_rows``)."""
    b, h, length, d = buffer.shape
    native.c_function("qb_quantize_kv_rows", _SIGNATURE)(b * h, length * d, length, int8.rows, last, d, buffer.data_ptr(), int8.values.data_ptr(), int8.scales.data_ptr())
    int8.rows = last


def _int8_rows(buffer: Optional[torch.Tensor]) -> Optional[Int8Rows]:
    """The int8 rows of an append buffer of [B, H, rows, D] float32 (made on first use), None
    for any other tensor."""
    if kv_append.filled_rows(buffer) is None or buffer.dim() != 4 \
            or buffer.dtype != torch.float32 or not buffer.is_contiguous() or buffer.size(3) % native.ATTENTION_HEAD_DIM_STEP:
        return None
    int8 = getattr(buffer, _INT8_ROWS, None)
    if int8 is None:
        int8 = Int8Rows(torch.empty(buffer.shape, dtype=torch.int8), torch.empty(buffer.shape[:3]))
        setattr(buffer, _INT8_ROWS, int8)
    return int8


def append_int8(past: torch.Tensor, new: torch.Tensor, dim: int) -> torch.Tensor:
    """``kv_append.append``, and the buffer's new rows quantized (rows along dim 2 only)."""
    result = kv_append.append(past, new, dim)
    if dim % max(new.dim(), 1) == 2:
        buffer = result._base
        int8 = _int8_rows(buffer)
        if int8 is not None:  # (up to this result's last row: the buffer's fill is what appends claimed)
            _quantize_rows(buffer, int8, result.storage_offset() // buffer.stride(2) + result.size(2))
    return result


append_int8.reads_any_strides = True


def _int8_view(view: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(int8 values, scales) of the rows ``view`` shows, where they are quantized."""
    buffer = view._base
    int8 = getattr(buffer, _INT8_ROWS, None) if buffer is not None else None
    if int8 is None or view.dim() != 4 or view.stride() != buffer.stride() or view.storage_offset() % buffer.stride(2) \
            or view.shape[:2] != buffer.shape[:2] or view.size(3) != buffer.size(3):
        return None
    start = view.storage_offset() // buffer.stride(2)
    if start + view.size(2) > int8.rows:
        return None
    return int8.values.narrow(2, start, view.size(2)), int8.scales.narrow(2, start, view.size(2))


def attention_kv_int8(q, k, v, mask, scale, is_causal=False):
    """``native.attention_f32`` reading ``k`` / ``v``'s int8 rows where they have them."""
    keys, values = _int8_view(k), _int8_view(v)
    if keys is None or values is None:
        return native.attention_f32(q, k, v, mask, scale, is_causal)
    return native._attention(None, q, k, v, mask, scale, is_causal, kv_int8=keys + values)


attention_kv_int8.reads_any_strides = True


def kv_cache_int8(gm: GraphModule) -> Optional[str]:
    """Attention whose keys and values are both KV cache appends reads their int8 rows."""
    rewritten = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not native.attention_f32:
            continue
        keys, values = node.args[1:3]
        if all(getattr(x, "target", None) in (kv_append.append, append_int8) for x in (keys, values)):
            keys.target = values.target = append_int8
            node.target = attention_kv_int8
            rewritten += 1
    return f"{rewritten} attention call(s) read an int8 copy of their KV cache (option kv_cache='int8')" if rewritten else None
