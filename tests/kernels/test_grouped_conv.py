"""Grouped 3x3 int8 convs (ResNeXt's, RegNet's) on qbackend's own kernel, each build this CPU
runs: its bytes against the float64 reference and oneDNN's, the lowering of a ResNeXt
bottleneck, the convs it leaves to oneDNN with the reason (groups it does not take), and the
exact int16 build that runs 8-bit weights whose pair sums the AVX2 build would saturate."""
import math

import pytest
import torch
import torch.nn as nn

from qbackend.kernels import registry
from qbackend.lowering import choice, grouped
from qbackend.lowering import cpu as lowering_cpu
from qbackend.lowering.capabilities import grouped_conv_inexact
from qbackend.lowering.own_conv import scale_and_offset
from qbackend.ops import resolve

from tests.helpers import assert_matches_reference, needs_own_kernels, quantize
from tests.tolerances import assert_int8_close

X_SCALE, X_ZP, OUT_SCALE, OUT_ZP = 0.02, 3, 0.05, 5  # (the tests' input and output quantization)

# (batch, channels, size, groups, stride): 4 / 8 / 16 / 32 channels a group; rows of fewer than 8
# output pixels and rows not a multiple of 8; borders at every side
CASES = [(1, 64, 12, 16, 1), (2, 64, 9, 8, 2), (1, 64, 7, 4, 1), (1, 32, 5, 8, 2), (2, 128, 11, 4, 2), (1, 96, 6, 3, 1),
         (1, 40, 7, 5, 1), (1, 24, 9, 6, 2),  # (these two: an odd number of 8-channel blocks)
         (1, 72, 9, 3, 2), (1, 80, 6, 2, 1)]  # (24 / 40 channels a group: a pair of blocks spans two groups; RegNetX's)
# every group width the kernel takes up to 64, in 2 and 3 groups (odd and even block counts, pairs
# of blocks within a group and across two)
CASES += [(1, width * groups, 5, groups, 1) for width in (8, 16, 24, 32, 40, 48, 56, 64) for groups in (2, 3)]
# batches of images wide enough for tiles inside the image (read in place) beside border tiles
CASES += [(2, 48, 21, 6, 2), (3, 32, 14, 8, 1), (2, 64, 18, 8, 1)]


