"""qbackend's scale-and-quantize kernel (csrc/scale_quantize.c): squeeze-excitation's channel
gate times the features, quantized, gives the reference's integers in every layout, factor
shape, channel tail and range, NaN / inf included; bad arguments get a clear error; the SE
block lowers onto it with the reason in the report, a per-pixel gate does not."""
import pytest
import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)

from qbackend.kernels import registry, scale_quantize
from qbackend.patterns import examples

from tests.helpers import assert_fused_into_quantize, compile_and_run, needs_own_kernels, short_graph

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
], ids=["float64", "rank 3", "per-pixel factors", "factor batch", "float64 factors", "qmin > qmax", "zero point",
        "negative qmin", "zero scale", "NaN scale"])
def test_bad_arguments_get_a_clear_error(args, message):
    for call in (scale_quantize.scale_quantize, registry.op("scale_quantize")):
        with pytest.raises((ValueError, RuntimeError), match=message):
            call(*args)


def test_squeeze_excitation_lowers_onto_the_kernel():
    assert_fused_into_quantize(examples.squeeze_excitation, "scale_quantize", "aten.mul",
                               "1 channel scale fused into its quantize")


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
