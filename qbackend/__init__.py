"""qbackend: a torch.compile backend that lowers PT2E-quantized models to oneDNN int8 kernels.

    torch.compile(converted_pt2e_module, backend="qbackend")   # no import needed
    qbackend.compile(converted_pt2e_module)                     # the same, without Dynamo's re-trace
    qbackend.quantize_x86(float_model, example_inputs, calibration)  # PT2E int8 in one call (torchao)
    qbackend.QuantizeConfig(...)                                    # its options as plain data (config=)
    qbackend.explain(converted_pt2e_module, *example_inputs)   # what was lowered, and why not
    qbackend.quantize_weights(float_model, bits=4, group_size=128)  # weight-only int4 / int8
    qbackend.smooth_quant(exported_module, calibration_batches)    # SmoothQuant pre-pass (PT2E)
    qbackend.save(converted_pt2e_module, "model.pt2"); qbackend.load("model.pt2")  # deploy
    qbackend.inspect("model.pt2")                                   # its recipe and versions
    qbackend.accuracy_report(float_model, converted_pt2e_module, batches)  # per-layer error vs fp32

Importing qbackend changes no global torch or Inductor state and does not import torchao
(``quantize_x86`` / ``quantize_xpu`` are loaded on first use; they import torchao when called).
"""
from __future__ import annotations

import functools

import torch

from qbackend.archive.archive_checks import ArchiveError
from qbackend.deploy import inspect, load, save
from qbackend.flow.accuracy import AccuracyReport, accuracy_report
from qbackend.flow.recipe import QuantizeConfig
from qbackend.pipeline.direct import compile
from qbackend.pipeline.report import Report
from qbackend.quantized_tensor import QuantizedLinearWeight, from_old_cpu_int4, quantize_weights
from qbackend.smoothquant.smooth_quant import SmoothReport, smooth_quant
from qbackend.version import VERSION

__version__ = VERSION


def explain(model, *example_inputs, device: str | None = None, **keyword_inputs) -> Report:
    """Compile ``model`` with qbackend, run it once on ``example_inputs`` (and keyword inputs:
    ``explain(m, **tokenizer_batch)``) and return the report of every conv / linear: the rule
    and op it became, or why it was kept. It runs the backend's own selection code, so it always
    agrees with what the backend does."""
    reports: list[Report] = []
    with torch.no_grad():  # (an exported graph goes to the backend directly: see qbackend.compile)
        compile(model, options={"report_sink": reports.append, "device": device})(*example_inputs, **keyword_inputs)
    if not reports:
        return Report(device or "?", notes=["no graph reached the backend (nothing to compile)"], graphs=0)
    return functools.reduce(Report.merge, reports)


FLOW = ("quantize_x86", "quantize_xpu")  # (qbackend.pt2e_flow's, loaded when first named)


def __getattr__(name: str):
    if name in FLOW:
        from qbackend import pt2e_flow

        return getattr(pt2e_flow, name)
    raise AttributeError(f"module 'qbackend' has no attribute {name!r}")


__all__ = ["quantize_x86", "quantize_xpu", "QuantizeConfig", "compile", "explain", "save", "load", "inspect", "ArchiveError", "accuracy_report", "AccuracyReport", "Report", "smooth_quant", "SmoothReport", "QuantizedLinearWeight", "quantize_weights", "from_old_cpu_int4"]
