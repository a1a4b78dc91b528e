"""The engines of bench_zoo, each run as its users run it: a preparation process saves every
engine's model once per model and batch; then each engine runs alone in a fresh process that
loads only its own saved model, builds it, warms it up and times calls back to back.

    python benchmarks/zoo_engines.py prepare --model resnet50 --batch 1 --work DIR --out FILE [--quick]
    python benchmarks/zoo_engines.py run --engine "OpenVINO int8" --work DIR --out FILE [--quick] [--profile]
    python benchmarks/zoo_engines.py interleaved --work DIR --out FILE [--quick] --engines E [E ...]

bench_zoo.py starts these processes. The work directory of a model and batch holds:

- ``data.npz``: the evaluation inputs (the timed batch first), the fp32 model's outputs on them
  and each converted module's (run eagerly);
- ``converted.pt2``: the module ``qbackend.pt2e_flow.quantize_x86`` converts, through
  ``torch.export.save``; both qbackend paths load it and mark it static as ``quantize_x86``
  returns it;
- ``inductor.pt2``: X86InductorQuantizer's own recipe (``prepare_pt2e`` / ``convert_pt2e``
  with its default config, no qbackend step), which Inductor int8 loads, as its users run it;
- ``ov_default.xml`` / ``ov_transformer.xml``: NNCF's int8 model with ``nncf.quantize``'s
  defaults / with ``model_type=nncf.ModelType.TRANSFORMER`` (transformers only);
- ``ort_int8.onnx``: ONNX Runtime's static QDQ int8 model (CNNs only);
- ``manifest.json``: what was built and in how many seconds, what was skipped or failed and why.

A ``run`` process writes one JSON object to ``--out``: ``compile_s`` (building the loaded model
and its first call, qbackend's kernel choices measured afresh; ``compile_cold``: Inductor's
cache directory was empty, as it is unless ``--inductor-cache`` names a used one; for the
torch.compile paths also ``dynamo_alone_s``: Dynamo's trace of a fresh copy with
``backend="eager"``, after the compile), ``median_ms`` of the timed calls,
``cos_fp32`` (mean over the evaluation batches) and ``cos_ref`` (PT2E paths: vs the converted
module the engine loads, run eagerly), or ``error``. The OpenVINO and ONNX Runtime processes never import torch.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import re
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

PROJECT_ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("qbackend") is None:  # not installed: use this checkout
    sys.path.insert(0, str(PROJECT_ROOT))

THREADS = 2  # every engine's threads, as its users on a 2-core machine would set them


@dataclass(frozen=True)
class Timing:
    calibration_batches: int
    warmup_calls: int  # untimed calls before the timed ones: at least this many ...
    warmup_s: float  # ... and for at least this long
    target_s: float  # timed calls: as many as fit this budget (from the warm-up's pace) ...
    min_calls: int  # ... within [min_calls, max_calls]
    max_calls: int


FULL = Timing(calibration_batches=4, warmup_calls=3, warmup_s=1.0, target_s=2.0, min_calls=20, max_calls=300)
QUICK = Timing(calibration_batches=2, warmup_calls=2, warmup_s=0.2, target_s=0.3, min_calls=5, max_calls=20)

INDUCTOR, TORCH_COMPILE, DIRECT = "Inductor int8", "qbackend (torch.compile)", "qbackend.compile"
ORT, OV_DEFAULT, OV_TRANSFORMER = "ONNX Runtime int8", "OpenVINO int8", "OpenVINO int8 (transformer preset)"
CONVERTED, INDUCTOR_MODEL, ORT_MODEL, OV_DEFAULT_MODEL, OV_TRANSFORMER_MODEL = (
    "converted.pt2", "inductor.pt2", "ort_int8.onnx", "ov_default.xml", "ov_transformer.xml")
REFERENCES = {CONVERTED: "ref", INDUCTOR_MODEL: "ref_inductor"}  # (data.npz: each converted module's outputs, run eagerly)


@dataclass(frozen=True)
class Engine:
    artifact: str  # the file of the work directory it loads
    load: Callable[[Path], object]  # untimed: the saved model read back
    # timed with the first call: what its users do to run the loaded model (loaded, example
    # inputs, alone: no other engine in the process)
    build: Callable[[object, tuple, bool], Callable]
    uses_torch: bool = True  # takes torch tensors; else numpy arrays, and its process never imports torch
    dynamo: bool = False  # a torch.compile path: Dynamo's trace alone (backend="eager") is timed too


def _exported(path: Path):
    import torch
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the q / dq ops the archive calls)

    return torch.export.load(path).module()


def _converted(path: Path):
    """The module quantize_x86 returns, as saved: marked for Dynamo (mark_static, as quantize_x86
    does) and without the input checks torch.export.load's module runs before each call in
    Python (convert_pt2e's module has none; through torch.compile they cost mobilenet_v2_like
    130-180 us a call, cold)."""
    from qbackend.pipeline.static_module import mark_static

    module = _exported(path)
    module._forward_pre_hooks.clear()
    module._forward_hooks.clear()
    return mark_static(module)


def _inductor(module, inputs, alone):
    from qbackend import pt2e_flow

    return pt2e_flow.inductor_int8(module, inputs)


# qbackend's reports of the process's compile: which layers its measured kernel choice gave
# oneDNN (each one splits a kernel chain), which differ from process to process on a noisy VM
REPORTS: list = []


def _torch_compile(module, inputs, alone):
    import torch

    return torch.compile(module, backend="qbackend", options={"report_sink": REPORTS.append})


def _direct(module, inputs, alone):
    import qbackend

    return qbackend.compile(module, {"report_sink": REPORTS.append})


def lowering_summary(reports: list) -> dict:
    """{"onednn": the layers (sources) oneDNN runs, "chains": own-kernel chains} of ``reports``."""
    onednn = [d.source or d.node for r in reports for d in r.lowered if (d.op or "").startswith("onednn::")]
    return {"onednn": onednn, "chains": sum(r.chains for r in reports)}


def _read_openvino(path: Path):
    import openvino as ov

    return ov.Core().read_model(path)


OV_PRECISION = None  # the float remainder's precision OpenVINO runs (``--ov-precision``), else its default


def _openvino(model, inputs, alone):
    import ov_peer

    return ov_peer.runner(model, THREADS, OV_PRECISION)


def _ort(path, inputs, alone):
    import ort_peer

    return ort_peer.runner(path, THREADS, spinning=alone)  # (ORT's default spinning only where it runs alone)


# the order of the tables' columns; a process of each kind runs alone
ENGINES: dict[str, Engine] = {
    INDUCTOR: Engine(INDUCTOR_MODEL, _exported, _inductor, dynamo=True),
    TORCH_COMPILE: Engine(CONVERTED, _converted, _torch_compile, dynamo=True),
    DIRECT: Engine(CONVERTED, _converted, _direct),
    ORT: Engine(ORT_MODEL, Path, _ort, uses_torch=False),
    OV_DEFAULT: Engine(OV_DEFAULT_MODEL, _read_openvino, _openvino, uses_torch=False),
    OV_TRANSFORMER: Engine(OV_TRANSFORMER_MODEL, _read_openvino, _openvino, uses_torch=False),
}


# --- preparation: once per model and batch ---------------------------------------------------


def _save_converted(zoo, path: Path, every_linear: bool, evaluation: list, arrays: dict) -> None:
    from qbackend import pt2e_flow

    _save_exported(pt2e_flow.quantize_x86(zoo.model, zoo.inputs, zoo.calibration, every_linear=every_linear),
                   zoo, path, evaluation, arrays, REFERENCES[CONVERTED])


def inductor_recipe(zoo):
    """X86InductorQuantizer's recipe as Inductor's users run it: the model exported (strict:
    torch 2.13's default non-strict export fails the quantizer on resnet50, "Input partition has
    more than one output node"), prepared with the quantizer's default config, calibrated on the
    zoo's batches, converted."""
    import torch
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = xiq.X86InductorQuantizer().set_global(xiq.get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(torch.export.export(zoo.model, tuple(zoo.inputs), strict=True).module(), quantizer)
    with torch.no_grad():
        for batch in zoo.calibration:
            prepared(*batch)
    return convert_pt2e(prepared)


def _save_exported(converted, zoo, path: Path, evaluation: list, arrays: dict, reference: str) -> None:
    """``converted``'s outputs on the evaluation batches (``{reference}_{j}``), and the module
    itself through ``torch.export.save``."""
    import torch

    with torch.no_grad():
        for j, inputs in enumerate(evaluation):
            arrays[f"{reference}_{j}"] = converted(*(t.clone() for t in inputs)).numpy()
    torch.export.save(torch.export.export(converted, tuple(t.clone() for t in zoo.inputs), strict=False), path)


def _save_openvino(zoo, path: Path, transformer: bool) -> None:
    import ov_peer

    ov_peer.save(ov_peer.quantize(zoo.model, zoo.inputs, zoo.calibration, transformer), path)


def _save_ort(zoo, path: Path) -> None:
    import ort_peer

    from qbackend import pt2e_flow

    ort_peer.quantize(zoo.model, zoo.inputs, zoo.calibration, path, reduce_range=pt2e_flow.cpu_needs_reduce_range())


def _build_qbackend_kernels() -> None:
    """qbackend's C kernels built (or found in its cache) here, so that no timed process pays
    for their build: as after qbackend's first use on a machine."""
    import torch

    import qbackend
    from qbackend import pt2e_flow

    tiny = (torch.randn(1, 3, 16, 16),)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()
    qbackend.compile(pt2e_flow.quantize_x86(model, tiny, [tiny]))(*tiny)


def prepare(name: str, batch: int, timing: Timing, work: Path, every_linear: bool) -> dict:
    """Build the float model (fixed seeds), its calibration and evaluation batches, and save
    every engine's model into ``work``; the manifest (also ``work/manifest.json``)."""
    import torch

    import zoo_models

    torch.set_num_threads(THREADS)
    work.mkdir(parents=True, exist_ok=True)  # (bench_zoo makes it; a direct call may name a new one)
    seconds, built, skipped, failed = {}, {}, {}, {}
    start = time.perf_counter()
    _build_qbackend_kernels()
    zoo = zoo_models.build(name, batch, timing.calibration_batches)
    evaluation = [zoo.inputs] + zoo.evaluation
    arrays = {f"input_{j}_{i}": t.numpy() for j, inputs in enumerate(evaluation) for i, t in enumerate(inputs)}
    with torch.no_grad():
        arrays.update({f"fp32_{j}": zoo.model(*(t.clone() for t in inputs)).numpy() for j, inputs in enumerate(evaluation)})
    seconds["float model"] = time.perf_counter() - start
    transformer = name in zoo_models.TRANSFORMERS
    steps = {  # artifact -> (why it is not made, or None; how it is made)
        CONVERTED: (None, lambda path: _save_converted(zoo, path, every_linear, evaluation, arrays)),
        INDUCTOR_MODEL: (None, lambda path: _save_exported(inductor_recipe(zoo), zoo, path, evaluation, arrays,
                                                           REFERENCES[INDUCTOR_MODEL])),
        ORT_MODEL: (None if zoo.is_cnn else "CNNs only (TorchScript export)", lambda path: _save_ort(zoo, path)),
        OV_DEFAULT_MODEL: (None, lambda path: _save_openvino(zoo, path, transformer=False)),
        OV_TRANSFORMER_MODEL: (None if transformer else "not a transformer",
                               lambda path: _save_openvino(zoo, path, transformer=True)),
    }
    for artifact, (why_not, make) in steps.items():
        if why_not:
            skipped[artifact] = why_not
            continue
        start = time.perf_counter()
        try:
            make(work / artifact)
            built[artifact] = seconds[artifact] = time.perf_counter() - start
        except Exception as error:  # one broken engine must not hide the others
            failed[artifact] = _short_error(error)
    np.savez(work / "data.npz", **arrays)
    manifest = {"model": name, "batch": batch, "inputs": len(zoo.inputs), "evaluation": len(evaluation),
                "built": built, "skipped": skipped, "failed": failed, "seconds": seconds}
    (work / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


# --- a timed process ----------------------------------------------------------------------------


def _conversions(uses_torch: bool) -> tuple:
    """(numpy arrays -> the engine's inputs, inputs -> the ones a call gets, output -> numpy).
    torch paths get fresh copies: Inductor's compiled code can write into its inputs."""
    if not uses_torch:
        return tuple, (lambda inputs: inputs), np.asarray
    import torch

    return (lambda arrays: tuple(torch.from_numpy(a) for a in arrays), lambda inputs: tuple(t.clone() for t in inputs),
            lambda output: output.detach().numpy())


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _short_error(error: Exception) -> str:
    from common import short_error  # (imports torch: only once something failed)

    return short_error(error)


def _timed_calls(runner, inputs, fresh, timing: Timing) -> tuple[list, float]:
    """(seconds per call of calls back to back, after untimed ones (``warmup_calls`` and
    ``warmup_s`` at least): the steady state of a loop over the model; the process's minor page
    faults a timed call, inside the call only (not the input's fresh copy before it): memory an
    engine's calls allocate afresh and Linux maps in again, each page zeroed)."""
    def call() -> tuple[float, int]:
        args = fresh(inputs)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        runner(*args)
        elapsed = time.perf_counter() - start
        return elapsed, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    warm, spent = 0, 0.0
    while warm < timing.warmup_calls or spent < timing.warmup_s:
        spent, warm = spent + call()[0], warm + 1
    calls = max(timing.min_calls, min(timing.max_calls, round(timing.target_s * warm / spent)))
    times, faults = zip(*(call() for _ in range(calls)))
    return list(times), sum(faults) / calls


def _set_up_torch(scratch: Path) -> None:
    """Threads and grad mode as an inference user sets them, the libraries a user of the PT2E
    flow has imported (torchao's registers Inductor's int8 fusions) and qbackend's kernel
    choices measured afresh (Inductor's caches are empty: ``main``)."""
    import torch
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer  # noqa: F401

    from qbackend.kernels import choice_cache

    torch.set_num_threads(THREADS)
    torch.set_grad_enabled(False)
    (scratch / "choices").mkdir()
    choice_cache._shared = choice_cache.ChoiceCache(scratch / "choices")  # every layer's kernels timed afresh


def _warm_up_dynamo() -> None:
    """Dynamo's one-time start in a process, paid on a tiny function: neither the timed compile
    nor Dynamo's trace alone after it carries it."""
    import torch

    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    torch._dynamo.reset()


def _dynamo_alone(module, inputs) -> float:
    import torch

    torch._dynamo.reset()
    start = time.perf_counter()
    torch.compile(module, backend="eager")(*inputs)
    return time.perf_counter() - start


def _evaluation(work: Path, to_engine) -> tuple[np.lib.npyio.NpzFile, list]:
    data, manifest = np.load(work / "data.npz"), json.loads((work / "manifest.json").read_text())
    return data, [to_engine(tuple(data[f"input_{j}_{i}"] for i in range(manifest["inputs"])))
                  for j in range(manifest["evaluation"])]


def _accuracy(runner, evaluation: list, fresh, to_numpy, data, reference: Optional[str]) -> dict:
    outputs = [to_numpy(runner(*fresh(inputs))) for inputs in evaluation]
    found = {"cos_fp32": statistics.mean(cosine(o, data[f"fp32_{j}"]) for j, o in enumerate(outputs))}
    if reference is not None:
        found["cos_ref"] = statistics.mean(cosine(o, data[f"{reference}_{j}"]) for j, o in enumerate(outputs))
    return found


def _run(name: str, work: Path, timing: Timing, profile: bool, scratch: Path) -> dict:
    engine = ENGINES[name]
    to_engine, fresh, to_numpy = _conversions(engine.uses_torch)
    data, evaluation = _evaluation(work, to_engine)
    if engine.uses_torch:
        _set_up_torch(scratch)
    loaded = engine.load(work / engine.artifact)
    spare = copy.deepcopy(loaded) if engine.dynamo else None
    if engine.dynamo:
        _warm_up_dynamo()
    start = time.perf_counter()
    runner = engine.build(loaded, fresh(evaluation[0]), True)
    runner(*fresh(evaluation[0]))
    result = {"compile_s": time.perf_counter() - start}
    if hasattr(runner, "precision"):
        result["precision"] = runner.precision
    if REPORTS:
        result["lowering"] = lowering_summary(REPORTS)
    result.update(_accuracy(runner, evaluation, fresh, to_numpy, data, REFERENCES.get(engine.artifact)))
    times, faults = _timed_calls(runner, evaluation[0], fresh, timing)
    result.update(median_ms=statistics.median(times) * 1e3, calls=len(times), faults_per_call=faults)
    if profile:
        result["profile"] = _profile(runner, evaluation[0], fresh, qbackend_frames=name in (TORCH_COMPILE, DIRECT))
    if engine.dynamo:
        result["dynamo_alone_s"] = _dynamo_alone(spare, fresh(evaluation[0]))
    return result


def run(name: str, work: Path, timing: Timing, profile: bool, scratch: Path) -> dict:
    try:
        return {"engine": name, **_run(name, work, timing, profile, scratch)}
    except Exception as error:
        return {"engine": name, "error": _short_error(error)}


# --- every engine in one process (bench_zoo --in-process) --------------------------------------

SETTLE_S = 0.012  # untimed calls of an engine before its timed one: see common.interleaved_samples


def interleaved(names: list, work: Path, timing: Timing, scratch: Path) -> dict:
    """{engine: result}: every engine built in this one process, then timed in interleaved
    rounds (``common.interleaved_samples``): ``in_process_ms``."""
    import torch

    from common import Settings, interleaved_samples

    to_torch, fresh, to_numpy = _conversions(True)
    data, evaluation = _evaluation(work, to_torch)
    results, runners = {}, {}
    _set_up_torch(scratch)
    for name in names:
        engine = ENGINES[name]
        try:
            start = time.perf_counter()
            runner = engine.build(engine.load(work / engine.artifact), fresh(evaluation[0]), False)
            if not engine.uses_torch:  # (torch tensors in and out, as the timing loop passes them)
                runner = (lambda run: lambda *ts: torch.from_numpy(run(*(t.numpy() for t in ts))))(runner)
            runner(*fresh(evaluation[0]))
            results[name] = {"compile_s": time.perf_counter() - start}
            results[name].update(_accuracy(runner, evaluation, fresh, to_numpy, data, REFERENCES.get(engine.artifact)))
            runners[name] = runner
        except Exception as error:
            results[name] = {"error": _short_error(error)}
    settings = Settings(timing.calibration_batches, timing.warmup_calls, timing.target_s, timing.min_calls, timing.max_calls)
    for name, times in interleaved_samples(runners, evaluation[0], settings, settle_s=SETTLE_S).items():
        results[name]["in_process_ms"] = statistics.median(times) * 1e3
    return results


# --- where the time goes (bench_zoo --profile) -------------------------------------------------

PROFILED_CALLS = 10
# a Python frame as torch.profiler's Python tracer names it: "<file>(<line>): <function>"
PYTHON_FRAME = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\): (?P<function>\S+)$")


def _profiled_op(key: str, qbackend_frames: bool, qbackend_dir: str) -> Optional[str]:
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
    if frame["file"].startswith(qbackend_dir):
        return f"qbackend {Path(frame['file']).stem}.{frame['function']}"
    return None


def _profile(runner, inputs, fresh, qbackend_frames: bool) -> tuple:
    """(wall ms per call, [(op, self ms per call, calls per call)]): OpenVINO's own counters,
    or torch.profiler's ATen / oneDNN ops and for qbackend's paths its own kernels
    (``_profiled_op``); the rest of the wall time is the frameworks' Python and wrappers."""
    if hasattr(runner, "openvino_profile"):  # (nothing of it runs in torch's profiler)
        return runner.openvino_profile(inputs, PROFILED_CALLS)
    import collections

    from torch.profiler import ProfilerActivity, profile

    import qbackend

    qbackend_dir = str(Path(qbackend.__file__).parent)
    with profile(activities=[ProfilerActivity.CPU], with_stack=qbackend_frames) as prof:
        start = time.perf_counter()
        for _ in range(PROFILED_CALLS):
            runner(*fresh(inputs))
        wall = (time.perf_counter() - start) * 1e3 / PROFILED_CALLS
    totals, calls = collections.Counter(), collections.Counter()
    for event in prof.key_averages():
        op = _profiled_op(event.key, qbackend_frames, qbackend_dir)
        if op is not None and event.self_cpu_time_total > 0:
            totals[op] += event.self_cpu_time_total / 1e3 / PROFILED_CALLS
            calls[op] += event.count / PROFILED_CALLS
    return wall, sorted(((op, ms, calls[op]) for op, ms in totals.items()), key=lambda op: -op[1])


# --- command line ------------------------------------------------------------------------------


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("prepare", "run", "interleaved"))
    parser.add_argument("--work", type=Path, required=True, help="the model and batch's work directory")
    parser.add_argument("--out", type=Path, required=True, help="where the JSON result goes")
    parser.add_argument("--quick", action="store_true", help="fewer calibration batches and timed calls")
    parser.add_argument("--model", help="prepare: the zoo model")
    parser.add_argument("--batch", type=int, help="prepare: the batch size")
    parser.add_argument("--inductor-recipe", action="store_true", help="prepare: quantize_x86(every_linear=False)")
    parser.add_argument("--engine", choices=ENGINES, help="run: the engine")
    parser.add_argument("--profile", action="store_true", help="run: also where the time goes")
    parser.add_argument("--ov-precision", choices=("f32", "bf16", "f16"),
                        help="run: OpenVINO's float precision (its INFERENCE_PRECISION_HINT; default: its own choice)")
    parser.add_argument("--inductor-cache", type=Path,
                        help="run: Inductor's cache directory, kept between processes (default: a fresh one)")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, help="interleaved: the engines")
    args = parser.parse_args(argv)
    global OV_PRECISION
    OV_PRECISION = args.ov_precision
    timing = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="bench_zoo_") as scratch:
        # cold unless told: Inductor's caches (FX graph, C++ code) start empty
        inductor_cache = args.inductor_cache or Path(scratch) / "inductor"
        cold = not (inductor_cache.is_dir() and any(inductor_cache.iterdir()))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache)
        if args.command == "prepare":
            result = prepare(args.model, args.batch, timing, args.work, not args.inductor_recipe)
        elif args.command == "run":
            result = {**run(args.engine, args.work, timing, args.profile, Path(scratch)), "compile_cold": cold}
        else:
            result = interleaved(args.engines, args.work, timing, Path(scratch))
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
