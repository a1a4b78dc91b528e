"""The torch.compile backend: capture -> freeze -> select/emit -> clean up.

Registered as ``backend="qbackend"`` through the ``torch_dynamo_backends`` entry point, so
users never import this module themselves. Importing it changes no global torch state.
"""
from __future__ import annotations

import copy
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.fx import GraphModule

from qbackend.kernels.kernel_chain import chain_calls
from qbackend.passes.batch_major import linears_in_row_order
from qbackend.pipeline.cleanup import cleanup, drop_inference_dropout
from qbackend.passes.einsum import einsums_as_matmuls
from qbackend.pipeline.freeze import freeze
from qbackend.llm.kv_int8 import KV_CACHES
from qbackend.pipeline.lower import lower
from qbackend.lowering import TABLES
from qbackend.lowering.choice import mode as choice_mode
from qbackend.pipeline.remainder import MODES, compile_with_inductor
from qbackend.pipeline.static_module import lifted_weights_note
from qbackend.pipeline.report import Report
from qbackend.runtime.runnable import runnable

log = logging.getLogger("qbackend")


@dataclass
class Options:
    """``torch.compile(m, backend="qbackend", options={...})``."""

    device: Optional[str] = None  # lower for this device's table instead of the inputs' device
    report: bool = False  # print the report to stderr (also: QBACKEND_REPORT=1)
    report_sink: Optional[Callable[[Report], None]] = None  # receives each graph's report
    # weight-only linears: "auto" (CPU: qbackend's int16 kernels where they build, else bf16),
    # "int16", "bf16" or "activation" (lowering/weight_only.py COMPUTE_CHOICES)
    weight_only_compute: str = "auto"
    # weight-only linears: from this many rows (tokens) on, run a dense matmul on a dequantized
    # copy kept in memory (+0.5x the fp32 weight in bf16); None: always the packed kernel
    weight_only_dense_rows: Optional[int] = None
    # the lowered graph will be traced again with fake tensors (export, another compiler): use
    # only op names that have a Meta kernel (torch 2.13's legacy qconv1d/qconv3d have none)
    need_meta: bool = False
    # what runs the ops qbackend does not lower: "eager" (ATen calls, no compiler needed) or
    # "inductor" (fused C++ loops around the oneDNN calls; Inductor's compile time, see remainder.py)
    remainder: str = "eager"
    # own kernel or oneDNN for a conv / linear both can run: "measure" (timed once per machine and
    # layer, then cached on disk), "cached" (measured choices only) or "prior" (fixed tables);
    # None: $QBACKEND_KERNEL_CHOICE, else "measure" (lowering/choice.py)
    kernel_choice: Optional[str] = None
    # an error while lowering raises (Dynamo reports it as a backend failure) instead of a
    # warning and the graph run unlowered; None: QBACKEND_STRICT=1, else the opposite of
    # torch._dynamo.config.suppress_errors where the user set it, else False (see strict_mode)
    strict: Optional[bool] = None
    # attention over a KV cache that grows by appends reads "float" keys and values (the
    # reference's) or an "int8" copy of them, a quarter of the bytes at long contexts (kv_int8.py)
    kv_cache: str = "float"

    @classmethod
    def parse(cls, options) -> "Options":
        options = dict(options or {})
        known = set(cls.__dataclass_fields__)
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"qbackend: unknown option(s) {sorted(unknown)}; valid options: {sorted(known)}")
        parsed = cls(**options)
        if parsed.remainder not in MODES:
            raise ValueError(f"qbackend: remainder={parsed.remainder!r}; valid: {', '.join(map(repr, MODES))}")
        if parsed.kv_cache not in KV_CACHES:
            raise ValueError(f"qbackend: kv_cache={parsed.kv_cache!r}; valid: {', '.join(map(repr, KV_CACHES))}")
        choice_mode(parsed.kernel_choice)  # (raises on an unknown mode)
        if parsed.device is not None and parsed.device not in TABLES:
            raise ValueError(f"qbackend: device={parsed.device!r}; it lowers for {', '.join(map(repr, TABLES))}")
        return parsed


def strict_mode(strict: Optional[bool]) -> bool:
    """Whether a lowering error raises: the option, else $QBACKEND_STRICT, else what the user set
    Dynamo's ``suppress_errors`` to (Dynamo's default, unset, still falls back: a model runs)."""
    if strict is not None:
        return strict
    if "QBACKEND_STRICT" in os.environ:
        return os.environ["QBACKEND_STRICT"] == "1"
    dynamo_config = sys.modules.get("torch._dynamo.config")
    is_default = getattr(dynamo_config, "_is_default", None)
    if is_default is None or is_default("suppress_errors"):
        return False
    return not dynamo_config.suppress_errors


