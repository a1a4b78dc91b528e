"""qbackend's int8 pool kernels: the max pool (csrc/max_pool_uint8.c) gives torch's
quantized::max_pool2d's bytes on every geometry the lowering hands it, the average pools
(csrc/avg_pool_uint8.c, csrc/global_avg_pool_uint8.c) the reference's integers within one step;
all chosen on CPU (max pools in ceil mode too), torch's kernels (with the reason) for a pool they
refuse."""
import functools

import pytest
import torch
import torch.nn as nn

from qbackend.kernels import choice_cache, fast_qdq, pools, registry
from qbackend.lowering import choice

from tests.helpers import assert_matches_reference, assert_one_chain_of_c_steps, needs_own_kernels, quantize, with_and_without_chains
from tests.kernels.test_kernel_choice import SimulatedMachine
from tests.tolerances import assert_int8_close

pytestmark = needs_own_kernels

GEOMETRIES = [  # kernel, stride, padding, dilation
    ((3, 3), (2, 2), (1, 1), (1, 1)),  # ResNet's
    ((2, 2), (2, 2), (0, 0), (1, 1)),
    ((3, 3), (1, 1), (1, 1), (1, 1)),
    ((3, 2), (2, 1), (1, 0), (1, 1)),
    ((3, 3), (1, 2), (1, 1), (2, 2)),
]


