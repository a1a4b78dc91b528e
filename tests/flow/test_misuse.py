"""Misuse fails early and says what to do (or, where running float is legitimate, warns and
raises under strict): calibration batches, devices, float models, weight-only group sizes,
keyword inputs to explain, layers kept float."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import qbackend
from qbackend.pt2e_flow import quantize_x86


class TwoConvs(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def _model_and_input(batch: int = 2):
    torch.manual_seed(0)
    return TwoConvs().eval(), torch.randn(batch, 3, 16, 16)


def test_no_calibration_batch_is_an_error():
    model, x = _model_and_input()
    with pytest.raises(ValueError, match="the calibration batches are empty"):
        quantize_x86(model, (x,), [])


def test_input_target_pairs_name_transform_fn_and_run_with_it():
    model, x = _model_and_input()
    pairs = [(x, torch.tensor([0, 1])), (x * 0.5, torch.tensor([1, 0]))]
    with pytest.raises(ValueError, match=r"calibration batch 0 \(tuple\(Tensor\[2, 3, 16, 16\], Tensor\[2\] torch.int64\)\).*"
                                         r"transform_fn=lambda batch: batch\[0\]"):
        quantize_x86(model, (x,), pairs)
    converted = quantize_x86(model, (x,), pairs, transform_fn=lambda batch: batch[:1])
    with torch.no_grad():
        assert torch.nn.functional.cosine_similarity(converted(x).flatten(), model(x).flatten(), dim=0) > 0.99


def test_a_batch_nested_one_level_too_deep_is_named():
    model, x = _model_and_input()
    with pytest.raises(ValueError, match=r"calibration batch 0 \(list\(tuple\(Tensor.*nested otherwise than the example"):
        quantize_x86(model, (x,), [[(x,)]])


@pytest.mark.parametrize("bad, message", [
    (torch.randn(2, 4, 16, 16), r"input 'x' has size 4 in dim 1 where export fixed 3"),
    (torch.randn(2, 3, 16), r"input 'x' has 3 dims \[2, 3, 16\], the model was exported with 4"),
    (torch.randn(2, 3, 16, 16, dtype=torch.float64), r"input 'x' is torch.float64, the model was exported with torch.float32"),
    (torch.randn(5, 3, 16, 16), r"size 5 in dim 0 where export fixed 2 \(dynamic_batch=True"),
])
def test_a_batch_the_export_does_not_take_is_named_before_it_runs(bad, message):
    model, x = _model_and_input()
    with pytest.raises(ValueError, match=r"calibration batch 1 .*" + message):
        quantize_x86(model, (x,), [(x,), (bad,)])


def test_other_batch_sizes_calibrate_a_dynamic_batch():
    model, x = _model_and_input()
    quantize_x86(model, (x,), [(x,), (torch.randn(5, 3, 16, 16),)], dynamic_batch=True)


def test_an_unknown_device_is_an_error():
    model, x = _model_and_input()
    converted = quantize_x86(model, (x,), [(x,)])
    with pytest.raises(ValueError, match=r"device='cuda'; it lowers for 'cpu', 'xpu'"):
        qbackend.compile(converted, options={"device": "cuda"})(x)


def test_a_float_model_warns_and_strict_raises():
    model, x = _model_and_input()
    reports = []
    with pytest.warns(UserWarning, match=r"this graph's 2 conv / linear ops are float and none reads a quantized"):
        qbackend.compile(model, options={"strict": False, "report_sink": reports.append})(x)  # (not strict, as by default)
    (report,) = reports
    assert len(report.kept) == 2 and any("are float" in note for note in report.notes), str(report)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="none reads a quantized input or weight"):
        qbackend.compile(model, options={"strict": True})(x)
    torch._dynamo.reset()


def _after_a_graph_break(x_int8, weight, bias):
    """What Dynamo hands the backend after a graph break split a converted model: this graph
    dequantizes its activation, but the weight's dequantize ran in an earlier one."""
    x = torch.ops.quantized_decomposed.dequantize_per_tensor.default(x_int8, 0.05, 10, 0, 255, torch.uint8)
    y = torch.nn.functional.conv2d(x, weight, bias, padding=1).relu()
    return torch.ops.quantized_decomposed.quantize_per_tensor.default(y, 0.05, 0, 0, 255, torch.uint8)


