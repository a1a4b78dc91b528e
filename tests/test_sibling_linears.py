"""Linears reading the same int8 activation with the same output arguments (Q, K, V) run as
one qlinear over their concatenated weights, bit for bit the separate calls; a sibling whose
output a later kernel updates in place, or whose output arguments differ, keeps its own call."""
import expecttest
import pytest
import torch
import torch.nn as nn

import qbackend.lowering as lowering

from .helpers import assert_matches_reference, compile_and_run, lower_without_running, quantize, short_graph


class Projections(nn.Module):
    """Attention's Q, K and V of one input (V with other widths and no bias), plus a fourth
    linear with a relu: its output arguments differ, so it is no sibling of the others."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.gate = nn.Linear(32, 16), nn.Linear(32, 16), nn.Linear(32, 12, bias=False), nn.Linear(32, 12)

    def forward(self, x):
        attention = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), dim=-1) @ self.v(x)
        return attention * torch.relu(self.gate(x))


class ResidualSibling(nn.Module):
    """k's output is the residual of a later linear's add: that kernel may write into it."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.out = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        return self.out(torch.softmax(self.q(x), dim=-1)) + self.k(x)


def inputs():
    torch.manual_seed(0)
    return (torch.randn(2, 12, 32),)  # 24 rows: oneDNN's qlinear (qbackend's own GEMM takes <= 16 rows, unmerged)


def _qlinear_lines(captured) -> list[str]:
    return [line for line in short_graph(captured.lowered).splitlines() if "= onednn.qlinear" in line or "= aten.slice" in line]


class TestSiblingGraph(expecttest.TestCase):
    def test_q_k_v_run_as_one_call(self):
        torch.manual_seed(0)
        captured = assert_matches_reference(quantize(Projections(), inputs()), inputs())
        self.assertExpectedInline("\n".join(_qlinear_lines(captured)), """\
qlinear_pointwise_default_4 = onednn.qlinear_pointwise(quantize_per_tensor_default, 0.0571, 55, <const>, <const>, <const>, <const>, 1, 0, float32, 'none', [], '')
slice_tensor = aten.slice.Tensor(qlinear_pointwise_default_4, -1, 0, 16)
slice_tensor_1 = aten.slice.Tensor(qlinear_pointwise_default_4, -1, 16, 32)
slice_tensor_2 = aten.slice.Tensor(qlinear_pointwise_default_4, -1, 32, 44)
qlinear_pointwise_default_3 = onednn.qlinear_pointwise(quantize_per_tensor_default, 0.0571, 55, <const>, <const>, <const>, <const>, 0.0138, 0, uint8, 'hardtanh', [0, 1.75], '')""")
        notes = {d.node: d.reason for d in captured.report.decisions}
        assert notes["linear"] == "one call with linear_1, linear_2 (same input, weights concatenated)", str(captured.report)
        assert "one call" not in notes["linear_3"], str(captured.report)


def test_merged_call_is_bit_exact(monkeypatch):
    torch.manual_seed(0)
    model = quantize(Projections(), inputs())
    merged, _, captured = compile_and_run(model, inputs())
    monkeypatch.setitem(lowering.FINISH, "cpu", ())
    separate, _, unmerged = compile_and_run(model, inputs())
    calls = [sum("onednn.qlinear" in line for line in _qlinear_lines(c)) for c in (captured, unmerged)]
    assert calls == [2, 4], calls
    assert torch.equal(merged, separate)


def test_sibling_updated_in_place_keeps_its_own_call():
    torch.manual_seed(0)
    captured = assert_matches_reference(quantize(ResidualSibling(), inputs()), inputs())
    assert not any("slice" in line for line in _qlinear_lines(captured)), short_graph(captured.lowered)
    notes = {d.source: d.reason for d in captured.report.decisions if d.kind == "linear"}
    assert notes == {"q": "", "k": "", "out": "residual updated in place"}, str(captured.report)


@pytest.mark.parametrize("device", ["cpu", "xpu"])
def test_no_int8_weight_is_left_behind_in_the_lowered_graph(device):
    """The emitters mark each qlinear with the int8 weight it was packed from, for the merge;
    on every device the marks go once lowering ends, or each weight would stay in memory twice."""
    from qbackend.lowering.common import SIBLING

    from .xpu_builds import SimulatedXpuBuild

    torch.manual_seed(0)
    registry = SimulatedXpuBuild() if device == "xpu" else None
    lowered, report = lower_without_running(quantize(Projections(), inputs()), inputs(), registry, device=device)
    assert {"q", "k", "v"} <= {d.source for d in report.lowered}, str(report)
    assert not [n.name for n in lowered.graph.nodes if SIBLING in n.meta]
