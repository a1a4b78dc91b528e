"""A structure-aware fuzzer of ``qbackend.load``: real saved archives, their records mutated as
an attacker or a corrupted disk would (names, targets, arguments, keyword keys, structure,
values, constants, sizes, strides, dtypes, expressions, truncated bytes).

    python -m tests.fuzz.archive --cases 20000 [--workers 2] [--first 0]

Every mutant must either be refused with ``qbackend.ArchiveError`` at load, or load and then
behave as its own graph run eagerly does: the same outputs (the differential fuzzer's
tolerances) on the first, second and third call, or an error where that run raises too.
Nothing else: no code run from the archive (a canary file and Python's audit events: process
starts, writes outside the workers' directories, imports of the canary's module), no crash of
the worker, no hang (a per-case timeout), no load taking memory beyond its archive. Workers are
subprocesses, restarted after a crash or a hang; each case is one seed archive and one index,
so ``--first N --cases 1`` reruns case N alone.
"""
from __future__ import annotations

import argparse
import copy
import io
import json
import os
import random
import resource
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SEEDS = ("cnn", "cnn_dynamic_batch", "encoder", "weight_only_decoder")
FAMILY = {"weight_only_decoder": "weight_only"}  # the differential fuzzer's tolerance family of each seed
CASE_SECONDS = 120  # a case still running then is a hang
LOAD_MEMORY = 1 << 30  # bytes a load may add to the worker's peak beyond its archive's size
WORKER_MEMORY = 8 << 30  # address space of a worker: a runaway allocation fails instead of swapping


# ---------------------------------------------------------------- the seed archives

def _decoder():
    """A weight-only decoder layer as an exported graph: int4 / int8 weights under PT2E's
    group and channel dequantize, RMSNorm, causal SDPA, SiLU MLP."""
    import torch.nn as nn
    import torch.nn.functional as F

    from qbackend.patterns.examples import GroupDequantLinear

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.norm = nn.Embedding(64, 32), nn.RMSNorm(32)
            self.qkv = GroupDequantLinear(32, 96, 4, 32)
            self.out = GroupDequantLinear(32, 32, 8, None, form="per_channel")
            self.up, self.down = GroupDequantLinear(32, 64, 4, 32), GroupDequantLinear(64, 32, 4, 32)

        def forward(self, ids):
            x = self.embed(ids)
            q, k, v = self.qkv(self.norm(x)).view(ids.shape[0], ids.shape[1], 3, 2, 16).permute(2, 0, 3, 1, 4)
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(attended.transpose(1, 2).reshape(ids.shape[0], ids.shape[1], 32))
            return x + self.down(F.silu(self.up(self.norm(x))))

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8))
    return torch.export.export(Decoder().eval(), (ids,), strict=True).module(), (ids,), {}


def seed_archive(name: str, directory: Path) -> tuple[Path, tuple, dict]:
    """(the archive ``qbackend.save`` wrote for seed ``name``, its inputs, keyword inputs)."""
    import qbackend
    from qbackend.models import bert_encoder_like, tiny_resnet
    from qbackend.pt2e_flow import quantize_x86

    torch.manual_seed(0)
    if name == "weight_only_decoder":
        model, args, kwargs = _decoder()
    elif name == "encoder":
        kwargs = {"x": torch.randn(2, 8, 32)}
        sizes = {"x": {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=64)}}
        model = quantize_x86(bert_encoder_like(num_layers=1, hidden=32, heads=2, ffn=64), kwargs, [kwargs],
                             dynamic_shapes=sizes, reduce_range=True)
        args = ()
    else:
        args, kwargs = (torch.randn(2, 3, 32, 32),), {}
        model = quantize_x86(tiny_resnet(), args, [args], dynamic_batch=name == "cnn_dynamic_batch", reduce_range=True)
    path = directory / f"{name}.pt2"
    qbackend.save(model, path)
    return path, args, kwargs


# ---------------------------------------------------------------- mutations

