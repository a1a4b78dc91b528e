"""qbackend's stem conv kernel (int8 convs of fewer than 4 input channels; builds for AVX2 and
AVX512-VNNI): the reference's integers, chosen on CPU where it applies, and oneDNN with the
reason elsewhere."""

import expecttest
import pytest
import torch
import torch.nn as nn

from qbackend.kernels import isa, pools, registry
from qbackend.kernels import stem as stem_kernel
from qbackend.lowering import stem
from qbackend.lowering import cpu as lowering_cpu
from qbackend.lowering.own_conv import scale_and_offset

from tests.helpers import compile_and_run, needs_own_kernels, quantize, short_graph
from tests.kernels.test_own_conv_kernels import ACTIVATIONS, CLAMPS, reference
from tests.tolerances import assert_int8_close, assert_outputs_close

STEM_OP = "qbackend::qconv_stem.default"

# (in channels, out channels, kernel, stride, padding, input height, width): ResNet's and
# MobileNet's stems; 1 and 2 channels; 5 blocks of 16 outputs (a 4-block tile and a 1-block
# one) and 3; rows of more than one 64-pixel piece; no padding.
SHAPES = {
    "ResNet 7x7 s2": (3, 64, 7, 2, 3, 23, 29),
    "MobileNet 3x3 s2": (3, 32, 3, 2, 1, 16, 15),
    "1 channel 5x5": (1, 80, 5, 1, 2, 9, 11),
    "2 channels, 48 outputs, no padding": (2, 48, 3, 1, 0, 8, 9),
    "3 pieces per row": (3, 16, 3, 1, 1, 3, 150),
}


