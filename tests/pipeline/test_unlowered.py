"""What is not lowered runs as the reference does; bad options give clear errors."""
import contextlib

import pytest
import torch
import torch.nn as nn

from qbackend.patterns.examples import HandQuantized, residual_block

from tests.helpers import Captured, assert_matches_reference, compile_and_run, quantize


def test_float_model_runs_bit_exact():
    module, inputs = residual_block()
    actual, expected, captured = compile_and_run(module.eval(), inputs)
    assert torch.equal(actual, expected)
    assert not captured.report.lowered and len(captured.report.kept) == 3


def test_a_graph_on_a_device_without_a_table_runs_unlowered_with_a_warning(monkeypatch):
    import qbackend
    from qbackend.pipeline import backend

    module, inputs = residual_block()
    converted = quantize(module, inputs)
    monkeypatch.setattr(backend, "graph_device", lambda *args: "vulkan")  # (tensors of a device this machine lacks)
    torch._dynamo.reset()
    reports = []
    with pytest.warns(UserWarning, match="on 'vulkan', which it has no table for: it runs unlowered"):
        qbackend.compile(converted, options={"strict": False, "report_sink": reports.append})(*inputs)
    (report,) = reports
    assert report.notes == ["no lowering table for device 'vulkan' (qbackend knows ['cpu', 'xpu']); ran unlowered",
                            "qbackend: this graph's tensors are on 'vulkan', which it has no table for: it runs unlowered"]
    assert not report.lowered
    with pytest.warns(UserWarning), torch.no_grad():
        assert torch.equal(qbackend.compile(converted, options={"strict": False})(*inputs), converted(*inputs))


def test_a_device_option_without_a_table_is_an_error():
    module, inputs = residual_block()
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"device='vulkan'; it lowers for 'cpu', 'xpu'"):
        torch.compile(quantize(module, inputs), backend="qbackend", options={"device": "vulkan"})(*inputs)


def test_unknown_option_is_a_clear_error():
    module, inputs = residual_block()
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"unknown option\(s\) \['fuse_everything'\]"):
        torch.compile(module, backend="qbackend", options={"fuse_everything": True})(*inputs)


def test_symbolic_shapes_lower_and_run():
    """dynamic=True: shapes are symbols at compile time (prepack gets no input shape)."""
    module = HandQuantized(rank=2)
    torch._dynamo.reset()
    captured = Captured()
    compiled = torch.compile(module, backend=captured, dynamic=True)
    with torch.no_grad():
        for batch, size in ((2, 12), (3, 9), (5, 16)):
            x = torch.randn(batch, 8, size, size)
            actual, expected = compiled(x), module(x)
            assert (actual - expected).abs().max() <= 0.03 * 1.0001, (batch, size)  # within one output step
    assert len(captured.graphs) == 1 and captured.report.decisions[0].rule == "qconv", str(captured.report)


def test_graph_break_gives_one_report_per_graph():
    class WithBreak(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            x = self.a(x)
            torch._dynamo.graph_break()
            return self.b(x)

    import qbackend

    module, inputs = WithBreak().eval(), (torch.randn(3, 8),)
    torch._dynamo.reset()
    report = qbackend.explain(module, *inputs)
    assert report.graphs == 2 and len(report.decisions) == 2
    assert all(d.reason.startswith("a float linear: neither its input nor its weight is dequantized") for d in report.kept), \
        str(report)


class SharedWeightConvs(nn.Module):
    """One conv module applied twice: both uses read the same int8 weight."""

    def __init__(self):
        super().__init__()
        self.stem, self.shared = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        return self.shared(torch.relu(self.shared(x)))


def test_conv_weight_shared_by_two_convs():
    inputs = (torch.randn(2, 3, 12, 12),)
    report = assert_matches_reference(quantize(SharedWeightConvs(), inputs), inputs).report
    assert [d.source for d in report.decisions if d.lowered] == ["stem", "shared", "shared"], str(report)


def test_forced_xpu_on_a_cpu_only_torch_keeps_everything_with_reasons():
    """The device option picks the XPU table; this torch has no XPU kernels, so every rule
    says why and the model runs unlowered with exact numerics."""
    module, inputs = conv_maxpool_residual()
    actual, expected, captured = compile_and_run(quantize(module, inputs), inputs, device="xpu")
    assert torch.equal(actual, expected)
    report = captured.report
    assert not report.lowered and report.device == "xpu"
    reasons = {d.node: d.reason for d in report.decisions}
    assert reasons["max_pool2d"].startswith("qmaxpool2d matched but xpu cannot run it: quantized::max_pool2d has CPU kernels only")
    assert reasons["conv2d"].startswith("qconv matched but xpu cannot run it: no qconv op for xpu: onednn::qconv_pointwise.default has no xpu kernel")
    assert any(note.startswith("rule qconv disabled on xpu") for note in report.notes)


def conv_maxpool_residual():
    from qbackend.patterns.examples import ResidualBlock

    module = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), ResidualBlock(8))
    return module, (torch.randn(2, 3, 16, 16),)


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_a_linear_kept_float_by_the_quantizer_runs_float_with_its_reason():
    inputs = (torch.randn(4, 16),)
    captured = assert_matches_reference(quantize(TwoLinears(), inputs, keep_float=["fc2"]), inputs)
    lines = {d.source: d.line() for d in captured.report.decisions}
    assert lines["fc1"].startswith("LOWERED"), lines
    assert lines["fc2"].startswith("KEPT") and "a float linear: neither its input nor its weight is dequantized" in lines["fc2"], \
        lines


class AttentionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha, self.fc = nn.MultiheadAttention(32, 4, batch_first=True), nn.Linear(32, 32)

    def forward(self, x):
        return self.fc(self.mha(x, x, x, need_weights=False)[0])


@pytest.mark.parametrize("keep_float, lowered", [((), ["mha", "mha", "fc"]), (("mha",), ["fc"])])
def test_every_linear_quantizes_the_attention_projections_the_quantizer_leaves_float(keep_float, lowered):
    """X86InductorQuantizer leaves nn.MultiheadAttention's in / out projections float (their
    source function is the attention's: ``every_linear=False``); every_linear, the default,
    quantizes them, keep_float still wins."""
    torch.manual_seed(0)
    inputs = (torch.randn(2, 6, 32),)
    quantizers_own = assert_matches_reference(quantize(AttentionBlock().eval(), inputs, every_linear=False), inputs)
    assert [d.source for d in quantizers_own.report.lowered if d.kind == "linear"] == ["fc"]
    captured = assert_matches_reference(quantize(AttentionBlock().eval(), inputs, keep_float=keep_float), inputs)
    assert [d.source for d in captured.report.lowered if d.kind == "linear"] == lowered, str(captured.report)


def test_the_xpu_flow_quantizes_the_attention_projections_too():
    from qbackend.pt2e_flow import quantize_xpu

    torch.manual_seed(0)
    inputs = (torch.randn(2, 6, 32),)
    for every_linear, quantized in ((True, ["mha", "mha", "fc"]), (False, ["fc"])):
        captured = assert_matches_reference(quantize_xpu(AttentionBlock().eval(), inputs, [inputs], every_linear=every_linear),
                                            inputs)
        # (the int8 linear rule matched each: lowered, or on a CPU without VNNI kept exact, its
        # 8-bit pairs overflowing int16: lowering/capabilities.int8_pairs_saturate)
        matched = [d.source for d in captured.report.decisions
                   if d.kind == "linear" and (d.lowered or d.reason.startswith("qlinear matched but cpu cannot run it"))]
        assert matched == quantized, str(captured.report)


def test_keep_float_takes_patterns_and_refuses_a_name_matching_no_module():
    inputs = (torch.randn(4, 16),)
    captured = assert_matches_reference(quantize(TwoLinears(), inputs, keep_float=["*2"]), inputs)
    lines = {d.source: d.line() for d in captured.report.decisions}
    assert lines["fc1"].startswith("LOWERED") and lines["fc2"].startswith("KEPT"), lines
    with pytest.raises(ValueError, match="'fc3' matches no module of TwoLinears"):
        quantize(TwoLinears(), inputs, keep_float=["fc3"])


