"""``options={"remainder": "inductor"}``: Inductor compiles the lowered graph.

The oneDNN calls qbackend emitted stay as they are (Inductor runs them as extern kernels, its
own int8 lowering emits the same ops); what Inductor adds is the float code between them:
LayerNorm, softmax, GELU, residual adds and the boundary quantize / dequantize fuse into a few
C++ loops instead of one ATen call each. First measured on all-MiniLM-L6-v2 batch 1: 13.1 ms
vs 15.4 ms with the remainder run eagerly and 14.7 ms for Inductor's own int8 lowering
(docs/benchmarks_smoothquant.md has the current numbers, design-notes.md the details). The
price is Inductor's compile time and a C++ compiler, so it is an option: the default needs
neither.
"""
from __future__ import annotations

import copy
import logging
from typing import Callable, Optional

import torch
from torch.fx import GraphModule

from qbackend.pipeline.report import Report

log = logging.getLogger("qbackend")

MODES = ("eager", "inductor")


def _copy(gm: GraphModule) -> GraphModule:
    """A copy for Inductor, whose passes rewrite the graph they get (the eager fallback runs
    ``gm``). Its frozen constants are plain attributes, not buffers: AOT then captures them as
    graph constants, which Inductor's oneDNN lowerings require of a prepacked weight, instead
    of lifting them to graph inputs."""
    work = GraphModule(gm, copy.deepcopy(gm.graph))
    for name in list(work._buffers):
        work.__dict__[name] = work._buffers.pop(name)
    return work


def _symbolic_shapes(gm: GraphModule) -> bool:
    """Dynamo handed over a graph with symbolic sizes (a dynamic dim, after a recompile)."""
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = node.meta.get("example_value", node.meta.get("val"))
            sizes = value.shape if isinstance(value, torch.Tensor) else [value]
            if any(isinstance(size, torch.SymInt) for size in sizes):
                return True
    return False


def compile_with_inductor(gm: GraphModule, inputs: list, report: Report) -> Optional[Callable]:
    """Inductor's compiled ``gm``, or None (the note says why) if Inductor cannot compile it:
    the lowered graph then runs eagerly, as by default."""
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    if _symbolic_shapes(gm):  # Inductor would compile for the example sizes only; this graph takes any
        report.notes.append("remainder runs eagerly: the graph has symbolic sizes (Inductor is handed static ones here)")
        return None
    work = _copy(gm)
    try:
        # An inference graph: with grad on, AOT would trace the oneDNN weights for autograd; outside
        # Dynamo's tracing context, whose fake mode refuses the real prepacked weights. Without
        # Inductor's pattern passes: qbackend has matched what it can, and in torch 2.13 the
        # attention pass rewrites a softmax over dim -2 into SDPA (over -1), silently wrong
        # (tests/pipeline/test_remainder.py); its scheduler still fuses the float ops.
        with torch.inference_mode(), torch._guards.tracing(None), inductor_config.patch(pattern_matcher=False):
            compiled = compile_fx(work, inputs)
    except Exception as error:  # e.g. no C++ compiler: the eager graph is still correct
        log.exception("qbackend: Inductor could not compile the remainder")
        report.notes.append(f"remainder runs eagerly: Inductor failed ({type(error).__name__}: {str(error).splitlines()[0][:200]})")
        return None
    report.notes.append("remainder (the ops around the lowered kernels) compiled by Inductor")
    return compiled
