"""An int8 KV cache's rows (csrc/kv_int8.c): quantized as they are appended, and attention that
reads them. Why and the graph rewrite: qbackend/llm/kv_int8.py."""
from __future__ import annotations

import ctypes
import dataclasses
from typing import Optional

import torch

from qbackend.kernels import attention, isa
from qbackend.kernels import kv_append


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
    isa.c_function("qb_quantize_kv_rows", _SIGNATURE)(b * h, length * d, length, int8.rows, last, d, buffer.data_ptr(), int8.values.data_ptr(), int8.scales.data_ptr())
    int8.rows = last


def _int8_rows(buffer: Optional[torch.Tensor]) -> Optional[Int8Rows]:
    """The int8 rows of an append buffer of [B, H, rows, D] float32 (made on first use), None
    for any other tensor."""
    if kv_append.filled_rows(buffer) is None or buffer.dim() != 4 \
            or buffer.dtype != torch.float32 or not buffer.is_contiguous() or buffer.size(3) % attention.ATTENTION_HEAD_DIM_STEP:
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
    """``attention.attention_f32`` reading ``k`` / ``v``'s int8 rows where they have them."""
    keys, values = _int8_view(k), _int8_view(v)
    if keys is None or values is None:
        return attention.attention_f32(q, k, v, mask, scale, is_causal)
    return attention._attention(q, k, v, mask, scale, is_causal, kv_int8=keys + values)


attention_kv_int8.reads_any_strides = True
