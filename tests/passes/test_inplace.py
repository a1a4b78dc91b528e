"""In-place sum (binary conv) never clobbers a tensor someone else still needs."""
import pytest
import torch
import torch.nn as nn

from qbackend.kernels import registry

from tests.helpers import assert_matches_reference, dense_convs_on_onednn, needs_own_kernels, onednn_linear_rows, quantize


class ResidualReadAgain(nn.Module):
    """The block input is read by conv3 AFTER the residual add: its int8 buffer must survive."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv1, self.conv2, self.conv3 = (nn.Conv2d(8, 8, 3, padding=1) for _ in range(3))

    def forward(self, x):
        x = torch.relu(self.stem(x))
        a = torch.relu(self.conv2(torch.relu(self.conv1(x))) + x)
        b = self.conv3(x)
        return a + b


class ResidualIsGraphInput(nn.Module):
    """The residual operand is the model's own input: the caller's tensor must not change."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x, residual):
        return torch.relu(self.conv(x) + residual)


class ResidualIsTheConvInput(nn.Module):
    """``y = conv(x); y += x``: the residual is the very tensor the conv reads (fuzz seed 723)."""

    def __init__(self):
        super().__init__()
        self.stem, self.conv, self.head = nn.Conv2d(4, 8, 3, padding=1), nn.Conv2d(8, 8, 5, padding=2), nn.Conv2d(8, 4, 1)

    def forward(self, x):  # (the head makes the sum int8, written into the int8 residual)
        x = torch.relu(self.stem(x))
        y = self.conv(x)
        y += x
        return self.head(y)


@pytest.fixture
def onednn_only(monkeypatch):
    """oneDNN's kernels, which write into their residual, rather than qbackend's own (which never do)."""
    monkeypatch.setattr(registry, "available", lambda: "turned off for this test")


@pytest.mark.usefixtures("onednn_only")
def test_residual_read_later_is_copied_not_clobbered():
    inputs = (torch.randn(2, 3, 12, 12),)
    report = assert_matches_reference(quantize(ResidualReadAgain(), inputs), inputs).report
    by_source = {d.source: d for d in report.decisions}
    assert by_source["conv2"].rule == "qconv_add", str(report)
    assert "residual copied:" in by_source["conv2"].reason, str(report)
    assert "is read again later by conv2d_3" in by_source["conv2"].reason, str(report)


@pytest.mark.usefixtures("onednn_only")
def test_a_residual_the_conv_also_reads_is_copied():
    """Summing into the conv's own input overwrote pixels its 5x5 windows still had to read:
    garbage in one run of three, by thread timing."""
    inputs = (torch.randn(1, 4, 8, 12),)
    converted = quantize(ResidualIsTheConvInput(), inputs)
    report = assert_matches_reference(converted, inputs).report
    conv = next(d for d in report.decisions if d.source == "conv")
    assert conv.rule == "qconv_add" and "residual copied:" in conv.reason, str(report)
    assert "is also the input the kernel reads" in conv.reason, str(report)


@pytest.mark.usefixtures("onednn_only")
def test_residual_from_caller_is_never_written():
    inputs = (torch.randn(2, 8, 10, 10), torch.randn(2, 8, 10, 10))
    converted = quantize(ResidualIsGraphInput(), inputs)
    before = [t.clone() for t in inputs]
    report = assert_matches_reference(converted, inputs).report
    assert all(torch.equal(a, b) for a, b in zip(inputs, before)), "the caller's input changed"
    binary = [d for d in report.decisions if d.rule == "qconv_add"]
    assert binary, str(report)
    assert "residual copied:" in binary[0].reason or "updated in place" in binary[0].reason


@pytest.mark.usefixtures("onednn_only")
def test_residual_with_no_later_reader_is_updated_in_place():
    from qbackend.patterns.examples import residual_block

    module, inputs = residual_block()
    report = assert_matches_reference(quantize(module, inputs), inputs).report
    binary = [d for d in report.decisions if d.rule == "qconv_add"]
    assert [d.reason.split("; ")[-1] for d in binary] == ["residual updated in place"], str(report)


