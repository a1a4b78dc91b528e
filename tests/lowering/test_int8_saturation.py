"""x86 CPUs without VNNI add pairs of uint8 x int8 products in int16 and saturate: 8-bit
activations times full-range weights come out wrong. qbackend asks the kernel, lowers only
where no pair can overflow, and keeps the rest exact with the reason."""
import pytest
import torch
import torch.nn as nn

from qbackend.lowering.capabilities import INT16_MAX, int8_pairs_saturate
from qbackend.lowering.cpu import _largest_pair_sum
from qbackend.patterns.examples import HandQuantized
from qbackend.pt2e_flow import cpu_needs_reduce_range

from tests.helpers import (needs_own_kernels, SATURATION_REASON, assert_matches_reference, compile_and_run, onednn_linear_rows, onednn_only, quantize, short_graph,
                      simulate_cpu)
from tests.tolerances import assert_outputs_close


def test_the_probe_says_what_the_kernel_computes_on_random_data():
    """A full-range dot product through the real kernel is exact exactly when the probe says
    this CPU does not saturate."""
    torch.manual_seed(0)
    x = torch.randint(0, 256, (4, 64), dtype=torch.uint8)
    w = torch.randint(-128, 128, (8, 64), dtype=torch.int8)
    scale, zp = torch.ones(8), torch.zeros(8, dtype=torch.int64)
    packed = torch.ops.onednn.qlinear_prepack(w, [4, 64])
    got = torch.ops.onednn.qlinear_pointwise(x, 1.0, 0, packed, scale, zp, None, 1.0, 0, torch.float32, "none", [], "")
    exact = x.double() @ w.double().t()
    assert torch.equal(got.double(), exact) == (not int8_pairs_saturate("cpu", "linear"))
    assert cpu_needs_reduce_range() == (int8_pairs_saturate("cpu", "conv") or int8_pairs_saturate("cpu", "linear"))


def _conv_linear():
    return nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 6 * 6, 10))


def test_full_range_model_runs_exact_and_unlowered_where_only_a_saturating_kernel_could_run_it(monkeypatch):
    """Without qbackend's own kernels (their GEMM has an exact build: test_gemm_exact16.py)."""
    simulate_cpu(monkeypatch, saturates=True)
    onednn_only(monkeypatch)
    inputs = (torch.randn(2, 8, 6, 6),)
    model = quantize(_conv_linear(), inputs, reduce_range=False)
    actual, expected, captured = compile_and_run(model, inputs)
    assert_outputs_close(actual, expected, "full-range model")
    report = captured.report
    assert [d.node for d in report.kept] == ["conv2d", "linear"], str(report)
    assert all(SATURATION_REASON in d.reason and "7-bit weights" in d.reason for d in report.kept), str(report)


@pytest.mark.parametrize("reduce_range", ["activations", "weights"])
def test_seven_bit_activations_or_weights_lower_where_the_kernel_saturates(monkeypatch, reduce_range):
    simulate_cpu(monkeypatch, saturates=True)
    inputs = (torch.randn(2, 8, 6, 6),)
    model = quantize(_conv_linear(), inputs, reduce_range=reduce_range)
    weights = [n.args[0] for n in model.graph.nodes if "dequantize_per_channel" in str(n.target)]
    ranges = {tuple(getattr(model, w.target).aminmax()) for w in weights}
    assert max(hi for _, hi in ranges) <= (63 if reduce_range == "weights" else 127), ranges
    report = assert_matches_reference(model, inputs).report
    assert not report.kept, str(report)


