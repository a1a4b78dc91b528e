"""ConvNeXt's layer scale folded into the int8 linear before it (lowering/layer_scale.py)."""
import pytest
import torch
import torch.nn as nn

from tests.helpers import assert_matches_reference, quantize


class LayerScaleBlock(nn.Module):
    """torchvision's CNBlock tail: linear over channels-last features, back to NCHW, times a
    per-channel gamma [C, 1, 1], plus the block input."""

    def __init__(self, gamma: torch.Tensor):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.gamma = nn.Parameter(gamma)

    def forward(self, x):
        y = self.fc(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.gamma * y + x


def inputs():
    torch.manual_seed(0)
    return (torch.randn(2, 16, 4, 4),)


def multiplies(captured) -> int:
    return sum(n.target is torch.ops.aten.mul.Tensor for n in captured.lowered.graph.nodes)


def test_a_positive_layer_scale_runs_inside_the_linear():
    torch.manual_seed(1)
    captured = assert_matches_reference(quantize(LayerScaleBlock(torch.rand(16, 1, 1) + 0.5).eval(), inputs()), inputs())
    assert multiplies(captured) == 0, captured.lowered.graph
    assert "1 per-channel constant multiply(s) after a linear folded into its weight scales and bias" in captured.report.notes


@pytest.mark.parametrize("gamma", [
    torch.linspace(-1, 1, 16).reshape(16, 1, 1),  # a negative factor: weight scales stay positive
    torch.rand(16, 4, 1) + 0.5,  # varies along H too: not one factor per output channel
], ids=["negative factor", "not per channel"])
def test_near_misses_keep_the_multiply(gamma):
    captured = assert_matches_reference(quantize(LayerScaleBlock(gamma).eval(), inputs()), inputs())
    assert multiplies(captured) == 1, captured.lowered.graph
    assert not any("folded into its weight scales" in note for note in captured.report.notes)
