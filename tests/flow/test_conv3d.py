"""3-D convs, which X86InductorQuantizer leaves float: quantize_x86 quantizes them as it does
2-D ones, the lowering runs them on oneDNN, and a ReLU / ReLU6 the kernel refuses becomes a
clamp of its quantized output (the bytes of quantizing the clipped floats)."""
import pytest
import torch
from expecttest import assert_expected_inline

from tests.helpers import assert_matches_reference, lowered_lines, quantize


def _video_block(activation) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv3d(3, 8, 3, padding=1), torch.nn.BatchNorm3d(8), activation(),
        torch.nn.Conv3d(8, 8, 3, padding=1), activation(),
        torch.nn.AdaptiveAvgPool3d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4)).eval()


def test_every_3d_conv_is_quantized_and_lowered_a_relu_as_a_clamp():
    torch.manual_seed(0)
    inputs = (torch.randn(2, 3, 4, 12, 12),)
    _, _, captured, lines = lowered_lines(quantize(_video_block(torch.nn.ReLU), inputs), inputs, "qconv_pointwise", "clamp")
    assert not captured.report.kept, str(captured.report)
    # the first conv's ReLU feeds the second conv only: uint8 out, clamped at the zero point
    assert_expected_inline(lines, """\
qconv_pointwise_default = onednn.qconv_pointwise(quantize_per_tensor_default, 0.0645, 63, <const>, <const>, <const>, <const>, [1, 1, 1], [1, 1, 1], [1, 1, 1], 1, 0.016, 0, uint8, 'none', [], '')
clamp_to_range_ = fast_qdq.clamp_to_range_(qconv_pointwise_default, 0, 127)
qconv_pointwise_default_1 = onednn.qconv_pointwise(clamp_to_range_, 0.016, 0, <const>, <const>, <const>, <const>, [1, 1, 1], [1, 1, 1], [1, 1, 1], 1, 1, 0, float32, 'none', [], '')
relu_1 = aten.relu(qconv_pointwise_default_1)""")
    assert_matches_reference(quantize(_video_block(torch.nn.ReLU), inputs), inputs)


def test_a_relu6_after_a_3d_conv_clamps_to_where_0_and_6_quantize():
    torch.manual_seed(0)
    inputs = (3 * torch.randn(2, 3, 4, 12, 12),)
    model = quantize(_video_block(torch.nn.ReLU6), inputs)
    _, _, captured, lines = lowered_lines(model, inputs, "clamp")
    (clamp,) = [n for n in captured.lowered.graph.nodes if n.name.startswith("clamp_to_range_")]
    scale, zero_point = clamp.args[0].args[11:13]
    assert clamp.args[1:] == (zero_point, min(127, zero_point + round(6 / scale))), lines
    assert_matches_reference(model, inputs)


def test_keep_float_leaves_a_3d_conv_float_and_says_why():
    torch.manual_seed(0)
    inputs = (torch.randn(2, 3, 4, 12, 12),)
    _, _, captured, _ = lowered_lines(quantize(_video_block(torch.nn.ReLU), inputs, keep_float=("3",)), inputs, "qconv")
    kept = [d for d in captured.report.decisions if not d.lowered]
    assert [(d.kind, d.source) for d in kept] == [("conv", "3")], str(captured.report)
    assert "left float when the model was quantized" in kept[0].reason
