"""The float32 linears the quantizer left float (torchvision ViT's attention in- and
out-projections: 24 of vit_b_16's linears, 56% of its time at batch 1) on a GEMM whose
weight is packed once at compile time: MKL's sgemm (``_mkl_linear``, what Inductor's freezing
runs) or oneDNN's (``mkldnn._linear_pointwise``), whichever is faster on this machine.

Why both: on a Zen 4 EPYC oneDNN's ran vit_b_16's shapes 1.1-1.26x faster than MKL's (197 x
768 -> 2304: 3.4 vs 4.3 ms); on Intel CPUs MKL is the one Inductor trusts. As for the int8
layers (lowering/choice.py), each distinct signature is timed once, interleaved, and the winner
kept in the machine's choice cache; the "prior" mode (no timing) keeps MKL, Inductor's choice.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, NamedTuple, Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.lowering import choice
from qbackend.lowering.common import static_shape
from qbackend.patterns.base import constant_value, fake_value

from qbackend.kernels import choice_cache
from qbackend.graph_constants import set_constant
from qbackend.ops import resolve

aten = torch.ops.aten
PRIOR = "mkl"  # Inductor's freezing runs fp32 linears on MKL's packed sgemm


def _float_constant(gm: GraphModule, node) -> Optional[torch.Tensor]:
    value = constant_value(gm, node) if isinstance(node, Node) else None
    return value if value is not None and value.dtype == torch.float32 and value.device.type == "cpu" else None


class Gemm(NamedTuple):
    name: str
    label: str  # in the report
    run: Callable
    pack: Callable  # (weight, rows) -> the packed weight
    call_args: Callable  # (x, packed, weight, bias, rows) -> run's arguments


# (name, label, logical run op, logical pack op, run's arguments)
_GEMMS = (("mkl", "MKL's sgemm", "float_linear_packed", "float_linear_pack", lambda x, p, w, b, rows: (x, p, w, b, rows)),
          ("onednn", "oneDNN", "float_linear_onednn", "float_linear_onednn_pack", lambda x, p, w, b, rows: (x, p, b, "none", [], "")))


def _gemms(device: str) -> dict[str, Gemm]:
    """The packed GEMMs this torch has for ``device``."""
    found = {}
    for name, label, run, pack, call_args in _GEMMS:
        run_op, pack_op = resolve(run, device).op, resolve(pack, device).op
        if run_op is not None and pack_op is not None:
            found[name] = Gemm(name, label, run_op, pack_op, call_args)
    return found


def _signature(x: torch.Tensor, weight: torch.Tensor, bias) -> str:
    return f"float_linear x{list(x.shape)} stride{list(x.stride())} w{list(weight.shape)} bias={bias is not None}"


def _timed(gemms: dict, x: torch.Tensor, weight: torch.Tensor, bias, rows: int) -> dict[str, float]:
    """Seconds per call of each GEMM on random inputs of ``x``'s shape and strides."""
    sample = torch.empty_strided(x.shape, x.stride()).normal_()
    runs = {}
    for name, gemm in gemms.items():
        runs[name] = (gemm.run, list(gemm.call_args(sample, gemm.pack(weight, rows), weight, bias, rows)))
    return choice.measure(runs)


def _winner(gemms: dict, mode: str, x, weight, bias, rows: int) -> tuple[str, Optional[str]]:
    """(the GEMM to run, the measurement behind the choice or None)."""
    prior = PRIOR if PRIOR in gemms else next(iter(gemms))
    if mode == "prior" or len(gemms) < 2:
        return prior, None
    cache, key = choice_cache.shared(), _signature(x, weight, bias)
    record = cache.get(key, choice_cache.fastest_of(*gemms))  # (an invalid one: measured again)
    if record is None:
        if mode != "measure":
            return prior, None
        seconds = _timed(gemms, x, weight, bias, rows)
        record = {"winner": min(seconds, key=seconds.get), **seconds}
        cache.put(key, record)
    times = " vs ".join(f"{gemms[n].label} {record[n] * 1e6:.0f} us" for n in gemms if isinstance(record.get(n), (int, float)))
    return record["winner"], times


def float_linears(gm: GraphModule, device: str, kernel_choice: Optional[str] = None) -> Optional[str]:
    """Each float32 ``aten.linear`` with constant weight (and bias) on the faster packed GEMM;
    the weight is packed for the input's row count (other row counts run too, unpacked inside
    the op). Without either GEMM, a non-contiguous input of 3+ dims (a transpose) is made
    contiguous: ATen would run it as a bmm against the weight expanded per row (614 ms a call
    at batch 8 on vit_b_16, 479 on the packed GEMM). Returns the report's note."""
    gemms, mode = _gemms(device), choice.mode(kernel_choice)
    chosen: Counter = Counter()  # the report's label of each GEMM run -> how many linears run on it
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.linear.default or node.kwargs:
            continue
        x_node, weight_node, bias_node = (*node.args, None)[:3]
        x, weight, bias = fake_value(x_node), _float_constant(gm, weight_node), _float_constant(gm, bias_node)
        if x is None or x.dtype != torch.float32 or static_shape(x_node) is None:
            continue
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        # (the packed GEMMs read the shapes as given: a graph from a file may hold any)
        shapes_fit = weight is not None and weight.dim() == 2 and x.shape[-1] == weight.shape[1] and (
            bias_node is None or bias is not None and tuple(bias.shape) == (weight.shape[0],))
        if gemms and shapes_fit and rows:
            name, times = _winner(gemms, mode, x, weight, bias, rows)
            gemm = gemms[name]
            constant = f"_qb_packed_{node.name}"
            set_constant(gm, constant, gemm.pack(weight, rows))
            with gm.graph.inserting_before(node):
                call = gm.graph.call_function(gemm.run, gemm.call_args(x_node, gm.graph.get_attr(constant), weight_node, bias_node, rows))
            call.meta = dict(node.meta)
            node.replace_all_uses_with(call)
            gm.graph.erase_node(node)
            chosen[gemm.label + (f" (measured on this machine: {times})" if times else "")] += 1
        elif x.dim() >= 3:
            with gm.graph.inserting_before(node):
                contiguous = gm.graph.call_function(aten.contiguous.default, (x_node,))
            contiguous.meta = {k: v for k, v in x_node.meta.items() if k in ("example_value", "val")}
            node.update_arg(0, contiguous)
    return "; ".join(f"{count} float linear(s) on {label}, weight packed once" for label, count in chosen.items()) or None
