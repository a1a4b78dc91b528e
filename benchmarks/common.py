"""What every benchmark script shares: interleaved timing, accuracy measures, the machine line."""

import importlib.metadata
import os
import resource
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

NUM_THREADS = 2


@dataclass
class Settings:
    calibration_batches: int
    warmup_calls: int
    target_seconds: float  # timed-loop budget per path; sets the iteration count
    min_iters: int
    max_iters: int


def clone_inputs(inputs):
    return tuple(t.clone() for t in inputs)


def time_one_call(runner, inputs):
    fresh_inputs = clone_inputs(inputs)  # some paths write into their inputs
    start = time.perf_counter()
    runner(*fresh_inputs)
    return time.perf_counter() - start


def interleaved_samples(runners, inputs, settings, settle_s: float = 0.0):
    """Seconds per call of every runner, timed in alternating rounds so that drifting load on a
    shared machine hits all paths alike: {path: [one sample per round]} (index i: round i).
    ``settle_s``: before each timed call, untimed calls of the same runner for at least that
    long, so that the timed one runs back to back with its own kind (the steady state of a
    loop of calls) and not while the previous engine's threads still spin (OpenMP's workers
    spin ~9 ms after a torch call before they sleep: on 2 cores, OpenVINO int8 on
    efficientnet_b0 at batch 8 ran 36 ms alone and 42 ms right after a torch call). A pause
    instead made every call start on idle cores (Inductor on mobilenet_v3_large at batch 1:
    8.63 ms, against 6.97 back to back)."""
    for runner in runners.values():
        for _ in range(settings.warmup_calls):
            time_one_call(runner, inputs)
    probe = sum(time_one_call(runner, inputs) for runner in runners.values())
    rounds = max(settings.min_iters, min(settings.max_iters, int(settings.target_seconds * len(runners) / max(probe, 1e-6))))
    samples = {path: [] for path in runners}
    for _ in range(rounds):
        for path, runner in runners.items():
            settled = 0.0
            while settled < settle_s:
                settled += time_one_call(runner, inputs)
            samples[path].append(time_one_call(runner, inputs))
    return samples


def parallel_speedup(calls: int = 200) -> float:
    """One thread's time over NUM_THREADS threads' for an add of 50K floats (ATen splits it
    between the threads): ~1.4 on the 2-vCPU guests this ran on while their vCPUs run side by
    side, ~1.0 while the host runs them as one, which it did for tens of seconds at a time
    (small multi-threaded kernels then run slower than on one thread)."""
    a, b = torch.randn(64, 28, 28), torch.randn(64, 28, 28)

    def per_call(threads: int) -> float:
        torch.set_num_threads(threads)
        for _ in range(20):
            torch.add(a, b)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            torch.add(a, b)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    try:
        return per_call(1) / per_call(NUM_THREADS)
    finally:
        torch.set_num_threads(NUM_THREADS)


def wait_for_parallel_speedup(minimum: float = 1.2, timeout_s: float = 60.0) -> float:
    """``parallel_speedup()``, probed again every 2 s while it is below ``minimum``, for at most
    ``timeout_s``: a model's timing starts with the vCPUs side by side where the host allows."""
    deadline = time.perf_counter() + timeout_s
    speedup = parallel_speedup()
    while speedup < minimum and time.perf_counter() < deadline:
        time.sleep(2.0)
        speedup = parallel_speedup()
    return speedup


def measure_interleaved(runners, inputs, settings):
    """Median seconds per call for every runner (``interleaved_samples``): {path: (median, calls)}."""
    return {path: (statistics.median(times), len(times)) for path, times in interleaved_samples(runners, inputs, settings).items()}


def paired_ratios(samples: list, baseline: list) -> tuple:
    """Per-round ratios of two paths timed in the same rounds: (median, lower quartile, upper
    quartile). A round's ratio cancels the load both calls of that round saw."""
    ratios = [a / b for a, b in zip(samples, baseline)]
    if len(ratios) < 2:
        return (ratios[0],) * 3
    low, _, high = statistics.quantiles(ratios, n=4)
    return statistics.median(ratios), low, high


def measure_back_to_back(runner, inputs, calls: int) -> float:
    """Median seconds per call of ``calls`` consecutive calls: what a loop over one model sees,
    with whatever of its weights the caches keep between calls (the interleaved rounds above
    flush them with the other paths' weights)."""
    return statistics.median(time_one_call(runner, inputs) for _ in range(calls))


def cosine(a, b):
    return float(F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def max_abs_diff(a, b):
    return float((a.double() - b.double()).abs().max())


def short_error(exc):
    """The error's type and first line; for an error without a message (a bare assert in a
    peer's code), where it was raised instead."""
    lines = str(exc).strip().splitlines()
    if lines:
        return f"{type(exc).__name__}: {lines[0]}"[:200]
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" raised in {frames[-1].name} ({'/'.join(Path(frames[-1].filename).parts[-2:])}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}{where}"[:200]


def _lscpu() -> dict:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in lscpu.splitlines() if ":" in line)}


def cpu_key() -> str:
    """The CPU a measurement belongs to: model name, family / model (AMD EPYC of two generations
    share a name: Zen 4 is family 25, Zen 5 26) and the widest ISA ATen uses here."""
    fields = _lscpu()
    name = fields.get("Model name", "unknown CPU")
    if "CPU family" in fields:
        name += f" family {fields['CPU family']} model {fields.get('Model', '?')}"
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


def machine_description(num_threads=NUM_THREADS, load=True):
    """``load``: with the load average now (other work on a shared machine skews latencies);
    off where nothing is measured now (results collected from earlier runs)."""
    now = f"load average {os.getloadavg()[0]:.2f} at start; " if load else ""
    return (f"{cpu_key()}, {os.cpu_count()} CPUs, {num_threads} torch threads, {now}"
            f"torch {torch.__version__}, torchao {importlib.metadata.version('torchao')}")


def replace_section(document: str, heading: str, body: str) -> str:
    """``document`` with its ``## heading`` section replaced by ``body`` (appended when new):
    docs keep one section per CPU, so a run on one machine leaves the others' results."""
    marker = f"\n## {heading}\n"
    start = document.find(marker)
    if start < 0:
        return document.rstrip("\n") + "\n" + marker + "\n" + body.rstrip("\n") + "\n"
    end = document.find("\n## ", start + len(marker))
    rest = document[end:] if end >= 0 else "\n"
    return document[:start] + marker + "\n" + body.rstrip("\n") + "\n" + rest


def write_section(path: Path, title: str, heading: str, body: str) -> None:
    """Write ``body`` as the ``## heading`` section of the document at ``path`` (created with
    ``title`` when new)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text() if path.exists() else f"# {title}\n\nOne section per CPU this was run on (newest run of each).\n"
    path.write_text(replace_section(old, heading, body))
    log(f"wrote {path}")


def fmt(value, spec):
    return "" if value is None else format(value, spec)


def log(message):
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# --- memory: bandwidth and a process's RSS (Linux) --------------------------------------------


def measure_bandwidth(megabytes=512, repeats=20) -> float:
    """Bytes per second of a large copy (read + write), the best of ``repeats`` (the target is
    written once first, so page faults are not timed)."""
    source = torch.ones(megabytes << 20, dtype=torch.uint8)
    target = torch.zeros_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() / best


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the current RSS


def peak_rss_bytes() -> int:
    """This process image's peak RSS. (Not ru_maxrss: Linux carries it over an exec, so a child
    started from the benchmark process would report the parent's peak.)"""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
