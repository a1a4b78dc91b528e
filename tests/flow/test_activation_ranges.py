"""Activation ranges by measurement (qbackend/flow/activation_ranges.py): the histogram observer's
ranges or each activation's min / max, chosen on a calibration batch the ranges were not
fitted to."""
import pytest
import torch
from torch import nn

from qbackend.patterns.qdq import is_op
from qbackend.pt2e_flow import quantize_x86


class OneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x)


def _input_grid(converted) -> tuple:
    """(scale, zero point) of the quantize of the model's input."""
    [quantize] = [n for n in converted.graph.nodes if is_op(n, "quantize_per_tensor") and n.args[0].op == "placeholder"]
    return quantize.args[1], quantize.args[2]


def _batches(*scales, outlier=None) -> list:
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(64, 16, generator=generator) * scale,) for scale in scales]
    if outlier is not None:
        batches[0][0][0, 0] = outlier
    return batches


def test_min_max_ranges_cover_every_calibration_value():
    batches = _batches(1.0, 2.0, 0.5)
    converted = quantize_x86(OneLinear().eval(), batches[0], batches, activation_ranges="min_max", reduce_range=False)
    values = torch.cat([b[0] for b in batches])
    low, high = min(values.min().item(), 0.0), max(values.max().item(), 0.0)
    scale, zero_point = _input_grid(converted)
    assert scale == pytest.approx((high - low) / 255, rel=1e-6)
    assert zero_point == round(-low / scale)
    assert "activation_ranges" not in converted.meta  # (chosen by the caller, not measured)


class ConvPool(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.fc = nn.Conv2d(3, 8, 3), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.conv(x), 1), 1))


def test_min_max_ranges_keep_an_observer_shared_by_two_tensors_shared():
    """X86InductorQuantizer gives a pool's output its input's observer (one module under two
    names): both keep one grid, and the pool stays a pure int8 pool."""
    generator = torch.Generator().manual_seed(2)
    batches = [(torch.randn(2, 3, 12, 12, generator=generator),) for _ in range(2)]
    converted = quantize_x86(ConvPool().eval(), batches[0], batches, activation_ranges="min_max", reduce_range=False)
    [pool] = [n for n in converted.graph.nodes if n.target is torch.ops.aten.adaptive_avg_pool2d.default]
    [quantize] = pool.users
    assert is_op(pool.args[0], "dequantize_per_tensor") and is_op(quantize, "quantize_per_tensor")
    assert pool.args[0].args[1:3] == quantize.args[1:3]


@pytest.mark.parametrize("batches, kept", [
    (_batches(1.0, 1.0, 1.0, 3.0), "min_max"),
    (_batches(1.0, 1.0, 1.0, 1.0, outlier=400.0), "histogram"),
], ids=["the unseen batch is wider: clipped tails cost more", "an outlier stretches min / max: its range is coarse"])
def test_auto_keeps_the_ranges_that_do_better_on_a_batch_they_were_not_fitted_to(batches, kept):
    converted = quantize_x86(OneLinear().eval(), batches[0], batches, reduce_range=False)
    chosen, cosines = converted.meta["activation_ranges"]
    assert chosen == kept and cosines[kept] > cosines[{"min_max": "histogram", "histogram": "min_max"}[kept]], cosines
    same = quantize_x86(OneLinear().eval(), batches[0], batches, activation_ranges=kept, reduce_range=False)
    assert _input_grid(converted) == _input_grid(same)  # (the full calibration's ranges of that kind)


def test_one_calibration_batch_keeps_the_quantizers_ranges():
    batches = _batches(1.0)
    converted = quantize_x86(OneLinear().eval(), batches[0], batches, reduce_range=False)
    histogram = quantize_x86(OneLinear().eval(), batches[0], batches, activation_ranges="histogram", reduce_range=False)
    assert "activation_ranges" not in converted.meta
    assert _input_grid(converted) == _input_grid(histogram)


def test_an_unknown_choice_is_a_clear_error():
    batches = _batches(1.0)
    with pytest.raises(ValueError, match=r"activation_ranges must be one of \('auto', 'histogram', 'min_max'\), got 'mse'"):
        quantize_x86(OneLinear().eval(), batches[0], batches, activation_ranges="mse")