class TwoLinearResiduals(nn.Module):
    """h = x + fc1(x) adds into the caller's input (must not be written); h + fc2(h) adds
    into h, a dead intermediate (may be written)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = x + self.fc1(x)
        return h + self.fc2(h)


def test_a_strided_residual_is_read_as_it_is_laid_out():
    """oneDNN's 'add' read a transposed residual as if dense (NaN or garbage rows: a graph
    input here, a transposed view in ViT's encoder). Same values, another layout."""
    x = torch.randn(onednn_linear_rows() // 2, 2, 16)
    model = quantize(TwoLinearResiduals(), (x.transpose(0, 1).contiguous(),))
    strided = (x.transpose(0, 1),)
    captured = assert_matches_reference(model, strided)
    assert "residual added out of place" in captured.report.decisions[0].reason, str(captured.report)


def test_linear_residual_never_writes_the_callers_input():
    """On oneDNN's kernel (enough rows for it)."""
    inputs = (torch.randn(2, onednn_linear_rows() // 2, 16),)
    before = inputs[0].clone()
    report = assert_matches_reference(quantize(TwoLinearResiduals(), inputs), inputs).report
    assert torch.equal(inputs[0], before), "the caller's input changed"
    by_source = {d.source: d for d in report.decisions}
    assert by_source["fc1"].rule == "qlinear_add" and "; residual added out of place (" in by_source["fc1"].reason, str(report)
    assert "graph input" in by_source["fc1"].reason, str(report)
    assert by_source["fc2"].rule == "qlinear_add" and by_source["fc2"].reason.endswith("; residual updated in place"), str(report)


@needs_own_kernels
def test_own_gemm_kernel_reads_its_residual_and_writes_a_new_tensor():
    inputs = (torch.randn(3, 5, 16),)
    before = inputs[0].clone()
    report = assert_matches_reference(quantize(TwoLinearResiduals(), inputs), inputs).report
    assert torch.equal(inputs[0], before), "the caller's input changed"
    reasons = {d.source: (d.rule, d.op, d.reason) for d in report.decisions if d.kind == "linear"}
    own = ("qlinear_add", "qbackend::qconv.default", "qbackend's int8 GEMM kernel (15 rows); residual added out of place")
    assert reasons == {"fc1": own, "fc2": own}, str(report)


class OwnKernelResidual(nn.Module):
    """A 1x1 conv (qbackend's GEMM at this size) whose int8 output is the residual of a 3x3
    conv on oneDNN (its input follows a ReLU: zero point 0); nobody reads it after the add."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Conv2d(8, 16, 1)
        self.conv1, self.conv2, self.head = (nn.Conv2d(16, 16, 3, padding=1) for _ in range(3))

    def forward(self, x):
        r = self.proj(x)
        return self.head(torch.relu(self.conv2(torch.relu(self.conv1(r))) + r))


@needs_own_kernels
def test_own_kernel_output_is_summed_into_in_place_not_copied(monkeypatch):
    """The own kernels allocate their outputs (``fresh_output``), so a later in-place sum may
    reuse one when no later reader needs it (oneDNN's binary conv: the 3x3 stays on it)."""
    dense_convs_on_onednn(monkeypatch)
    inputs = (torch.randn(2, 8, 10, 10),)
    report = assert_matches_reference(quantize(OwnKernelResidual(), inputs), inputs).report
    by_source = {d.source: d for d in report.decisions}
    assert by_source["proj"].op == "qbackend::qconv.default", str(report)
    assert by_source["conv2"].rule == "qconv_add" and by_source["conv2"].op.startswith("onednn::"), str(report)
    assert by_source["conv2"].reason.endswith("residual updated in place"), str(report)