def test_depthwise_conv_has_no_pairs_and_lowers_with_full_range_activations(monkeypatch):
    """One input channel per group: no two products share an int16 sum (measured exact on an
    AVX2-only CPU), so 8-bit activations lower on oneDNN even where its kernel saturates."""
    simulate_cpu(monkeypatch, saturates=True)
    onednn_only(monkeypatch)
    inputs = (torch.randn(2, 8, 10, 10),)
    model = quantize(nn.Sequential(nn.Conv2d(8, 8, 3, groups=8), nn.ReLU(), nn.Conv2d(8, 8, 1)), inputs, reduce_range=False)
    report = assert_matches_reference(model, inputs).report
    assert [(d.node, d.lowered) for d in report.decisions] == [("conv2d", True), ("conv2d_1", False)], str(report)


def test_seven_bit_weights_leave_depthwise_convs_their_8_bits(monkeypatch):
    """reduce_range="weights" narrows the weights whose kernels add two input channels' products
    in int16; a depthwise conv's have no pairs and keep 8 bits, exact on every kernel."""
    simulate_cpu(monkeypatch, saturates=True)
    inputs = (torch.randn(2, 8, 10, 10),)
    model = quantize(nn.Sequential(nn.Conv2d(8, 16, 1), nn.ReLU(), nn.Conv2d(16, 16, 3, groups=16), nn.ReLU(),
                                   nn.Conv2d(16, 8, 1)), inputs, reduce_range="weights")
    weights = [getattr(model, n.args[0].target) for n in model.graph.nodes if "dequantize_per_channel" in str(n.target)]
    assert [(tuple(w.shape[:2]), -64 <= int(w.min()) and int(w.max()) <= 63) for w in weights] == [
        ((16, 8), True), ((16, 1), False), ((8, 16), True)]
    report = assert_matches_reference(model, inputs).report
    assert not report.kept, str(report)


class PatchStem(nn.Module):
    """ConvNeXt's stem: a 4x4 stride-4 conv of 3 channels read by a float LayerNorm."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv2d(3, 16, 4, 4), nn.LayerNorm(16), nn.Conv2d(16, 8, 1)

    def forward(self, x):
        y = self.norm(self.conv(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.head(y)


def _stem_weights_within_seven_bits(model) -> bool:
    (stem, *_) = [getattr(model, n.args[0].target) for n in model.graph.nodes if "dequantize_per_channel" in str(n.target)]
    assert stem.shape[1] == 3
    return -64 <= int(stem.min()) and int(stem.max()) <= 63


@needs_own_kernels
def test_seven_bit_weights_leave_a_stem_its_8_bits_where_the_stem_kernel_runs_it(monkeypatch):
    """A stem conv whose output is quantized keeps 8 bits: the stem kernel runs it exactly
    (its AVX2 build on int16 pairs). One whose output a float op reads would stay float with
    8 bits where oneDNN saturates (the stem kernel writes uint8 only): it keeps 7."""
    simulate_cpu(monkeypatch, saturates=True)
    inputs = (torch.randn(2, 3, 16, 16),)
    model = quantize(nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 8, 1)), inputs,
                     reduce_range="weights")
    assert not _stem_weights_within_seven_bits(model)
    report = assert_matches_reference(model, inputs).report
    assert not report.kept and report.decisions[0].op == "qbackend::qconv_stem.default", str(report)
    patch = quantize(PatchStem().eval(), inputs, reduce_range="weights")
    assert _stem_weights_within_seven_bits(patch)
    assert not assert_matches_reference(patch, inputs).report.kept


def test_pair_bound_reads_input_channel_pairs_of_one_sign_per_output_and_kernel_position():
    """With uint8 activations two products of one sign add up; of opposite signs a pair never
    passes its larger member."""
    w = torch.zeros(2, 3, 2, 2, dtype=torch.int8)
    w[0, 0, 0, 0], w[0, 1, 0, 0], w[0, 2, 1, 1] = 127, -100, 127  # opposite signs at (0, 0); (1, 1) is alone
    w[1, :, 0, 1] = torch.tensor([50, 60, -70], dtype=torch.int8)
    assert _largest_pair_sum(w) == 127
    w[1, :, 1, 0] = torch.tensor([-100, 30, -60], dtype=torch.int8)
    assert _largest_pair_sum(w) == 160
    assert _largest_pair_sum(torch.full((4, 1, 3, 3), -128, dtype=torch.int8)) == 128  # depthwise
    assert 127 * 256 <= INT16_MAX < 255 * 2 * 127
    # whole groups of 4 input channels: the pairs oneDNN adds, 2j and 2j + 1 (0-1 and 2-3 here)
    grouped = torch.zeros(1, 4, 1, 1, dtype=torch.int8)
    grouped[0, :, 0, 0] = torch.tensor([127, 0, 0, -127], dtype=torch.int8)
    assert _largest_pair_sum(grouped) == 127
    grouped[0, :, 0, 0] = torch.tensor([127, -127, -100, -29], dtype=torch.int8)
    assert _largest_pair_sum(grouped) == 129


class PairBoundModel(nn.Module):
    """Layers whose input channels come in groups of 4 (a 3x3 conv, a 1x1, a linear) and one
    whose do not (6), normal-initialized as trained weights are shaped."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Conv2d(8, 6, 3, padding=1), nn.Conv2d(6, 16, 1)
        self.third, self.head = nn.Conv2d(16, 8, 1), nn.Linear(8 * 6 * 6, 12)
        for layer in (self.first, self.second, self.third, self.head):
            nn.init.normal_(layer.weight, std=0.1)

    def forward(self, x):
        x = self.third(torch.relu(self.second(torch.relu(self.first(x)))))
        return self.head(torch.relu(x).flatten(1))