def _strings(canary: Path, records: dict) -> list:
    """What a mutated string becomes: code (each would touch the canary), other names of the
    archive, operators that touch files or storage, expressions, odd text."""
    touch = f"__import__('pathlib').Path({str(canary)!r}).touch()"
    names = [node[0] for node in records["nodes"]][:40] + list(records["constants"])[:10] + list(records["symbols"])
    return [touch, f"x={touch}", f"x, y={touch}", f'a") or {touch} or getattr(self, "b', f"x':{touch},'y",
            f"{touch} #", f"__import__('os').system('touch {canary}')", "self", "torch", "forward", "_modules", "__class__",
            "aten::from_file.default", "aten::set_.source_Storage", "builtins::eval.default", "aten::add_.Tensor",
            "aten::empty.memory_format", "aten::as_strided.default", "prims::empty_strided.default",
            "quantized_decomposed::quantize_per_tensor.default", "operator.getitem", "os.system",
            "10**10**10", "s0*2**62", "s0**64", "FloorDiv(s0, 0)", "Max(s0, s1)", "(s0)" * 40, "-" * 3000 + "1",
            "qint8", "complex64", "_dynamo", "float32", "int64", "cuda", "meta", "file:/etc/passwd", "cpu:99",
            "", "x" * 5000, "é", "a.b", "a..b", ".a", "1a", "None", "output", "placeholder", "call_module",
            *names]


def _integers(value: int) -> list:
    return [0, 1, -1, 2, value + 1, value - 1, -value, value * 2, value * 1000, 2**31, 2**62, 2**63, -2**63, 10**30,
            True, None, "1", 1.5]


def _floats(value: float) -> list:
    return [float("nan"), float("inf"), -float("inf"), 0.0, -value, value * 1e30, 1e-45, 1, None]


