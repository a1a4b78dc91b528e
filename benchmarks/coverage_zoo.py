"""What each zoo model gets quantized and lowered, written to docs/coverage_zoo.md: the convs /
linears X86InductorQuantizer's own recipe quantizes, those ``quantize_x86`` quantizes (every
linear, 3-D convs, Hugging Face's Conv1D projections), and what ``qbackend.explain`` reports
lowered or kept (with the reasons) for the latter. No timing: any machine load is fine.

    python benchmarks/coverage_zoo.py [--models M [M ...]] [--docs docs]
"""
from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch

import qbackend
from qbackend.pt2e_flow import quantize_x86

import zoo_models
from common import cpu_key, log, machine_description, short_error, write_section
from zoo_engines import inductor_recipe

PROJECT_ROOT = Path(__file__).resolve().parents[1]
MODELS = (zoo_models.TORCHVISION + zoo_models.IN_HOUSE + (zoo_models.MINILM, zoo_models.BERT_BASE, zoo_models.DISTILBERT)
          + zoo_models.MORE_TORCHVISION + zoo_models.VIDEO + (zoo_models.GPT2,))
CALIBRATION = 2  # batches: enough for every observer to see data (coverage does not depend on how many)
aten = torch.ops.aten
# op -> (kind, the positions of its two operands)
LAYERS = {aten.conv1d.default: ("conv", 0, 1), aten.conv2d.default: ("conv", 0, 1), aten.conv3d.default: ("conv", 0, 1),
          aten.linear.default: ("linear", 0, 1), aten.addmm.default: ("linear", 1, 2),  # (Hugging Face's Conv1D)
          aten.matmul.default: ("attention", 0, 1), aten.bmm.default: ("attention", 0, 1),
          aten.scaled_dot_product_attention.default: ("attention", 0, 1)}
DEQUANTIZE = ("dequantize_per_tensor", "dequantize_per_channel")


def _dequantized(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and any(d in str(node.target) for d in DEQUANTIZE)


def quantized_layers(converted: torch.fx.GraphModule) -> collections.Counter:
    """Per kind ("conv", "linear", "attention": products of two activations): how many the
    converted graph has ("total") and how many read both operands dequantized ("int8")."""
    counts = collections.Counter()
    for node in converted.graph.nodes:
        kind, first, second = LAYERS.get(node.target, (None, 0, 0)) if node.op == "call_function" else (None, 0, 0)
        if kind is not None:
            counts[kind, "total"] += 1
            counts[kind, "int8"] += _dequantized(node.args[first]) and _dequantized(node.args[second])
    return counts


def _int8_cell(counts: collections.Counter, kind: str) -> str:
    return f"{counts[kind, 'int8']} / {counts[kind, 'total']}" if counts[kind, "total"] else "–"


def row(name: str) -> list[str]:
    zoo = zoo_models.build(name, 1, CALIBRATION)
    try:
        plain = quantized_layers(inductor_recipe(zoo))
        plain_cells = [_int8_cell(plain, kind) for kind in ("conv", "linear")]
    except Exception as error:  # (the recipe's own failure is a result)
        plain_cells = [short_error(error), ""]
    converted = quantize_x86(zoo.model, zoo.inputs, zoo.calibration, progress=False)
    ours = quantized_layers(converted)
    with torch.no_grad():
        report = qbackend.explain(converted, *zoo.inputs)
    kinds = collections.Counter(d.kind for d in report.decisions)
    lowered = collections.Counter(d.kind for d in report.lowered)
    kept = collections.Counter(f"{d.kind}: {d.reason}" for d in report.kept)
    return [name, *plain_cells, *(_int8_cell(ours, kind) for kind in ("conv", "linear")), _int8_cell(ours, "attention"),
            ", ".join(f"{kind} {lowered[kind]} / {n}" for kind, n in sorted(kinds.items())),
            "; ".join(f"{n} x {why}" for why, n in kept.most_common()) or "none"]


HEADER = ["model", "X86InductorQuantizer: int8 convs", "int8 linears", "quantize_x86: int8 convs", "int8 linears",
          "int8 attention products", "qbackend lowered, per kind", "kept (why)"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=MODELS)
    parser.add_argument("--docs", type=Path, default=PROJECT_ROOT / "docs")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    rows = []
    for name in args.models:
        log(f"{name}")
        try:
            rows.append(row(name))
        except Exception as error:
            rows.append([name, short_error(error)] + [""] * (len(HEADER) - 2))
    lines = [f"- Machine: {machine_description()}",
             f"- Command: `python benchmarks/coverage_zoo.py{'' if tuple(args.models) == MODELS else ' --models ' + ' '.join(args.models)}`;"
             f" batch 1, {CALIBRATION} calibration batches; the models as bench_zoo builds them.",
             "- int8: a conv / linear (or Hugging Face Conv1D's `addmm`) whose input and weight are both dequantized in the"
             " converted graph; attention products: matmuls of two activations and fused attention calls, which neither"
             " recipe quantizes (qbackend runs them in float, fused). Lowered: `qbackend.explain`'s"
             " decisions on `quantize_x86`'s module (convs, linears, pools, attention), kept ones with their reason.",
             "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    write_section(args.docs / "coverage_zoo.md", "What each zoo model gets quantized and lowered", cpu_key(), "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
