"""The per-layer accuracy table of the bundled demo model, written to docs/accuracy_demo.md:
``qbackend.accuracy_report`` of ResNet-18-like quantized as the demo does, and what
``quantize_x86(target_cosine=...)`` keeps float to reach a tighter output cosine.

    python benchmarks/accuracy_demo.py [--docs docs]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path


import qbackend
from qbackend import models
from qbackend.pt2e_flow import cpu_needs_reduce_range, quantize_x86

from common import cpu_key, machine_description, write_section

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=Path, default=PROJECT_ROOT / "docs")
    args = parser.parse_args(argv)
    name = "resnet18_like"
    model, inputs = models.build_model(name), models.example_inputs(name, 1)
    calibration = models.calibration_batches(name, 1, 8)
    converted = quantize_x86(model, inputs, calibration)
    report = qbackend.accuracy_report(model, converted, calibration[:4])
    target = round(1 - (1 - report.output.cosine) * 0.9, 6)  # a tenth of the cosine gap closed: what does it take?
    start = time.perf_counter()
    tighter = quantize_x86(model, inputs, calibration, target_cosine=target)
    seconds = time.perf_counter() - start
    lines = [f"- Machine: {machine_description()}",
             f"- Command: `python benchmarks/accuracy_demo.py`; model `{name}` (random weights, BatchNorm statistics"
             " estimated), batch 1, 8 calibration batches, the report over the first 4.",
             f"- Weights {'7-bit (this CPU has no VNNI)' if cpu_needs_reduce_range() else '8-bit'}; errors are cumulative"
             " along the network (SQNR is not additive: a layer's output can be cleaner than its input)."
             " target_cosine keeps float, one at a time, the layer whose float input helps the output most.", "",
             str(report), "",
             f"`quantize_x86(..., target_cosine={target})` kept {tighter.meta['kept_float'] or 'nothing'} float in"
             f" {seconds:.1f} s: output cosine {tighter.meta['accuracy'].output.cosine:.6f}"
             f" (SQNR {tighter.meta['accuracy'].output.sqnr_db:.1f} dB)."]
    write_section(args.docs / "accuracy_demo.md", "Per-layer accuracy of the bundled demo model", cpu_key(), "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