def test_a_weight_dequantized_in_another_graph_warns_and_strict_raises():
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (the quantized_decomposed ops)

    torch.manual_seed(0)
    args = (torch.randint(0, 255, (1, 8, 6, 6), dtype=torch.uint8), torch.randn(8, 8, 3, 3), torch.randn(8))
    reports = []
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match=r"1 of this graph's 1 conv / linear ops \(conv2d\) read a quantized input but get "
                                         r"their weight as a float input of the graph .*a graph break"):
        out = torch.compile(_after_a_graph_break, backend="qbackend",
                            options={"strict": False, "report_sink": reports.append})(*args)
    assert torch.equal(out, _after_a_graph_break(*args))  # (it runs float, as captured)
    (decision,) = reports[0].decisions
    assert not decision.lowered and "its weight is a float input of this graph" in decision.reason, str(reports[0])
    torch._dynamo.reset()
    with pytest.raises(Exception, match="get their weight as a float input of the graph"):
        torch.compile(_after_a_graph_break, backend="qbackend", options={"strict": True})(*args)
    torch._dynamo.reset()


def test_a_quantized_model_does_not_warn():
    model, x = _model_and_input()
    converted = quantize_x86(model, (x,), [(x,)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = qbackend.explain(converted, x)
    assert len(report.lowered) == 2, str(report)


def test_a_layer_kept_float_is_explained_as_float():
    model, x = _model_and_input()
    converted = quantize_x86(model, (x,), [(x,)], keep_float=("second",))
    (kept,) = qbackend.explain(converted, x).kept
    assert kept.reason.startswith("a float conv: neither its input nor its weight is dequantized"), kept.reason


def test_explain_takes_keyword_inputs():
    class Keyword(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 32)

        def forward(self, input_ids, mask):
            return self.proj(input_ids) * mask

    torch.manual_seed(0)
    batch = {"input_ids": torch.randn(2, 8, 32), "mask": torch.ones(2, 8, 1)}
    converted = quantize_x86(Keyword().eval(), batch, [batch])
    report = qbackend.explain(converted, **batch)
    assert [d.lowered for d in report.decisions] == [True], str(report)


def test_a_group_size_that_fits_no_linear_warns_with_their_names():
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 8))
    with pytest.warns(UserWarning, match=r"2 linear\(s\) kept float, their in_features not a multiple of group_size 100: "
                                         r"0 \(in_features 256\), 2 \(in_features 64\)"):
        qbackend.quantize_weights(model, bits=4, group_size=100)
    assert not any(isinstance(m.weight, qbackend.QuantizedLinearWeight) for m in model if isinstance(m, nn.Linear))
    with pytest.raises(ValueError, match="group_size must be a positive int, got 0"):
        qbackend.quantize_weights(model, bits=4, group_size=0)


def test_a_weight_only_quantized_weight_is_a_quantized_operand_also_through_a_transpose():
    from qbackend.patterns.base import GraphView
    from qbackend.patterns.qdq import quantized_operand

    root = nn.Module()
    root.w, root.plain = qbackend.QuantizedLinearWeight.from_float(torch.randn(16, 64), 4, 32), torch.randn(16, 64)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    weights = [graph.get_attr(name) for name in ("w", "plain")]
    views = [graph.call_function(torch.ops.aten.t.default, (w,)) for w in weights]
    graph.output([graph.call_function(torch.ops.aten.mm.default, (x, view)) for view in views])
    view = GraphView(torch.fx.GraphModule(root, graph))
    assert [quantized_operand(view, node) for node in (*weights, *views, x)] == [True, False, True, False, False]
