"""What was measured on this machine, kept on disk so later compiles and processes decide the
same way without timing again: kernel choices (lowering/choice.py) and the zmm / ymm probe
(native.zmm_speedup).

One JSON file per machine: the key is the CPU (model and the ISA flags the kernels use), the
torch version, the thread count and the hash of qbackend's C sources, so a result measured on
another CPU, torch or kernel never applies here. The file holds data only, and is read only
from a directory and file this user owns that no one else can write.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

import torch

from qbackend import kernel_build
from qbackend.kernel_build import trusted  # (else another user could steer choices)

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
            "kernels": kernel_build.sources_digest()[:16]}


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
        if not (trusted(self.directory) and trusted(self.path)):
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}  # torn or foreign: measured again
        entries = data.get("entries") if isinstance(data, dict) and data.get("machine") == self.machine else None
        return entries if isinstance(entries, dict) else {}

    def get(self, name: str) -> Optional[dict]:
        record = self.entries.get(name)
        return record if isinstance(record, dict) else None

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

    def remembered(self, name: str, measure: Callable[[], float]) -> float:
        """``measure()``'s value, measured once per machine."""
        record = self.get(name)
        if record is not None and isinstance(record.get("value"), (int, float)):
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
