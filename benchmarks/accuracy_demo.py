"""Per-layer accuracy, written to docs/accuracy_demo.md with a chart: ``qbackend.accuracy_report``
of all-MiniLM-L6-v2 (or the bundled ResNet-18-like) quantized with ``quantize_x86``, and what
``quantize_x86(target_cosine=...)`` keeps float to reach a tighter output cosine.

    python benchmarks/accuracy_demo.py [--model all-MiniLM-L6-v2|resnet18_like] [--docs docs]
"""
from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import qbackend
from qbackend.pt2e_flow import cpu_needs_reduce_range, quantize_x86

import zoo_models
from common import cpu_key, machine_description, write_section

PROJECT_ROOT = Path(__file__).resolve().parents[1]
MODELS = (zoo_models.MINILM, "resnet18_like")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default=MODELS[0])
    parser.add_argument("--docs", type=Path, default=PROJECT_ROOT / "docs")
    args = parser.parse_args(argv)
    zoo = zoo_models.build(args.model, 1, 8)
    converted = quantize_x86(zoo.model, zoo.inputs, zoo.calibration)
    report = qbackend.accuracy_report(zoo.model, converted, zoo.calibration[:4])
    chart = args.docs / f"accuracy_{re.sub(r'[^a-z0-9]+', '_', args.model.lower())}.png"
    report.plot(chart, title=f"{args.model}, {cpu_key()}")
    target = round(1 - (1 - report.output.cosine) * 0.5, 6)  # half the cosine gap closed: what does it take?
    start = time.perf_counter()
    tighter = quantize_x86(zoo.model, zoo.inputs, zoo.calibration, target_cosine=target)
    seconds = time.perf_counter() - start
    lines = [f"- Machine: {machine_description()}",
             f"- Command: `python benchmarks/accuracy_demo.py --model {args.model}`; random-init CNNs have BatchNorm"
             " statistics estimated, MiniLM is the trained checkpoint; batch 1, 8 calibration batches, the report over"
             f" the first 4. Chart (layers in network order; written by `AccuracyReport.plot`): [{chart.name}]({chart.name}).",
             f"- Weights {'7-bit (this CPU has no VNNI)' if cpu_needs_reduce_range() else '8-bit'}; errors are cumulative"
             " along the network (SQNR is not additive: a layer's output can be cleaner than its input)."
             " target_cosine keeps float, one at a time, the layer whose float input helps the output most.", "",
             str(report), "",
             f"`quantize_x86(..., target_cosine={target})` kept {tighter.meta['kept_float'] or 'nothing'} float in"
             f" {seconds:.1f} s: output cosine {tighter.meta['accuracy'].output.cosine:.6f}"
             f" (SQNR {tighter.meta['accuracy'].output.sqnr_db:.1f} dB)."]
    write_section(args.docs / "accuracy_demo.md", "Per-layer accuracy vs fp32", f"{args.model} on {cpu_key()}",
                  "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
