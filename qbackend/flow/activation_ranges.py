"""Activation ranges chosen by measuring the model, not by one estimator per tensor.

X86InductorQuantizer (and XPUInductorQuantizer) observe activations with HistogramObserver,
which gives each tensor the range of least quantization error on the calibration data,
clipping its tails. Fitted to few batches, those ranges clip what new inputs bring: on
torchvision's mobilenet_v3_large (random weights, BatchNorm statistics of random images, 4
calibration images) the output cosine vs fp32 on 4 other images is 0.959-0.972 with them and
0.967-0.976 with each tensor's plain min / max (OpenVINO int8: 0.958 on the benchmark's
image); resnet50 goes the other way (0.984-0.985 vs 0.982-0.984). Scored on the calibration
batches themselves the two tie (0.9733 vs 0.9729): the histogram ranges fit them. So "auto"
calibrates a probe on all but the last of the first calibration batches, scores both kinds of
ranges on that last one (data they have not seen) and converts the fully calibrated model with
the winner. One calibration gives both kinds: the histogram observer keeps the running min /
max too.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from qbackend.flow.accuracy import output_cosine
from qbackend.flow.convert import convert
from qbackend.flow.graph_copy import graph_copy

CHOICES = ("auto", "histogram", "min_max")


def min_max_ranges(prepared: torch.fx.GraphModule) -> Optional[torch.fx.GraphModule]:
    """A copy of a calibrated (prepared) model whose histogram observers give the min / max of
    everything they saw; None when it has none (QAT's fake quantizers, dynamic quantization)."""
    from torchao.quantization.pt2e.observer import HistogramObserver, MinMaxObserver

    if not any(type(module) is HistogramObserver for module in prepared.modules()):
        return None
    result = graph_copy(prepared)
    replaced = {}  # one observer under several names (a shared qspec: a pool's output, a cat's inputs) stays one
    for name, histogram in list(result.named_modules(remove_duplicate=False)):
        if type(histogram) is not HistogramObserver:
            continue
        if id(histogram) not in replaced:
            plain = MinMaxObserver(dtype=histogram.dtype, qscheme=histogram.qscheme, quant_min=histogram.quant_min,
                                   quant_max=histogram.quant_max, eps=float(histogram.eps))
            plain.min_val, plain.max_val = histogram.min_val.clone(), histogram.max_val.clone()
            replaced[id(histogram)] = plain
        parent, _, attribute = name.rpartition(".")
        setattr(result.get_submodule(parent), attribute, replaced[id(histogram)])
    return result


def chosen(model: torch.nn.Module, probe: Callable[[list], torch.fx.GraphModule], batches: list) -> tuple[str, dict]:
    """("histogram" or "min_max", {each: its output cosine vs ``model`` on the last batch}):
    ``probe(batches[:-1])`` is the model prepared and calibrated on them. Fewer than 2
    batches, or no histogram observers: ("histogram", {})."""
    if len(batches) < 2:
        return "histogram", {}
    prepared = probe(batches[:-1])
    plain = min_max_ranges(prepared)
    if plain is None:
        return "histogram", {}
    candidates = {"histogram": convert(prepared), "min_max": convert(plain)}
    cosines = {name: output_cosine(model, candidate, batches[-1:]) for name, candidate in candidates.items()}
    # (NaN counts as worst; a tie keeps the quantizer's own)
    best = max(cosines, key=lambda name: (-2.0 if math.isnan(cosines[name]) else cosines[name], name == "histogram"))
    return best, cosines


def converted(prepared: torch.fx.GraphModule, ranges: str, is_qat: bool = False) -> torch.fx.GraphModule:
    """``prepared`` (calibrated) converted with "min_max" activation ranges, or else (also an
    "auto" that probed nothing: QAT) the histogram observers' own."""
    plain = min_max_ranges(prepared) if ranges == "min_max" else None
    return convert(plain if plain is not None else prepared, is_qat)
