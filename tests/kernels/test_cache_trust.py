"""The machine's choice cache (qbackend/kernels/choice_cache.py) is untrusted input: the file is read only
where this user alone can write it and is what it claims, and each record kind is checked field
by field where it is read; an invalid record is measured again and overwritten, never used."""
import json
import math
import os
import threading

import pytest
import torch

from qbackend.kernels import choice_cache, isa
from qbackend.llm import dense_weight_only
from qbackend.lowering import choice

from tests.passes import test_float_linear as float_linear
from tests.helpers import compile_and_run, needs_own_kernels, short_graph
from tests.llm.test_dense_weight_only import simulated
from tests.weight_only.test_weight_only import quantized_and_reference


def _saved(cache: choice_cache.ChoiceCache) -> dict:
    return json.loads(cache.path.read_text())["entries"]


def _edited(cache: choice_cache.ChoiceCache, change) -> None:
    """The cache's file with its entries passed through ``change``, as the next process reads it."""
    saved = json.loads(cache.path.read_text())
    saved["entries"] = change(saved["entries"])
    cache.path.write_text(json.dumps(saved))


VALUE = choice_cache.number(*isa.ZMM_SPEEDUPS)  # (isa.zmm_speedup's check)


@pytest.mark.parametrize("kept", [float("nan"), float("inf"), 1e9, -1.0, True, "1.5", None])
def test_a_kept_value_out_of_range_is_measured_again_and_overwritten(tmp_path, kept):
    """The zmm probe's value chooses the GEMM's register width in every later process."""
    cache = choice_cache.ChoiceCache(tmp_path / "choices")
    assert cache.remembered("zmm_speedup", lambda: 0.6, VALUE) == 0.6
    _edited(cache, lambda entries: {"zmm_speedup": {"value": kept}})
    probes = []
    again = choice_cache.ChoiceCache(tmp_path / "choices")
    assert again.remembered("zmm_speedup", lambda: probes.append(1) or 1.9, VALUE) == 1.9 and probes == [1]
    assert _saved(again)["zmm_speedup"] == {"value": 1.9}


@pytest.mark.parametrize("record, why", [
    ({"winner": "own", "own": 1e-4, "fallback": 2e-4}, None),
    ({"winner": "own", "own": 1e-4}, "missing"),
    ({"winner": "own", "own": True, "fallback": 2e-4}, "missing or out of range"),  # (a bool is an int)
    ({"winner": "own", "own": -1e-4, "fallback": 2e-4}, "out of range"),
    ({"winner": "own", "own": 1e-4, "fallback": 2e-4, "code": "import os"}, "unknown field(s) ['code']"),
    ({"winner": "own", "own": 3e-4, "fallback": 2e-4}, "contradict"),
    ("own", "a str, not a record"),
])
def test_a_timed_choice_is_checked_field_by_field(record, why):
    found = choice.RECORD.why_invalid(record)
    assert found is None if why is None else why in found


def _write_cache(tmp_path) -> choice_cache.ChoiceCache:
    cache = choice_cache.ChoiceCache(tmp_path / "choices")
    cache.put("zmm_speedup", {"value": 1.5})
    assert choice_cache.ChoiceCache(tmp_path / "choices").entries  # (read back as it is)
    return cache


def test_a_cache_file_that_is_a_symlink_is_not_read(tmp_path):
    cache = _write_cache(tmp_path)
    elsewhere = tmp_path / "elsewhere.json"  # (this user's, private: only the link is wrong)
    os.replace(cache.path, elsewhere)
    cache.path.symlink_to(elsewhere)
    assert choice_cache.ChoiceCache(tmp_path / "choices").entries == {}


def test_a_cache_file_nested_past_the_parsers_depth_is_measured_again(tmp_path):
    """json recurses per level: a RecursionError had escaped the cache into the compile."""
    cache = _write_cache(tmp_path)
    cache.path.write_text("[" * 200_000)
    assert choice_cache.ChoiceCache(tmp_path / "choices").entries == {}