class BatchFirstAttention(nn.Module):
    """nn.MultiheadAttention(batch_first=True), as ViT's encoder: X86InductorQuantizer's own
    recipe (``every_linear=False``) leaves its in-projection float, and it reads a transpose
    of the input."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.attention = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        x = self.fc(x)
        return self.attention(x, x, x, need_weights=False)[0]


def _float_linears(captured) -> list:
    return [n for n in captured.lowered.graph.nodes if n.target in (torch.ops.aten.linear.default, torch.ops.mkl._mkl_linear.default)]


def test_float_linears_with_constant_weights_run_on_a_packed_gemm():
    """As Inductor's freezing: MKL's sgemm on a weight packed once (float_linear.py; the
    "prior" kernel choice the tests pin: test_kernel_choice.py measures it)."""
    inputs = (torch.randn(3, 10, 32),)
    captured = assert_matches_reference(quantize(BatchFirstAttention().eval(), inputs, every_linear=False), inputs)
    assert [n.target for n in _float_linears(captured)] == [torch.ops.mkl._mkl_linear.default] * 2, captured.lowered.graph
    assert [n.args[-1] for n in _float_linears(captured)] == [30, 30]  # (the rows it was packed for)
    assert "2 float linear(s) on MKL's sgemm, weight packed once" in captured.report.notes


class TransposedRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return self.fc(x.transpose(0, 1))


def test_without_a_packed_gemm_a_float_linear_of_a_transposed_input_reads_it_contiguous(monkeypatch):
    """(else ATen runs it as a bmm against the weight expanded per row)"""
    from qbackend.passes import float_linear
    from qbackend.ops import Resolved

    monkeypatch.setattr(float_linear, "resolve", lambda logical, device: Resolved(logical, device, None, None, "no GEMM"))
    inputs = (torch.randn(3, 10, 32),)
    captured = assert_matches_reference(quantize(TransposedRows().eval(), inputs, keep_float=["fc"]), inputs)
    readers = [n.args[0] for n in _float_linears(captured)]
    assert [r.target for r in readers] == [torch.ops.aten.contiguous.default], captured.lowered.graph
    assert readers[0].args[0].target == "transpose", captured.lowered.graph


def _failing_lowering(monkeypatch):
    import qbackend.pipeline.backend

    def lower(*args, **kwargs):
        raise RuntimeError("a kernel refused its arguments")
    monkeypatch.setattr(qbackend.pipeline.backend, "lower", lower)


def test_a_lowering_error_runs_the_graph_unlowered_with_a_warning_by_default(monkeypatch):
    _failing_lowering(monkeypatch)
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval(), torch.randn(2, 8)
    reports = []
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="runs it unlowered: RuntimeError: a kernel refused its arguments"), torch.no_grad():
        out = torch.compile(model, backend="qbackend", options={"report_sink": reports.append})(x)
    assert torch.equal(out, model(x))
    assert reports[0].notes == ["lowering failed: RuntimeError: a kernel refused its arguments"]


@pytest.mark.parametrize("how", ["option", "environment", "suppress_errors set False"])
def test_strict_mode_raises_the_lowering_error(monkeypatch, how):
    _failing_lowering(monkeypatch)
    monkeypatch.delenv("QBACKEND_STRICT", raising=False)
    options = {"strict": True} if how == "option" else {}
    if how == "environment":
        monkeypatch.setenv("QBACKEND_STRICT", "1")
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(8, 4)).eval()
    with torch._dynamo.config.patch(suppress_errors=False) if how.startswith("suppress") else contextlib.nullcontext():
        with pytest.raises(Exception, match="a kernel refused its arguments"), torch.no_grad():
            torch.compile(model, backend="qbackend", options=options)(torch.randn(2, 8))


@pytest.mark.parametrize("options, suppress_errors", [({"strict": False}, False), ({}, True)])
def test_an_explicit_choice_to_fall_back_runs_the_graph_unlowered(monkeypatch, options, suppress_errors):
    """``strict=False`` wins over ``suppress_errors=False``; ``suppress_errors=True`` falls back."""
    _failing_lowering(monkeypatch)
    monkeypatch.delenv("QBACKEND_STRICT", raising=False)
    torch._dynamo.reset()
    model, x = nn.Sequential(nn.Linear(8, 4)).eval(), torch.randn(2, 8)
    with torch._dynamo.config.patch(suppress_errors=suppress_errors), torch.no_grad():
        with pytest.warns(UserWarning, match="runs it unlowered"):
            out = torch.compile(model, backend="qbackend", options=options)(x)
    assert torch.equal(out, model(x))
