"""``qbackend.accuracy_report``: every conv / linear of a converted model against the float
model's same layer, worst first, over tuples or keyword batches; its output line is the
cosine of the two models' outputs."""
import math
import sys

import pytest
import torch

import qbackend
from qbackend.models import tiny_resnet

from tests.helpers import quantize
from tests.flow.test_calibration import Masked, _batches
from tests.tolerances import cosine


def _images(n: int) -> list:
    return [(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(i)),) for i in range(n)]


def test_every_layer_is_compared_worst_first_and_the_output_as_the_models_give_it():
    model = tiny_resnet()
    quantized = quantize(model, _images(1)[0], calibration=_images(4))
    report = qbackend.accuracy_report(model, quantized, _images(3))
    convs_and_linears = [name for name, m in model.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    assert sorted(e.path for e in report.layers) == sorted(convs_and_linears) and not report.unmatched
    assert [e.sqnr_db for e in report.layers] == sorted(e.sqnr_db for e in report.layers)
    assert all(0.9 < e.cosine <= 1 + 1e-9 and math.isfinite(e.sqnr_db) for e in report.layers), str(report)
    with torch.no_grad():
        together = [torch.cat(parts) for parts in zip(*[(quantized(x), model(x)) for (x,) in _images(3)])]
    assert report.output.cosine == pytest.approx(cosine(*together), abs=1e-9)
    assert report.batches == 3 and str(report).splitlines()[0].startswith("accuracy vs fp32 over 3 batch(es)")
    in_order = sorted(report.layers, key=lambda e: e.position)
    assert [e.position for e in in_order] == list(range(len(convs_and_linears))) and in_order[0].path == "conv1"
    assert in_order[-1].path == "fc", [e.path for e in in_order]


def test_the_plot_is_written_in_network_order_and_needs_matplotlib_only_then(tmp_path, monkeypatch):
    model = tiny_resnet()
    report = qbackend.accuracy_report(model, quantize(model, _images(1)[0], calibration=_images(2)), _images(1))
    report.plot(tmp_path / "layers.png", title="tiny")
    assert (tmp_path / "layers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'qbackend\[plot\]'"):
        report.plot(tmp_path / "again.png")


class TwoBranches(torch.nn.Module):
    """Two linears side by side; the second reads its input with one channel 100x the others
    (a channel its weights ignore), so per-tensor int8 activations keep ~1 bit for the channels
    its output comes from: it must be named first."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.plain, self.outlier = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        with torch.no_grad():
            self.outlier.weight[:, 0] = 0.0
        self.register_buffer("spread", torch.tensor([100.0] + [1.0] * 15))

    def forward(self, x):
        return torch.cat([self.plain(x), self.outlier(x * self.spread)], dim=-1)


def test_the_layer_whose_input_int8_cannot_hold_is_named_first():
    batches = [(torch.randn(8, 16, generator=torch.Generator().manual_seed(i)),) for i in range(3)]
    model = TwoBranches().eval()
    report = qbackend.accuracy_report(model, quantize(model, batches[0], calibration=batches), batches)
    assert [e.path for e in report.layers] == ["outlier", "plain"], str(report)
    assert report.layers[0].sqnr_db < report.layers[1].sqnr_db - 10, str(report)


def test_keyword_batches():
    model = Masked().eval()
    batches = [{"x": x, "mask": mask} for x, mask in _batches(2)]
    report = qbackend.accuracy_report(model, quantize(model, batches[0], calibration=batches), batches)
    assert [e.path for e in report.layers] == ["fc"] and report.output.cosine > 0.999, str(report)


def test_target_cosine_keeps_the_layer_that_loses_the_most_float():
    batches = [(torch.randn(8, 16, generator=torch.Generator().manual_seed(i)),) for i in range(3)]
    model = TwoBranches().eval()
    plain = qbackend.accuracy_report(model, quantize(model, batches[0], calibration=batches), batches)
    target = (plain.output.cosine + 1) / 2  # (not met with both linears quantized)
    converted = quantize(model, batches[0], calibration=batches, target_cosine=target)
    assert converted.meta["kept_float"] == ["outlier"], str(converted.meta["accuracy"])
    assert converted.meta["accuracy"].output.cosine >= target
    report = qbackend.accuracy_report(model, converted, batches)
    [outlier] = [e for e in report.layers if e.path == "outlier"]
    assert outlier.sqnr_db > 60 and report.output.cosine >= target, str(report)  # (float input, float weights)


class CoarseWeights(torch.nn.Module):
    """Two linears side by side; the second's weights have one column 200x the rest, on an input
    channel that is always 0: its per-channel weight scale leaves the weights that count ~1
    level, while its input quantizes well. Skipping its input quantize gains nothing; keeping it
    float is what helps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.plain, self.coarse = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        with torch.no_grad():
            self.coarse.weight[:, 0] = 50.0
        self.register_buffer("first_off", torch.tensor([0.0] + [1.0] * 15))

    def forward(self, x):
        return torch.cat([self.plain(x), self.coarse(x * self.first_off)], dim=-1)


def test_target_cosine_keeps_the_layer_whose_own_weights_lose_the_most():
    batches = [(torch.randn(8, 16, generator=torch.Generator().manual_seed(i)),) for i in range(3)]
    model = CoarseWeights().eval()
    plain = qbackend.accuracy_report(model, quantize(model, batches[0], calibration=batches), batches)
    [coarse] = [e for e in plain.layers if e.path == "coarse"]
    assert coarse.input_sqnr_db > coarse.sqnr_db + 15, str(plain)  # (the premise: the loss is its own)
    target = (plain.output.cosine + 1) / 2
    converted = quantize(model, batches[0], calibration=batches, target_cosine=target)
    assert converted.meta["kept_float"] == ["coarse"], str(converted.meta["accuracy"])
    assert converted.meta["accuracy"].output.cosine >= target


def test_validate_keeps_layers_float_until_the_users_metric_is_within_max_drop(capsys):
    """Accuracy control by the user's own metric (NNCF's quantize_with_accuracy_control): the
    float model scored once, each candidate as qbackend.compile runs it, each step said."""
    batches = [(torch.randn(8, 16, generator=torch.Generator().manual_seed(i)),) for i in range(3)]
    model = CoarseWeights().eval()
    held_out = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(9))  # (4 batches of 8: the export's size)
    with torch.no_grad():
        truth = torch.stack([model(rows).argmax(-1) for rows in held_out])
    scored = []

    def validate(m):  # (the share of held-out rows whose arg max agrees with the float model's)
        with torch.no_grad():
            scored.append(type(m).__name__)
            return (torch.stack([m(rows).argmax(-1) for rows in held_out]) == truth).float().mean().item()

    plain = validate(quantize(model, batches[0], calibration=batches))
    assert plain < 0.95, plain  # (the premise: quantized as it is, the metric drops more than max_drop)
    converted = quantize(model, batches[0], calibration=batches, validate=validate, max_drop=0.05, progress=True)
    assert converted.meta["kept_float"] == ["coarse"], str(converted.meta["accuracy"])
    assert 1.0 - validate(qbackend.compile(converted)) <= 0.05
    assert scored[1] == "CoarseWeights" and set(scored[2:]) == {"CompiledGraphModule"}, scored  # (float once, then compiled)
    said = capsys.readouterr().err
    assert "validate: the float model scores 1" in said and "at most 8 steps" in said, said
    assert "step 1: coarse kept float, validate " in said, said
    recorded = converted.meta["qbackend_recipe"]["options"]
    assert recorded["validate"].endswith("validate") and recorded["max_drop"] == 0.05, recorded


