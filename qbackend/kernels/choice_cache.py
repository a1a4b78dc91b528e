"""What was measured on this machine, kept on disk so later compiles and processes decide the
same way without timing again: kernel choices (lowering/choice.py) and the zmm / ymm probe
(isa.zmm_speedup).

One JSON file per machine: the key is the CPU (model and the ISA flags the kernels use), the
torch version, the thread count, the hash of qbackend's C sources, qbackend's version and the
records' layout (``LAYOUT``), so a result measured on another CPU, torch, kernel or record
layout never applies here. The file holds data only, and is read only from a directory and
file this user owns that no one else can write (neither a symlink).

A record is still untrusted input (a half-edited file, another version's bug, a hand edit): each
reader names its record's ``Schema`` and ``get`` returns only a record that matches it field by
field, type and range. Any other is reported as absent, so the caller measures again and its
``put`` overwrites it: a KeyError from a record with a field missing had made the lowering give
up on every conv it read it for, in every later process.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from qbackend import version
from qbackend.kernels import kernel_build
from qbackend.kernels.kernel_build import trusted  # (else another user could steer choices)

log = logging.getLogger("qbackend")

# The layout of the records: raise it when a record kind's fields change (the key then differs,
# and records of the old layout are neither read nor overwritten)
LAYOUT = 2
MAX_FILE_BYTES = 16 << 20  # (a few thousand records take well under 1 MB)

Check = Callable[[object], bool]


def number(low: float, high: float) -> Check:
    """A finite int or float (not a bool) within [low, high]."""
    return lambda v: type(v) in (int, float) and math.isfinite(v) and low <= v <= high


def count(low: int, high: int = 1 << 31) -> Check:
    """An int (not a bool) within [low, high]."""
    return lambda v: type(v) is int and low <= v <= high


def one_of(*names: str) -> Check:
    return lambda v: isinstance(v, str) and v in names


def optional(check: Check) -> Check:
    """``check``, or None (an absent field reads as None)."""
    return lambda v: v is None or check(v)


def pair_of(check: Check) -> Check:
    return lambda v: isinstance(v, list) and len(v) == 2 and all(map(check, v))


def mapping_of(check: Check, most: int = 64) -> Check:
    """A dict of at most ``most`` str keys, each value passing ``check``."""
    return lambda v: isinstance(v, dict) and len(v) <= most and all(isinstance(k, str) and check(x) for k, x in v.items())


SECONDS = number(0.0, 3600.0)  # a timed call


class Schema(NamedTuple):
    """A record kind: its fields (no others) and what each holds, and a rule across them."""

    fields: dict[str, Check]
    consistent: Callable[[dict], bool] = lambda record: True

    def why_invalid(self, record) -> Optional[str]:
        if not isinstance(record, dict):
            return f"a {type(record).__name__}, not a record"
        unknown = sorted(set(record) - set(self.fields))
        if unknown:
            return f"unknown field(s) {unknown}"
        wrong = [name for name, check in self.fields.items() if not check(record.get(name))]
        if wrong:
            return f"field(s) {wrong} missing or out of range"
        return None if self.consistent(record) else "its fields contradict each other"


def fastest_of(*names: str) -> Schema:
    """A timed choice: each candidate's seconds per call, and the winner, the fastest of them."""
    return Schema({"winner": one_of(*names), **{name: SECONDS for name in names}},
                  lambda record: record[record["winner"]] == min(record[name] for name in names))

# the CPU flags that change which kernel is faster (/proc/cpuinfo spelling)
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


@lru_cache(maxsize=None)
def cpu_description() -> tuple[str, tuple[str, ...]]:
    """(model name with family and model number, the ISA_FLAGS this CPU has)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break  # the first processor is enough
                name, _, value = line.partition(":")
                fields[name.strip()] = value.strip()
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    model = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        model += f" family {fields['cpu family']} model {fields.get('model', '?')}"
    return model, tuple(f for f in ISA_FLAGS if f in flags)


def machine() -> dict:
    """What a measurement depends on besides the layer itself."""
    model, flags = cpu_description()
    return {"cpu": model, "isa": list(flags), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "kernels": kernel_build.sources_digest()[:16], "qbackend": version.VERSION, "layout": LAYOUT}


class ChoiceCache:
    """Measurements of one machine (``machine()``): name -> JSON record. Reads the file once;
    each ``put`` writes it whole again (atomically, merged with what other processes wrote)."""

    def __init__(self, directory: Optional[Path] = None):
        self.machine = machine()
        digest = hashlib.sha256(json.dumps(self.machine, sort_keys=True).encode()).hexdigest()[:16]
        self.directory = directory if directory is not None else kernel_build.cache_dir() / "choices"
        self.path = self.directory / f"{digest}.json"
        self.entries: dict = self._read()
        self._lock = threading.Lock()

    def _read(self) -> dict:
        if not trusted(self.directory):
            return {}
        try:
            data = json.loads(kernel_build.read_private(self.path, MAX_FILE_BYTES))
        except (OSError, ValueError, RecursionError):  # (json recurses per nesting level: "[[[[...")
            return {}  # absent, torn, foreign or not this user's alone: measured again
        entries = data.get("entries") if isinstance(data, dict) and data.get("machine") == self.machine else None
        return entries if isinstance(entries, dict) else {}

    def get(self, name: str, schema: Schema) -> Optional[dict]:
        """The record kept under ``name`` if it matches ``schema``, else None (measure again and
        ``put``: that overwrites it)."""
        record = self.entries.get(name)
        why = None if record is None else schema.why_invalid(record)
        if why is not None:
            log.info("qbackend: the cached record %r in %s is not valid (%s): not used, measured again where measuring is on",
                     name, self.path, why)
            return None
        return record

    def put(self, name: str, record: dict) -> None:
        with self._lock:
            self.entries[name] = record
            try:
                self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                if not trusted(self.directory):
                    return  # kept for this process only
                merged = {**self._read(), **self.entries}
                handle, temporary = tempfile.mkstemp(dir=self.directory, prefix=".choices-", suffix=".json")
                try:
                    with os.fdopen(handle, "w") as out:
                        json.dump({"machine": self.machine, "entries": merged}, out, indent=1, sort_keys=True)
                        out.flush()
                        os.fsync(out.fileno())
                    os.replace(temporary, self.path)
                finally:
                    if os.path.exists(temporary):  # (a failed write leaves no partial file behind)
                        os.unlink(temporary)
                self.entries = merged
            except OSError:
                pass  # a read-only cache directory or a full disk: measured again by the next process

    def remembered(self, name: str, measure: Callable[[], float], valid: Check) -> float:
        """``measure()``'s value, measured once per machine (again where the kept one is not
        ``valid``)."""
        record = self.get(name, Schema({"value": valid}))
        if record is not None:
            return float(record["value"])
        value = float(measure())
        self.put(name, {"value": value})
        return value


_shared: Optional[ChoiceCache] = None


def shared() -> ChoiceCache:
    """This process's cache (rebuilt when the machine key changes: another thread count)."""
    global _shared
    if _shared is None or _shared.machine != machine():
        _shared = ChoiceCache()
    return _shared
