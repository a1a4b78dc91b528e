"""ConvNeXt's depthwise conv -> LayerNorm over channels -> quantize as one kernel call
(qbackend/passes/depthwise_norm.py, qconv_depthwise_layer_norm): the bytes of the conv's float result
run through layer_norm_quantize, and the block lowered onto it."""
import pytest
import torch
import torch.nn as nn

from qbackend.kernels import layer_norm_quantize
from qbackend.kernels import depthwise as depthwise_kernel
from qbackend.lowering import depthwise
from qbackend.lowering.own_conv import scale_and_offset

from tests.helpers import assert_matches_reference, quantize, short_graph
from tests.kernels.test_own_conv_kernels import _needs_vnni_library


def _case(n, c, h, w, window, stride, activation, mult_scale=0.01):
    _needs_vnni_library()
    torch.manual_seed(0)
    x = torch.randint(0, 256, (n, c, h, w), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    weight = torch.randint(-128, 128, (c, 1, window, window), dtype=torch.int8)
    packed = depthwise.pack(weight, *scale_and_offset(weight, torch.rand(c) * mult_scale + 0.001, 0.03, 7, torch.randn(c)), True)
    conv = (x, 7, *packed, (stride, stride), (window // 2, window // 2), float("-inf"), float("inf"))
    norm = (torch.randn(c), torch.randn(c), 1e-6, 0.03, 127, 0, 255)
    floats = depthwise_kernel.qconv_depthwise(*conv, 1.0, 0, 0, 255, True, activation, window)
    expected = layer_norm_quantize.layer_norm_quantize(floats.permute(0, 2, 3, 1), *norm)
    return depthwise_kernel.qconv_depthwise_layer_norm(*conv, activation, window, *norm), expected


@pytest.mark.parametrize("n, c, h, w, window, stride, activation", [
    (1, 96, 56, 56, 7, 1, "none"), (2, 48, 9, 11, 3, 2, "swish"), (1, 16, 5, 7, 5, 1, "hardswish"),
    (2, 32, 11, 6, 7, 2, "none")], ids=["ConvNeXt stage 1", "a last group of 16, stride 2", "one group of 16", "odd rows"])
def test_the_fused_kernel_gives_the_bytes_of_the_conv_then_the_norm(n, c, h, w, window, stride, activation):
    actual, expected = _case(n, c, h, w, window, stride, activation)
    assert actual.shape == expected.shape and actual.is_contiguous() and actual.dtype == torch.uint8
    assert torch.equal(actual, expected)


def test_pixels_past_float32_statistics_take_atens_path():
    """(conv outputs ~1e17: squared deviations past the kernel's bound; layer_norm_quantize
    leaves such rows to ATen, and so does the fused call)"""
    actual, expected = _case(1, 32, 6, 6, 3, 1, "none", mult_scale=1e15)
    assert torch.equal(actual, expected)


class ConvNeXtBlock(nn.Module):
    def __init__(self, c=32):
        super().__init__()
        self.dwconv = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        return x + self.fc2(nn.functional.gelu(self.fc1(y))).permute(0, 3, 1, 2)


def test_a_convnext_block_lowers_onto_the_fused_kernel():
    _needs_vnni_library()
    torch.manual_seed(0)
    inputs = (torch.randn(2, 32, 8, 8),)
    captured = assert_matches_reference(quantize(ConvNeXtBlock().eval(), inputs), inputs)
    graph = short_graph(captured.lowered)
    assert "depthwise.qconv_depthwise_layer_norm(" in graph and "layer_norm_quantize" not in graph, graph
    assert "1 depthwise conv(s) normalize and quantize their own output (LayerNorm fused)" in captured.report.notes
