"""What OpenVINO's float precision is worth: its int8 models with the float remainder in its
default precision and in float32, beside qbackend.compile, each engine alone in its process.

    python benchmarks/bench_ov_precision.py [--models vit_b_16 ...] [--batches 1 8] [--reps 3] [--reuse]

On CPUs with AMX or AVX512-BF16 OpenVINO's CPU plugin runs what NNCF left float (softmax,
attention's matmuls in the transformer preset, LayerNorm, GELU, residual adds) in bfloat16
unless told otherwise; qbackend runs it in float32, as the converted PT2E module does (its
numerics are the reference's). This times both precisions on bench_zoo's saved models (the
same preparation, ``--reuse`` takes them from bench_zoo's work directory), the processes
alternated as bench_zoo alternates them, and writes docs/benchmarks_ov_precision.md, one
section per CPU.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path
from typing import Optional

import bench_zoo
from common import cpu_key, log, machine_description, wait_for_parallel_speedup, write_section
from zoo_engines import DIRECT, FULL, OV_DEFAULT, OV_TRANSFORMER, PROJECT_ROOT

# (engine, OpenVINO's precision hint: None = its default)
VARIANTS = ((OV_DEFAULT, None), (OV_DEFAULT, "f32"), (OV_TRANSFORMER, None), (OV_TRANSFORMER, "f32"), (DIRECT, None))


def _label(engine: str, precision: Optional[str]) -> str:
    return engine if precision is None else f"{engine}, f32 float ops"


def measure(name: str, batch: int, args) -> dict:
    """{label: [each process's result]} for ``name`` at ``batch``."""
    folder, manifest = bench_zoo.prepared(args.work, name, batch, FULL, args)
    variants = [v for v in VARIANTS if not bench_zoo._why_not(manifest, v[0])]
    runs = {_label(*v): [] for v in variants}
    for rep in range(args.reps):
        for engine, precision in variants[rep % len(variants):] + variants[:rep % len(variants)]:
            wait_for_parallel_speedup(timeout_s=args.probe_wait)
            result = bench_zoo._child(["run", "--engine", engine, "--work", str(folder),
                                       *(["--ov-precision", precision] if precision else [])],
                                      folder / "precision_run.log", bench_zoo.RUN_TIMEOUT_S)
            runs[_label(engine, precision)].append(result)
            log(f"{name} batch {batch} rep {rep + 1}: {_label(engine, precision)}: "
                + (result.get("error") or f"{result['median_ms']:.2f} ms ({result.get('precision', 'float32')})"))
    return runs


def _cell(results: list) -> str:
    times = [r["median_ms"] for r in results if "median_ms" in r]
    if not times:
        return next((r["error"] for r in results if "error" in r), "–")
    return f"{min(times):.2f} ({statistics.median(times):.2f})"


def table(rows: list) -> str:
    labels = [_label(*v) for v in VARIANTS]
    header = ["model", "batch", *(f"{label} ms: best (median)" for label in labels),
              *(f"cos vs fp32: {label}" for label in labels), "OpenVINO's default precision"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, batch, runs in rows:
        def cos(label):
            values = [r["cos_fp32"] for r in runs.get(label, []) if r.get("cos_fp32") is not None]
            return f"{statistics.median(values):.4f}" if values else "–"
        default = next((r["precision"] for r in runs.get(OV_DEFAULT, []) if "precision" in r), "–")
        lines.append("| " + " | ".join([name, str(batch), *(_cell(runs[label]) if label in runs else "n/a" for label in labels),
                                         *(cos(label) for label in labels), default]) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["vit_b_16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "qbackend-bench-zoo")
    parser.add_argument("--reuse", action="store_true", help="reuse bench_zoo's saved models")
    parser.add_argument("--probe-wait", type=float, default=60.0)
    parser.add_argument("--docs", type=Path, default=PROJECT_ROOT / "docs")
    args = parser.parse_args(argv)
    args.quick, args.inductor_recipe = False, False  # (bench_zoo.prepared's other settings: its defaults)
    machine = machine_description()
    rows = [(name, batch, measure(name, batch, args)) for name in args.models for batch in args.batches]
    body = "\n".join([f"- Machine: {machine}", f"- Date: {datetime.date.today().isoformat()}; command: "
                      f"`python benchmarks/bench_ov_precision.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
                      "- Each cell: the best (the median) of an engine's per-process medians, its processes "
                      "alternated with the others' (bench_zoo's solo mode); cos vs fp32: the median over them.",
                      "", table(rows), ""])
    write_section(args.docs / "benchmarks_ov_precision.md", "OpenVINO's float precision: bf16 or float32 beside qbackend",
                  cpu_key(), body)
    print(table(rows))


if __name__ == "__main__":
    main()
