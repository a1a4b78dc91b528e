"""qbackend's own int8 conv kernels (depthwise 3x3, 1x1): the same integers as dequantize ->
conv -> quantize, chosen on CPU where they apply, and oneDNN (with the reason) elsewhere."""
import ctypes
import math
import mmap

import expecttest
import pytest
import torch
import torch.nn as nn

from qbackend.kernels import common, conv_gemm, isa, library, registry
from qbackend.kernels import depthwise as depthwise_kernel
from qbackend.lowering import capabilities, depthwise, gemm
from qbackend.lowering.own_conv import scale_and_offset

from tests.helpers import compile_and_run, needs_own_kernels, quantize, short_graph
from tests.tolerances import assert_int8_close, assert_outputs_close

CLAMPS = {"none": (-math.inf, math.inf), "relu": (0.0, math.inf), "relu6": (0.0, 6.0)}


def reference(x, x_scale, x_zp, w, w_scale, bias, stride, padding, low, high, out_scale, out_zp, qmin, qmax,
              residual=None, residual_scale=1.0, residual_zp=0, dilation=1):
    """The PT2E reference: dequantize, float conv (+ dequantized residual), clamp, quantize
    (round half to even)."""
    xf = (x.float() - x_zp) * x_scale
    wf = w.float() * w_scale[:, None, None, None]
    groups = x.shape[1] // w.shape[1]
    y = nn.functional.conv2d(xf, wf, bias, stride, padding, dilation, groups=groups)
    if residual is not None:
        y = y + (residual.float() - residual_zp) * residual_scale
    y = y.clamp(low, high)
    return (torch.round(y / out_scale) + out_zp).clamp(qmin, qmax).to(torch.uint8)


# the output's zero point: 60, or 0, where a clamp-only uint8 epilogue leaves its low clamp to the
# byte packs' saturation (every result below 0 packs to 0)
OUT_ZERO_POINTS = pytest.mark.parametrize("out_zp", [60, 0], ids=["zero point 60", "zero point 0"])


def _depthwise_case(channels, post, stride, padding, qmax, window=3, out_zp=60):
    """Random uint8 activations, full 8-bit weights, and the kernel's call and the reference's."""
    torch.manual_seed(0)
    x_scale, x_zp, out_scale = 0.03, 7, 0.05
    x = torch.randint(0, 256, (2, channels, 9, 11), dtype=torch.uint8)  # odd sizes: every border case
    w = torch.randint(-128, 128, (channels, 1, window, window), dtype=torch.int8)  # full 8-bit weights are exact here
    w_scale, bias = torch.rand(channels) * 0.01 + 0.001, torch.randn(channels)
    low, high = CLAMPS[post]

    def run():
        packed = depthwise.pack(w, *scale_and_offset(w, w_scale, x_scale, x_zp, bias), depthwise.vnni_built())
        return registry.op("qconv_depthwise")(x, x_zp, *packed, [stride] * 2, [padding] * 2, low, high, out_scale, out_zp, 0, qmax,
                                            False, "none", window)

    return run, reference(x, x_scale, x_zp, w, w_scale, bias, stride, padding, low, high, out_scale, out_zp, 0, qmax)


@needs_own_kernels
@pytest.mark.parametrize("post", sorted(CLAMPS))
@pytest.mark.parametrize("stride,padding", [(1, 1), (2, 1), (1, 0), (2, 0)])
@pytest.mark.parametrize("qmax", [255, 127], ids=["8-bit out", "7-bit out"])
@pytest.mark.parametrize("channels", [16, 48, 58, 5, 96], ids=["16 channels", "32 + 16 channels", "58: 3 groups + 10",
                                                               "5: a part of a group", "96: 64 + 32"])
@OUT_ZERO_POINTS
def test_kernel_gives_the_reference_integers(post, stride, padding, qmax, channels, out_zp, int8_build):
    run, expected = _depthwise_case(channels, post, stride, padding, qmax, out_zp=out_zp)
    assert out_zp or (expected == 0).any()  # (results below 0: the packs clamped them)
    actual = run()
    assert actual.is_contiguous(memory_format=torch.channels_last)
    assert_int8_close(actual, expected, f"{post} stride {stride} padding {padding}")
    assert int(actual.max()) <= qmax