@pytest.mark.parametrize("kernels", ["own kernels", "oneDNN only"])
def test_pair_bounded_weights_keep_8_bits_and_lower_exactly_where_the_kernel_saturates(monkeypatch, kernels):
    """reduce_range="pairs" (the default on such CPUs): each channel's scale is its largest
    adjacent pair sum / 127, so every pair the kernels add stays within 128 with 8-bit integers;
    a layer whose input channels do not come in groups of 4 gets 7 bits."""
    from qbackend.lowering.gemm import largest_pair_sums, pairs_of_whole_words

    simulate_cpu(monkeypatch, saturates=True)
    if kernels == "oneDNN only":
        onednn_only(monkeypatch)
    torch.manual_seed(0)
    float_model, inputs = PairBoundModel().eval(), (torch.randn(2, 8, 6, 6),)
    model = quantize(float_model, inputs, reduce_range="pairs")
    dequantizes = [n for n in model.graph.nodes if "dequantize_per_channel" in str(n.target)]
    found = {}
    for node, layer in zip(dequantizes, (float_model.first, float_model.second, float_model.third, float_model.head)):
        ints, scale = getattr(model, node.args[0].target), getattr(model, node.args[1].target)
        found[layer.weight.shape[1]] = (node.args[4], node.args[5], int(ints.abs().max()) > 64,
                                        int(largest_pair_sums(ints).max()) <= 128)
        if pairs_of_whole_words(layer.weight.shape):
            assert torch.allclose(scale, largest_pair_sums(layer.weight.detach()) / 127)
    assert found == {8: (-128, 127, True, True), 6: (-64, 63, False, True), 16: (-128, 127, True, True),
                     288: (-128, 127, True, True)}, found
    report = assert_matches_reference(model, inputs).report
    assert not report.kept, str(report)


