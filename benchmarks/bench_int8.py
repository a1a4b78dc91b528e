"""Compare int8 CPU inference paths in one run.

    python benchmarks/bench_int8.py [--quick] [--out docs/benchmarks.md]

For each (model, batch) config it measures fp32 eager, Inductor fp32,
Inductor int8 (PT2E + freezing), qbackend int8 and the PT2E reference (the
converted module run eagerly): first-call (compile) time, median latency,
latency relative to Inductor int8, and output error vs the reference and
vs fp32. A path that fails (e.g. qbackend while it is still being written)
gets its error in the table instead of stopping the run.
"""

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

PROJECT_ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("qbackend") is None:  # not installed: use this checkout
    sys.path.insert(0, str(PROJECT_ROOT))

import qbackend  # noqa: E402
from qbackend import models, pt2e_flow  # noqa: E402

import ort_peer  # noqa: E402
from common import (NUM_THREADS, Settings, clone_inputs, cosine, fmt, log, machine_description,  # noqa: E402
                    interleaved_samples, max_abs_diff, paired_ratios, short_error)

FULL_CONFIGS = [
    ("resnet18_like", 1),
    ("resnet18_like", 8),
    ("mobilenet_v2_like", 1),
    ("bert_encoder_like", 1),
    ("bert_encoder_like", 8),
]
QUICK_CONFIGS = [("resnet18_like", 1), ("bert_encoder_like", 1)]
DISPLAY_NAMES = {
    "resnet18_like": "ResNet-18-like 224x224",
    "mobilenet_v2_like": "MobileNetV2-like 224x224",
    "bert_encoder_like": "BERT-base-like encoder (4 layers, seq 128)",
}
BASELINE_PATH = "Inductor int8"
ORT_PATH = "ONNX Runtime int8 (static QDQ)"
DIRECT_PATH = "qbackend int8, qbackend.compile (no Dynamo)"
REMAINDER_PATH = "qbackend int8 + Inductor for the float remainder (qbackend.compile, remainder='inductor')"
CNNS = ("resnet18_like", "mobilenet_v2_like")


FULL = Settings(calibration_batches=4, warmup_calls=3, target_seconds=3.0, min_iters=10, max_iters=500)
QUICK = Settings(calibration_batches=2, warmup_calls=2, target_seconds=1.0, min_iters=3, max_iters=100)


@dataclass
class Row:
    model: str
    batch: int
    path: str
    compile_s: Optional[float] = None
    latency_ms: Optional[float] = None
    iters: Optional[int] = None
    max_abs_vs_ref: Optional[float] = None
    cos_vs_ref: Optional[float] = None
    cos_vs_fp32: Optional[float] = None
    paired: Optional[tuple] = None  # qbackend paths: per-round ratio to the best peer (median, quartiles)
    notes: str = ""  # error message, or a warning about the path


# --- the paths being compared: each returns a callable taking *inputs ------


@dataclass
class Case:
    name: str
    model: torch.nn.Module
    converted: torch.nn.Module
    inputs: tuple
    calibration: list
    cache: dict = field(default_factory=dict)  # what a path may build once per case (an ORT session)


def build_fp32_eager(case):
    return case.model


def build_inductor_fp32(case):
    return torch.compile(case.model)


def build_inductor_int8(case):
    # Compiles (first call) inside the freezing patch; see pt2e_flow.
    return pt2e_flow.inductor_int8(case.converted, case.inputs)


def build_qbackend_int8(case):
    # "qbackend" comes from the package's torch_dynamo_backends entry point, so
    # it only resolves once the package is pip-installed (pip install -e .).
    return torch.compile(case.converted, backend="qbackend")


def build_qbackend_direct(case):
    return qbackend.compile(case.converted)  # the same lowering, without Dynamo's re-trace


def build_qbackend_inductor_remainder(case):
    return qbackend.compile(case.converted, {"remainder": "inductor"})  # the float ops around the kernels fused


def build_pt2e_reference(case):
    return case.converted


def build_ort_int8(case):
    if case.name not in CNNS:
        raise NotApplicable("ONNX Runtime is the peer for the CNNs only")
    if "ort" not in case.cache:
        case.cache["ort"] = ort_peer.int8_session(case.model, case.inputs, case.calibration, NUM_THREADS,
                                                  reduce_range=pt2e_flow.cpu_needs_reduce_range())
    return case.cache["ort"]


