"""Int8 values flowing between ops: average pool variants and cat / view edge cases, each
against the reference."""
import pytest
import torch
import torch.nn as nn

from tests.helpers import assert_matches_reference, quantize

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


class SharedConvOutput(nn.Module):
    """MaxViT's stem and first block: a conv whose output is both a shortcut and the input of a
    BatchNorm (the block's pre-norm) before another conv."""

    def __init__(self):
        super().__init__()
        self.stem, self.norm, self.conv = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 1)
        with torch.no_grad():  # (statistics far from the identity: a wrong fold shows)
            self.norm.running_mean.uniform_(-2, 2), self.norm.running_var.uniform_(0.2, 4), self.norm.weight.uniform_(0.5, 2)

    def forward(self, x):
        y = self.stem(x)
        return y + self.conv(self.norm(y))


@pytest.mark.parametrize("keep_float", [("*",), ()], ids=["nothing quantized", "int8"])
def test_a_batch_norm_after_a_shared_conv_is_not_folded_into_it(keep_float):
    """prepare_pt2e folds each BatchNorm into the conv before it, even where the conv's output
    has other readers, which then read the normalized values (torchao 0.18). The flow keeps such
    a BatchNorm off the conv: the converted model computes the float model's function."""
    model, inputs = SharedConvOutput().eval(), (torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0)),)
    converted = quantize(model, inputs, keep_float=keep_float)
    with torch.no_grad():
        expected, actual = model(*inputs), converted(*inputs)
    cosine = torch.nn.functional.cosine_similarity(actual.flatten().double(), expected.flatten().double(), 0).item()
    assert cosine > (0.999999 if keep_float else 0.99), cosine
    assert any(n.target is torch.ops.aten.alias.default for n in converted.graph.nodes)
    assert_matches_reference(converted, inputs)