def test_a_cache_file_larger_than_any_the_cache_writes_is_not_read(tmp_path, monkeypatch):
    cache = _write_cache(tmp_path)
    monkeypatch.setattr(choice_cache, "MAX_FILE_BYTES", cache.path.stat().st_size - 1)
    assert choice_cache.ChoiceCache(tmp_path / "choices").entries == {}


def test_a_fifo_in_place_of_the_cache_file_does_not_hang_the_compile(tmp_path):
    cache = _write_cache(tmp_path)
    cache.path.unlink()
    os.mkfifo(cache.path, 0o600)  # (opening it to read waits for a writer)
    read = []
    reader = threading.Thread(target=lambda: read.append(choice_cache.ChoiceCache(tmp_path / "choices").entries), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert read == [{}]


@needs_own_kernels
def test_a_float_linear_choice_its_times_contradict_is_measured_again(cache_dir, monkeypatch):
    machine = float_linear.SimulatedMachine(mkl_us=100, onednn_us=300)
    assert float_linear.float_gemms(float_linear.compiled(monkeypatch, machine)) == [float_linear.MKL] * 2
    _edited(choice_cache.shared(), lambda entries: {name: {**r, "winner": "onednn"} for name, r in entries.items()})
    choice_cache._shared = None  # (as a new process)
    again = float_linear.compiled(monkeypatch, machine)
    assert float_linear.float_gemms(again) == [float_linear.MKL] * 2 and len(machine.widths) == 4
    assert all(choice_cache.fastest_of("mkl", "onednn").why_invalid(r) is None
               for name, r in _saved(choice_cache.shared()).items() if name.startswith("float_linear"))


@needs_own_kernels
@pytest.mark.parametrize("change", [{"from": -1}, {"from": "24"}, {"dtype": "int2"}, {"from": None}, {"bf16_from": 4}],
                         ids=["negative rows", "rows as text", "unknown dtype", "a dtype without rows", "under MIN_ROWS"])
def test_a_dense_weight_only_record_out_of_range_is_measured_again(cache_dir, monkeypatch, change):
    """Its row counts become the graph's arguments: from -1 rows on, decode too would run in bf16."""
    calls, measured = simulated({"bf16_from": None, "dtype": "bf16", "from": 24, "ms": {"int16": [0.5, 2.0]}})
    monkeypatch.setattr(dense_weight_only, "_measured", measured)
    model, _ = quantized_and_reference(4, 128)
    x = torch.randn(1, 32, 256)
    compile_and_run(model.gate, (x,), kernel_choice="measure")
    _edited(choice_cache.shared(), lambda entries: {name: {**r, **change} for name, r in entries.items()})  # (its one record)
    choice_cache._shared = None
    _, _, captured = compile_and_run(model.gate, (x,), kernel_choice="measure")
    assert "kernel_or_dense(reshape_default, 24, 24, bfloat16, 4" in short_graph(captured.lowered)
    assert len(calls) == 2
    assert [dense_weight_only.RECORD.why_invalid(r) for r in _saved(choice_cache.shared()).values()] == [None]


def test_every_measured_dense_record_shape_passes_its_check():
    """What ``_measured`` writes (its docstring's cases) is what the check accepts."""
    times = {"int16": [0.5, 2.0], "bf16": [1.0, 1.5], "fp32": [1.2, 1.9], "bf16 kernel": [0.4, 1.2]}
    for record in ({"bf16_from": None, "dtype": None, "from": None, "ms": times},
                   {"bf16_from": None, "dtype": "fp32", "from": 2, "ms": times},
                   {"bf16_from": 9, "dtype": None, "from": None, "ms": {**times, "bf16 kernel, part": [3.0, 9.0]}},
                   {"bf16_from": 9, "dtype": "bf16", "from": 300, "ms": times}):
        assert dense_weight_only.RECORD.why_invalid(record) is None, record
    assert "contradict" in dense_weight_only.RECORD.why_invalid({"bf16_from": 90, "dtype": "bf16", "from": 30, "ms": {}})
    assert dense_weight_only.RECORD.why_invalid({"dtype": "bf16", "from": 24, "ms": {"int16": [math.nan, 1.0]}})
