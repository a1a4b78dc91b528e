"""Weights a decode step streams, on 2 MB pages.

A weight-only LLM decode step reads every weight once (a 4-layer Llama-architecture int4 model:
130 MB a token). On 4 KB pages that stream costs a TLB miss per 4 KB; the same 17 kernel calls
ran 7-10% faster (paired) with their weights on 2 MB pages, at 4.2-4.4 ms, the machine's
copy-bandwidth floor (Zen 4, 2 threads). ``streamed_weights_on_huge_pages`` asks Linux to
move the weight-only kernels' constants onto transparent huge pages in place
(``madvise(MADV_COLLAPSE)``, Linux 6.1+): the same addresses and bytes, no copy kept. That
leaves each tensor's partial first and last 2 MB page; the tensors qbackend makes itself (the
merged weights of sibling linears) are written from a 2 MB boundary instead (``aligned_cat``).
Where the kernel or its settings refuse, nothing changes.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from torch.fx import GraphModule

from qbackend.kernels import registry
from qbackend.kernels.huge_pages import collapse
from qbackend.llm.dense_swiglu import swiglu
from qbackend.llm.dense_weight_only import WEIGHT_ONLY, kernel_or_dense
from qbackend.patterns.base import constant_value

def _weight_only_calls():
    return {registry.PLAIN[name] for name in WEIGHT_ONLY} | {kernel_or_dense, swiglu}


def _flat(args) -> list:
    """The arguments, those in tuples too (swiglu's two linears)."""
    return [a for arg in args for a in (_flat(arg) if isinstance(arg, tuple) else [arg])]


def streamed_weights_on_huge_pages(gm: GraphModule) -> Optional[str]:
    """The constants the graph's weight-only kernel calls read, on huge pages (see the module
    docstring)."""
    calls = _weight_only_calls()
    tensors = [value for node in gm.graph.nodes if node.op == "call_function" and node.target in calls
               for arg in _flat(node.args) if (value := constant_value(gm, arg)) is not None]
    if not tensors:
        return None
    start = time.perf_counter()
    moved = collapse(tensors)
    if not moved:
        return None
    return (f"{moved / 2**20:.0f} MB of weight-only weights on 2 MB pages "
            f"({(time.perf_counter() - start) * 1e3:.0f} ms): fewer TLB misses as a step streams them")
