"""Linears reading the same int8 activation with the same output arguments (Q, K, V) run as
one qlinear (or one call of qbackend's own GEMM kernel) over their concatenated weights, bit for
bit the separate calls; a sibling whose output a later kernel updates in place, or whose output
arguments differ, keeps its own call."""
import expecttest
import pytest
import torch
import torch.nn as nn

import qbackend
import qbackend.lowering as lowering
from qbackend.kernels import isa
from qbackend.lowering import gemm

from tests.tolerances import assert_weight_only_close
from tests.helpers import assert_matches_reference, compile_and_run, lower_without_running, needs_own_kernels, onednn_linear_rows, quantize, short_graph


class Projections(nn.Module):
    """Attention's Q, K and V of one input (V with other widths and no bias), plus a fourth
    linear with a relu: its output arguments differ, so it is no sibling of the others."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.gate = nn.Linear(32, 16), nn.Linear(32, 16), nn.Linear(32, 24, bias=False), nn.Linear(32, 24)

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


KERNELS = {"onednn": "= onednn.qlinear", "own": "= conv_gemm.qconv("}  # kernel -> how its calls print


def inputs(kernel="onednn"):
    torch.manual_seed(0)
    rows = onednn_linear_rows() if kernel == "onednn" else 16  # (within every GEMM build's max_rows)
    return (torch.randn(2, rows // 2, 32),)


def _qlinear_lines(captured) -> list[str]:
    return [line for line in short_graph(captured.lowered).splitlines()
            if any(call in line for call in KERNELS.values()) or ".narrow(" in line]


class TestSiblingGraph(expecttest.TestCase):
    def test_q_k_v_run_as_one_call(self):
        torch.manual_seed(0)
        captured = assert_matches_reference(quantize(Projections(), inputs()), inputs())
        self.assertExpectedInline("\n".join(_qlinear_lines(captured)), """\
qlinear_pointwise_default_4 = onednn.qlinear_pointwise(quantize_per_tensor_default, 0.0645, 63, <const>, <const>, <const>, <const>, 1, 0, float32, 'none', [], '')
slice_tensor = qlinear_pointwise_default_4.narrow(-1, 0, 16)
slice_tensor_1 = qlinear_pointwise_default_4.narrow(-1, 16, 16)
slice_tensor_2 = qlinear_pointwise_default_4.narrow(-1, 32, 24)
qlinear_pointwise_default_3 = onednn.qlinear_pointwise(quantize_per_tensor_default, 0.0645, 63, <const>, <const>, <const>, <const>, 0.0172, 0, uint8, 'hardtanh', [0, 2.19], '')""")
        notes = {d.node: d.reason for d in captured.report.decisions}
        assert notes["linear"].endswith("; one call with linear_1, linear_2 (same input, weights concatenated)"), str(captured.report)
        assert "one call" not in notes["linear_3"], str(captured.report)

    @needs_own_kernels
    def test_q_k_v_run_as_one_call_of_the_own_kernel(self):
        torch.manual_seed(0)
        captured = assert_matches_reference(quantize(Projections(), inputs("own")), inputs("own"))
        self.assertExpectedInline("\n".join(_qlinear_lines(captured)), """\
qconv_4 = conv_gemm.qconv(reshape_default, <const>, <const>, <const>, None, 0, -inf, inf, 1, 0, 0, 255, True, 'none')
slice_tensor = reshape_default_8.narrow(-1, 0, 16)
slice_tensor_1 = reshape_default_8.narrow(-1, 16, 16)
slice_tensor_2 = reshape_default_8.narrow(-1, 32, 24)
qconv_3 = conv_gemm.qconv(reshape_default_6, <const>, <const>, <const>, None, 0, 0, inf, 0.0154, 0, 0, 127, False, 'none')""")
        notes = {d.node: d.reason for d in captured.report.decisions}
        assert notes["linear"] == "qbackend's int8 GEMM kernel (16 rows); one call with linear_1, linear_2 (same input, weights concatenated)", str(captured.report)
        assert "one call" not in notes["linear_3"], str(captured.report)


@needs_own_kernels
@pytest.mark.parametrize("kernel", KERNELS)
def test_merged_call_is_bit_exact(monkeypatch, kernel):
    torch.manual_seed(0)
    model = quantize(Projections(), inputs(kernel))
    merged, _, captured = compile_and_run(model, inputs(kernel))
    monkeypatch.setitem(lowering.FINISH, "cpu", ())
    separate, _, unmerged = compile_and_run(model, inputs(kernel))
    calls = [sum(KERNELS[kernel] in line for line in _qlinear_lines(c)) for c in (captured, unmerged)]
    assert calls == [2, 4], calls
    assert torch.equal(merged, separate)


@needs_own_kernels
def test_sibling_updated_in_place_keeps_its_own_call():
    torch.manual_seed(0)
    captured = assert_matches_reference(quantize(ResidualSibling(), inputs()), inputs())
    assert not any("slice" in line for line in _qlinear_lines(captured)), short_graph(captured.lowered)
    notes = {d.source: d.reason for d in captured.report.decisions if d.kind == "linear"}
    onednn = (f"oneDNN, not qbackend's linear kernel: {inputs()[0].shape[:-1].numel()} rows > {gemm.limits().max_rows}"
              f" in LIMITS[{isa.gemm_build()!r}]")
    assert notes == {"q": onednn, "k": onednn, "out": f"{onednn}; residual updated in place"}, str(captured.report)


@needs_own_kernels
def test_sibling_read_as_the_own_kernels_residual_is_merged():
    """qbackend's own kernel only reads its residual (and copies a strided one): k may merge."""
    torch.manual_seed(0)
    captured = assert_matches_reference(quantize(ResidualSibling(), inputs("own")), inputs("own"))
    notes = {d.source: d.reason for d in captured.report.decisions if d.kind == "linear"}
    own = "qbackend's int8 GEMM kernel (16 rows)"
    assert notes == {"q": f"{own}; one call with linear_2 (same input, weights concatenated)",
                     "k": f"{own}; one call with linear (same input, weights concatenated)",
                     "out": f"{own}; residual added out of place"}, str(captured.report)