PATHS = [
    ("fp32 eager", build_fp32_eager),
    ("Inductor fp32", build_inductor_fp32),
    (BASELINE_PATH, build_inductor_int8),
    (ORT_PATH, build_ort_int8),
    ("qbackend int8", build_qbackend_int8),
    (DIRECT_PATH, build_qbackend_direct),
    (REMAINDER_PATH, build_qbackend_inductor_remainder),
    ("PT2E reference (eager)", build_pt2e_reference),
]
PEERS = (BASELINE_PATH, ORT_PATH)  # qbackend's latency target: <= 0.95x the best of these
QBACKEND_PATHS = ("qbackend int8", DIRECT_PATH, REMAINDER_PATH)


class NotApplicable(Exception):
    pass


# --- measurements ----------------------------------------------------------


def measure_first_call(build, case, inputs):
    """Build the runner and call it once; the wall time includes compilation."""
    torch._dynamo.reset()  # no cached graphs from the previous path
    start = time.perf_counter()
    runner = build(case)
    output = runner(*inputs)
    return runner, output, time.perf_counter() - start


def measure_path(row, build, case, reference, fp32_output):
    """Compile time (cold: Dynamo reset first) and accuracy; returns the runner or None."""
    inputs = case.inputs
    try:
        own_inputs = clone_inputs(inputs)
        runner, output, row.compile_s = measure_first_call(build, case, own_inputs)
        if not all(torch.equal(mine, original) for mine, original in zip(own_inputs, inputs)):
            row.notes = "writes into its input tensors"
        row.max_abs_vs_ref = max_abs_diff(output, reference)
        row.cos_vs_ref = cosine(output, reference)
        row.cos_vs_fp32 = cosine(output, fp32_output)
        return runner
    except NotApplicable as why:
        row.notes = str(why)
        return None
    except Exception as exc:  # one broken path must not hide the others
        row.notes = short_error(exc)
        return None


def warm_up_compilers():
    # Pay each compiler's one-time process start-up (Inductor: C++ toolchain and ISA checks;
    # qbackend: importing its modules, as the entry point does on first use) here, so it is
    # not charged to whichever path happens to compile first.
    torch.compile(lambda x: torch.relu(x) + 1)(torch.randn(8))
    torch.compile(lambda x: torch.relu(x) + 1, backend="qbackend")(torch.randn(8))
    tiny = models.example_inputs("tiny_resnet", 1)
    qbackend.compile(pt2e_flow.quantize_x86(models.build_model("tiny_resnet"), tiny, [tiny]))(*tiny)
    torch._dynamo.reset()


def benchmark_config(name, batch, settings):
    model = models.build_model(name)
    inputs = models.example_inputs(name, batch)
    calibration = models.calibration_batches(name, batch, settings.calibration_batches)
    converted = pt2e_flow.quantize_x86(model, inputs, calibration)
    case = Case(name, model, converted, inputs, calibration)
    reference = converted(*clone_inputs(inputs))
    fp32_output = model(*clone_inputs(inputs))
    rows, builds = [], {}
    for path, build in PATHS:
        log(f"{name} batch {batch}: compile {path}")
        row = Row(DISPLAY_NAMES[name], batch, path)
        rows.append(row)
        if measure_path(row, build, case, reference, fp32_output) is not None:
            builds[path] = build
    # Latency: every path compiled again side by side (a Dynamo reset above would have dropped
    # the earlier ones), then timed in interleaved rounds.
    torch._dynamo.reset()
    runners = {path: build(case) for path, build in builds.items()}
    for runner in runners.values():
        runner(*clone_inputs(inputs))
    # The int8 contenders in rounds of their own (more of them in the same time; the slow
    # float paths would flush their caches between calls), then the rest.
    contenders = {path: runner for path, runner in runners.items() if path in PEERS + QBACKEND_PATHS}
    others = {path: runner for path, runner in runners.items() if path not in contenders}
    log(f"{name} batch {batch}: timing {len(contenders)} int8 paths interleaved, then {len(others)} others")
    samples = interleaved_samples(contenders, inputs, settings)
    samples.update(interleaved_samples(others, inputs, dataclasses.replace(settings, target_seconds=settings.target_seconds / 3)))
    peers = [p for p in PEERS if p in samples]
    best_peer = min(peers, key=lambda p: statistics.median(samples[p])) if peers else None
    for row in rows:
        if row.path in samples:
            row.latency_ms, row.iters = statistics.median(samples[row.path]) * 1e3, len(samples[row.path])
        if row.path in QBACKEND_PATHS and row.path in samples and best_peer:
            row.paired = paired_ratios(samples[row.path], samples[best_peer])
    torch._dynamo.reset()
    return rows


