"""Weight-only linears over many rows (a prompt's prefill): the weight written out a slice at a
time (csrc/weight_dequantize.c) and multiplied densely, where that measures faster.

qbackend's int16 weight-only kernels unpack every weight for every few rows: over many rows they
are compute-bound. A 512-row 2048 -> 5632 int4 layer took 97 ms on them, 80 ms on torch's bf16
int4 kernel, and 29 ms as a dense bf16 matmul (Zen 4 EPYC, avx512_bf16, 2 threads); a
4-layer Llama's 512-token prefill took 1465 ms where Inductor on the bf16 model took 572. Here
the weight is written out as bf16 or float32 ``CHUNK_BYTES`` at a time (the int4 weights stay
what is kept in memory) and each slice is multiplied with ATen's dense matmul.

From how many rows on, and in which dtype, is measured per machine and weight shape on the
lowered graph (``dense_slices_pass``, kept in qbackend/kernels/choice_cache.py): the int16 kernel and
each dense dtype are timed at ``PROBE_ROWS`` rows, and the crossover is where their straight
lines meet. Decode (one row) never reaches it: the dense matmul reads 4x (bf16) or 8x the bytes.
With bf16, activations and products round as in torch's bf16 kernels (relative error ~3e-3
where the int16 kernels give ~3e-5): ``weight_only_compute="int16"`` keeps the int16 kernels.

Between a decode step's row and a long prompt, a weight on a CPU with AVX512-BF16 has a
third kernel (csrc/weight_only_bf16.c): a tile of weight rows unpacked to bf16 once, in the
caches, for all rows of the call. It is timed at the same probes, and at ``LARGE_PROBE_ROWS``
rows on a part of the weight against the dense matmul: 32 rows of a 2048 -> 11264 layer 9.3 ms
where the dense slices took 12.3 and the int16 kernel 16.2 (Zen 4); from ~512 rows the dense
slices (and the MLP they make one call of, dense_swiglu.py) are as fast or faster.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.kernels import choice_cache, registry
from qbackend.kernels.choice_cache import Schema, count, mapping_of, number, one_of, optional, pair_of
from qbackend.kernels.dense_weight_only import bf16_kernel_takes, bf16_mm, in_features, written_out
from qbackend.lowering.choice import mode as choice_mode
from qbackend.lowering.common import static_shape
from qbackend.lowering.sibling_linears import weight_only_input
from qbackend.patterns.base import constant_value
from qbackend.runtime.stack_room import in_fresh_chunk


CHUNK_BYTES = 4 << 20  # a written-out slice: stays in the caches while multiplied; little transient memory


# ...over many rows the matmul is compute-bound and fewer, larger slices win: 4 MB more per 128 rows,
# up to 16 MB (Zen 4, the 4 shapes of a Llama layer: 512 rows 130 -> 125 ms; 64 rows: 16 MB 23.0 ms, 4 MB 19.9)
CHUNK_GROWTH_ROWS, MAX_CHUNK_BYTES = 128, 16 << 20
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PROBE_ROWS = (32, 128)
LARGE_PROBE_ROWS, LARGE_PROBE_WEIGHT_ROWS = 512, 2048  # the bf16 kernel against the dense slices, on this many weight rows
ROUNDS = 2  # timed calls of each candidate at each probe, interleaved, after one warm-up
MIN_ROWS = 8  # a graph whose rows are known to be fewer runs the kernel alone (not measured)


# ``_measured``'s record, checked where it is read (its row counts become the graph's arguments)
RECORD = Schema({"bf16_from": optional(count(MIN_ROWS)), "dtype": optional(one_of(*DTYPES)), "from": optional(count(2)),
                 "ms": mapping_of(pair_of(number(0.0, 3.6e6)))},
                lambda r: (r.get("dtype") is None) == (r.get("from") is None)
                and (r.get("from") or math.inf) >= (r.get("bf16_from") or 0))


def slice_rows(m: int, k: int, dtype: torch.dtype) -> int:
    """Weight rows per written-out slice, for ``m`` activation rows of ``k`` features."""
    chunk = min(MAX_CHUNK_BYTES, CHUNK_BYTES * max(1, m // CHUNK_GROWTH_ROWS))
    return max(16, chunk // (k * dtype.itemsize) // 16 * 16)


def dense_slices(x: torch.Tensor, bits: int, dtype: torch.dtype, *args) -> torch.Tensor:
    """x [M, K] float32 (or already ``dtype``) times the weight ``args`` hold, transposed:
    float32 [M, N], the weight written out ``CHUNK_BYTES`` at a time in ``dtype`` and
    multiplied densely."""
    n, k = args[0].shape[0], in_features(bits, args)
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.float32, dtype):
        raise ValueError(f"qbackend dense weight-only: float32 activations [M, {k}], got {x.dtype} {tuple(x.shape)}")
    rows = slice_rows(x.shape[0], k, dtype)
    x_dtype, y = x.to(dtype), torch.empty(x.shape[0], n)
    slice_ = torch.empty(min(rows, n), k, dtype=dtype)
    for start in range(0, n, rows):
        part = slice_[:min(rows, n - start)]
        y[:, start:start + part.shape[0]] = torch.mm(x_dtype, written_out(bits, args, start, part).t())
    return y


def kernel_or_dense(x: torch.Tensor, bf16_from: int, dense_from: int, dtype: torch.dtype, bits: int, *args) -> torch.Tensor:
    """The int16 kernel for fewer than ``bf16_from`` rows, the AVX512-BF16 kernel for fewer than
    ``dense_from``, ``dense_slices`` from there on."""
    rows = x.shape[0]
    if rows >= dense_from:
        return dense_slices(x, bits, dtype, *args)
    if rows >= bf16_from:
        return bf16_mm(x, bits, *args)
    return registry.PLAIN[f"int{bits}_mm_int16"](x, *args)


def _timed(candidates: dict, rows: int, k: int) -> dict:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    for fn in candidates.values():
        fn(x)
    samples = {name: [] for name in candidates}
    for _ in range(ROUNDS):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn(x)
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in samples.items()}


def _crossing(low: dict, high: dict, rows: tuple, faster: str, slower: str) -> Optional[int]:
    """The first row count from which ``faster``'s straight line through the times at ``rows``
    lies below ``slower``'s, or None where it does not (slower at ``rows[1]``, or growing faster)."""
    slope = {name: (high[name] - low[name]) / (rows[1] - rows[0]) for name in (faster, slower)}
    if not (high[faster] < high[slower] and slope[faster] < slope[slower]):
        return None
    crossing = rows[0] + (low[faster] - low[slower]) / (slope[slower] - slope[faster])
    return max(2, math.floor(round(crossing, 6)) + 1)  # (the first row count past it)


