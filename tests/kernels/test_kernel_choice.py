"""Own kernel or oneDNN, measured on the machine that compiles (lowering/choice.py), and the
choice cache that makes later compiles decide the same way (qbackend/kernels/choice_cache.py)."""
import json
import os

import pytest
import torch
import torch.nn as nn

from qbackend.kernels import choice_cache
from qbackend.pipeline.backend import Options
from qbackend.lowering import choice

from tests.helpers import assert_matches_reference, needs_own_kernels, quantize

pytestmark = needs_own_kernels


class ResidualNet(nn.Module):
    """A 3x3 conv, a 1x1 conv with a residual add, a linear: each runnable by both."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(16, 32, 3, padding=1), nn.Conv2d(32, 32, 1)
        self.fc = nn.Linear(32, 16)

    def forward(self, x):
        y = torch.relu(self.conv1(x))
        y = torch.relu(self.conv2(y) + y)
        return self.fc(y.mean((2, 3)))


def inputs():
    torch.manual_seed(0)
    return (torch.randn(1, 16, 8, 8),)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty cache directory (the kernels are built already: only the choices go there)."""
    monkeypatch.setenv("QBACKEND_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(choice_cache, "_shared", None)
    return tmp_path / "choices"


class SimulatedMachine:
    """choice.measure on a machine where one side is faster; checks on the way that the two
    candidates it is given give the same integers on the same random inputs."""

    def __init__(self, own_us: float, onednn_us: float):
        self.seconds = {"own": own_us * 1e-6, "fallback": onednn_us * 1e-6}
        self.layers = 0

    def __call__(self, runs: dict) -> dict:
        self.layers += 1
        # (the model's activations are 7-bit: choice's timing inputs span 8 bits, on which the
        # AVX2 GEMM's int16 pair sums may saturate where oneDNN's do not)
        outputs = {name: fn(*[a.clamp(max=127) if isinstance(a, torch.Tensor) and a.dtype == torch.uint8 else a for a in args])
                   for name, (fn, args) in runs.items()}
        own, onednn = (out if out.dtype == torch.uint8 else out.float() for out in outputs.values())
        assert own.shape == onednn.shape
        if own.dtype == torch.uint8:
            assert (own.int() - onednn.int()).abs().max() <= 1
        else:
            torch.testing.assert_close(own, onednn, rtol=1e-3, atol=1e-3)
        return dict(self.seconds)


def compiled(monkeypatch, machine, mode="measure"):
    monkeypatch.setattr(choice, "measure", machine)
    return assert_matches_reference(quantize(ResidualNet().eval(), inputs()), inputs(), kernel_choice=mode)


def ops(captured) -> list:
    return [d.op for d in captured.report.decisions if d.kind in ("conv", "linear")]


ONEDNN = ["onednn::qconv_pointwise", "onednn::qconv2d_pointwise.binary", "onednn::qlinear_pointwise"]
OWN = ["qbackend::qconv.default"] * 3


@pytest.mark.parametrize("onednn_us,expected", [(100, OWN), (90, ONEDNN)], ids=["oneDNN 5% faster", "oneDNN 17% faster"])
def test_a_near_tie_keeps_the_own_kernel(cache_dir, monkeypatch, onednn_us, expected):
    """Within OWN_KEPT_WITHIN the own kernel runs (no Python call in a chain, no chain split);
    the record still names the faster side."""
    captured = compiled(monkeypatch, SimulatedMachine(own_us=105, onednn_us=onednn_us))
    assert ops(captured) == expected, str(captured.report)
    records = [r for r in json.loads(next(cache_dir.glob("*.json")).read_text())["entries"].values() if "winner" in r]
    assert [r["winner"] for r in records] == ["fallback"] * 3


def test_where_onednn_is_faster_it_runs_every_layer(cache_dir, monkeypatch):
    """As on a CPU with AMX: the own kernels the fixed table picks for these sizes lose."""
    machine = SimulatedMachine(own_us=300, onednn_us=100)
    captured = compiled(monkeypatch, machine)
    assert ops(captured) == ONEDNN, str(captured.report)
    assert machine.layers == 3
    reasons = [d.reason for d in captured.report.decisions if d.kind in ("conv", "linear")]
    assert all(r.startswith("oneDNN, not qbackend's") and r.endswith("measured on this machine: 300 us vs oneDNN's 100 us")
               for r in reasons), reasons


def test_where_the_own_kernel_is_faster_it_runs_every_layer(cache_dir, monkeypatch):
    captured = compiled(monkeypatch, SimulatedMachine(own_us=100, onednn_us=300))
    assert ops(captured) == OWN, str(captured.report)
    assert "measured on this machine: 100 us vs oneDNN's 300 us" in captured.report.decisions[0].reason


class ThreeSiblings(nn.Module):
    """Q / K / V style: three linears read one input; the sibling merge runs them as one call."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = nn.Linear(32, 16), nn.Linear(32, 16), nn.Linear(32, 16)

    def forward(self, x):
        return torch.stack([self.q(x), self.k(x), self.v(x)]).sum(0)


class WidthRecorder(SimulatedMachine):
    def __call__(self, runs: dict) -> dict:
        fn, args = runs["own"]
        self.widths = getattr(self, "widths", []) + [fn(*args).shape[-1]]
        return super().__call__(runs)


@pytest.mark.parametrize("own_us, onednn_us, op", [(100, 300, "qbackend::qconv.default"), (300, 100, "onednn::qlinear_pointwise")])
def test_siblings_are_timed_at_the_width_they_run_as_one_call(cache_dir, monkeypatch, own_us, onednn_us, op):
    """Timed alone, a GEMM's choice can invert once merged (MiniLM's Q / K / V at batch 8)."""
    machine = WidthRecorder(own_us, onednn_us)
    monkeypatch.setattr(choice, "measure", machine)
    x = (torch.randn(4, 32),)
    captured = assert_matches_reference(quantize(ThreeSiblings().eval(), x), x, kernel_choice="measure")
    assert machine.widths == [48]  # (3 x 16, once: the other two read the choice it cached)
    linears = [d for d in captured.report.decisions if d.kind == "linear"]
    assert [d.op for d in linears] == [op] * 3, str(captured.report)
    assert all(f"measured on this machine: {own_us} us vs oneDNN's {onednn_us} us (3 siblings as one call)" in d.reason
               for d in linears), [d.reason for d in linears]
    assert "one call with" in linears[0].reason  # (and the merge ran them as one)


def test_the_next_compile_reads_the_choice_without_measuring(cache_dir, monkeypatch):
    compiled(monkeypatch, SimulatedMachine(own_us=300, onednn_us=100))
    monkeypatch.setattr(choice_cache, "_shared", None)  # as a new process
    again = SimulatedMachine(own_us=100, onednn_us=300)  # (would pick the other side)
    captured = compiled(monkeypatch, again)
    assert again.layers == 0 and ops(captured) == ONEDNN, str(captured.report)
    saved = json.loads(next(cache_dir.glob("*.json")).read_text())
    assert saved["machine"] == choice_cache.machine()
    assert sorted(r["winner"] for r in saved["entries"].values() if "winner" in r) == ["fallback"] * 3


def test_another_cpu_measures_again(cache_dir, monkeypatch):
    compiled(monkeypatch, SimulatedMachine(own_us=300, onednn_us=100))
    monkeypatch.setattr(choice_cache, "cpu_description", lambda: ("Another CPU family 6 model 143", ("avx512f", "amx_int8")))
    monkeypatch.setattr(choice_cache, "_shared", None)
    again = SimulatedMachine(own_us=100, onednn_us=300)
    assert ops(compiled(monkeypatch, again)) == OWN and again.layers == 3
    assert len(list(cache_dir.glob("*.json"))) == 2


def test_cached_mode_never_measures_and_falls_back_to_the_fixed_table(cache_dir, monkeypatch):
    machine = SimulatedMachine(own_us=300, onednn_us=100)
    prior = ops(compiled(monkeypatch, machine, mode="prior"))
    assert ops(compiled(monkeypatch, machine, mode="cached")) == prior and machine.layers == 0
    assert prior == OWN  # (these sizes are within every build's LIMITS)
    assert not cache_dir.exists()


def test_a_cache_others_can_write_is_not_read(cache_dir, monkeypatch):
    compiled(monkeypatch, SimulatedMachine(own_us=300, onednn_us=100))
    os.chmod(cache_dir, 0o777)
    monkeypatch.setattr(choice_cache, "_shared", None)
    again = SimulatedMachine(own_us=100, onednn_us=300)
    assert ops(compiled(monkeypatch, again)) == OWN and again.layers == 3


def test_a_torn_cache_file_is_measured_again(cache_dir, monkeypatch):
    compiled(monkeypatch, SimulatedMachine(own_us=300, onednn_us=100))
    next(cache_dir.glob("*.json")).write_text('{"machine": ')
    monkeypatch.setattr(choice_cache, "_shared", None)
    again = SimulatedMachine(own_us=100, onednn_us=300)
    assert ops(compiled(monkeypatch, again)) == OWN and again.layers == 3


def test_a_candidate_failing_on_the_timing_inputs_leaves_the_fixed_table_to_decide(cache_dir, monkeypatch):
    def failing(runs):
        raise RuntimeError("simulated kernel failure")

    captured = compiled(monkeypatch, failing)
    assert ops(captured) == OWN, str(captured.report)  # (these sizes: the own kernel in every build's LIMITS)
    assert captured.report.decisions[0].reason.endswith("not measured (RuntimeError: simulated kernel failure)")
    assert not cache_dir.exists() or not list(cache_dir.glob("*.json"))


def test_measured_for_real_the_faster_side_is_kept(cache_dir, monkeypatch):
    timings = []

    def timed(runs):
        timings.append(choice.time_each(runs))
        return timings[-1]

    captured = compiled(monkeypatch, timed)
    assert len(timings) == 3 and all(t["own"] > 0 and t["fallback"] > 0 for t in timings)
    expected = ["qbackend::qconv.default" if t["own"] <= t["fallback"] * choice.OWN_KEPT_WITHIN else onednn
                for t, onednn in zip(timings, ONEDNN)]
    assert ops(captured) == expected, str(captured.report)


def test_an_unknown_mode_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="kernel_choice='fastest'; valid: 'measure', 'cached', 'prior'"):
        Options.parse({"kernel_choice": "fastest"})
    monkeypatch.setenv(choice.ENVIRONMENT, "fast")
    with pytest.raises(ValueError, match="kernel_choice='fast'"):
        Options.parse({})


def test_the_zmm_probe_is_measured_once_per_machine(cache_dir):
    probes = []
    valid = choice_cache.number(0.0, 2.0)
    first = choice_cache.shared().remembered("probe", lambda: probes.append(1) or 1.5, valid)
    choice_cache._shared = None
    assert choice_cache.shared().remembered("probe", lambda: probes.append(1) or 0.5, valid) == first == 1.5
    assert probes == [1]


def _rewrite_records(cache_dir, change) -> None:
    """Each kernel choice kept in the machine's file passed through ``change`` (a hand edit, a
    torn write of another version), as the next process reads it."""
    path = next(cache_dir.glob("*.json"))
    saved = json.loads(path.read_text())
    saved["entries"] = {name: change(dict(r)) if "winner" in r else r for name, r in saved["entries"].items()}
    path.write_text(json.dumps(saved))
    choice_cache._shared = None


MALFORMED = {"a field missing": lambda r: {k: v for k, v in r.items() if k != "fallback"},
             "a time that is text": lambda r: {**r, "own": "fast"},
             "a time that is NaN": lambda r: {**r, "fallback": float("nan")},
             "a winner the times contradict": lambda r: {**r, "winner": "fallback"},
             "an unknown winner": lambda r: {**r, "winner": "float"},
             "not a record": lambda r: [r["winner"]]}


@pytest.mark.parametrize("change", MALFORMED.values(), ids=MALFORMED)
def test_an_invalid_record_is_measured_again_and_overwritten(cache_dir, monkeypatch, change):
    """A record with a field missing had raised a KeyError the lowering took for "failed to
    emit": every later process ran those convs in float between quantize / dequantize pairs."""
    compiled(monkeypatch, SimulatedMachine(own_us=100, onednn_us=300))
    _rewrite_records(cache_dir, change)
    again = SimulatedMachine(own_us=100, onednn_us=300)
    captured = compiled(monkeypatch, again)
    assert ops(captured) == OWN and again.layers == 3, str(captured.report)
    records = [r for r in json.loads(next(cache_dir.glob("*.json")).read_text())["entries"].values() if "winner" in r]
    assert [choice.RECORD.why_invalid(r) for r in records] == [None] * 3  # (rewritten)