class OppositeSignPairs(nn.Module):
    """A 1x1 conv, a 3x3 conv and a linear whose adjacent input channels (features) have
    opposite signs: 8-bit weights whose pairs add up to ~250 in magnitude, ~128 in reach."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.head = nn.Conv2d(8, 16, 1), nn.Conv2d(16, 8, 3, padding=1), nn.Linear(8 * 6 * 6, 12)
        torch.manual_seed(0)
        for layer in (self.first, self.second, self.head):
            sign = torch.tensor([1.0, -1.0]).repeat(layer.weight.shape[1] // 2)
            with torch.no_grad():
                layer.weight.copy_(torch.empty_like(layer.weight).uniform_(0.6, 1.0)
                                   * sign.reshape(1, -1, *[1] * (layer.weight.dim() - 2)))

    def forward(self, x):
        x = torch.relu(self.second(torch.relu(self.first(x))))
        return self.head(x.flatten(1))


@pytest.mark.parametrize("kernels", ["own kernels", "oneDNN only"])
def test_weights_whose_pairs_have_opposite_signs_keep_8_bits_on_the_fast_kernels(monkeypatch, kernels):
    """8-bit activations x 8-bit weights where every pair the kernels add mixes signs: no int16
    sum can pass 255 x 127, so oneDNN and the GEMM's vpmaddubsw build run every layer exactly
    (by |w_a| + |w_b| each pair would have reached ~250 x 255)."""
    from qbackend.lowering.gemm import largest_pair_sums

    simulate_cpu(monkeypatch, saturates=True)
    if kernels == "oneDNN only":
        onednn_only(monkeypatch)
    inputs = (torch.randn(2, 8, 6, 6) * 3,)
    model = quantize(OppositeSignPairs().eval(), inputs, reduce_range=False)
    weights = [getattr(model, n.args[0].target) for n in model.graph.nodes if "dequantize_per_channel" in str(n.target)]
    assert [(int(largest_pair_sums(w).max()) <= 128, int(w.to(torch.int32).abs().amax()) >= 127) for w in weights] == [
        (True, True)] * 3
    assert all(int(largest_pair_sums(w.to(torch.int32).abs()).max()) > 200 for w in weights)  # (|w_a| + |w_b|)
    report = assert_matches_reference(model, inputs).report
    assert not report.kept, str(report)
    assert not any("exact int16 build" in (d.reason or "") for d in report.decisions), str(report)


@pytest.mark.parametrize("post_op,clipped_by", [(None, "hardtanh"), ("relu", "hardtanh"), ("relu6", "hardtanh"),
                                                ("gelu", "clamp_to_range_")])
def test_seven_bit_outputs_are_clipped_to_their_range(post_op, clipped_by):
    """The kernels clamp int8 outputs to [0, 255]; a 7-bit output is clipped to [0, 127] by a
    hardtanh folded into the kernel or, for other post-ops, a clamp after it. Inputs drive
    most outputs past the range's top, so a missing clip shows in the int8 comparison."""
    model = HandQuantized(rank=0, in_ch=256, out_ch=16, post_op=post_op)
    inputs = (torch.full((onednn_linear_rows(), 256), 2.5),)  # oneDNN's kernel (qbackend's own: below)
    with torch.no_grad():
        assert (model(*inputs) >= 4.6).float().mean() > 0.3  # (127 - 50) * 0.06: the top of the range
    captured = assert_matches_reference(model, inputs)
    graph = short_graph(captured.lowered)
    assert clipped_by in graph, graph


def test_unknown_reduce_range_is_a_clear_error():
    with pytest.raises(ValueError, match="reduce_range must be None or one of"):
        quantize(_conv_linear(), (torch.randn(2, 8, 6, 6),), reduce_range="both")


@needs_own_kernels
@pytest.mark.parametrize("post_op", [None, "relu", "relu6", "gelu"])
def test_seven_bit_outputs_of_the_own_gemm_kernel_stay_in_range(post_op):
    """qbackend's own int8 GEMM clamps to the output's [qmin, qmax] itself, after any post-op."""
    model = HandQuantized(rank=0, in_ch=256, out_ch=16, post_op=post_op)
    captured = assert_matches_reference(model, (torch.full((4, 256), 2.5),))
    graph = short_graph(captured.lowered)
    assert "conv_gemm.qconv(" in graph and f", 0, 127, False, '{post_op if post_op == 'gelu' else 'none'}')" in graph, graph
    assert "clamp_to_range" not in graph, graph