def _measured(bits: int, kernel: Callable, args: tuple) -> dict:
    """{"bf16_from": rows or None, "dtype": name or None, "from": rows, "ms": the probes' times}:
    from how many rows the AVX512-BF16 kernel beats the int16 one (None: never, or not here);
    the dense dtype whose time grows least with rows, from where it beats the kernel before it."""
    k = in_features(bits, args)
    candidates = {"int16": lambda x: kernel(x, *args)}
    candidates.update({name: lambda x, d=d: dense_slices(x, bits, d, *args) for name, d in DTYPES.items()})
    if bf16_kernel_takes(bits, args):
        candidates["bf16 kernel"] = lambda x: bf16_mm(x, bits, *args)
    low, high = (in_fresh_chunk(_timed, candidates, rows, k) for rows in PROBE_ROWS)
    best = min(DTYPES, key=lambda name: (high[name], high[name] - low[name]))  # (then the one growing least)
    record = {"bf16_from": None, "dtype": None, "from": None,
              "ms": {name: [round(low[name] * 1e3, 3), round(high[name] * 1e3, 3)] for name in candidates}}
    bf16_from = _crossing(low, high, PROBE_ROWS, "bf16 kernel", "int16") if "bf16 kernel" in candidates else None
    # (the lines through 32 and 128 rows put it lower than it is: 4 rows of a Llama layer took 2.0 ms
    # on the int16 kernel, 2.5 on the bf16 one, Zen 4)
    bf16_from = None if bf16_from is None else max(bf16_from, MIN_ROWS)
    if bf16_from is None:
        dense_from = _crossing(low, high, PROBE_ROWS, best, "int16")
        if dense_from is not None:
            record.update(dtype=best, **{"from": dense_from})
        return record
    # the dense slices against the bf16 kernel over many rows, on part of the weight (both take
    # time in proportion to its rows)
    part = tuple(a[:LARGE_PROBE_WEIGHT_ROWS] for a in args[:3]) + tuple(args[3:])
    pair = {"bf16 kernel": lambda x: bf16_mm(x, bits, *part), best: lambda x: dense_slices(x, bits, DTYPES[best], *part)}
    rows = (PROBE_ROWS[1], LARGE_PROBE_ROWS)
    mid, large = (in_fresh_chunk(_timed, pair, r, k) for r in rows)
    record["bf16_from"] = bf16_from
    record["ms"].update({f"{name}, part": [round(mid[name] * 1e3, 3), round(large[name] * 1e3, 3)] for name in pair})
    dense_from = _crossing(mid, large, rows, best, "bf16 kernel")
    if dense_from is not None:
        record.update(dtype=best, **{"from": max(dense_from, bf16_from)})
    return record