# --- reporting -------------------------------------------------------------


def markdown_table(rows):
    header = ("| Model | Batch | Path | First call / compile (s) | Median latency (ms) "
              "| vs Inductor int8 | vs best peer | paired vs best peer: median [quartiles] "
              "| max abs diff vs ref | cos vs ref | cos vs fp32 | timed calls | Notes |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    baselines = {(r.model, r.batch): r.latency_ms for r in rows if r.path == BASELINE_PATH}
    best_peer = {}
    for r in rows:
        if r.path in PEERS and r.latency_ms:
            key = (r.model, r.batch)
            best_peer[key] = min(best_peer.get(key, r.latency_ms), r.latency_ms)
    for r in rows:
        baseline, peer = baselines.get((r.model, r.batch)), best_peer.get((r.model, r.batch))
        ratio = r.latency_ms / baseline if r.latency_ms and baseline else None
        peer_ratio = r.latency_ms / peer if r.latency_ms and peer else None
        notes = r.notes.replace("|", "\\|")
        lines.append(
            f"| {r.model} | {r.batch} | {r.path} | {fmt(r.compile_s, '.1f')} "
            f"| {fmt(r.latency_ms, '.2f')} | {fmt(ratio, '.2f')} | {fmt(peer_ratio, '.2f')} "
            f"| {'%.2f [%.2f-%.2f]' % r.paired if r.paired else ''} "
            f"| {fmt(r.max_abs_vs_ref, '.3g')} | {fmt(r.cos_vs_ref, '.6f')} "
            f"| {fmt(r.cos_vs_fp32, '.6f')} | {fmt(r.iters, 'd')} | {notes} |"
        )
    return "\n".join(lines)


def report(rows, quick, machine):
    mode = "quick (smoke test)" if quick else "full"
    return "\n".join([
        "# int8 CPU benchmarks",
        "",
        f"- Machine: {machine}",
        f"- Date: {datetime.date.today().isoformat()}",
        f"- int8 weights: {'7-bit (this CPU has no VNNI: its int8 kernels overflow 8-bit x 8-bit products; ONNX Runtime with its own reduce_range, also 7-bit weights)' if pt2e_flow.cpu_needs_reduce_range() else '8-bit'}, chosen by `quantize_x86`, the same model for every PT2E path",
        f"- Mode: {mode}; command: `python benchmarks/bench_int8.py{' --quick' if quick else ''}`",
        "- ref = PT2E converted module run eagerly; latency ratio is relative to Inductor int8"
        " (PT2E + freezing); first call of the eager paths is just their first run.",
        "- Compile times are cold (fresh, empty Inductor cache directory, Dynamo reset), measured after"
        " one throwaway compile per compiler that absorbs its one-time process start-up.",
        "- `qbackend.compile` hands the converted module's graph to the same backend without Dynamo's"
        " re-trace (Dynamo is most of `torch.compile`'s time here); its lowered graph and outputs are"
        " the torch.compile path's.",
        "- `remainder='inductor'`: the same lowered graph, whose float ops (LayerNorm, softmax, GELU,"
        " boundary q/dq) Inductor compiles around the oneDNN calls; opt-in, it needs Inductor's compile"
        " time and a C++ compiler.",
        "- Latencies: all paths compiled side by side, then timed in interleaved rounds (median), so"
        " drifting load on this shared machine hits every path alike: first the int8 paths (the peers"
        " and qbackend's) in rounds of their own, then the float and reference paths. The paired"
        " column: each round's qbackend / best-peer ratio (the peer with the lower median), its median"
        " and quartiles over the rounds: a round's ratio cancels the load both calls saw.",
        "",
        markdown_table(rows),
        "",
    ])


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="ResNet and encoder at batch 1 only, fewer iterations")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "docs" / "benchmarks.md",
                        help="markdown file to write (default: docs/benchmarks.md)")
    return parser.parse_args()


def main():
    args = parse_args()
    torch.set_num_threads(NUM_THREADS)
    configs, settings = (QUICK_CONFIGS, QUICK) if args.quick else (FULL_CONFIGS, FULL)
    machine = machine_description()  # before the run, so the load average is other work
    rows = []
    # A fresh Inductor cache so compile times do not depend on earlier runs.
    with tempfile.TemporaryDirectory(prefix="bench_int8_inductor_") as cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        with torch.no_grad():
            warm_up_compilers()
            for name, batch in configs:
                rows += benchmark_config(name, batch, settings)
                gc.collect()
    text = report(rows, args.quick, machine)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