def _case(batch, channels, size, groups, stride, seed=0, weight_bits=8):
    torch.manual_seed(seed)
    x = torch.randint(0, 256, (batch, channels, size, size), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    low = -2 ** (weight_bits - 1)
    w = torch.randint(low, -low, (channels, channels // groups, 3, 3), dtype=torch.int8)
    w_scale, bias = torch.rand(channels) * 0.002 + 5e-4, torch.randn(channels)
    return x, w, w_scale, bias


@pytest.mark.parametrize("case", CASES, ids=str)
def test_grouped_kernel_bytes_match_the_reference_and_onednn(case, int8_build):
    batch, channels, size, groups, stride = case
    x, w, w_scale, bias = _case(*case, weight_bits=7 if int8_build == "avx2" else 8)  # (AVX2: what the lowering gives it)
    expected = _requantized(_reference(x, w, w_scale, bias, case).relu())
    mult, add = scale_and_offset(w, w_scale, X_SCALE, X_ZP, bias)
    args = (x, X_ZP, *grouped.pack(w, mult, add), groups, stride, 0.0, math.inf, OUT_SCALE, OUT_ZP, 0, 255)
    for kernel in registry.own_kernel_forms("qconv_grouped"):
        actual = kernel(*args)
        assert actual.is_contiguous(memory_format=torch.channels_last)
        assert_int8_close(actual, expected, f"{case}")
    if grouped_conv_inexact("cpu", channels // groups):  # (the probe the lowering asks: it keeps such convs off oneDNN)
        # its miss shows on this case or, where oneDNN sums pairs in int16 (AVX2 without VNNI),
        # on full 8-bit weights and activations
        x_full, w_full = x.clone(), _case(*case)[1]
        x_full[..., 0, :] = 255
        misses = [(_onednn(*inputs, w_scale, bias, case).int()
                   - _requantized(_reference(*inputs, w_scale, bias, case).relu()).int()).abs().max().item()
                  for inputs in ((x, w), (x_full, w_full))]
        assert max(misses) > 1, f"{case}: the probe called oneDNN inexact, yet it matches"
    else:
        assert_int8_close(actual, _onednn(x, w, w_scale, bias, case), f"{case} vs oneDNN")


def _reference(x, w, w_scale, bias, case):
    """The float64 conv of ``case`` on the dequantized input and weights, before its activation."""
    stride, groups = case[4], case[3]
    return torch.nn.functional.conv2d((x.double() - X_ZP) * X_SCALE, w.double() * w_scale.double()[:, None, None, None],
                                      bias.double(), stride, 1, 1, groups)


def _requantized(reference):
    return torch.clamp(torch.round(reference / OUT_SCALE) + OUT_ZP, 0, 255).to(torch.uint8)


def _onednn(x, w, w_scale, bias, case):
    """The conv + ReLU through torch's oneDNN op."""
    stride, groups = case[4], case[3]
    prepack, qconv = resolve("qconv_prepack", "cpu").op, resolve("qconv", "cpu").op
    packed = prepack(w, w_scale, X_SCALE, X_ZP, [stride] * 2, [1, 1], [1, 1], groups, x.shape)
    return qconv(x, X_SCALE, X_ZP, packed, w_scale, torch.zeros(w.shape[0], dtype=torch.int64), bias, [stride] * 2, [1, 1],
                 [1, 1], groups, OUT_SCALE, OUT_ZP, None, "relu", [], "")


@needs_own_kernels
@pytest.mark.parametrize("float_out", [False, True], ids=["uint8 out", "float32 out"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_exact16_build_gives_the_reference_for_8_bit_weights(case, float_out):
    """The int16 build (int16 packed weights, any CPU with AVX2): full 8-bit weights and
    activations, whose pair sums pass int16's range; 4 channels a group read both groups'
    words interleaved from the widened copy."""
    batch, channels, size, groups, stride = case
    x, w, w_scale, bias = _case(*case)
    x[..., 0, :] = 255  # (a row of full activations: 255 x (|w_a| + |w_b|) well past 32767)
    reference = _reference(x, w, w_scale, bias, case).clamp(-1.0, 6.0)
    mult, add = scale_and_offset(w, w_scale, X_SCALE, X_ZP, bias)
    weight, mult, add = grouped.pack(w, mult, add, exact16=True)
    assert weight.dtype == torch.int16
    requantize = (1.0, 0, 0, 255, True) if float_out else (OUT_SCALE, OUT_ZP, 0, 255)
    args = (x, X_ZP, weight, mult, add, groups, stride, -1.0, 6.0, *requantize)
    for kernel in registry.own_kernel_forms("qconv_grouped"):
        actual = kernel(*args)
        if float_out:
            torch.testing.assert_close(actual.double(), reference, atol=1e-5, rtol=1e-5)
        else:
            assert_int8_close(actual, _requantized(reference), f"{case}")


@pytest.mark.parametrize("case", CASES[:10], ids=str)
def test_grouped_kernel_float_output_is_the_clamped_reference(case, int8_build):
    """float_out (RegNetY's grouped convs feed a squeeze-excitation block in float): the clamped
    float32 result in channel order, also where a vector holds two groups' channels interleaved."""
    batch, channels, size, groups, stride = case
    x, w, w_scale, bias = _case(*case, weight_bits=7 if int8_build == "avx2" else 8)
    reference = _reference(x, w, w_scale, bias, case).clamp(0.0, 6.0)
    mult, add = scale_and_offset(w, w_scale, X_SCALE, X_ZP, bias)
    args = (x, X_ZP, *grouped.pack(w, mult, add), groups, stride, 0.0, 6.0, 1.0, 0, 0, 255, True)
    for kernel in registry.own_kernel_forms("qconv_grouped"):
        actual = kernel(*args)
        assert actual.dtype == torch.float32 and actual.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(actual.double(), reference, atol=1e-5, rtol=1e-5)


class Bottleneck(nn.Module):
    """ResNeXt's block: 1x1 down, grouped 3x3 (``groups`` of ``width / groups`` channels), 1x1 up, residual."""

    def __init__(self, width=64, groups=16, stride=1):
        super().__init__()
        self.down, self.up = nn.Conv2d(64, width, 1, bias=False), nn.Conv2d(width, 64, 1, bias=False)
        self.grouped = nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False)
        self.bn1, self.bn2, self.bn3 = nn.BatchNorm2d(width), nn.BatchNorm2d(width), nn.BatchNorm2d(64)
        self.stride = stride

    def forward(self, x):
        h = torch.relu(self.bn1(self.down(x)))
        h = torch.relu(self.bn2(self.grouped(h)))
        h = self.bn3(self.up(h))
        return torch.relu(h + x) if self.stride == 1 else torch.relu(h)


def _grouped_decisions(report):
    return [d for d in report.decisions if d.kind == "conv" and "grouped" in (d.reason or "")]


@pytest.mark.parametrize("groups, stride", [(16, 1), (8, 2)])
def test_a_resnext_block_runs_its_grouped_conv_on_the_kernel(groups, stride, int8_build):
    torch.manual_seed(0)
    inputs = (torch.randn(2, 64, 10, 10),)
    captured = assert_matches_reference(quantize(Bottleneck(groups=groups, stride=stride).eval(), inputs), inputs)
    ops = [d.op for d in captured.report.decisions if d.kind == "conv"]
    assert f"{registry.NAMESPACE}::qconv_grouped.default" in ops, str(captured.report)


def test_groups_of_two_channels_stay_on_onednn_and_say_why():
    torch.manual_seed(0)
    inputs = (torch.randn(1, 64, 8, 8),)
    captured = assert_matches_reference(quantize(Bottleneck(width=32, groups=16).eval(), inputs), inputs)
    reasons = [d.reason for d in captured.report.decisions if d.kind == "conv" and "grouped conv kernel" in (d.reason or "")]
    assert any("32 channels in 16 groups: the kernel takes groups of 4 or a multiple of 8" in r for r in reasons), \
        str(captured.report)


def test_weights_whose_pair_sums_saturate_run_on_the_exact_build(int8_build):
    """8-bit activations and 8-bit weights: 255 x (|w_a| + |w_b|) can pass int16's 32767, which
    vpmaddubsw (and oneDNN without VNNI) saturates at: the AVX2 CPU runs the int16 build, not
    float; 7-bit weights (quantize_x86's choice on such CPUs) the uint8 one."""
    torch.manual_seed(0)
    inputs = (torch.randn(2, 64, 10, 10),)
    for reduce_range in (False, "weights"):
        captured = assert_matches_reference(quantize(Bottleneck(groups=16).eval(), inputs, reduce_range=reduce_range), inputs)
        (decision,) = [d for d in captured.report.decisions if d.kind == "conv" and "grouped" in d.source]
        said = decision.line() + "".join(map(str, decision.tried))
        saturates = reduce_range is False and int8_build == "avx2"
        assert ("its exact int16 build, not vpmaddubsw: its int16 pair sums could reach" in said) == saturates, said
        assert decision.op == f"{registry.NAMESPACE}::qconv_grouped.default", said


def test_group_widths_onednn_misses_run_on_the_kernel_unmeasured(monkeypatch):
    """Where the CPU's oneDNN misses a grouped conv's exact sums (24 channels a group on an AMX
    Xeon), the kernel runs it without timing oneDNN, even in the measured choice, saying why."""
    monkeypatch.setattr(lowering_cpu, "grouped_conv_inexact", lambda device, per_group: per_group == 4)
    monkeypatch.setenv("QBACKEND_KERNEL_CHOICE", "measure")
    monkeypatch.setattr(choice, "measure", lambda runs: {"own": 2e-3, "fallback": 1e-3})  # (timed, oneDNN would win)
    torch.manual_seed(0)
    inputs = (torch.randn(2, 64, 10, 10),)
    captured = assert_matches_reference(quantize(Bottleneck(groups=16).eval(), inputs), inputs)
    (decision,) = [d for d in captured.report.decisions if d.kind == "conv" and "grouped" in d.source]
    assert decision.op == f"{registry.NAMESPACE}::qconv_grouped.default", decision.line()
    assert "qbackend's grouped conv kernel, not oneDNN: this CPU's oneDNN grouped int8 conv misses the exact sums at 4 channels a group" \
        in decision.reason, decision.line()
    assert "measured on this machine" not in decision.reason, decision.line()
