"""qbackend's scale-and-quantize kernel (csrc/scale_quantize.c): squeeze-excitation's channel
gate times the features, quantized, gives the reference's integers in every layout, factor
shape, channel tail and range, NaN / inf included; bad arguments get a clear error; the SE
block lowers onto it with the reason in the report, a per-pixel gate does not."""
import pytest
import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)

from qbackend.kernels import registry, scale_quantize
from qbackend.patterns import examples

from tests.helpers import assert_fused_into_quantize, compile_and_run, needs_own_kernels, quantize, short_graph
from tests.tolerances import assert_int8_close, assert_outputs_close

pytestmark = needs_own_kernels


def reference(x, factors, scale, zero_point, qmin, qmax):
    return torch.ops.quantized_decomposed.quantize_per_tensor(x * factors, scale, zero_point, qmin, qmax, torch.uint8)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("shape,factor_batch", [((2, 40, 7, 5), 2), ((3, 13, 4, 4), 1), ((2, 37, 1, 1), 2), ((1, 96, 9, 9), 1)],
                         ids=["per image", "one for the batch, 5 + 8 channels", "1x1 image", "96 channels"])
@pytest.mark.parametrize("qparams", [(0.02, 128, 0, 255), (0.05, 0, 0, 127)], ids=["full range", "7-bit"])
def test_kernel_gives_the_references_integers(layout, shape, factor_batch, qparams):
    torch.manual_seed(0)
    x = torch.randn(shape) * 4
    x.view(-1)[:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -0.0])
    x.view(-1)[5] = 0.51 * qparams[0] * 2  # a product that lands near a rounding tie
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    factors = torch.rand(factor_batch, shape[1], 1, 1)
    before = x.clone()
    expected = reference(x, factors, *qparams)
    for actual in (scale_quantize.scale_quantize(x, factors, *qparams), registry.op("scale_quantize")(x, factors, *qparams)):
        assert actual.stride() == x.stride() and actual.dtype == torch.uint8
        # NaN: the reference casts NaN to uint8 (undefined in C, 0 here); the kernel gives qmin
        assert actual.flatten()[0] == qparams[2]
        assert torch.equal(actual.flatten()[1:], expected.flatten()[1:])
    torch.testing.assert_close(x, before, rtol=0, atol=0, equal_nan=True)  # the input is left as it was


@pytest.mark.parametrize("gate", ["sigmoid", "hardsigmoid"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_the_gate_runs_in_the_kernel(gate, layout):
    """sigmoid by the kernels' own e^x (within 2e-7 of torch's), hard sigmoid in torch's order:
    the reference's integers within the int8 tolerance; a NaN factor makes its channel's
    products NaN, stored as qmin; +-inf factors gate to torch's 0 and 1."""
    torch.manual_seed(0)
    x = torch.randn(2, 21, 6, 5) * 4  # (21 channels: a tail past whole vectors)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    logits = torch.randn(2, 21, 1, 1) * 4
    logits.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -3.0])
    qparams = (0.05, 10, 0, 255)
    actual = scale_quantize.scale_quantize(x, logits, *qparams, gate)
    expected = reference(x, getattr(torch, gate)(logits) if gate == "sigmoid" else torch.nn.functional.hardsigmoid(logits),
                         *qparams)
    assert actual.stride() == x.stride()
    assert (actual[0, 0] == qparams[2]).all()  # (the reference's NaN cast is undefined: the kernel gives qmin)
    assert_int8_close(actual[:, 1:], expected[:, 1:], gate)
    assert torch.equal(actual[0, 1:4], expected[0, 1:4])  # inf, -inf, -3: gates of exactly 1, 0, 0


