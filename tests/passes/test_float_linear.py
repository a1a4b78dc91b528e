"""The linears the quantizer left float: MKL's or oneDNN's packed GEMM, measured on the machine
that compiles (qbackend/passes/float_linear.py), the choice cached like the int8 layers'."""
import torch

from qbackend.lowering import choice

from tests.helpers import assert_matches_reference, quantize
from tests.pipeline.test_unlowered import BatchFirstAttention

MKL, ONEDNN = torch.ops.mkl._mkl_linear.default, torch.ops.mkldnn._linear_pointwise.default


class SimulatedMachine:
    """choice.measure where one GEMM is faster; checks that both candidates give the same
    values on the same inputs and counts the signatures it was asked to time."""

    def __init__(self, mkl_us: float, onednn_us: float):
        self.seconds = {"mkl": mkl_us * 1e-6, "onednn": onednn_us * 1e-6}
        self.widths = []

    def __call__(self, runs: dict) -> dict:
        outputs = {name: fn(*args) for name, (fn, args) in runs.items()}
        torch.testing.assert_close(outputs["mkl"], outputs["onednn"], rtol=1e-5, atol=1e-5)
        self.widths.append(outputs["mkl"].shape[-1])
        return dict(self.seconds)



def compiled(monkeypatch, machine, mode="measure"):
    monkeypatch.setattr(choice, "measure", machine)
    inputs = (torch.randn(3, 10, 32),)
    return assert_matches_reference(quantize(BatchFirstAttention().eval(), inputs, every_linear=False), inputs, kernel_choice=mode)


def float_gemms(captured) -> list:
    return [n.target for n in captured.lowered.graph.nodes if n.target in (MKL, ONEDNN, torch.ops.aten.linear.default)]


def test_where_onednn_is_faster_it_runs_both_projections(cache_dir, monkeypatch):
    machine = SimulatedMachine(mkl_us=300, onednn_us=100)
    captured = compiled(monkeypatch, machine)
    assert float_gemms(captured) == [ONEDNN, ONEDNN], captured.lowered.graph
    assert sorted(machine.widths) == [32, 96]  # (in-projection 3 x 32, out-projection 32: one timing each)
    assert ("2 float linear(s) on oneDNN (measured on this machine: MKL's sgemm 300 us vs oneDNN 100 us), weight packed once"
            in captured.report.notes), captured.report.notes


def test_where_mkl_is_faster_it_stays_and_the_next_compile_reads_the_cache(cache_dir, monkeypatch):
    machine = SimulatedMachine(mkl_us=100, onednn_us=300)
    assert float_gemms(compiled(monkeypatch, machine)) == [MKL, MKL]
    assert len(machine.widths) == 2
    again = compiled(monkeypatch, machine, mode="cached")
    assert float_gemms(again) == [MKL, MKL]
    assert len(machine.widths) == 2  # (not timed again)
    assert any("MKL's sgemm 100 us vs oneDNN 300 us" in note for note in again.report.notes), again.report.notes


def test_cached_mode_without_a_measurement_keeps_inductors_choice(cache_dir, monkeypatch):
    machine = SimulatedMachine(mkl_us=300, onednn_us=100)
    captured = compiled(monkeypatch, machine, mode="cached")
    assert float_gemms(captured) == [MKL, MKL] and machine.widths == []
    assert "2 float linear(s) on MKL's sgemm, weight packed once" in captured.report.notes
