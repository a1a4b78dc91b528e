"""Save -> fresh process -> load -> first output, written to docs/benchmarks_deploy.md: a
torchvision ResNet-50 quantized once with a dynamic batch, saved with ``qbackend.save``, then
loaded by ``qbackend.load`` in new processes (no torchao, no calibration data) and run at
batch 1 and 3; each fresh process's outputs are compared with the saving process's.

    python benchmarks/bench_deploy.py [--runs 3] [--docs docs]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import qbackend
from qbackend.pt2e_flow import quantize_x86

import zoo_models
from common import NUM_THREADS, cpu_key, log, machine_description, write_section

PROJECT_ROOT = Path(__file__).resolve().parents[1]
MODEL = "resnet50"

FRESH_PROCESS = """
import json, sys, time
started = time.perf_counter()
import torch, qbackend
torch.set_num_threads({threads})
imported = time.perf_counter()
loaded = qbackend.load({archive!r})
ready = time.perf_counter()
io = torch.load({io!r})
with torch.no_grad():
    first = loaded(io["inputs"][0])
    done = time.perf_counter()
    dynamo_at_first_output = "torch._dynamo" in sys.modules
    outputs = [first] + [loaded(x) for x in io["inputs"][1:]]
    second = time.perf_counter() - done
print(json.dumps({{"import": imported - started, "load": ready - imported, "first_call": done - ready, "second": second,
                  "identical": all(torch.equal(a, b) for a, b in zip(outputs, io["expected"])),
                  "torchao": "torchao" in sys.modules, "dynamo_at_first_output": dynamo_at_first_output,
                  "lowerings": len(loaded.lowered)}}))
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh processes timed")
    parser.add_argument("--docs", type=Path, default=PROJECT_ROOT / "docs")
    args = parser.parse_args(argv)
    torch.set_num_threads(NUM_THREADS)
    zoo = zoo_models.build(MODEL, 1, 8)
    converted = quantize_x86(zoo.model, zoo.inputs, zoo.calibration, dynamic_batch=True)
    with tempfile.TemporaryDirectory() as scratch:
        archive, io = os.path.join(scratch, "model.pt2"), os.path.join(scratch, "io.pt")
        qbackend.save(converted, archive)
        size_mb = os.path.getsize(archive) / 1e6
        inputs = [zoo.inputs[0], torch.cat([zoo.inputs[0]] * 3)]
        with torch.no_grad():
            compiled = qbackend.compile(converted)  # (one module for both, as in the fresh process: batch 1's
            expected = [compiled(x) for x in inputs]  # lowering, then the symbolic sizes')
        torch.save({"inputs": inputs, "expected": expected}, io)
        runs = []
        for run in range(args.runs):
            out = subprocess.run([sys.executable, "-c", FRESH_PROCESS.format(threads=NUM_THREADS, archive=archive, io=io)],
                                 capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            log(f"fresh process {run + 1}: {runs[-1]}")
    median = {key: statistics.median(r[key] for r in runs) for key in ("import", "load", "first_call", "second")}
    lines = [f"- Machine: {machine_description()}",
             f"- Command: `python benchmarks/bench_deploy.py --runs {args.runs}`; torchvision {MODEL} (random weights,"
             " BatchNorm statistics estimated), `quantize_x86(..., dynamic_batch=True)`, `qbackend.save`; then each"
             " fresh process: `import torch, qbackend`, `qbackend.load`, the first call at batch 1, a call at batch 3.",
             f"- Median of {args.runs} fresh processes. Archive {size_mb:.1f} MB.", "",
             "| step | seconds |", "|---|---|",
             f"| `import torch, qbackend` (before loading; any torch program pays it) | {median['import']:.2f} |",
             f"| `qbackend.load(path)` (reads the archive's records) | {median['load']:.2f} |",
             f"| first call (qbackend lowers for this CPU and batch, then runs) | {median['first_call']:.2f} |",
             f"| **load to first output** | **{median['load'] + median['first_call']:.2f}** |",
             f"| later: the call at batch 3 (the archive's values over symbolic sizes, one lowering for every batch,"
             f" runs) | {median['second']:.2f} |", "",
             f"Outputs identical to the saving process's at both batches in every run: {all(r['identical'] for r in runs)};"
             f" torchao imported: {any(r['torchao'] for r in runs)}; Dynamo imported by the first output:"
             f" {any(r['dynamo_at_first_output'] for r in runs)}; lowerings after two batches (batch 1's, then one for"
             f" every batch): {sorted({r['lowerings'] for r in runs})}."]
    write_section(args.docs / "benchmarks_deploy.md", "Deployment: save, then load in a fresh process", cpu_key(),
                  "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