@pytest.mark.parametrize("args,message", [
    ((torch.zeros(1, 8, 4, 4, dtype=torch.float64), torch.ones(1, 8, 1, 1), 0.1, 0, 0, 255), "float32 CPU"),
    ((torch.zeros(8, 4, 4), torch.ones(1, 8, 1, 1), 0.1, 0, 0, 255), "float32 CPU"),
    ((torch.zeros(2, 8, 4, 4), torch.ones(2, 8, 4, 4), 0.1, 0, 0, 255), "factors"),
    ((torch.zeros(2, 8, 4, 4), torch.ones(3, 8, 1, 1), 0.1, 0, 0, 255), "factors"),
    ((torch.zeros(2, 8, 4, 4), torch.ones(2, 8, 1, 1, dtype=torch.float64), 0.1, 0, 0, 255), "factors"),
    ((torch.zeros(2, 8, 4, 4), torch.ones(2, 8, 1, 1), 0.1, 0, 200, 100), "uint8 range"),
    ((torch.zeros(2, 8, 4, 4), torch.ones(2, 8, 1, 1), 0.1, 300, 0, 255), "uint8 range"),
    ((torch.zeros(2, 8, 4, 4), torch.ones(2, 8, 1, 1), 0.1, 0, -5, 255), "uint8 range"),
    ((torch.zeros(2, 8, 4, 4), torch.ones(2, 8, 1, 1), 0.0, 0, 0, 255), "scale"),
    ((torch.zeros(2, 8, 4, 4), torch.ones(2, 8, 1, 1), float("nan"), 0, 0, 255), "scale"),
    ((torch.zeros(2, 8, 4, 4), torch.ones(2, 8, 1, 1), 0.1, 0, 0, 255, "tanh"), "gate 'tanh'"),
], ids=["float64", "rank 3", "per-pixel factors", "factor batch", "float64 factors", "qmin > qmax", "zero point",
        "negative qmin", "zero scale", "NaN scale", "unknown gate"])
def test_bad_arguments_get_a_clear_error(args, message):
    for call in (scale_quantize.scale_quantize, registry.op("scale_quantize")):
        with pytest.raises((ValueError, RuntimeError), match=message):
            call(*args)


def test_squeeze_excitation_lowers_onto_the_kernel():
    captured = assert_fused_into_quantize(examples.squeeze_excitation, "scale_quantize", "aten.mul",
                                          "1 channel scale fused into its quantize")
    assert "sigmoid" not in short_graph(captured.lowered).replace("'sigmoid'", "")
    [scale] = [d for d in captured.report.moves if d.rule == "qscale"]
    assert "its sigmoid gate too" in scale.reason, scale


class HardSigmoidGate(torch.nn.Module):
    """MobileNetV3's excitation: a hard-sigmoid gate, whose logits another op reads too."""

    def __init__(self, shared: bool):
        super().__init__()
        self.features, self.excite = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.Conv2d(16, 16, 1)
        self.project, self.shared = torch.nn.Conv2d(16, 8, 1), shared

    def forward(self, x):
        x = self.features(x)
        gate = torch.nn.functional.hardsigmoid(self.excite(torch.nn.functional.adaptive_avg_pool2d(x, 1)))
        y = self.project(x * gate)
        return (y, gate.sum()) if self.shared else y


@pytest.mark.parametrize("shared", [False, True], ids=["gate read by the multiply only", "gate read by another op"])
def test_a_hard_sigmoid_gate_runs_in_the_kernel_unless_another_op_reads_it(shared):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 10, 10)
    model = quantize(HardSigmoidGate(shared).eval(), (x,))
    actual, expected, captured = compile_and_run(model, (x,))
    assert_outputs_close(actual, expected, "hardsigmoid gate")
    graph = short_graph(captured.lowered)
    assert ("aten.hardsigmoid" in graph) == shared, graph
    assert ("'hardsigmoid')" in graph) != shared, graph


def test_a_per_pixel_gate_keeps_the_graphs_multiply():
    converted, inputs = examples.spatial_gate()
    _, _, captured = compile_and_run(converted, inputs)
    assert "scale_quantize" not in short_graph(captured.lowered)
    assert "channel scale" not in str(captured.report)


@needs_own_kernels
def test_a_signed_quantize_keeps_the_graphs_multiply():
    """XPU-quantized models run on CPU as uint8 + 128, where the reference stores NaN as 128;
    the kernel would store it as 0: the multiply and its quantize stay apart, with the reason."""
    from qbackend.pt2e_flow import quantize_xpu

    torch.manual_seed(0)
    module, inputs = examples.squeeze_excitation()
    _, _, captured = compile_and_run(quantize_xpu(module, inputs, [inputs]), inputs)
    graph = short_graph(captured.lowered)
    assert "scale_quantize.scale_quantize(" not in graph and "nan_as=128" in graph, graph
    scale = [d for d in captured.report.moves if d.rule == "qscale"]
    assert scale and all("stores NaN as another level than qmin" in d.reason for d in scale), scale