def test_an_invalid_record_in_cached_mode_leaves_the_fixed_table_to_decide(cache_dir, monkeypatch):
    compiled(monkeypatch, SimulatedMachine(own_us=300, onednn_us=100))
    _rewrite_records(cache_dir, MALFORMED["a field missing"])
    again = SimulatedMachine(own_us=300, onednn_us=100)
    captured = compiled(monkeypatch, again, mode="cached")
    assert ops(captured) == OWN and again.layers == 0, str(captured.report)  # (the prior: own kernels at these sizes)


def test_records_of_another_layout_or_qbackend_version_are_not_read(cache_dir, monkeypatch):
    from qbackend import version

    assert {k: choice_cache.machine()[k] for k in ("layout", "qbackend")} == {"layout": choice_cache.LAYOUT,
                                                                          "qbackend": version.VERSION}
    for field, value in (("LAYOUT", choice_cache.LAYOUT - 1), ("VERSION", "0.0.1")):
        with monkeypatch.context() as older:
            older.setattr(choice_cache if field == "LAYOUT" else version, field, value)
            compiled(older, SimulatedMachine(own_us=300, onednn_us=100))
        choice_cache._shared = None
        again = SimulatedMachine(own_us=100, onednn_us=300)
        assert ops(compiled(monkeypatch, again)) == OWN and again.layers == 3
        for path in cache_dir.glob("*.json"):
            path.unlink()
        choice_cache._shared = None