@pytest.mark.parametrize("ceil_mode", [False, True], ids=["floor", "ceil"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("channels", [64, 40, 59, 24, 3],
                         ids=["64 channels", "32 + 8 channels", "32 + 16 + 8 + 3 channels", "16 + 8 channels", "3 channels"])
def test_kernel_gives_torchs_bytes(geometry, channels, ceil_mode):
    torch.manual_seed(0)
    for height, width in ((11, 9), (14, 14), (7, 10)):  # (ceil mode: a last, partial window or none, by size)
        x = torch.randint(0, 256, (2, channels, height, width), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
        kernel_size, stride, padding, dilation = geometry
        expected = torch.ops.quantized.max_pool2d(x, list(kernel_size), list(stride), list(padding), list(dilation), ceil_mode)
        for actual in (pools.max_pool_u8(x, *geometry, ceil_mode), registry.op("max_pool_u8")(x, *geometry, ceil_mode)):
            assert actual.is_contiguous(memory_format=torch.channels_last)
            assert torch.equal(actual, expected)


def test_bad_inputs_get_a_clear_error():
    with pytest.raises(ValueError, match="takes uint8 CPU activations"):
        pools.max_pool_u8(torch.zeros(1, 8, 4, 4), (2, 2), (2, 2), (0, 0), (1, 1))
    with pytest.raises(ValueError, match=r"padding \[2, 2\] over half the kernel \[2, 2\]"):
        pools.max_pool_u8(torch.zeros(1, 8, 4, 4, dtype=torch.uint8), (2, 2), (2, 2), (2, 2), (1, 1))
    with pytest.raises(ValueError, match=r"dilation \[0, 0\]: two ints from 1"):  # (#20: SIGFPE in C)
        registry.op("max_pool_u8")(torch.zeros(1, 8, 4, 4, dtype=torch.uint8), [2, 2], [2, 2], [0, 0], [0, 0])


def conv_pool_conv(ceil_mode):
    """(4 input channels: a stem conv's kernel would take the pool in, test_stem_kernel.py)"""
    return nn.Sequential(nn.Conv2d(4, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, 1, ceil_mode=ceil_mode),
                         nn.Conv2d(16, 16, 3, padding=1))


@pytest.mark.parametrize("ceil_mode", [False, True], ids=["floor", "ceil"])
def test_int8_pool_runs_on_the_kernel(ceil_mode):
    inputs = (torch.randn(2, 4, 16, 16),)  # (ceil mode: 8x8 out, floor 7x7)
    report = assert_matches_reference(quantize(conv_pool_conv(ceil_mode), inputs), inputs).report
    pool = next(d for d in report.decisions if d.rule == "qmaxpool2d")
    assert pool.op == "qbackend::max_pool_u8.default", str(report)


@pytest.mark.parametrize("zero_point", [0, 3, 128], ids=["zp 0", "odd zp", "zp 128"])
@pytest.mark.parametrize("channels", [1280, 36, 5], ids=["1280 channels", "32 + 4 channels", "5 channels"])
def test_global_average_pool_gives_the_reference_integers(zero_point, channels):
    """The reference: dequantize, adaptive_avg_pool2d to 1x1, quantize with the same parameters."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401  registers the reference ops

    qd = torch.ops.quantized_decomposed
    torch.manual_seed(0)
    x = torch.randint(0, 256, (3, channels, 7, 6), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    x[0, 0] = torch.arange(42).reshape(7, 6) % 2 + 1  # a mean of exactly 1.5: a rounding tie
    scale = 0.05
    pooled = nn.functional.adaptive_avg_pool2d(qd.dequantize_per_tensor(x, scale, zero_point, 0, 255, torch.uint8), 1)
    expected = qd.quantize_per_tensor(pooled, scale, zero_point, 0, 255, torch.uint8)
    for actual in (pools.global_avg_pool_u8(x, zero_point, 0, 255), registry.op("global_avg_pool_u8")(x, zero_point, 0, 255)):
        assert actual.shape == (3, channels, 1, 1)
        assert_int8_close(actual, expected, f"zero point {zero_point}")


@pytest.mark.parametrize("channels", [104, 36, 5], ids=["3 x 32 + 8 channels", "32 + 4 channels", "5 channels"])
@pytest.mark.parametrize("scale, zero_point, qmin, qmax, nan_as", [(0.02, 0, 0, 255, 0), (0.05, 128, 0, 255, 7),
                                                                   (0.03, 63, 0, 127, 0)], ids=["zp 0", "zp 128", "7 bits"])
def test_the_pool_of_a_quantized_float_tensor_is_the_pool_of_its_quantize(channels, scale, zero_point, qmin, qmax, nan_as):
    """global_avg_pool_quantize(x) == global_avg_pool_u8(quantize_per_tensor(x)): the same
    integers (clamped values, ties, a NaN stored as ``nan_as``) summed without the uint8 tensor."""
    torch.manual_seed(0)
    x = (torch.randn(3, channels, 7, 6) * 4).contiguous(memory_format=torch.channels_last)
    x[0, 0] = (torch.arange(42.0).reshape(7, 6) % 2 + 0.5) * scale  # values halfway between two levels
    x[1, channels - 1, 2, 3] = float("nan")
    x[2, :, 0, 0] = float("inf")
    expected = pools.global_avg_pool_u8(fast_qdq.quantize_per_tensor(x, scale, zero_point, qmin, qmax, torch.uint8, nan_as),
                                        zero_point, qmin, qmax)
    args = (scale, zero_point, qmin, qmax, nan_as, zero_point, qmin, qmax)
    for actual in (pools.global_avg_pool_quantize(x, *args), registry.op("global_avg_pool_quantize")(x, *args),
                   pools.global_avg_pool_quantize(x.contiguous(), *args)):
        assert actual.shape == (3, channels, 1, 1) and actual.dtype == torch.uint8
        assert torch.equal(actual, expected)


AVERAGE_GEOMETRIES = [  # kernel, stride, padding, ceil_mode, count_include_pad, divisor (0: none)
    ((2, 2), (2, 2), (0, 0), False, True, 0),  # DenseNet's transitions
    ((3, 3), (1, 1), (1, 1), False, True, 0),  # (Inception's branch pools)
    ((3, 3), (1, 1), (1, 1), False, False, 0),
    ((3, 3), (2, 2), (1, 1), True, True, 0),  # (a last, partial window)
    ((3, 2), (2, 1), (1, 0), True, False, 0),
    ((2, 2), (2, 2), (0, 0), False, True, 3),
]


@pytest.mark.parametrize("zero_point", [0, 3, 128], ids=["zp 0", "odd zp", "zp 128"])
@pytest.mark.parametrize("geometry", AVERAGE_GEOMETRIES, ids=str)
@pytest.mark.parametrize("channels", [64, 36, 5], ids=["64 channels", "32 + 4 channels", "5 channels"])
def test_average_pool_rounds_the_exact_mean_within_a_step_of_the_reference(geometry, channels, zero_point):
    """Each output is the window's exact mean (its zero points taken out, over torch's divisor)
    rounded half to even; the reference, which averages dequantized floats, within one step."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401  registers the reference ops

    qd = torch.ops.quantized_decomposed
    kernel_size, stride, padding, ceil_mode, count_include_pad, divisor = geometry
    torch.manual_seed(0)
    for height, width in ((11, 9), (14, 14)):
        x = torch.randint(0, 256, (2, channels, height, width), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
        x[0, 0, :4, :4] = torch.tensor([[1, 2] * 2, [2, 1] * 2] * 2)  # a window mean of exactly 1.5: a rounding tie
        pool = functools.partial(nn.functional.avg_pool2d, kernel_size=kernel_size, stride=stride, padding=padding,
                                 ceil_mode=ceil_mode, count_include_pad=count_include_pad, divisor_override=divisor or None)
        exact = (pool(x.double() - zero_point).round() + zero_point).clamp(0, 255).to(torch.uint8)  # (float64: every mean exact)
        reference = qd.quantize_per_tensor(pool(qd.dequantize_per_tensor(x, 0.05, zero_point, 0, 255, torch.uint8)), 0.05,
                                           zero_point, 0, 255, torch.uint8)
        args = (kernel_size, stride, padding, ceil_mode, count_include_pad, divisor, zero_point, 0, 255)
        for actual in (pools.avg_pool_u8(x, *args), registry.op("avg_pool_u8")(x, *args)):
            assert actual.is_contiguous(memory_format=torch.channels_last)
            assert torch.equal(actual, exact)
            assert_int8_close(actual, reference, f"{geometry}, zero point {zero_point}")


def pool_head(pool):
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), pool, nn.Flatten(),
                         nn.Linear(pool(torch.zeros(1, 16, 14, 14)).numel(), 10))


@pytest.mark.parametrize("pool, op", [(nn.AdaptiveAvgPool2d(1), "qbackend::global_avg_pool_u8.default"),
                                      (nn.AvgPool2d(2), "qbackend::avg_pool_u8.default"),
                                      (nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False), "qbackend::avg_pool_u8.default"),
                                      (nn.AvgPool2d(2, divisor_override=70000), "aten::avg_pool2d (quantized tensor)")],
                         ids=["global", "2x2", "3x3 ceil, padding not counted", "a divisor past the kernel's"])
