"""Int8 values flowing between ops: average pool variants and cat / view edge cases, each
against the reference."""
import pytest
import torch
import torch.nn as nn

from .helpers import assert_matches_reference, quantize

POOLS = {
    "avg_3x3_s2_p1": nn.AvgPool2d(3, 2, 1),
    "avg_ceil_mode": nn.AvgPool2d(3, 2, ceil_mode=True),
    "avg_exclude_pad": nn.AvgPool2d(3, 1, 1, count_include_pad=False),
    "avg_divisor_override": nn.AvgPool2d(2, divisor_override=3),
    "adaptive_1x1": nn.AdaptiveAvgPool2d(1),
    "adaptive_uneven_3x2": nn.AdaptiveAvgPool2d((3, 2)),
}


@pytest.mark.parametrize("name", POOLS)
def test_average_pool_variants_within_one_step(name):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), POOLS[name], nn.Conv2d(16, 8, 1))
    inputs = (torch.randn(2, 3, 11, 11),)
    report = assert_matches_reference(quantize(module, inputs), inputs).report
    assert [d.rule for d in report.decisions] == ["qconv", "qavgpool", "qconv"], str(report)


class CatSameInputTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.relu, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 1)

    def forward(self, x):
        y = self.relu(self.conv(x))
        return self.head(torch.cat([y, y], 1))


def test_cat_of_one_tensor_twice():
    inputs = (torch.randn(2, 3, 8, 8),)
    captured = assert_matches_reference(quantize(CatSameInputTwice(), inputs), inputs)
    assert [d.rule for d in captured.report.moves if d.lowered] == ["qcat"], str(captured.report)


class ReshapeOfChannelsLast(nn.Module):
    """A view of a channels-last int8 conv output (a plain view would fail on it)."""

    def __init__(self):
        super().__init__()
        self.conv, self.relu, self.fc = nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Linear(6 * 6, 5)

    def forward(self, x):
        return self.fc(self.relu(self.conv(x)).view(2, 4, 36))


def test_view_of_a_channels_last_int8_tensor():
    inputs = (torch.randn(2, 3, 8, 8),)
    captured = assert_matches_reference(quantize(ReshapeOfChannelsLast(), inputs), inputs)
    assert "int8 flow: 1 view chain run on int8" in str(captured.report), str(captured.report)