def _case(shape, post, build="avx512_vnni", activation="none"):
    """The kernel's arguments for ``build`` and the reference's integers: full 8-bit weights
    (exact in int32 on both builds); with an ``activation``, the reference runs it in float64
    after the conv (then ``post``'s clamp)."""
    torch.manual_seed(0)
    cin, cout, k, stride, padding, h, w = shape
    x_scale, x_zp, out_scale, out_zp = 0.03, 7, 0.05, 60
    x = torch.randint(0, 256, (2, cin, h, w), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    weight = torch.randint(-128, 128, (cout, cin, k, k), dtype=torch.int8)
    w_scale, bias = torch.rand(cout) * 0.01 + 0.001, torch.randn(cout)
    low, high = CLAMPS[post]
    mult, add = (t.float() for t in scale_and_offset(weight, w_scale, x_scale, x_zp, bias))
    args = (x, x_zp, stem.pack(weight, build), mult, add, [k, k], [stride] * 2, [padding] * 2, low, high, out_scale, out_zp, 0, 255)
    if activation == "none":
        return args, reference(x, x_scale, x_zp, weight, w_scale, bias, stride, padding, low, high, out_scale, out_zp, 0, 255)
    exact = nn.functional.conv2d((x.double() - x_zp) * x_scale, weight.double() * w_scale.double()[:, None, None, None],
                                 bias.double(), stride, padding)
    assert (exact < -3).any() and (exact > 3).any()  # both tails and the middle of each activation
    activated = ACTIVATIONS[activation](exact).clamp(low, high)
    return args, (torch.round(activated / out_scale) + out_zp).clamp(0, 255).to(torch.uint8)


@needs_own_kernels
@pytest.mark.parametrize("post", sorted(CLAMPS))
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_kernel_gives_the_reference_integers(shape, post, int8_build):
    args, expected = _case(shape, post, int8_build)
    actual = registry.op("qconv_stem")(*args)
    assert actual.is_contiguous(memory_format=torch.channels_last)
    assert_int8_close(actual, expected, f"{shape} {post}")
    assert torch.equal(stem_kernel.qconv_stem(*args), actual)  # the plain function eager graphs call


POOLS = {"ResNet's 3x3 s2 p1": ((3, 3), (2, 2), (1, 1)), "2x2 s2": ((2, 2), (2, 2), (0, 0)),
         "3x3 s1 p1": ((3, 3), (1, 1), (1, 1)), "5x3 s3 p(2, 1)": ((5, 3), (3, 3), (2, 1))}


@needs_own_kernels
@pytest.mark.parametrize("pool", POOLS.values(), ids=POOLS.keys())
@pytest.mark.parametrize("shape", [SHAPES[k] for k in ("ResNet 7x7 s2", "1 channel 5x5", "3 pieces per row")],
                         ids=["ResNet 7x7 s2", "1 channel 5x5", "3 pieces per row"])
def test_fused_max_pool_gives_the_separate_pools_bytes(shape, pool, int8_build):
    """With a pool fused, each thread pools the conv rows it computes: the bytes of the conv and
    then qbackend's max pool kernel (itself exact against quantized::max_pool2d)."""
    args, _ = _case(shape, "relu", int8_build)
    separate = pools.max_pool_u8(stem_kernel.qconv_stem(*args), *pool, (1, 1))
    fused = registry.op("qconv_stem")(*args, *pool)
    assert fused.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(fused, separate)
    assert torch.equal(stem_kernel.qconv_stem(*args, *pool), separate)


@needs_own_kernels
@pytest.mark.parametrize("activation", ["swish", "hardswish"])
@pytest.mark.parametrize("shape", [SHAPES[k] for k in ("MobileNet 3x3 s2", "1 channel 5x5")], ids=["MobileNet 3x3 s2", "1 channel 5x5"])
def test_activations_run_in_the_epilogue(shape, activation, int8_build):
    """EfficientNet's stem ends in SiLU, MobileNetV3's in hardswish: each build's epilogue runs
    them before the clamp (the VNNI build on zmm, a block's pixels in lockstep); with a pool
    fused too."""
    args, expected = _case(shape, "relu6", int8_build, activation)
    run = registry.op("qconv_stem")
    actual = run(*args, *stem_kernel.NO_POOL, activation)
    assert_int8_close(actual, expected, activation)
    pool = POOLS["ResNet's 3x3 s2 p1"]
    assert torch.equal(run(*args, *pool, activation), pools.max_pool_u8(actual, *pool, (1, 1)))


def test_pack_puts_each_rows_leftover_bytes_after_the_whole_words():
    """A 3-channel 3x3 window: rows of 9 bytes, 2 words each from the input, the 3 rows' 9th
    bytes packed into one more word (and a zero): K4 = 3 * 2 + 1 steps."""
    weight = torch.arange(27, dtype=torch.int8).reshape(1, 3, 3, 3).repeat(16, 1, 1, 1)  # [o, c, kh, kw] = 9c + 3kh + kw
    assert stem_kernel.stem_steps(3, 3, 3) == (2, 1, 1, 7)
    first_output = stem.pack(weight).reshape(1, 7, 16, 4)[0, :, 0].flatten().tolist()
    row = lambda kh: [9 * c + 3 * kh + kw for kw in range(3) for c in range(3)]  # noqa: E731 (column, channel)
    assert first_output == row(0)[:8] + row(1)[:8] + row(2)[:8] + [row(0)[8], row(1)[8], row(2)[8], 0]


def test_avx2_pack_pairs_int16_values_and_their_leftovers():
    """The AVX2 build's steps are int16 pairs: rows of 9 values give 4 pairs each, the 3 rows'
    9th values 2 more pairs (and a zero): K2 = 3 * 4 + 2, blocks of 8 outputs."""
    weight = torch.arange(27, dtype=torch.int8).reshape(1, 3, 3, 3).repeat(16, 1, 1, 1)
    assert stem_kernel.stem_steps(3, 3, 3, word=2) == (4, 1, 2, 14)
    packed = stem.pack(weight, "avx2")
    assert packed.dtype == torch.int16 and packed.numel() == 16 * 14 * 2
    first_output = packed.reshape(2, 14, 8, 2)[0, :, 0].flatten().tolist()
    row = lambda kh: [9 * c + 3 * kh + kw for kw in range(3) for c in range(3)]  # noqa: E731 (column, channel)
    assert first_output == row(0)[:8] + row(1)[:8] + row(2)[:8] + [row(0)[8], row(1)[8], row(2)[8], 0]


def Stem(out_channels=64, dilation=1):
    """ResNet's stem: 7x7 stride-2 conv of 3 channels, ReLU, 3x3 stride-2 max pool."""
    return nn.Sequential(nn.Conv2d(3, out_channels, 7, 2, 3 * dilation, dilation=dilation), nn.ReLU(), nn.MaxPool2d(3, 2, 1))


class FloatOutputStem(nn.Module):
    """A stem conv whose result stays float: the quantizer leaves the pool after a functional relu unquantized."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 64, 7, 2, 3)

    def forward(self, x):
        return nn.functional.max_pool2d(torch.relu(self.conv(x)), 3, 2, 1)


class TestStemLowering(expecttest.TestCase):
    @needs_own_kernels
    def test_resnet_stem_runs_on_the_kernel(self):
        torch.manual_seed(0)  # (the graph below holds the calibrated scales)
        x = torch.randn(1, 3, 32, 32)
        model = quantize(Stem().eval(), (x,))
        actual, expected, captured = compile_and_run(model, (x,))
        assert_outputs_close(actual, expected, "stem")
        conv, pool = captured.report.decisions[:2]
        assert conv.op == pool.op == STEM_OP, str(captured.report)
        assert conv.reason == ("qbackend's stem conv kernel (3 input channels: oneDNN pads each window row); "
                               "max_pool2d pooled in its kernel")
        assert pool.reason == "in conv2d's stem conv kernel (its output pooled as computed)"
        graph = short_graph(captured.lowered)
        self.assertExpectedInline([line for line in graph.splitlines() if "qconv_stem" in line][0], """qconv_stem_1 = stem.qconv_stem(quantize_per_tensor_default, 63, <const>, <const>, <const>, (7, 7), (2, 2), (3, 3), 0, inf, 0.0176, 0, 0, 127, (3, 3), (2, 2), (1, 1))""")


class TwoPoolsStem(nn.Module):
    """A stem conv whose output two max pools read: it must be written out, so no pool is fused."""

    def __init__(self):
        super().__init__()
        self.conv, self.relu = nn.Conv2d(3, 64, 7, 2, 3), nn.ReLU()
        self.wide, self.narrow = nn.MaxPool2d(3, 2, 1), nn.MaxPool2d(2, 2)

    def forward(self, x):
        y = self.relu(self.conv(x))
        return torch.cat([self.wide(y), self.narrow(y)], 1)


@needs_own_kernels
def test_a_stem_output_read_twice_is_not_pooled_in_the_kernel():
    x = torch.randn(1, 3, 32, 32)
    actual, expected, captured = compile_and_run(quantize(TwoPoolsStem().eval(), (x,)), (x,))
    assert_outputs_close(actual, expected, "two pools")
    ops = [d.op for d in captured.report.decisions[:3]]
    assert ops == [STEM_OP, "qbackend::max_pool_u8.default", "qbackend::max_pool_u8.default"], str(captured.report)
    assert "pooled" not in captured.report.decisions[0].reason


@pytest.mark.parametrize("model,reason", [
    (Stem(out_channels=24), "24 output channels: the kernel takes a multiple of 16"),
    (Stem(dilation=2), "dilation [2, 2]: the kernel takes 1"),
    (FloatOutputStem(), "the kernel reads and writes uint8"),
], ids=["24 outputs", "dilated", "float output"])
@needs_own_kernels
def test_near_misses_stay_on_onednn_with_the_reason(model, reason):
    x = torch.randn(1, 3, 32, 32)
    actual, expected, captured = compile_and_run(quantize(model.eval(), (x,)), (x,))
    assert_outputs_close(actual, expected, reason)
    decision = captured.report.decisions[0]
    assert decision.op == "onednn::qconv_pointwise"
    assert f"oneDNN, not qbackend's stem conv kernel: {reason}" in decision.reason


@needs_own_kernels
def test_narrow_convs_at_many_pixels_stay_on_onednn():
    """32 outputs (2-block tiles) at more than MAX_NARROW_PIXELS output pixels: oneDNN is
    faster (the fixed table: kernel_choice "prior", the tests' default)."""
    x = torch.randn(1, 3, 2 * 160, 2 * 160)  # 160 x 160 = 25600 output pixels
    model = quantize(Stem(out_channels=32).eval(), (x,))
    _, _, captured = compile_and_run(model, (x,))
    decision = captured.report.decisions[0]
    assert decision.op == "onednn::qconv_pointwise"
    assert "32 output channels at 25600 output pixels: oneDNN is faster" in decision.reason


class HardswishStem(nn.Module):
    """MobileNetV3's stem: a 3x3 stride-2 conv of 3 channels, batch norm, hardswish (and a
    1x1 conv reading it: the stem's output is quantized)."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.act = nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish()
        self.head = nn.Conv2d(16, 16, 1)

    def forward(self, x):
        return self.head(self.act(self.norm(self.conv(x))))


@needs_own_kernels
def test_activation_runs_in_the_stem_kernel(int8_build):
    """Every build's epilogue runs the hardswish (the VNNI build's folded clamps only before:
    oneDNN or the GEMM ran such a stem)."""
    x = torch.randn(1, 3, 32, 32)
    actual, expected, captured = compile_and_run(quantize(HardswishStem().eval(), (x,)), (x,))
    assert_outputs_close(actual, expected, "hardswish stem")
    decision = captured.report.decisions[0]
    assert decision.op == STEM_OP, str(captured.report)
    assert "'hardswish')" in [line for line in short_graph(captured.lowered).splitlines() if "qconv_stem" in line][0]


@needs_own_kernels
def test_full_range_weights_run_on_the_avx2_build_where_onednn_saturates(monkeypatch):
    """8-bit weights and 8-bit activations (X86InductorQuantizer's default) on a CPU without
    VNNI: oneDNN's int16 pair sums could saturate; the AVX2 build multiplies int16 pairs into
    int32, exact, so it runs the conv (before, it stayed float)."""
    monkeypatch.setattr(isa, "int8_build", lambda: "avx2")
    monkeypatch.setattr(isa, "gemm_build", lambda: "avx2")
    monkeypatch.setattr(lowering_cpu, "int8_pairs_saturate", lambda device, kind: True)  # (oneDNN without VNNI)
    x = torch.randn(1, 3, 32, 32)
    model = quantize(Stem().eval(), (x,), reduce_range=False)
    actual, expected, captured = compile_and_run(model, (x,))
    assert_outputs_close(actual, expected, "8-bit stem")
    decision = captured.report.decisions[0]
    assert decision.op == STEM_OP, str(captured.report)
    assert "qbackend's stem conv kernel, not oneDNN: this CPU's oneDNN int8 kernel adds pairs of products in int16" in decision.reason


@needs_own_kernels
def test_bad_inputs_get_a_clear_error_not_a_crash():
    args, _ = _case(SHAPES["MobileNet 3x3 s2"], "relu", "avx2")
    op = registry.op("qconv_stem")
    with pytest.raises(ValueError, match="takes uint8 CPU activations"):
        op(args[0].float(), *args[1:])
    with pytest.raises(ValueError, match="expected a contiguous CPU torch.int16 constant"):
        op(args[0], args[1], args[2][:-2], *args[3:])  # a weight packed for other sizes
    with pytest.raises(ValueError, match="24 output channels"):
        op(args[0], args[1], args[2][: 24 * 14 * 2], args[3][:24], args[4][:24], *args[5:])
    with pytest.raises(ValueError, match=r"activation 'mish' is not one of \['none', 'gelu', 'gelu_tanh', 'swish', 'hardswish'\]"):
        op(*args, *stem_kernel.NO_POOL, "mish")
    if isa.vnni_unavailable():  # (int8 weights are the VNNI build's packing)
        with pytest.raises(ValueError, match="int8 weights are packed for AVX512-VNNI"):
            op(args[0], args[1], stem.pack(torch.zeros(32, 3, 3, 3, dtype=torch.int8)), *args[3:])
    with pytest.raises(ValueError, match="no output"):
        op(args[0][..., :2, :2], *args[1:6], [1, 1], [0, 0], *args[8:])
    with pytest.raises(ValueError, match=r"stride \[-1, -1\]: two ints from 1"):  # (#20: a 3x3 output of a 1x1 input)
        op(args[0], *args[1:6], [-1, -1], *args[7:])
    with pytest.raises(ValueError, match=r"pool kernel \[9, 3\]: the kernel keeps 1 to 8 conv rows"):
        op(*args, [9, 3], [2, 2], [1, 1])
    with pytest.raises(ValueError, match="not a max_pool2d's"):
        op(*args, [3, 3], [2, 2], [2, 1])