WEIGHT_ONLY = {"int4_mm_int16": 4, "int8_mm_int16": 8}


def _rows(call: Node) -> Optional[int]:
    """The activation rows a weight-only kernel call gets, or None when they vary."""
    shape = static_shape(weight_only_input(call))
    return None if shape is None else math.prod(shape[:-1])


def dense_slices_pass(gm: GraphModule, kernel_choice: Optional[str] = None, compute: str = "auto") -> Optional[str]:
    """Each int16 weight-only kernel call that may see ``MIN_ROWS`` rows or more runs on the
    AVX512-BF16 kernel and densely from their measured crossovers on (see the module doc); the
    report's note, or None."""
    mode = choice_mode(kernel_choice)
    if mode == "prior" or compute != "auto" or registry.available() is not None:
        return None
    plain = {registry.PLAIN[name]: bits for name, bits in WEIGHT_ONLY.items()}  # (a graph to be traced calls the ops: kept)
    changed = []
    for node in list(gm.graph.nodes):
        bits = plain.get(node.target) if node.op == "call_function" else None
        if not bits or node.kwargs:
            continue
        args = tuple(constant_value(gm, a) if isinstance(a, Node) else a for a in node.args[1:])
        if any(a is None for a in args):
            continue
        rows = _rows(node)
        if rows is not None and rows < MIN_ROWS:
            continue
        group = f" g{args[3]}" if bits == 4 else ""
        key = f"weight-only dense int{bits} {args[0].shape[0]}x{in_features(bits, args)}{group}"
        record = choice_cache.shared().get(key, RECORD)  # (an invalid one: measured again)
        if record is None and mode == "measure":
            record = _measured(bits, registry.PLAIN[f"int{bits}_mm_int16"], args)
            choice_cache.shared().put(key, record)
        bf16 = record.get("bf16_from") if record and bf16_kernel_takes(bits, args) else None  # (measured with it; off since)
        if not bf16 and not (record and record.get("dtype")):
            continue
        dense_from = record["from"] if record.get("dtype") else math.inf
        bf16_from = bf16 or dense_from
        node.args = (node.args[0], bf16_from, dense_from, DTYPES[record.get("dtype") or "bf16"], bits, *node.args[1:])
        node.target = kernel_or_dense
        parts = ([f"the bf16 kernel from {bf16_from} rows"] if bf16 else []) + \
            ([f"dense {record['dtype']} from {dense_from} rows"] if record.get("dtype") else [])
        times = record.get("ms", {})
        at_probe = [f"{name} {times[name][1]} ms" for name in ("int16", "bf16 kernel", record.get("dtype")) if name in times]
        changed.append(f"{key}: {', '.join(parts)}" + (f" (at {PROBE_ROWS[1]} rows: {', '.join(at_probe)})" if at_probe else ""))
    if not changed:
        return None
    return (f"{len(changed)} weight-only linear(s) run, over enough rows, on the AVX512-BF16 kernel or as dense matmuls "
            f"over slices of the weight written out (measured on this machine): {'; '.join(changed)}")
