"""Bias correction (qbackend/flow/bias_correction.py): each quantized conv / linear's bias absorbs the
mean output shift of its weights' rounding on the calibration data."""
import functools

import pytest
import torch
from torch import nn

from qbackend.patterns.qdq import is_op
from qbackend.flow.bias_correction import InputMeans
from qbackend.pt2e_flow import quantize_x86

from tests.helpers import assert_matches_reference, quantize


class ConvStack(nn.Module):
    """A dense conv, a depthwise conv with padding (its borders see zeros, not the mean) and a
    bias-less linear: every kind the correction handles."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.fc = nn.Linear(8 * 5 * 5, 6, bias=False)

    def forward(self, x):
        x = self.depthwise(torch.relu(self.conv(x)))
        return self.fc(torch.relu(x).flatten(1))


def _batches(count=4, offset=1.5):
    """Inputs with non-zero channel means: there the weights' rounding shifts the outputs."""
    generator = torch.Generator().manual_seed(3)
    return [(torch.rand(16, 4, 5, 5, generator=generator) + offset,) for _ in range(count)]


def _layer_output_error(converted, model, batches, name):
    """Per-channel mean of (int8 - float) at module ``name``'s output, both on the input the
    int8 layer gets: the layer's own shift, without what earlier layers bring."""
    from torch.fx import Interpreter

    node = {"conv": "conv2d", "depthwise": "conv2d_1", "fc": "linear"}[name]
    seen = {}

    class Recording(Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            if n.name == node:
                seen["input"], seen["output"] = self.env[n.args[0]], result
            return result

    errors = []
    with torch.no_grad():
        for (x,) in batches:
            Recording(converted).run(x)
            errors.append(seen["output"] - getattr(model, name)(seen["input"]))
    error = torch.cat(errors)
    return error.mean(dim=[0] + list(range(2, error.dim())))


@pytest.mark.parametrize("layer, per_position", [("conv", True), ("depthwise", True), ("fc", True), ("conv", False)])
def test_corrected_layers_have_no_mean_shift_on_the_calibration_data(layer, per_position, monkeypatch):
    """Per position: the conv of the mean image, exact; past the size limit, channel means spread
    over the image (here a dense conv: its borders still leave a part of the shift)."""
    if not per_position:
        monkeypatch.setattr(InputMeans, "PER_POSITION_LIMIT", 1)
    model, batches = ConvStack().eval(), _batches()
    plain = quantize_x86(model, batches[0], batches, bias_correction=False, activation_ranges="min_max")
    corrected = quantize_x86(model, batches[0], batches, activation_ranges="min_max")
    before = _layer_output_error(plain, model, batches, layer).abs().mean()
    after = _layer_output_error(corrected, model, batches, layer).abs().mean()
    assert corrected.meta["bias_correction"] == 3 and "bias_correction" not in plain.meta
    assert after < 0.35 * before, (layer, before, after)


def test_the_float_model_keeps_its_own_biases():
    model, batches = ConvStack().eval(), _batches()
    bias, values = model.conv.bias, model.conv.bias.detach().clone()
    converted = quantize_x86(model, batches[0], batches)
    assert model.conv.bias is bias and torch.equal(bias, values) and model.fc.bias is None
    assert converted.meta["bias_correction"] == 3


def test_a_bias_less_linear_gets_a_bias_and_lowers_as_the_reference_runs():
    model, batches = ConvStack().eval(), _batches()
    converted = quantize(model, batches[0], batches)
    [linear] = [n for n in converted.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert linear.args[2].op == "get_attr" and linear.args[2].target.startswith("_qb_corrected_bias_")
    captured = assert_matches_reference(converted, batches[0])
    assert not captured.report.kept


def test_layers_left_float_and_qat_are_not_corrected():
    model, batches = ConvStack().eval(), _batches()
    kept = quantize_x86(model, batches[0], batches, keep_float=["fc"])
    assert kept.meta["bias_correction"] == 2
    [linear] = [n for n in kept.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert len(linear.args) == 2 or linear.args[2] is None  # (float, as it was)
    qat = quantize_x86(ConvStack(), batches[0], batches, is_qat=True)
    assert "bias_correction" not in qat.meta
    with pytest.raises(ValueError, match="bias_correction must be True or False"):
        quantize_x86(model, batches[0], batches, bias_correction="yes")


def test_correction_moves_only_biases():
    """The weights' int8 values and every scale stay as convert_pt2e gives them without it."""
    model, batches = ConvStack().eval(), _batches()
    plain = quantize_x86(model, batches[0], batches, bias_correction=False, activation_ranges="min_max")
    corrected = quantize_x86(model, batches[0], batches, activation_ranges="min_max")

    def constants(gm):
        return {n.name: functools.reduce(getattr, n.target.split("."), gm) for n in gm.graph.nodes if n.op == "get_attr"}

    def scales(gm):
        return [n.args[1:] for n in gm.graph.nodes if is_op(n, "quantize_per_tensor")]

    plain_constants, corrected_constants = constants(plain), constants(corrected)
    changed = sorted(name for name, value in plain_constants.items() if not torch.equal(value, corrected_constants[name]))
    assert changed == ["conv_bias", "depthwise_bias"]
    assert scales(plain) == scales(corrected)


def test_calibration_batches_of_any_size_with_a_variable_batch():
    """Each batch adds its rows to the sums: batches of 3 and 16 weigh by their rows."""
    model = ConvStack().eval()
    batches = [(b[0][:size],) for b, size in zip(_batches(), (3, 16, 7, 16))]
    converted = quantize_x86(model, batches[0], batches, dynamic_batch=True, activation_ranges="min_max")
    assert converted.meta["bias_correction"] == 3
    error = _layer_output_error(converted, model, batches, "conv").abs().mean()
    plain = quantize_x86(model, batches[0], batches, dynamic_batch=True, activation_ranges="min_max",
                         bias_correction=False)
    assert error < 0.35 * _layer_output_error(plain, model, batches, "conv").abs().mean()


def test_dynamic_quantization_is_corrected_and_lowers_as_the_reference_runs():
    """Dynamic activations: the weights round as in the static flow, so their shift is the same."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    batches = [(torch.rand(16, 32) + 1,) for _ in range(4)]
    with torch.no_grad():
        fp32 = model(*batches[0])
        plain = quantize_x86(model, batches[0], batches, is_dynamic=True, bias_correction=False)(*batches[0]) - fp32
        converted = quantize_x86(model, batches[0], batches, is_dynamic=True)
        corrected = converted(*batches[0]) - fp32
    assert converted.meta["bias_correction"] == 2
    assert corrected.mean(0).abs().mean() < 0.35 * plain.mean(0).abs().mean()
    assert_matches_reference(converted, batches[0])
