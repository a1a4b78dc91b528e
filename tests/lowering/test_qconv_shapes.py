"""Quantized conv1d / conv2d / conv3d with grouped, depthwise, strided, dilated and padded
variants, with and without relu and output quantize: all lowered, reference numerics."""
import pytest
import torch

from qbackend.lowering.capabilities import conv_post_op_refusal
from qbackend.patterns.examples import HandQuantized

from tests.helpers import assert_matches_reference

CASES = {
    "conv1d": dict(rank=1),
    "conv1d_strided_no_relu": dict(rank=1, stride=2, post_op=None),
    "conv2d_grouped": dict(rank=2, groups=2),
    "conv2d_depthwise_dilated": dict(rank=2, groups=8, dilation=2, padding=2),
    "conv2d_stride2_pad0_float_out": dict(rank=2, stride=2, padding=0, quantize_output=False),
    "conv2d_no_bias": dict(rank=2, bias=False),
    "conv3d": dict(rank=3),
    "conv3d_float_out": dict(rank=3, post_op=None, quantize_output=False),
}
SPATIAL = {1: (20,), 2: (12, 12), 3: (6, 6, 6)}


@pytest.mark.parametrize("case", CASES)
def test_conv_variant_lowers(case):
    args = CASES[case]
    module = HandQuantized(**args)
    inputs = (torch.randn(2, 8, *SPATIAL[args["rank"]]),)
    captured = assert_matches_reference(module, inputs)
    report = captured.report
    assert [d.rule for d in report.decisions] == ["qconv"], str(report)
    relu, quantized = args.get("post_op", "relu") == "relu", args.get("quantize_output", True)
    refusal = relu and conv_post_op_refusal("cpu", args["rank"], "relu", (), "")
    if refusal and quantized:  # the kernel said no (conv3d in torch 2.13): its int8 output is clamped
        assert report.decisions[0].post_ops == ["relu", "quantize(torch.uint8)"]
        assert "relu as a clamp of the int8 output to [" in report.decisions[0].reason, report.decisions[0].reason
    elif refusal:  # float output: the relu stays in the graph
        assert report.decisions[0].post_ops == ["torch.float32 out"]
        assert f"relu not fused: {refusal}" in report.decisions[0].reason
    else:
        expected = (["relu"] if relu else []) + (["quantize(torch.uint8)"] if quantized else ["torch.float32 out"])
        assert report.decisions[0].post_ops == expected


def test_kernel_limits_are_asked_of_the_kernel():
    """The refusal text is the kernel's own error, so it cannot be a hard-coded assumption."""
    assert conv_post_op_refusal("cpu", 2, "relu", (), "") is None
    refusal = conv_post_op_refusal("cpu", 2, "gelu", (), "none")
    assert refusal is not None and "gelu" in refusal