@pytest.mark.parametrize("options, message", [({"validate": len}, "validate and max_drop go together"),
                                              ({"max_drop": 0.01}, "validate and max_drop go together"),
                                              ({"validate": len, "max_drop": 0.1, "target_cosine": 0.9}, "not both"),
                                              ({"validate": len, "max_drop": -1}, "max_drop a number >= 0")])
def test_accuracy_control_options_that_do_not_go_together(options, message):
    batches = [(torch.randn(8, 16),)]
    with pytest.raises(ValueError, match=message):
        quantize(CoarseWeights().eval(), batches[0], calibration=batches, **options)


class BatchNormAct(torch.nn.BatchNorm2d):
    """timm's BatchNormAct2d: a batch norm that applies its activation too (children: drop, act)."""

    def __init__(self, channels: int):
        super().__init__(channels)
        self.drop, self.act = torch.nn.Identity(), torch.nn.ReLU()

    def forward(self, x):
        return self.act(self.drop(super().forward(x)))


def test_a_norm_that_applies_its_activation_is_compared_before_the_activation():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), BatchNormAct(16), torch.nn.Conv2d(16, 8, 3)).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5), model[1].running_var.uniform_(0.5, 2.0), model[1].bias.uniform_(-1, 1)
    batches = _images(2)
    report = qbackend.accuracy_report(model, quantize(model, batches[0], calibration=batches), batches)
    first = next(layer for layer in report.layers if layer.path == "0")
    # (compared with the post-activation output the cosine was ~0.7 while the model's output stays near 1)
    assert first.cosine > 0.999 and report.output.cosine > 0.99, str(report)
