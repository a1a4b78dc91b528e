"""``options={"remainder": "inductor"}``: Inductor compiles the lowered graph.

The oneDNN calls qbackend emitted stay as they are (Inductor runs them as extern kernels, its
own int8 lowering emits the same ops); what Inductor adds is the float code between them:
LayerNorm, softmax, GELU, residual adds and the boundary quantize / dequantize fuse into a few
C++ loops instead of one ATen call each. Measured on all-MiniLM-L6-v2 batch 1: 13.1 ms vs
15.4 ms with the remainder run eagerly and 14.7 ms for Inductor's own int8 lowering
(docs/benchmarks_smoothquant.md has the current numbers). The price is Inductor's compile time
and a C++ compiler, so it is an option: the default needs neither.
"""
from __future__ import annotations

import copy
import logging
from typing import Callable, Optional

import torch
from torch.fx import GraphModule

from .report import Report

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


def compile_with_inductor(gm: GraphModule, inputs: list, report: Report) -> Optional[Callable]:
    """Inductor's compiled ``gm``, or None (the note says why) if Inductor cannot compile it:
    the lowered graph then runs eagerly, as by default."""
    from torch._inductor.compile_fx import compile_fx

    work = _copy(gm)
    try:
        # (an inference graph: with grad on, AOT would trace the oneDNN weights for autograd; outside
        # Dynamo's tracing context, whose fake mode refuses the real prepacked weights)
        with torch.inference_mode(), torch._guards.tracing(None):
            compiled = compile_fx(work, inputs)
    except Exception as error:  # e.g. no C++ compiler: the eager graph is still correct
        log.exception("qbackend: Inductor could not compile the remainder")
        report.notes.append(f"remainder runs eagerly: Inductor failed ({type(error).__name__}: {str(error).splitlines()[0][:200]})")
        return None
    report.notes.append("remainder (the ops around the lowered kernels) compiled by Inductor")
    return compiled