@needs_own_kernels
@pytest.mark.parametrize("post", sorted(CLAMPS))
@pytest.mark.parametrize("stride,padding", [(1, "half"), (2, "half"), (1, 0), (2, 1)])
@pytest.mark.parametrize("channels", [48, 5], ids=["32 + 16 channels", "5: a part of a group"])
@pytest.mark.parametrize("window", [5, 7])
def test_larger_windows_give_the_reference_integers(post, stride, padding, channels, window, int8_build):
    """EfficientNet's and MobileNetV3's later stages (5x5), ConvNeXt's blocks (7x7): 25 or 49
    taps, and one with zero weights to make whole pairs."""
    padding = window // 2 if padding == "half" else padding
    run, expected = _depthwise_case(channels, post, stride, padding, 255, window=window)
    assert_int8_close(run(), expected, f"{window}x{window} {post} stride {stride} padding {padding}")


ACTIVATIONS = {"none": lambda t: t, "swish": nn.functional.silu, "hardswish": nn.functional.hardswish,
               "gelu": nn.functional.gelu, "gelu_tanh": lambda t: nn.functional.gelu(t, approximate="tanh")}


@needs_own_kernels
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("float_out", [False, True], ids=["uint8 out", "float32 out"])
@pytest.mark.parametrize("channels", [112, 58], ids=["112: 64 + 48", "58: 3 groups + 10"])
@pytest.mark.parametrize("window", [3, 5, 7])
def test_kernels_run_activations_and_write_float32(activation, float_out, channels, window, int8_build):
    """EfficientNet's depthwise convs end in SiLU, MobileNetV3's in hardswish, MaxViT's in GELU,
    and each feeds a squeeze-excitation block that reads them as float32: float out within 2e-6 of the float64
    reference (dequantize, conv, activation, ReLU6 clamp), uint8 out its integers."""
    torch.manual_seed(0)
    x_scale, x_zp, out_scale, out_zp = 0.03, 7, 0.05, 60
    x = torch.randint(0, 256, (2, channels, 9, 11), dtype=torch.uint8)
    w = torch.randint(-128, 128, (channels, 1, window, window), dtype=torch.int8)
    w_scale, bias = torch.rand(channels) * 0.01 + 0.001, torch.randn(channels)
    exact = nn.functional.conv2d((x.double() - x_zp) * x_scale, w.double() * w_scale.double()[:, None, None, None],
                                 bias.double(), 1, window // 2, groups=channels)
    assert (exact < -3).any() and (exact > 3).any()  # both tails and the middle of each activation
    expected = ACTIVATIONS[activation](exact).clamp(-1.0, 6.0)
    packed = depthwise.pack(w, *scale_and_offset(w, w_scale, x_scale, x_zp, bias), depthwise.vnni_built())
    actual = registry.op("qconv_depthwise")(x, x_zp, *packed, [1, 1], [window // 2] * 2, -1.0, 6.0, out_scale, out_zp, 0, 255,
                                          float_out, activation, window)
    assert actual.is_contiguous(memory_format=torch.channels_last)
    if float_out:
        assert actual.dtype == torch.float32
        torch.testing.assert_close(actual.double(), expected, atol=2e-6, rtol=1e-6)
    else:
        assert_int8_close(actual, (torch.round(expected / out_scale) + out_zp).clamp(0, 255).to(torch.uint8), activation)


def test_an_unknown_depthwise_activation_is_refused():
    x = torch.zeros(1, 16, 4, 4, dtype=torch.uint8)
    packed = (torch.zeros(160, dtype=torch.int16), torch.zeros(16), torch.zeros(16))
    with pytest.raises(ValueError, match=r"activation 'mish' is not one of \['none', 'gelu', 'gelu_tanh', 'swish', 'hardswish'\]"):
        registry.op("qconv_depthwise")(x, 0, *packed, [1, 1], [1, 1], 0.0, 6.0, 1.0, 0, 0, 255, False, "mish")


def _before_a_guard_page(values: torch.Tensor) -> torch.Tensor:
    """``values`` (uint8) copied so that their last byte is the last one before a page that
    cannot be read: a kernel reading past the tensor's end crashes instead of passing."""
    page = mmap.PAGESIZE
    pages = -(-values.numel() // page) + 1
    memory = mmap.mmap(-1, pages * page)
    guard = ctypes.addressof(ctypes.c_char.from_buffer(memory)) + (pages - 1) * page
    assert ctypes.CDLL(None, use_errno=True).mprotect(ctypes.c_void_p(guard), page, 0) == 0  # PROT_NONE
    tensor = torch.frombuffer(memory, dtype=torch.uint8, count=values.numel(), offset=(pages - 1) * page - values.numel())
    return tensor.copy_(values.flatten())


@needs_own_kernels
@pytest.mark.parametrize("channels", [58, 5, 24, 72], ids=["58: 3 groups + 10", "5", "24: 16 + 8", "72: 64 + 8"])
@pytest.mark.parametrize("float_out", [False, True], ids=["uint8 out", "float32 out"])
def test_a_last_partial_channel_group_reads_and_writes_only_its_channels(channels, float_out, int8_build):
    """Channels past the last whole group run in place: the tail's loads read the next pixel's
    channels (AVX2) or only its own (AVX512's masked loads), never past the tensor's end (here
    right before an unreadable page), and its stores write only its own (a whole group's store
    would overwrite the next pixel's first)."""
    torch.manual_seed(0)
    n, h, w = 2, 5, 7
    values = torch.randint(0, 256, (n, h, w, channels), dtype=torch.uint8)
    x = _before_a_guard_page(values).view(n, h, w, channels).permute(0, 3, 1, 2)
    weight = torch.randint(-128, 128, (channels, 1, 3, 3), dtype=torch.int8)
    w_scale, bias = torch.rand(channels) * 0.01 + 0.001, torch.randn(channels)
    packed = depthwise.pack(weight, *scale_and_offset(weight, w_scale, 0.03, 7, bias), depthwise.vnni_built())
    actual = registry.op("qconv_depthwise")(x, 7, *packed, [1, 1], [1, 1], -math.inf, math.inf, 0.05, 60, 0, 255, float_out)
    if float_out:
        exact = nn.functional.conv2d((values.permute(0, 3, 1, 2).double() - 7) * 0.03,
                                     weight.double() * w_scale.double()[:, None, None, None], bias.double(), 1, 1, groups=channels)
        torch.testing.assert_close(actual.double(), exact, atol=2e-6, rtol=1e-6)
    else:
        expected = reference(values.permute(0, 3, 1, 2), 0.03, 7, weight, w_scale, bias, 1, 1, -math.inf, math.inf, 0.05, 60, 0, 255)
        assert_int8_close(actual, expected, f"{channels} channels")


@pytest.mark.parametrize("post", sorted(CLAMPS))
def test_depthwise_builds_give_the_same_bytes(post, monkeypatch):
    """The VNNI kernel clamps after the requantizing map instead of before it: the same bytes,
    as the map is monotone (and any rounding differs from the reference's in both alike); its
    ymm and zmm builds too."""
    _needs_vnni_library()
    results = {}
    for gemm_build in ("avx2", "avx512_vnni", "avx512_vnni_zmm"):
        monkeypatch.setattr(isa, "int8_build", lambda: library.GEMM_BUILDS[gemm_build][0])
        monkeypatch.setattr(isa, "gemm_build", lambda: gemm_build)
        results[gemm_build] = _depthwise_case(112, post, 1, 1, 255)[0]()
    assert torch.equal(results["avx2"], results["avx512_vnni"])
    assert torch.equal(results["avx2"], results["avx512_vnni_zmm"])


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand -> ReLU6 -> depthwise 3x3 -> ReLU6 -> 1x1 project."""

    def __init__(self, channels=8, expanded=32, stride=1, residual=False):
        super().__init__()
        self.residual = residual
        self.expand = nn.Sequential(nn.Conv2d(channels, expanded, 1), nn.ReLU6())
        self.depthwise = nn.Sequential(nn.Conv2d(expanded, expanded, 3, stride, 1, groups=expanded), nn.ReLU6())
        self.project = nn.Conv2d(expanded, channels, 1)

    def forward(self, x):
        y = self.project(self.depthwise(self.expand(x)))
        return x + y if self.residual else y


DEPTHWISE_OP, GEMM_OP = "qbackend::qconv_depthwise.default", "qbackend::qconv.default"


class SqueezeExcitationBlock(nn.Module):
    """EfficientNet's MBConv (``act`` SiLU) / MobileNetV3's block (hardswish): 1x1 expand ->
    act -> depthwise 3x3 -> act -> squeeze-excitation (pool, 1x1, act, 1x1, sigmoid, scale) ->
    1x1 project. The depthwise output is read in float by the scale and quantized for the pool."""

    def __init__(self, act, channels=8, expanded=32, window=3):
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(channels, expanded, 1), act())
        self.depthwise = nn.Sequential(nn.Conv2d(expanded, expanded, window, 1, window // 2, groups=expanded), act())
        self.squeeze = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(expanded, 8, 1), act(), nn.Conv2d(8, expanded, 1),
                                     nn.Sigmoid())
        self.project = nn.Conv2d(expanded, channels, 1)

    def forward(self, x):
        y = self.depthwise(self.expand(x))
        return self.project(y * self.squeeze(y))


class TestDepthwiseLowering(expecttest.TestCase):
    @needs_own_kernels
    def test_block_runs_on_qbackends_kernels(self):
        torch.manual_seed(0)  # (the pinned line holds a calibrated scale)
        x = torch.randn(2, 8, 14, 14)
        model = quantize(InvertedResidual(stride=2).eval(), (x,))
        actual, expected, captured = compile_and_run(model, (x,))
        assert_outputs_close(actual, expected, "block")
        ops = [d.op for d in captured.report.decisions]
        assert ops == [GEMM_OP, DEPTHWISE_OP, GEMM_OP], str(captured.report)  # (the last one writes float32)
        graph = short_graph(captured.lowered)  # run eagerly: the kernels as plain functions
        self.assertExpectedInline([line for line in graph.splitlines() if "qconv_depthwise" in line][0], """qconv_depthwise = depthwise.qconv_depthwise(qconv, 0, <const>, <const>, <const>, (2, 2), (1, 1), 0, 6, 0.00825, 0, 0, 127)""")
        _, _, traced = compile_and_run(model, (x,), need_meta=True)  # to be traced: the registered ops
        targets = {node.target for node in traced.lowered.graph.nodes}
        assert {registry.op("qconv_depthwise"), registry.op("qconv")} <= targets
        assert not {depthwise_kernel.qconv_depthwise, conv_gemm.qconv} & targets

    @needs_own_kernels
    def test_squeeze_excitation_blocks_run_their_activations_on_qbackends_kernels(self):
        """SiLU (EfficientNet), hardswish (MobileNetV3) and GELU (MaxViT: oneDNN's conv has no
        GELU post-op, so the own kernels alone fuse it)."""
        for act in (nn.SiLU, nn.Hardswish, nn.GELU):
            torch.manual_seed(0)
            x = torch.randn(2, 8, 14, 14)
            model = quantize(SqueezeExcitationBlock(act).eval(), (x,))
            actual, expected, captured = compile_and_run(model, (x,))
            assert_outputs_close(actual, expected, act.__name__)
            by_layer = {d.source: d for d in captured.report.decisions}
            assert [by_layer[f"{name}.0"].op for name in ("expand", "depthwise")] == [GEMM_OP, DEPTHWISE_OP], str(captured.report)
            graph = short_graph(captured.lowered)
            call = [line for line in graph.splitlines() if "qconv_depthwise" in line][0]
            activation = {nn.SiLU: "swish", nn.Hardswish: "hardswish", nn.GELU: "gelu"}[act]
            assert call.endswith(f", -inf, inf, 1, 0, 0, 255, True, '{activation}')"), call
            assert not any(f"aten.{name}" in line for line in graph.splitlines() for name in ("silu", "hardswish", "gelu")), graph

    @needs_own_kernels
    def test_5x5_depthwise_convs_run_on_qbackends_kernel(self):
        torch.manual_seed(0)
        x = torch.randn(2, 8, 14, 14)
        model = quantize(SqueezeExcitationBlock(nn.SiLU, window=5).eval(), (x,))
        actual, expected, captured = compile_and_run(model, (x,))
        assert_outputs_close(actual, expected, "5x5")
        assert {d.source: d for d in captured.report.decisions}["depthwise.0"].op == DEPTHWISE_OP, str(captured.report)
        call = [line for line in short_graph(captured.lowered).splitlines() if "qconv_depthwise" in line][0]
        self.assertExpectedInline(call, """qconv_depthwise = depthwise.qconv_depthwise(qconv, 12, <const>, <const>, <const>, (1, 1), (2, 2), -inf, inf, 1, 0, 0, 255, True, 'swish', 5)""")

    def test_channels_that_are_not_whole_lanes_run_on_the_kernel(self):
        x = torch.randn(1, 8, 10, 10)
        model = quantize(InvertedResidual(expanded=40).eval(), (x,))  # 40 channels: not whole 16-lane steps
        actual, expected, captured = compile_and_run(model, (x,))
        assert_outputs_close(actual, expected, "40 channels")
        assert captured.report.decisions[1].op == DEPTHWISE_OP, str(captured.report)


def test_without_the_kernels_onednn_runs_it(monkeypatch):
    x = torch.randn(1, 8, 10, 10)
    model = quantize(InvertedResidual().eval(), (x,))
    monkeypatch.setattr(registry, "available", lambda: "qbackend's own kernels are unavailable: no C compiler found")
    actual, expected, captured = compile_and_run(model, (x,))
    assert_outputs_close(actual, expected, "no kernels")
    decision = captured.report.decisions[1]
    assert decision.op == "onednn::qconv_pointwise" and "no C compiler found" in decision.reason


@needs_own_kernels
@pytest.mark.parametrize("post", sorted(CLAMPS))
@pytest.mark.parametrize("residual", [False, True], ids=["", "residual"])
@pytest.mark.parametrize("cout", [24, 40, 56, 64], ids=["24-wide tiles", "16-wide tail", "8-wide tail", "whole zmm blocks"])
@pytest.mark.parametrize("qmax", [255, 127], ids=["8-bit out", "7-bit out"])
@OUT_ZERO_POINTS
def test_1x1_kernel_gives_the_reference_integers(post, residual, cout, qmax, out_zp, int8_build):
    torch.manual_seed(0)
    cin, x_scale, x_zp, out_scale, r_scale, r_zp = 36, 0.03, 7, 0.05, 0.04, 11
    x = torch.randint(0, 128, (2, cin, 3, 5), dtype=torch.uint8)  # 30 pixels: a 2-pixel tail tile
    w = torch.randint(-128, 128, (cout, cin, 1, 1), dtype=torch.int8)  # 127 x 256 < 32767: exact
    w_scale, bias = torch.rand(cout) * 0.01 + 0.001, torch.randn(cout)
    r = torch.randint(0, 256, (2, cout, 3, 5), dtype=torch.uint8) if residual else None
    low, high = CLAMPS[post]
    weight, (mult, add) = gemm.pack(w), scale_and_offset(w, w_scale, x_scale, x_zp, bias, -r_zp * r_scale if residual else 0.0)
    mult, add = mult.float(), add.float()
    actual = registry.op("qconv")(x, weight, mult, add, r, r_scale if residual else 0.0, low, high, out_scale, out_zp, 0, qmax)
    expected = reference(x, x_scale, x_zp, w, w_scale, bias, 1, 0, low, high, out_scale, out_zp, 0, qmax, r, r_scale, r_zp)
    assert out_zp or (expected == 0).any()  # (results below 0: the packs clamped them)
    assert actual.is_contiguous(memory_format=torch.channels_last)
    assert_int8_close(actual, expected, f"1x1 {post} residual={residual} cout={cout}")


@pytest.mark.parametrize("kernel,stride,padding,dilation", [
    ((3, 3), (1, 1), (1, 1), (1, 1)), ((3, 3), (2, 2), (1, 1), (1, 1)), ((3, 3), (1, 1), (0, 0), (1, 1)),
    ((3, 3), (1, 1), (2, 2), (2, 2)), ((1, 1), (2, 2), (0, 0), (1, 1)), ((1, 3), (1, 2), (0, 1), (1, 1)),
], ids=["3x3", "3x3 stride 2", "3x3 no padding", "3x3 dilation 2", "1x1 stride 2", "1x3"])
@needs_own_kernels
@pytest.mark.parametrize("cout", [40, 64], ids=["3-block tiles", "64-wide tiles"])
def test_gemm_conv_gives_the_reference_integers(kernel, stride, padding, dilation, cout, int8_build):
    """Windows that leave the image read the input's zero point (7 here), as zero padding of
    the dequantized input does; windows inside it, their first row plus each tap's offset."""
    torch.manual_seed(0)
    cin, x_scale, x_zp, out_scale, out_zp = 12, 0.03, 7, 0.05, 60
    x = torch.randint(0, 256, (2, cin, 7, 9), dtype=torch.uint8)
    w = torch.randint(-64, 64, (cout, cin, *kernel), dtype=torch.int8)
    w_scale, bias = torch.rand(cout) * 0.01 + 0.001, torch.randn(cout)
    mult, add = (t.float() for t in scale_and_offset(w, w_scale, x_scale, x_zp, bias))
    actual = registry.op("qconv")(x, gemm.pack(w), mult, add, None, 0.0, 0.0, math.inf, out_scale, out_zp, 0, 255, False, "none",
                                kernel, stride, padding, dilation, x_zp)
    expected = reference(x, x_scale, x_zp, w, w_scale, bias, stride, padding, 0.0, math.inf, out_scale, out_zp, 0, 255,
                         dilation=dilation)
    assert actual.is_contiguous(memory_format=torch.channels_last)
    assert_int8_close(actual, expected, f"kernel {kernel} stride {stride} padding {padding} dilation {dilation}")


@needs_own_kernels
@pytest.mark.parametrize("kernel,padding", [((1, 1), 0), ((3, 3), 1)], ids=["1x1", "3x3"])
@pytest.mark.parametrize("cin,cout", [(58, 58), (3, 116), (5, 5), (7, 232)],
                         ids=["58 -> 58", "3 -> 116", "5 -> 5", "7 -> 232"])
@pytest.mark.parametrize("residual", [None, "uint8", "float"])
def test_any_channel_counts_give_the_reference(kernel, padding, cin, cout, residual, int8_build):
    """ShuffleNet's 58 / 116 / 232 channels: the call runs on copies padded to whole 4-input groups
    and 8-output blocks (the packing's weights there are 0), a residual padded with the output,
    and only the real channels come back."""
    torch.manual_seed(0)
    x_scale, x_zp, out_scale, out_zp, r_scale, r_zp = 0.03, 7, 0.05, 60, 0.04, 11
    x = torch.randint(0, 128, (2, cin, 5, 7), dtype=torch.uint8)
    w = torch.randint(-128, 128, (cout, cin, *kernel), dtype=torch.int8)  # 127 x 256 < 32767: exact on AVX2
    w_scale, bias = torch.rand(cout) * 0.01 + 0.001, torch.randn(cout)
    r = {None: None, "uint8": torch.randint(0, 256, (2, cout, 5, 7), dtype=torch.uint8),
         "float": torch.randn(2, cout, 5, 7)}[residual]
    shift = -r_zp * r_scale if residual == "uint8" else 0.0
    mult, add = (t.float() for t in scale_and_offset(w, w_scale, x_scale, x_zp, bias, shift))
    scale = {None: 0.0, "uint8": r_scale, "float": 1.0}[residual]
    geometry = (kernel, (1, 1), (padding, padding), (1, 1), x_zp)
    conv = registry.op("qconv")
    floats = conv(x, gemm.pack(w), mult, add, r, scale, 0.0, math.inf, 1.0, 0, 0, 255, True, "none", *geometry)
    ints = conv(x, gemm.pack(w), mult, add, r, scale, 0.0, math.inf, out_scale, out_zp, 0, 255, False, "none", *geometry)
    xf, wf = (x.float() - x_zp) * x_scale, w.float() * w_scale[:, None, None, None]
    exact = nn.functional.conv2d(xf.double(), wf.double(), bias.double(), 1, padding)
    if residual == "uint8":
        exact = exact + (r.double() - r_zp) * r_scale
    elif residual == "float":
        exact = exact + r.double()
    exact = exact.clamp_min(0)
    torch.testing.assert_close(floats.double(), exact, atol=2e-5, rtol=1e-5)
    assert_int8_close(ints, (torch.round(exact / out_scale) + out_zp).clamp(0, 255).to(torch.uint8),
                      f"{cin} -> {cout} {kernel} residual={residual}")


def test_3x3_conv_after_a_relu_takes_the_gemm_up_to_max_dense_macs(monkeypatch):
    """A 3x3 conv of the (asymmetric) model input takes qbackend's kernel up to max_conv_pixels;
    one after a ReLU (zero point 0) only up to max_dense_macs multiply-adds (the zmm build's
    limit: oneDNN's fixed cost per call weighs on small convs), else oneDNN, which is faster."""
    _needs_vnni_library()
    x = torch.randn(2, 8, 12, 12)
    model = quantize(nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1)).eval(), (x,))
    macs = 288 * 16 * 16 * 9  # the second conv's

    def decisions(max_dense_macs):
        monkeypatch.setitem(gemm.LIMITS, "avx512_vnni_zmm", gemm.Limits(max_rows=32, max_conv_pixels=1024,
                                                                         max_dense_macs=max_dense_macs))
        actual, expected, captured = compile_and_run(model, (x,))
        assert_outputs_close(actual, expected, "3x3 convs")
        first, second = captured.report.decisions[:2]
        assert (first.op, first.reason) == (GEMM_OP, "qbackend's int8 GEMM kernel (288 output pixels)"), str(captured.report)
        return second.op
    monkeypatch.setattr(isa, "gemm_build", lambda: "avx512_vnni_zmm")
    assert decisions(macs) == GEMM_OP
    assert decisions(macs - 1) == "onednn::qconv_pointwise"
    assert gemm.LIMITS["avx2"].max_dense_macs == gemm.LIMITS["avx512_vnni"].max_dense_macs == 0  # (ymm: never)


@needs_own_kernels
def test_block_with_residual_adds_it_in_the_1x1_kernel():
    x = torch.randn(2, 16, 10, 10)
    block = nn.Sequential(InvertedResidual(channels=16, expanded=64, residual=True), nn.Conv2d(16, 8, 1))  # sum read as int8
    model = quantize(block.eval(), (x,))
    actual, expected, captured = compile_and_run(model, (x,))
    assert_outputs_close(actual, expected, "residual block")
    decisions = captured.report.decisions
    assert [(d.rule, d.op) for d in decisions][:3] == [("qconv", GEMM_OP), ("qconv", DEPTHWISE_OP),
                                                        ("qconv_add", GEMM_OP)], str(captured.report)


def test_1x1_runs_weights_whose_pair_sums_could_saturate_on_the_exact_build(monkeypatch):
    """On a CPU whose oneDNN kernels do not saturate but which runs the AVX2 GEMM (a VNNI CPU
    whose compiler cannot build the VNNI one), 8-bit activations x 8-bit weights reach the 1x1
    kernel, whose vpmaddubsw pair sums could saturate: its exact int16 build takes them.
    Simulated here; only the decision is checked, not this CPU's result."""
    monkeypatch.setattr(capabilities, "int8_pairs_saturate", lambda *args: False)
    monkeypatch.setattr("qbackend.lowering.cpu.int8_pairs_saturate", lambda *args: False)
    monkeypatch.setattr(isa, "int8_build", lambda: "avx2")
    x = torch.randn(1, 8, 6, 6)
    model = quantize(nn.Sequential(nn.Conv2d(8, 16, 1), nn.ReLU(), nn.Conv2d(16, 8, 1)).eval(), (x,), reduce_range=False)
    _, _, captured = compile_and_run(model, (x,))
    decision = captured.report.decisions[0]
    assert decision.op == GEMM_OP, str(captured.report)
    assert "its exact int16 build, not vpmaddubsw: its int16 pair sums could reach" in decision.reason


def _needs_vnni_library():
    if isa._vnni_library()[0] is None:
        pytest.skip(f"needs the AVX512-VNNI GEMM: {isa._vnni_library()[1]}")


def test_vnni_build_is_exact_where_the_avx2_build_saturates(monkeypatch):
    """255 x (127 + 127) per pair overflows vpmaddubsw's int16; vpdpbusd adds in int32."""
    _needs_vnni_library()
    x = torch.full((1, 64, 2, 2), 255, dtype=torch.uint8)
    w = torch.full((8, 64, 1, 1), 127, dtype=torch.int8)
    mult, add = (t.float() for t in scale_and_offset(w, torch.ones(8), 1.0, 0))
    exact = torch.full((1, 8, 2, 2), 255.0 * 127 * 64)

    def run(build):
        monkeypatch.setattr(isa, "gemm_build", lambda: build)
        return registry.op("qconv")(x, gemm.pack(w), mult, add, None, 0.0, -math.inf, math.inf, 1.0, 0, 0, 255, True)
    assert not torch.equal(run("avx2"), exact)  # what the lowering keeps away from the AVX2 build
    assert torch.equal(run("avx512_vnni"), exact)
    assert torch.equal(run("avx512_vnni_zmm"), exact)


def test_8bit_weights_run_on_the_vnni_build():
    """Where the GEMM adds in int32, 8-bit activations x 8-bit weights lower onto it."""
    _needs_vnni_library()
    x = torch.randn(1, 8, 6, 6)
    model = quantize(nn.Sequential(nn.Conv2d(8, 16, 1), nn.ReLU(), nn.Conv2d(16, 8, 1)).eval(), (x,), reduce_range=False)
    actual, expected, captured = compile_and_run(model, (x,))
    assert_outputs_close(actual, expected, "8-bit weights")
    assert [(d.op, d.reason) for d in captured.report.decisions] == [
        (GEMM_OP, "qbackend's int8 GEMM kernel (36 output pixels)")] * 2, str(captured.report)


@needs_own_kernels
def test_bad_inputs_get_a_clear_error_not_a_crash():
    w = torch.zeros(16, 8, 1, 1, dtype=torch.int8)
    weight, (mult, add) = gemm.pack(w), (t.float() for t in scale_and_offset(w, torch.ones(16), 0.1, 0))
    conv1x1 = registry.op("qconv")
    with pytest.raises(ValueError, match="takes uint8 CPU activations"):
        conv1x1(torch.zeros(1, 8, 4, 4), weight, mult, add, None, 0.0, 0.0, 6.0, 0.1, 0, 0, 255)
    with pytest.raises(ValueError, match="expected a contiguous CPU torch.float32 constant"):
        conv1x1(torch.zeros(1, 8, 4, 4, dtype=torch.uint8), weight, mult.double(), add, None, 0.0, 0.0, 6.0, 0.1, 0, 0, 255)
    with pytest.raises(ValueError, match="residual"):
        conv1x1(torch.zeros(1, 8, 4, 4, dtype=torch.uint8), weight, mult, add, torch.zeros(1, 16, 2, 2, dtype=torch.uint8),
                0.1, 0.0, 6.0, 0.1, 0, 0, 255)
    x = torch.zeros(1, 8, 4, 4, dtype=torch.uint8)
    geometry = dict(kernel_size=[1, 1], stride=[1, 1], padding=[0, 0], dilation=[1, 1])
    for bad, message in [(dict(dilation=[-1, -1]), r"dilation \[-1, -1\]: two ints from 1"),
                         (dict(kernel_size=[-1, -3]), r"kernel_size \[-1, -3\]: two ints from 1"),
                         (dict(stride=[0, 1]), r"stride \[0, 1\]: two ints from 1"),
                         (dict(padding=[-1, 0]), r"padding \[-1, 0\]: two ints from 0"),
                         (dict(kernel_size=[3, 3], padding=[0, 0], dilation=[3, 3]), "no output")]:
        with pytest.raises(ValueError, match=message):  # (torch's convs reject each; #20 read past the input)
            conv1x1(x, weight, mult, add, None, 0.0, 0.0, 6.0, 0.1, 0, 0, 255, False, "none", **{**geometry, **bad})
    with pytest.raises(ValueError, match=r"zero points 0, 300 and clamp \[0, 255\] must lie within 0..255"):
        conv1x1(x, weight, mult, add, None, 0.0, 0.0, 6.0, 0.1, 300, 0, 255)
    dw = torch.zeros(16, 1, 3, 3, dtype=torch.int8)
    dw_weight, dw_mult, dw_add = depthwise.pack(dw, *scale_and_offset(dw, torch.ones(16), 0.1, 0), vnni=False)
    with pytest.raises(ValueError, match="activations of 32 channels for constants packed for 16"):
        registry.op("qconv_depthwise")(torch.zeros(1, 32, 4, 4, dtype=torch.uint8), 0, dw_weight, dw_mult, dw_add, [1, 1], [1, 1],
                                 0.0, 6.0, 0.1, 0, 0, 255)
    with pytest.raises(ValueError, match="expected a contiguous CPU torch.int16 constant"):  # (int8 would mean VNNI packing)
        registry.op("qconv_depthwise")(torch.zeros(1, 16, 4, 4, dtype=torch.uint8), 0, torch.zeros(160), dw_mult, dw_add, [1, 1],
                                 [1, 1], 0.0, 6.0, 0.1, 0, 0, 255)
    with pytest.raises(ValueError, match=r"stride \[-1, -1\]: two ints from 1"):
        registry.op("qconv_depthwise")(torch.zeros(1, 16, 4, 4, dtype=torch.uint8), 0, dw_weight, dw_mult, dw_add, [-1, -1],
                                 [1, 1], 0.0, 6.0, 0.1, 0, 0, 255)


@needs_own_kernels
def test_block_traced_by_inductor_runs_the_kernels_as_ops():
    """remainder='inductor' traces the lowered graph with fake tensors: the kernels' fake
    implementations give the NHWC uint8 outputs the real ones return."""
    import qbackend

    x = torch.randn(1, 16, 10, 10)
    block = nn.Sequential(InvertedResidual(channels=16, expanded=64, residual=True), nn.Conv2d(16, 8, 1))
    model = quantize(block.eval(), (x,))
    reports = []
    compiled = qbackend.compile(model, {"remainder": "inductor", "report_sink": reports.append})
    with torch.no_grad():
        assert_outputs_close(compiled(x), model(x), "through Inductor")
    assert "remainder (the ops around the lowered kernels) compiled by Inductor" in reports[0].notes
    assert [d.op for d in reports[0].decisions][:3] == [GEMM_OP, DEPTHWISE_OP, GEMM_OP]


@needs_own_kernels
def test_prepared_calls_go_with_their_weight():
    """The eager graphs' calls keep one prepared argument struct per packed weight; it must not
    keep a dropped model's constants alive (nor outlive the weight whose id it is keyed by)."""
    import gc

    w = torch.zeros(16, 8, 1, 1, dtype=torch.int8)
    weight, (mult, add) = gemm.pack(w), (t.float() for t in scale_and_offset(w, torch.ones(16), 0.1, 0))
    x = torch.zeros(1, 8, 2, 2, dtype=torch.uint8)
    conv_gemm.qconv(x, weight, mult, add, None, 0.0, 0.0, 6.0, 0.1, 0, 0, 255)
    key = id(weight)
    assert key in common.PREPARED
    del weight
    gc.collect()
    assert key not in common.PREPARED