def test_average_pools_run_on_the_kernels_or_on_torchs_with_the_reason(pool, op):
    inputs = (torch.randn(2, 3, 14, 14),)
    report = assert_matches_reference(quantize(pool_head(pool), inputs), inputs).report
    decision = next(d for d in report.decisions if d.rule == "qavgpool")
    assert decision.op == op, str(report)
    if op.startswith("aten"):
        assert "divisor 70000: the kernel takes windows of up to 65536 pixels, divisors to 65536" in decision.reason, str(report)


def test_an_unbatched_global_average_pool_runs_on_torchs_with_the_reason():
    inputs = (torch.randn(3, 14, 14),)  # [C, H, W]: the kernel reads a batch of images
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
    report = assert_matches_reference(quantize(model, inputs), inputs).report
    decision = next(d for d in report.decisions if d.rule == "qavgpool")
    assert decision.op == "aten::adaptive_avg_pool2d (quantized tensor)", str(report)
    assert "batched [N, C, H, W] input, not one of rank 3" in decision.reason, str(report)


def test_a_ceil_mode_pool_after_a_stem_conv_stays_a_call_of_its_own():
    """(the stem conv's fused pool is floor mode: GoogLeNet's stem pools in ceil mode)"""
    inputs = (torch.randn(2, 3, 32, 32),)
    stem = nn.Sequential(nn.Conv2d(3, 16, 7, 2, 3), nn.ReLU(), nn.MaxPool2d(3, 2, ceil_mode=True), nn.Conv2d(16, 16, 1))
    report = assert_matches_reference(quantize(stem, inputs), inputs).report
    pool = next(d for d in report.decisions if d.rule == "qmaxpool2d")
    assert pool.op == "qbackend::max_pool_u8.default" and "stem conv" not in pool.reason, str(report)


def test_a_transitions_average_pool_is_a_step_of_the_chain(tmp_path, monkeypatch):
    """DenseNet's transition (a conv, a 2x2 average pool): the pool ran torch's quantized-tensor
    ops between two chains; as a step, the transition is one chain, with the separate calls' bytes."""
    monkeypatch.setenv("QBACKEND_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(choice_cache, "_shared", None)
    monkeypatch.setattr(choice, "measure", SimulatedMachine(own_us=100, onednn_us=300))
    x = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(0))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        transition = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 1), nn.AvgPool2d(2),
                                   nn.Conv2d(16, 8, 3, padding=1))
    model = quantize(transition.eval(), (x,))
    # (the pool's ties one step off, as allowed, move the last conv's float output by more than
    # the float tolerance: its int8 input, the pool's, is what is checked)
    chained, separate = with_and_without_chains(
        lambda: assert_matches_reference(model, (x,), outputs=False, kernel_choice="measure"), monkeypatch)
    assert_one_chain_of_c_steps(chained, separate, ["qconv_stem", "qconv", "avg_pool_u8", "qconv"],
                                [torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(k)) for k in range(1, 4)])
