"""qbackend's LayerNorm-and-quantize kernel (csrc/layer_norm_quantize.c): the reference's
integers (ATen's LayerNorm, then the quantize) within one level on rounding ties, for every
channel tail and row count; a LayerNorm before a quantized linear lowers onto it, writing its
float rows too where other ops read them."""
import pytest
import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)

from qbackend.kernels import layer_norm_quantize, registry
from qbackend.patterns import examples

from tests.helpers import assert_fused_into_quantize, assert_matches_reference, needs_own_kernels, quantize, short_graph

pytestmark = needs_own_kernels


def reference(x, weight, bias, eps, scale, zero_point, qmin, qmax):
    normed = torch.nn.functional.layer_norm(x, [x.shape[-1]], weight, bias, eps)
    return torch.ops.quantized_decomposed.quantize_per_tensor(normed, scale, zero_point, qmin, qmax, torch.uint8)


@pytest.mark.parametrize("shape", [(3136, 96), (2, 7, 13), (1, 5), (5, 768), (4, 4, 1), (3, 50)],
                         ids=["ConvNeXt rows", "rows of 8 + 5", "one row of 5", "ViT rows", "one channel", "rows of 32 + 2 x 8 + 2"])
@pytest.mark.parametrize("qparams", [(0.02, 128, 0, 255), (0.05, 0, 0, 127)], ids=["full range", "7-bit"])
def test_kernel_gives_the_references_integers(shape, qparams):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3 + 2  # (an offset: the mean is subtracted before the squares)
    weight, bias = torch.randn(shape[-1]), torch.randn(shape[-1])
    expected = reference(x, weight, bias, 1e-6, *qparams).int()
    for actual in (layer_norm_quantize.layer_norm_quantize(x, weight, bias, 1e-6, *qparams),
                   registry.op("layer_norm_quantize")(x, weight, bias, 1e-6, *qparams)):
        assert actual.shape == x.shape and actual.dtype == torch.uint8 and actual.is_contiguous()
        off = (actual.int() - expected).abs()
        # float32 statistics summed in another order: a value on a rounding tie may round the other way
        assert int(off.max()) <= 1 and int((off > 0).sum()) <= max(2, x.numel() // 20000), f"{int((off > 0).sum())} off"


@pytest.mark.parametrize("special", [1e30, -1e30, 3e38, float("inf"), float("nan")])
def test_rows_past_float32_statistics_give_atens_result(special):
    """ATen's running variance of such a row overflows to NaN or not by the value's place in
    its vector: the kernel leaves the tensor to ATen, whatever it gives."""
    torch.manual_seed(0)
    x = torch.randn(6, 16)
    x[1, 3], x[4, 8], x[5, 0] = special, special, -special
    weight, bias = torch.randn(16), torch.randn(16)
    expected = reference(x, weight, bias, 1e-5, 0.02, 128, 0, 255)
    assert torch.equal(layer_norm_quantize.layer_norm_quantize(x, weight, bias, 1e-5, 0.02, 128, 0, 255), expected)


def test_a_strided_input_reads_as_its_values():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 6, 6).permute(0, 2, 3, 1)  # (ConvNeXt: the conv's NCHW output seen as NHWC)
    weight, bias = torch.randn(16), torch.randn(16)
    assert torch.equal(layer_norm_quantize.layer_norm_quantize(x, weight, bias, 1e-6, 0.02, 128, 0, 255),
                       layer_norm_quantize.layer_norm_quantize(x.contiguous(), weight, bias, 1e-6, 0.02, 128, 0, 255))


def test_a_norm_before_a_quantized_linear_lowers_onto_the_kernel():
    assert_fused_into_quantize(examples.normed_linear, "layer_norm_quantize", "layer_norm.default",
                               "1 LayerNorm fused into its quantize")


def test_a_norm_other_ops_read_too_writes_its_float_rows_as_well():
    torch.manual_seed(0)
    module, inputs = examples.normed_linear(also_return=True)  # (the normed rows are an output too)
    captured = assert_matches_reference(quantize(module, inputs), inputs)
    graph = short_graph(captured.lowered)
    assert "layer_norm_quantize.layer_norm_and_quantize(" in graph and "layer_norm.default" not in graph, graph
    assert "1 LayerNorm fused into its quantize" in str(captured.report), str(captured.report)
