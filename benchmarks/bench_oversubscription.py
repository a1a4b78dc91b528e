"""Kernels under CPU oversubscription: one process, then two at once, each with the machine's
thread count, then two with one thread each.

    python benchmarks/bench_oversubscription.py [--seconds 6] [--out docs/benchmarks_weight_only.md]

Each worker times, interleaved, qbackend's int4 weight-only kernel (a 4096x4096 layer, one
token) and torch's dense fp32 and bf16 linears of the same shape, and prints its medians. A
fork-join kernel whose thread is descheduled waits at its barrier, so with more busy threads
than cores every parallel call can stall for a scheduler slice: this measures by how much,
for qbackend's kernel and torch's alike.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import NUM_THREADS, cpu_key, log, machine_description, write_section  # noqa: E402

SIZE, GROUP = 4096, 128


def worker(seconds: float) -> dict:
    from qbackend.kernels import registry
    from qbackend.weight_only.weight_quant import quantize

    torch.manual_seed(0)
    dense = torch.randn(SIZE, SIZE)
    weight = quantize(dense, 4, GROUP)
    scale = weight.scale.float().contiguous()
    args = (weight.nibble_storage(), scale, (weight.float_offset() - 8 * scale).contiguous(), GROUP)
    x, dense_bf16 = torch.randn(1, SIZE), dense.bfloat16()
    kernels = {
        "qbackend int4": lambda: registry.op("int4_mm_int16")(x, *args),
        "torch fp32 linear": lambda: torch.nn.functional.linear(x, dense),
        "torch bf16 linear": lambda: torch.nn.functional.linear(x.bfloat16(), dense_bf16),
    }
    samples = {name: [] for name in kernels}
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for name, kernel in kernels.items():
            start = time.perf_counter()
            kernel()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times[len(times) // 10:]) * 1e3 for name, times in samples.items()}


def run(processes: int, threads: int, seconds: float) -> list:
    command = [sys.executable, __file__, "--worker", "--seconds", str(seconds)]
    workers = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
               for _ in range(processes)]
    return [json.loads(w.communicate()[0].strip().splitlines()[-1]) for w in workers]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "benchmarks_weight_only.md"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.seconds)))
        return
    rows = []
    for processes, threads in ((1, NUM_THREADS), (2, NUM_THREADS), (2, 1)):
        log(f"{processes} process(es), {threads} thread(s) each")
        results = run(processes, threads, args.seconds)
        for name in results[0]:
            rows.append(f"| {processes} x {threads} threads | {name} | "
                        + " / ".join(f"{r[name]:.3f}" for r in results) + " |")
    body = "\n".join([
        f"- Machine: {machine_description()}",
        f"- A {SIZE}x{SIZE} layer, one token; median ms per call in each process (interleaved, {args.seconds:.0f} s).",
        "",
        "| processes x threads | kernel | ms per call (each process) |",
        "|---|---|---|",
        *rows,
    ])
    print(body)
    write_section(Path(args.out), "Weight-only int4 / int8 benchmarks", f"Oversubscription: {cpu_key()}", body)


if __name__ == "__main__":
    main()