def _tensors(value: torch.Tensor) -> list:
    flat = value.reshape(-1)
    out = [value.to(torch.float32), value.to(torch.int64), value.to(torch.uint8), value.t() if value.dim() == 2 else value,
           flat[:1].expand(max(flat.numel(), 1)), flat[::2], flat.flip(0), value.new_zeros(0), torch.zeros(3, 3),
           value.unsqueeze(0), torch.full_like(value, float("nan")) if value.is_floating_point() else value * 0,
           torch.randn(value.shape) * 1e30, "not a tensor", None]
    if flat.numel() > 1:
        out.append(flat.as_strided((flat.numel() // 2,), (2,), 1))
    return out


def _mutate(value, rng: random.Random, strings: list, depth: int = 0):
    """``value`` with one random change somewhere inside it (containers rebuilt on the way)."""
    leaf = not isinstance(value, (dict, list, tuple)) or not value
    if not leaf and (depth == 0 or rng.random() < 0.8):  # descend
        if isinstance(value, dict):
            key = rng.choice(list(value))
            if rng.random() < 0.1:  # the key itself
                changed = dict(value)
                changed[rng.choice(strings)] = changed.pop(key)
                return changed
            return {**value, key: _mutate(value[key], rng, strings, depth + 1)}
        index = rng.randrange(len(value))
        items = list(value)
        items[index] = _mutate(items[index], rng, strings, depth + 1)
        return type(value)(items)
    if isinstance(value, (list, tuple)):
        items, kind = list(value), rng.randrange(6)
        if kind == 0 and items:
            items.pop(rng.randrange(len(items)))
        elif kind == 1 and items:
            items.insert(rng.randrange(len(items) + 1), rng.choice(items))
        elif kind == 2 and len(items) > 1:
            i, j = rng.sample(range(len(items)), 2)
            items[i], items[j] = items[j], items[i]
        elif kind == 3:
            return (list if isinstance(value, tuple) else tuple)(items)
        elif kind == 4:
            items.append(rng.choice(strings + [0, None, [], {}]))
        else:
            return rng.choice([[], (), {}, None, "", 0])
        return type(value)(items)
    if isinstance(value, dict):
        return rng.choice([{}, [], None, {rng.choice(strings): 0}])
    if isinstance(value, bool):
        return rng.choice([not value, None, 0, "True"])
    if isinstance(value, int):
        return rng.choice(_integers(value))
    if isinstance(value, float):
        return rng.choice(_floats(value))
    if isinstance(value, str):
        if rng.random() < 0.7:
            return rng.choice(strings)
        cut = rng.randrange(len(value) + 1)
        return value[:cut] + rng.choice(["", "x", "(", "'", '"', ".", "_1", "\n"]) + value[cut + 1:]
    if isinstance(value, torch.Tensor):
        return rng.choice(_tensors(value))
    return rng.choice(strings + [0, None])


def mutant(records: dict, archive_bytes: bytes, index: int, canary: Path) -> bytes:
    """The bytes of mutant ``index``: 1-3 record changes, saved again; one in ten a cut or
    bit-flipped copy of the original file instead."""
    rng = random.Random(index)
    if rng.random() < 0.1:
        data = bytearray(archive_bytes)
        if rng.random() < 0.5:
            return bytes(data[:rng.randrange(len(data))])
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    strings = _strings(canary, records)
    changed = records
    for _ in range(rng.randint(1, 3)):
        changed = _mutate(changed, rng, strings)
    buffer = io.BytesIO()
    torch.save(changed, buffer)
    return buffer.getvalue()


# ---------------------------------------------------------------- one case, in a worker

def _outputs(value) -> tuple:
    import torch.utils._pytree as pytree

    return tuple(leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor))


def run_mutant(path: Path, args: tuple, kwargs: dict, family: str) -> tuple[str, list[str]]:
    """(outcome, problems) of loading and running the archive at ``path``: "refused" (an
    ArchiveError at load), "raised" (loaded; its graph run eagerly raises, and so does the
    compiled call), "ran" (outputs equal to the eager run's, three calls)."""
    import qbackend

    from .check import _compare, _same_bits

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        loaded, outcome, problems = qbackend.load(path), None, []
    except qbackend.ArchiveError:
        loaded, outcome, problems = None, "refused", []
    except Exception as error:  # anything but a clear refusal is a failure
        loaded, outcome, problems = None, "load failed", [f"load raised {type(error).__name__}: {str(error)[:300]}"]
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak  # (a new peak only)
    if grown > LOAD_MEMORY + path.stat().st_size:
        problems.append(f"load grew the peak memory by {grown >> 20} MB")
    if loaded is None:
        return outcome, problems
    reference_module = qbackend.load(path).module  # (a second copy: a call may write its constants)
    with torch.no_grad():
        try:
            expected = _outputs(reference_module(*copy.deepcopy(args), **copy.deepcopy(kwargs)))
        except Exception as reference_error:
            try:
                loaded(*args, **kwargs)
            except Exception:
                return "raised", []
            return "ran where eager raises", [f"the eager graph raises {type(reference_error).__name__} "
                                              f"({str(reference_error)[:200]}), the compiled call does not"]
        try:
            calls = [_outputs(loaded(*copy.deepcopy(args), **copy.deepcopy(kwargs))) for _ in range(3)]
        except Exception as error:
            return "compiled call failed", [f"the eager graph runs, the compiled call raised {type(error).__name__}: "
                                            f"{str(error)[:300]}"]
    problems += _compare(calls[0], expected, family)
    for number, later in enumerate(calls[1:], 2):
        if len(later) != len(calls[0]) or not all(map(_same_bits, later, calls[0])):
            problems.append(f"call {number} differs from the first")
    return "ran", problems


def _watch(allowed_roots: tuple, events: list):
    """Record audit events no mutant may cause: process starts, writes outside the allowed
    directories, importing the canary's module."""
    def hook(event, arguments):
        if event in ("os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.fork"):
            events.append(f"{event} {str(arguments)[:200]}")
        elif event == "open" and arguments[1] not in (None, "r", "rb") and isinstance(arguments[0], (str, bytes, os.PathLike)):
            target = os.path.abspath(os.fsdecode(arguments[0]))
            if "canary" in target or not target.startswith(allowed_roots):
                events.append(f"open {target} {arguments[1]}")
        elif event in ("os.remove", "os.rename", "os.mkdir", "os.symlink") and arguments:
            target = os.path.abspath(os.fsdecode(arguments[0])) if isinstance(arguments[0], (str, bytes, os.PathLike)) else ""
            if "canary" in target or not target.startswith(allowed_roots):
                events.append(f"{event} {target}")
        elif event == "import" and "canary" in str(arguments[0]):
            events.append(f"import {arguments[0]}")
    sys.addaudithook(hook)


def worker() -> None:
    """Reads case lines (seed, index) on stdin, writes one JSON result line per case."""
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    os.environ["QBACKEND_KERNEL_CHOICE"] = "prior"  # (no timing: the cases run in parallel)
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    directory = Path(tempfile.mkdtemp(prefix="qbackend-archive-fuzz-"))
    os.chdir(directory)
    canary = directory / "canary"
    seeds, events = {}, []
    for name in SEEDS:
        path, args, kwargs = seed_archive(name, directory)
        seeds[name] = (torch.load(path, weights_only=True), path.read_bytes(), args, kwargs)
        run_mutant(path, args, kwargs, FAMILY.get(name, "int8"))  # (imports and kernel builds before the watch starts)
    _watch((str(directory), tempfile.gettempdir(), str(Path.home() / ".cache")), events)
    print("ready", flush=True)
    for line in sys.stdin:
        name, index = json.loads(line)
        records, data, args, kwargs = seeds[name]
        path = directory / "mutant.pt2"
        path.write_bytes(mutant(records, data, index, canary))
        events.clear()
        try:
            outcome, problems = run_mutant(path, args, kwargs, FAMILY.get(name, "int8"))
        except Exception as error:  # (the harness's own failure: reported, not hidden)
            outcome, problems = "harness", [f"{type(error).__name__}: {error}"]
        if canary.exists():
            problems.append("the canary file was written: code from the archive ran")
            canary.unlink()
        problems += [f"audit event: {event}" for event in events]
        print(json.dumps([outcome, problems]), flush=True)


# ---------------------------------------------------------------- the driver

class Worker:
    """A worker process; its stderr (logged lowering errors, a crash's trace) goes to a file
    whose end a crash or hang report quotes."""

    def __init__(self):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="qbackend-archive-fuzz-", suffix=".log", delete=False)
        self.process = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "tests.fuzz.archive", "--worker"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                        cwd=Path(__file__).resolve().parents[2])
        ready = self.process.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the worker did not start (exit {self.process.poll()}): {self._log_tail()}")

    def _log_tail(self) -> str:
        return Path(self.log.name).read_text()[-2000:]

    def run(self, name: str, index: int) -> tuple[str, list[str]]:
        self.process.stdin.write(json.dumps([name, index]) + "\n")
        self.process.stdin.flush()
        readable, _, _ = select.select([self.process.stdout], [], [], CASE_SECONDS)
        if not readable:
            self.process.kill()
            return "hang", [f"no result after {CASE_SECONDS} s; the worker's log ends:\n{self._log_tail()}"]
        line = self.process.stdout.readline()
        if not line:
            return "crash", [f"the worker died (exit {self.process.wait()}); its log ends:\n{self._log_tail()}"]
        return tuple(json.loads(line))

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.archive")
    parser.add_argument("--cases", type=int, default=200, help="mutants, spread over the seed archives")
    parser.add_argument("--first", type=int, default=0, help="index of the first mutant")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker()
        return 0
    import concurrent.futures
    import threading

    start, counts, failed, local = time.time(), {}, [], threading.local()

    def one(index: int):
        if getattr(local, "worker", None) is None or not local.worker.alive:
            local.worker = Worker()
        name = SEEDS[index % len(SEEDS)]
        return index, name, *local.worker.run(name, index)

    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        for done, (index, name, outcome, problems) in enumerate(pool.map(one, range(args.first, args.first + args.cases)), 1):
            counts[outcome] = counts.get(outcome, 0) + 1
            if problems:
                failed.append(index)
                print(f"FAIL case {index} ({name}, {outcome})\n  " + "\n  ".join(problems)
                      + f"\n  rerun: python -m tests.fuzz.archive --first {index} --cases 1", flush=True)
            if done % 500 == 0:
                print(f"... {done} cases in {time.time() - start:.0f} s, {len(failed)} failed", file=sys.stderr, flush=True)
    print(f"{args.cases} mutants in {time.time() - start:.0f} s: {counts}; {len(failed)} failed {failed[:50]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
