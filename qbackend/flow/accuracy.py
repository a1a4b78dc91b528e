"""Where a quantized model loses accuracy: every conv / linear output of the converted PT2E
module against the same layer's output in the float model, over the user's batches.

The converted graph's conv / linear nodes name the module they came from (export's
``nn_module_stack``); the float model's module of that path gives the reference through a
forward hook. Errors are cumulative (each layer sees the quantized model's own inputs), as a
user sees them: the first layer whose error jumps is where to look, or what to keep float
(``quantize_x86(..., keep_float=[path])``).
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
from torch.fx import GraphModule, Interpreter
from torch.nn.modules.batchnorm import _BatchNorm

from qbackend.flow.batches import positional_and_keyword
from qbackend.pipeline.direct import InputBinding, qdq_name
from qbackend.pipeline.report import source_of

aten = torch.ops.aten
LAYER_OPS = {aten.conv1d.default: "conv", aten.conv2d.default: "conv", aten.conv3d.default: "conv",
             aten.conv_transpose1d.default: "conv", aten.conv_transpose2d.input: "conv", aten.linear.default: "linear"}


def _is_layer(node) -> bool:
    return node.op == "call_function" and node.target in LAYER_OPS


class _Agreement:
    """Running sums that give the cosine and SQNR of a quantized tensor against its reference
    over many batches (as if all were one tensor)."""

    def __init__(self):
        self.dot = self.reference = self.actual = self.error = 0.0

    def add(self, actual: torch.Tensor, reference: torch.Tensor) -> None:
        a, r = actual.detach().double().flatten(), reference.detach().double().flatten()
        self.dot += float(a @ r)
        self.reference += float(r @ r)
        self.actual += float(a @ a)
        self.error += float((a - r) @ (a - r))

    @property
    def cosine(self) -> float:
        return self.dot / math.sqrt(self.reference * self.actual) if self.reference and self.actual else float("nan")

    @property
    def sqnr_db(self) -> float:
        if not self.error:
            return math.inf
        return 10 * math.log10(self.reference / self.error) if self.reference else -math.inf


@dataclass(frozen=True)
class LayerError:
    path: str  # the module path, as keep_float takes it
    kind: str  # conv / linear
    sqnr_db: float  # of the output: 10 log10(|reference|^2 / |quantized - reference|^2), higher is better
    cosine: float
    input_sqnr_db: float = math.inf  # of the float input it reads, before its quantize: what earlier layers lost
    position: int = 0  # its place in the order the layers ran


@dataclass
class AccuracyReport:
    layers: list[LayerError]  # worst (lowest SQNR) first
    output: LayerError  # the model's output
    batches: int
    unmatched: list[str] = field(default_factory=list)  # quantized layers with no float module of their path

    def __str__(self) -> str:
        lines = [f"accuracy vs fp32 over {self.batches} batch(es): output SQNR {self.output.sqnr_db:.1f} dB, "
                 f"cosine {self.output.cosine:.5f}; layers worst first:",
                 "| layer | kind | SQNR dB | cosine | its float input's SQNR dB |", "|---|---|---|---|---|"]
        lines += [f"| {e.path} | {e.kind} | {e.sqnr_db:.1f} | {e.cosine:.5f} | {e.input_sqnr_db:.1f} |" for e in self.layers]
        if self.unmatched:
            lines.append(f"not compared (no float module of that path): {', '.join(self.unmatched)}")
        return "\n".join(lines)

    def plot(self, path, title: str = "") -> None:
        """Write a chart of every layer's SQNR (and its float input's) in network order to
        ``path`` (any format matplotlib saves by its suffix). Needs matplotlib: ``pip install
        qbackend[plot]``."""
        try:
            import matplotlib
            matplotlib.use("Agg", force=False)  # (no display needed; a backend already chosen stays)
            import matplotlib.pyplot as plt
        except ImportError as error:
            raise ImportError("AccuracyReport.plot needs matplotlib: pip install 'qbackend[plot]'") from error
        layers = sorted(self.layers, key=lambda e: e.position)
        steps = range(len(layers))
        figure, axes = plt.subplots(figsize=(max(6.0, 0.22 * len(layers)), 4.0), layout="constrained")
        try:
            axes.plot(steps, [e.sqnr_db for e in layers], "o-", label="layer output")
            axes.plot(steps, [e.input_sqnr_db for e in layers], ".--", label="its float input")
            axes.axhline(self.output.sqnr_db, color="gray", linewidth=0.8, label=f"model output ({self.output.sqnr_db:.1f} dB)")
            axes.set_xticks(list(steps), [e.path for e in layers], rotation=90, fontsize=6)
            axes.set_ylabel("SQNR vs fp32, dB (higher: better)", fontsize=8)
            axes.set_title(title or f"per-layer error over {self.batches} batch(es)")
            axes.legend(fontsize=7)
            figure.savefig(path, dpi=120)
        finally:
            plt.close(figure)


def _float_input(layer) -> object:
    """The float tensor a conv / linear reads, before the quantize / dequantize pair in front
    of it (the tensor itself where there is none: a layer kept float)."""
    x = layer.args[0]
    if qdq_name(x) == "dequantize_per_tensor" and qdq_name(x.args[0]) == "quantize_per_tensor":
        return x.args[0].args[0]
    return x


class _LayerOutputs(Interpreter):
    """Runs the converted graph, keeping every conv / linear (float input, output) under its
    module path (each input recorded when it is made: the interpreter frees it after its
    quantize)."""

    def __init__(self, gm: GraphModule, unquantized_input: Optional[str] = None):
        super().__init__(gm)
        self.unquantized_input = unquantized_input  # a layer path whose layers read their float input
        self.outputs: dict = collections.defaultdict(list)
        self.watched = collections.defaultdict(list)  # float input node -> the layers reading it
        for layer in filter(_is_layer, gm.graph.nodes):
            self.watched[_float_input(layer)].append(layer)
        self.inputs: dict = {}

    def run_node(self, node):
        if self.unquantized_input is not None and node in self.inputs and source_of(node) == self.unquantized_input:
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            value = node.target(self.inputs[node], *args[1:], **kwargs)
        else:
            value = super().run_node(node)
        for layer in self.watched.get(node, ()):
            self.inputs[layer] = value
        if _is_layer(node):  # (a copy, as the float side's: before an in-place activation after it)
            self.outputs[(source_of(node), LAYER_OPS[node.target])].append((self.inputs.pop(node, None), value.clone()))
        return value


def _flat_tensors(value) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _record_layer_outputs(modules: dict) -> tuple[dict, list]:
    """Forward hooks on the float model's leaf modules (and batch norms): path -> its (input,
    output) per call, each output as the layer made it (before any activation after it, as the
    converted side records it). A batch norm reading a module's output replaces that output by
    its normalization alone (prepare_pt2e folds that into the conv before it, whose converted
    node then gives it): computed from the norm's own statistics, since a subclass may apply
    more (timm's BatchNormAct2d: its activation, a node of its own in the converted graph)."""
    outputs: dict = collections.defaultdict(list)
    produced: dict = {}  # id of an output tensor -> (path, call index); the tensors stay alive in ``outputs``

    def record(module, inputs, out, path):
        if isinstance(module, _BatchNorm) and inputs and id(inputs[0]) in produced:
            source, index = produced[id(inputs[0])]
            outputs[source][index] = (outputs[source][index][0], _normalized(module, inputs[0], out))
        if isinstance(out, torch.Tensor):
            produced[id(out)] = (path, len(outputs[path]))
        # (a copy: an in-place activation after the layer, ReLU(inplace=True), would change it)
        outputs[path].append((inputs[0] if inputs else None, out.clone() if isinstance(out, torch.Tensor) else out))

    hooks = [module.register_forward_hook(lambda m, i, o, path=path: record(m, i, o, path))
             for path, module in modules.items() if isinstance(module, _BatchNorm) or not any(True for _ in module.children())]
    return outputs, hooks


def _normalized(norm: _BatchNorm, x: torch.Tensor, out):
    """What an eval-mode batch norm computes from ``x``, without what a subclass adds after it."""
    if norm.running_mean is None or norm.running_var is None:
        return out
    return torch.nn.functional.batch_norm(x, norm.running_mean, norm.running_var, norm.weight, norm.bias, False, 0.0, norm.eps)


def _bound(quantized: GraphModule, batches: Iterable) -> list[tuple[tuple, dict, list]]:
    """Each batch as (args, kwargs) for the float model and the placeholders of ``quantized``
    (batches as calibration takes them: tuples, dicts of keyword inputs, tensors)."""
    binding, bound = InputBinding(quantized), []
    for batch in batches:
        args, kwargs = positional_and_keyword(batch)
        placeholders = binding.placeholders(args, kwargs)
        if placeholders is None:
            raise ValueError(f"a batch does not bind to the quantized model's inputs ({binding.parameters})")
        bound.append((args, kwargs, placeholders))
    if not bound:
        raise ValueError("comparing with the float model needs at least one batch")
    return bound


def accuracy_report(model_fp32: torch.nn.Module, quantized: GraphModule, batches: Iterable) -> AccuracyReport:
    """Per-layer error of ``quantized`` (a converted PT2E module) against ``model_fp32`` over
    ``batches`` (tuples, dicts of keyword inputs or tensors, as calibration takes them)."""
    modules = dict(model_fp32.named_modules())
    agreements: dict = collections.defaultdict(_Agreement)
    input_agreements: dict = collections.defaultdict(_Agreement)
    output, unmatched = _Agreement(), set()
    bound = _bound(quantized, batches)
    model_fp32.eval()
    with torch.no_grad():
        for args, kwargs, placeholders in bound:
            recorder = _LayerOutputs(quantized)
            actual = recorder.run(*placeholders)
            reference_outputs, hooks = _record_layer_outputs(modules)
            try:
                expected = model_fp32(*args, **kwargs)
            finally:
                for hook in hooks:
                    hook.remove()
            for (path, kind), values in recorder.outputs.items():
                if path not in modules or len(reference_outputs[path]) != len(values):
                    unmatched.add(path or "?")
                    continue
                for (x, value), (x_reference, reference) in zip(values, reference_outputs[path]):
                    agreements[(path, kind)].add(value, reference)
                    if isinstance(x, torch.Tensor) and isinstance(x_reference, torch.Tensor) and x.shape == x_reference.shape:
                        input_agreements[(path, kind)].add(x, x_reference)
            for a, r in zip(_flat_tensors(quantized.graph.process_outputs(actual)), _flat_tensors(expected)):
                output.add(a, r)
    layers = sorted((LayerError(path, kind, a.sqnr_db, a.cosine, input_agreements[(path, kind)].sqnr_db
                                if (path, kind) in input_agreements else math.nan, position)
                     for position, ((path, kind), a) in enumerate(agreements.items())), key=lambda e: e.sqnr_db)
    return AccuracyReport(layers, LayerError("output", "model", output.sqnr_db, output.cosine), len(bound), sorted(unmatched))


def output_cosine(model_fp32: torch.nn.Module, quantized: GraphModule, batches: Iterable) -> float:
    """The cosine of ``quantized``'s outputs against ``model_fp32``'s over ``batches`` (all
    output tensors of all batches as one vector), without the per-layer comparison."""
    output = _Agreement()
    model_fp32.eval()
    with torch.no_grad():
        for args, kwargs, placeholders in _bound(quantized, batches):
            actual = quantized.graph.process_outputs(Interpreter(quantized).run(*placeholders))
            for a, r in zip(_flat_tensors(actual), _flat_tensors(model_fp32(*args, **kwargs))):
                output.add(a, r)
    return output.cosine


def input_sensitivity(model_fp32: torch.nn.Module, quantized: GraphModule, batches: Iterable) -> dict[str, float]:
    """Layer path -> the model's output cosine vs fp32 when that layer reads its float input
    (its quantize skipped, its weights still int8), over ``batches``: how much the layer's input
    quantization costs the output. What a layer loses is not additive along the network (an
    early layer's error is diluted, a late one's is not), so this runs the model once per
    layer rather than reading per-layer SQNRs."""
    bound = _bound(quantized, batches)
    with torch.no_grad():
        expected = [_flat_tensors(model_fp32(*args, **kwargs)) for args, kwargs, _ in bound]
    cosines = {}
    with torch.no_grad():
        for path in sorted({source_of(n) for n in filter(_is_layer, quantized.graph.nodes)}):
            output = _Agreement()
            for (_, _, inputs), reference in zip(bound, expected):
                actual = quantized.graph.process_outputs(_LayerOutputs(quantized, path).run(*inputs))
                for a, r in zip(_flat_tensors(actual), reference):
                    output.add(a, r)
            cosines[path] = output.cosine
    return cosines
