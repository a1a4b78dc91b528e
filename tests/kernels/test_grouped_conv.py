"""Grouped 3x3 int8 convs (ResNeXt's) on qbackend's own AVX512-VNNI kernel: its bytes against
the float64 reference and oneDNN's, the lowering of a ResNeXt bottleneck, and the groups it
leaves to oneDNN with the reason."""
import math

import pytest
import torch
import torch.nn as nn

from qbackend.kernels import registry
from qbackend.lowering import grouped
from qbackend.lowering.own_conv import scale_and_offset
from qbackend.ops import resolve

from tests.helpers import assert_matches_reference, quantize
from tests.kernels.test_stem_kernel import _needs_vnni_library
from tests.tolerances import assert_int8_close

# (batch, channels, size, groups, stride): 4 / 8 / 16 / 32 channels a group; rows of fewer than 8
# output pixels and rows not a multiple of 8; borders at every side
CASES = [(1, 64, 12, 16, 1), (2, 64, 9, 8, 2), (1, 64, 7, 4, 1), (1, 32, 5, 8, 2), (2, 128, 11, 4, 2), (1, 96, 6, 3, 1),
         (1, 40, 7, 5, 1), (1, 24, 9, 6, 2),  # (these two: an odd number of 8-channel blocks)
         (1, 72, 9, 3, 2), (1, 80, 6, 2, 1)]  # (24 / 40 channels a group: a pair of blocks spans two groups; RegNetX's)
# every group width the kernel takes up to 64, in 2 and 3 groups (odd and even block counts, pairs
# of blocks within a group and across two)
CASES += [(1, width * groups, 5, groups, 1) for width in (8, 16, 24, 32, 40, 48, 56, 64) for groups in (2, 3)]


def _case(batch, channels, size, groups, stride, seed=0):
    torch.manual_seed(seed)
    x = torch.randint(0, 256, (batch, channels, size, size), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    w = torch.randint(-128, 128, (channels, channels // groups, 3, 3), dtype=torch.int8)
    w_scale, bias = torch.rand(channels) * 0.002 + 5e-4, torch.randn(channels)
    return x, w, w_scale, bias


@pytest.mark.parametrize("case", CASES, ids=str)
def test_grouped_kernel_bytes_match_the_reference_and_onednn(case):
    _needs_vnni_library()
    batch, channels, size, groups, stride = case
    x, w, w_scale, bias = _case(*case)
    x_scale, x_zp, out_scale, out_zp = 0.02, 3, 0.05, 5
    reference = torch.nn.functional.conv2d((x.double() - x_zp) * x_scale, w.double() * w_scale.double()[:, None, None, None],
                                           bias.double(), stride, 1, 1, groups).relu()
    expected = torch.clamp(torch.round(reference / out_scale) + out_zp, 0, 255).to(torch.uint8)
    mult, add = scale_and_offset(w, w_scale, x_scale, x_zp, bias)
    args = (x, x_zp, *grouped.pack(w, mult, add), groups, stride, 0.0, math.inf, out_scale, out_zp, 0, 255)
    for kernel in registry.own_kernel_forms("qconv_grouped"):
        actual = kernel(*args)
        assert actual.is_contiguous(memory_format=torch.channels_last)
        assert_int8_close(actual, expected, f"{case}")
    prepack, qconv = resolve("qconv_prepack", "cpu").op, resolve("qconv", "cpu").op
    packed = prepack(w, w_scale, x_scale, x_zp, [stride] * 2, [1, 1], [1, 1], groups, x.shape)
    onednn = qconv(x, x_scale, x_zp, packed, w_scale, torch.zeros(channels, dtype=torch.int64), bias, [stride] * 2, [1, 1],
                   [1, 1], groups, out_scale, out_zp, None, "relu", [], "")
    assert_int8_close(actual, onednn, f"{case} vs oneDNN")


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
def test_a_resnext_block_runs_its_grouped_conv_on_the_kernel(groups, stride):
    _needs_vnni_library()
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
