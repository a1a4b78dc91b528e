"""The main job on a bundled model: quantize a ResNet-18-shaped CNN with PT2E, compile it
with qbackend, and show what was lowered, the accuracy vs fp32 and the latency vs fp32
eager and vs Inductor int8.

    python -m qbackend.demo [--batch 1] [--no-inductor]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import qbackend
from qbackend import models
from qbackend.pt2e_flow import cpu_needs_reduce_range, inductor_int8, quantize_x86


def median_ms(fn, inputs, iters=30) -> float:
    with torch.no_grad():
        for _ in range(3):
            fn(*inputs)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn(*inputs)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def compiled_row(name, build, inputs) -> tuple[str, float, float]:
    """(name, median ms, seconds to build and make the first call, which compiles)."""
    start = time.perf_counter()
    with torch.no_grad():
        runner = build()
        runner(*inputs)
    return name, median_ms(runner, inputs), time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--no-inductor", action="store_true", help="skip the paths that need Inductor (a C++ compiler, ~10 s)")
    args = parser.parse_args(argv)

    model = models.resnet18_like().eval()
    inputs = models.example_inputs("resnet18_like", args.batch)
    print("1. PT2E: export (strict=True), prepare with X86InductorQuantizer, calibrate, convert")
    if cpu_needs_reduce_range():
        print("   this CPU has no VNNI: its int8 kernels add product pairs in int16, so each weight channel's scale keeps "
              "its pairs within 128 (reduce_range='pairs')")
    converted = quantize_x86(model, inputs, models.calibration_batches("resnet18_like", args.batch, 4))

    print("2. torch.compile(converted, backend='qbackend')")
    torch._dynamo.reset()
    start = time.perf_counter()
    reports = []  # the same report qbackend.explain returns, from this one compile
    with torch.no_grad():
        compiled = torch.compile(converted, backend="qbackend", options={"report_sink": reports.append})
        out = compiled(*inputs)
    compile_s = time.perf_counter() - start
    print("\n".join(str(report) for report in reports))

    with torch.no_grad():
        fp32 = model(*inputs)
        reference = converted(*inputs)
    cos = lambda a, b: torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()  # noqa: E731
    print(f"\n3. accuracy: cosine vs fp32 {cos(out, fp32):.6f}, vs PT2E reference {cos(out, reference):.6f}, "
          f"top-1 agreement with fp32 {(out.argmax(-1) == fp32.argmax(-1)).float().mean().item():.2f}")
    layers = qbackend.accuracy_report(model, converted, models.calibration_batches("resnet18_like", args.batch, 2))
    print("   the 5 layers furthest from fp32 (qbackend.accuracy_report; errors accumulate along the net):")
    print("\n".join(f"     {e.path:<28} SQNR {e.sqnr_db:5.1f} dB  cosine {e.cosine:.5f}" for e in layers.layers[:5]))

    rows = [("fp32 eager", median_ms(model, inputs), 0.0), ("qbackend int8", median_ms(compiled, inputs), compile_s)]
    # the same lowering without Dynamo's re-trace
    rows.append(compiled_row("qbackend.compile int8", lambda: qbackend.compile(converted), inputs))
    if not args.no_inductor:
        # Inductor fuses the float ops between qbackend's kernels
        rows.append(compiled_row("qbackend + Inductor remainder",
                                 lambda: qbackend.compile(converted, {"remainder": "inductor"}), inputs))
        torch._dynamo.reset()
        rows.append(compiled_row("Inductor int8 (freezing)", lambda: inductor_int8(converted, inputs), inputs))
    print(f"\n4. latency, batch {args.batch}, {torch.get_num_threads()} threads (median; the first compile"
          " also pays qbackend's one-time start-up):")
    for name, ms, compile_time in rows:
        print(f"   {name:<30} {ms:8.2f} ms   compile {compile_time:5.1f} s")


if __name__ == "__main__":
    main()