@pytest.mark.parametrize("device", ["cpu", "xpu"])
def test_no_int8_weight_is_left_behind_in_the_lowered_graph(device):
    """The emitters mark each qlinear with the int8 weight it was packed from, for the merge;
    on every device the marks go once lowering ends, or each weight would stay in memory twice."""
    from qbackend.lowering.common import SIBLING

    from tests.xpu_builds import SimulatedXpuBuild

    torch.manual_seed(0)
    registry = SimulatedXpuBuild() if device == "xpu" else None
    lowered, report = lower_without_running(quantize(Projections(), inputs()), inputs(), registry, device=device)
    assert {"q", "k", "v"} <= {d.source for d in report.lowered}, str(report)
    assert not [n.name for n in lowered.graph.nodes if SIBLING in n.meta]


class LlamaProjections(nn.Module):
    """A Llama block's Q / K / V (of one normed input) and gate / up (of another), no biases."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(128, 128, bias=False), nn.Linear(128, 32, bias=False), nn.Linear(128, 32, bias=False)
        self.gate, self.up, self.down = nn.Linear(128, 256, bias=False), nn.Linear(128, 256, bias=False), nn.Linear(256, 128, bias=False)

    def forward(self, x):
        attended = self.q(x) * torch.cat([self.k(x), self.v(x)], -1).repeat(1, 1, 2)
        h = x + attended
        return self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def _weight_only_lines(captured) -> list[str]:
    return [line for line in short_graph(captured.lowered).splitlines() if "= weight_only_mm.int" in line or ".narrow(" in line]


class TestWeightOnlySiblingGraph(expecttest.TestCase):
    @needs_own_kernels
    def test_q_k_v_and_gate_up_run_as_one_call_each(self):
        torch.manual_seed(0)
        model = qbackend.quantize_weights(LlamaProjections().eval(), bits=4, group_size=64)
        _, _, captured = compile_and_run(model, (torch.randn(1, 3, 128),))
        self.assertExpectedInline("\n".join(_weight_only_lines(captured)), """\
int4_mm_int16_6 = weight_only_mm.int4_mm_int16(reshape_default, <const>, <const>, <const>, 64)
int4_mm_int16_7 = weight_only_mm.int4_mm_int16(reshape_default_3, <const>, <const>, <const>, 64)
int4_mm_int16_5 = weight_only_mm.int4_mm_int16(reshape_default_5, <const>, <const>, <const>, 64)""")
        notes = {d.source: d.reason for d in captured.report.decisions}
        assert notes["q"].endswith("one call with linear_1, linear_2 (same input, weights concatenated)"), str(captured.report)
        assert notes["up"].endswith("one call with linear_3 (same input, weights concatenated)"), str(captured.report)
        assert "one call" not in notes["down"], str(captured.report)


@needs_own_kernels
@pytest.mark.parametrize("bits", [4, 8])
def test_merged_weight_only_call_is_bit_exact(monkeypatch, bits):
    torch.manual_seed(0)
    model = qbackend.quantize_weights(LlamaProjections().eval(), bits=bits, group_size=64 if bits == 4 else None)
    x = (torch.randn(2, 5, 128),)
    merged, expected, captured = compile_and_run(model, x)
    monkeypatch.setitem(lowering.FINISH, "cpu", ())
    separate, _, unmerged = compile_and_run(model, x)
    calls = [sum("= weight_only_mm.int" in line for line in _weight_only_lines(c)) for c in (captured, unmerged)]
    assert calls == [3, 6], calls
    assert torch.equal(merged, separate)
    assert_weight_only_close(merged, expected)


@needs_own_kernels
def test_siblings_with_float_and_integer_zero_points_keep_their_own_calls():
    """An integer zero point packs as int8 offset codes, a float offset (torchao's float
    zero-point domain) as float32 offsets: a cat of the two would read the codes as offsets."""
    from qbackend.quantized_tensor import QuantizedLinearWeight

    torch.manual_seed(0)
    model = qbackend.quantize_weights(LlamaProjections().eval(), bits=4, group_size=64)
    w = model.q.weight
    float_offsets = QuantizedLinearWeight(w.qdata, w.scale, -w.zero.float() * w.scale, 4, 64, tuple(w.shape), w.dtype)
    model.q.weight = nn.Parameter(float_offsets, requires_grad=False)  # (the same weights: w = q s - z s)
    actual, expected, captured = compile_and_run(model, (torch.randn(2, 5, 128),))
    notes = {d.source: d.reason for d in captured.report.decisions}
    assert not any("one call" in notes[name] for name in ("q", "k", "v")), str(captured.report)  # (the group is refused)
    assert notes["up"].endswith("one call with linear_3 (same input, weights concatenated)"), str(captured.report)
    assert_weight_only_close(actual, expected)