def graph_device(example_inputs, gm: GraphModule) -> str:
    """The device of the graph's tensors: real inputs first, then parameters and buffers."""
    for value in example_inputs:
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            return value.device.type
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            return value.device.type
    for value in gm.buffers():
        return value.device.type
    return "cpu"


def compile_graph(gm: GraphModule, example_inputs, options: Options, registry=None) -> tuple[Callable, Report, GraphModule]:
    """(callable taking Dynamo's inputs, report, the lowered GraphModule). ``gm`` is not
    modified. ``registry`` replaces the live op registry (tests simulate other torch versions)."""
    device = options.device or graph_device(example_inputs, gm)
    work = GraphModule(gm, copy.deepcopy(gm.graph))
    runtime_inputs = freeze(work, example_inputs)
    lifted_note = lifted_weights_note(len(example_inputs) - len(runtime_inputs))
    drop_inference_dropout(work)
    einsums_as_matmuls(work)
    row_order = linears_in_row_order(work)
    inductor = options.remainder == "inductor"  # (Inductor traces the graph: ops with Meta kernels, its own q/dq)
    report = lower(work, device, registry, options.weight_only_compute, options.weight_only_dense_rows,
                   options.need_meta or inductor, options.kernel_choice)
    report.notes.extend(note for note in (lifted_note, row_order) if note)
    report.notes.extend(cleanup(work, device, fast_boundary=not inductor, kernel_choice=options.kernel_choice,
                                weight_only_compute=options.weight_only_compute, kv_cache=options.kv_cache))
    report.chains = chain_calls(work)
    compiled = inductor and compile_with_inductor(work, [example_inputs[i] for i in runtime_inputs], report)
    return runnable(compiled or work, runtime_inputs, len(example_inputs)), report, work


def unlowered_why(report: Report) -> Optional[str]:
    """Why nothing (or less than the model holds) was lowered where the user expected int8 kernels,
    or None: a device qbackend has no table for; convs / linears whose weight came dequantized
    from another graph (``Decision.weight_from_outside``: a graph break); or convs / linears
    that are all float (``Decision.float_layer``: a model never converted)."""
    if report.device not in TABLES:
        return f"qbackend: this graph's tensors are on {report.device!r}, which it has no table for: it runs unlowered"
    layers = [d for d in report.decisions if d.kind in ("conv", "linear")]
    outside = [d.node for d in layers if d.weight_from_outside]
    if outside:
        return (f"qbackend: {len(outside)} of this graph's {len(layers)} conv / linear ops ({', '.join(outside[:3])}"
                f"{', ...' if len(outside) > 3 else ''}) read a quantized input but get their weight as a float input of "
                "the graph (its dequantize ran in another graph Dynamo split off: a graph break): they run float. "
                "qbackend.compile(model) lowers an exported model whole; torch.compile(model, backend='qbackend', "
                "dynamic=True) avoids the recompiles that split it")
    if not layers or not all(d.float_layer for d in layers):
        return None
    return (f"qbackend: this graph's {len(layers)} conv / linear ops are float and none reads a quantized input or weight: "
            "nothing to lower to int8 (was the model converted with quantize_x86 / convert_pt2e, or quantize_weights?)")


def qbackend(gm: GraphModule, example_inputs, options=None, **_mode):
    """Entry point Dynamo calls with each captured graph."""
    opts = Options.parse(options)
    try:
        compiled, report, _ = compile_graph(gm, example_inputs, opts)
        why = unlowered_why(report)
        if why is not None:
            if strict_mode(opts.strict):
                raise ValueError(why)
            warnings.warn(why)
            report.notes.append(why)
    except Exception as error:  # never crash the user's model: run it as captured, unless asked to
        if strict_mode(opts.strict):
            raise
        warnings.warn(f"qbackend could not lower this graph and runs it unlowered: {type(error).__name__}: {error}")
        log.exception("qbackend lowering failed")
        compiled, report = gm.forward, Report(opts.device or "?", notes=[f"lowering failed: {type(error).__name__}: {error}"])
    if opts.report_sink is not None:
        opts.report_sink(report)
    if opts.report or os.environ.get("QBACKEND_REPORT") == "1":
        print(report, file=sys.stderr)
    log.info("%s", report)
    return compiled
