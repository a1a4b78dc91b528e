"""qbackend's own int8 GEMM on linears (lowering/gemm.py): GELU (erf and tanh), SiLU, hardswish
and a float32 residual fused in its epilogue, the same values as the reference, chosen for linears of
up to its build's max_rows rows and oneDNN's qlinear above, or with the reason where it does not apply."""
import subprocess

import pytest
import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  registers the reference ops
import torch.nn as nn

from qbackend.kernels import registry
from qbackend.lowering import gemm
from qbackend.lowering.capabilities import linear_binary_post_op_refusal
from qbackend.lowering.own_conv import scale_and_offset
from qbackend.patterns import examples

from tests.helpers import compile_and_run, cpu_saturates, needs_own_kernels, onednn_linear_rows, quantize
from tests.tolerances import assert_int8_close, assert_outputs_close

OWN, ONEDNN, ONEDNN_ADD = "qbackend::qconv.default", "onednn::qlinear_pointwise", "onednn::qlinear_pointwise.binary"
# the kernel's activation -> torch's function
ACTIVATIONS = {"gelu": lambda t: nn.functional.gelu(t), "gelu_tanh": lambda t: nn.functional.gelu(t, approximate="tanh"),
               "swish": nn.functional.silu, "hardswish": nn.functional.hardswish}


def _gemm_case(rows=37, cin=64, cout=40, x_zp=9, x_scale=0.03):
    """uint8 rows, 7-bit weights, the packed kernel constants and the exact float64 result."""
    torch.manual_seed(0)
    x = torch.randint(0, 256, (rows, cin), dtype=torch.uint8)
    w = torch.randint(-64, 64, (cout, cin), dtype=torch.int8)
    w_scale, bias = torch.rand(cout) * 0.004 + 0.001, torch.randn(cout)
    mult, add = scale_and_offset(w, w_scale, x_scale, x_zp, bias)
    exact = (x.double() - x_zp) * x_scale @ (w.double() * w_scale.double()[:, None]).T + bias.double()
    constants = (gemm.pack(w.reshape(cout, cin, 1, 1)), mult.float(), add.float())
    return x.reshape(rows, cin, 1, 1), constants, exact


@needs_own_kernels
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("cout", [40, 128], ids=["16-wide tail", "64-wide tiles"])
def test_activation_in_the_epilogue_gives_the_reference_values(activation, cout, int8_build):
    """Float out: within 2e-6 of the float64 activation over the exact sum (37 rows: a tail
    tile; 40 outputs: a 16-wide tail, half of the zmm build's last block masked; 128: its tiles
    of 6 pixels x 64 outputs). uint8 out: the reference integers, rarely one step off where a
    value sits on a rounding boundary."""
    x, constants, exact = _gemm_case(cout=cout)
    expected = ACTIVATIONS[activation](exact)
    assert (exact < -3).any() and (exact > 3).any()  # both tails and the middle of each activation
    kernel = registry.op("qconv")
    floats = kernel(x, *constants, None, 0.0, float("-inf"), float("inf"), 1.0, 0, 0, 255, True, activation)
    torch.testing.assert_close(floats.reshape(exact.shape).double(), expected, atol=2e-6, rtol=1e-6)
    out_scale, out_zp = 0.02, 40
    ints = kernel(x, *constants, None, 0.0, float("-inf"), float("inf"), out_scale, out_zp, 0, 255, False, activation)
    reference = (torch.round(expected / out_scale) + out_zp).clamp(0, 255).to(torch.uint8)
    assert_int8_close(ints.reshape(reference.shape), reference, activation)
    assert (ints.reshape(reference.shape) == reference).double().mean() > 0.999


@needs_own_kernels
@pytest.mark.parametrize("activation", ["hardswish", "swish"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["", "uint8 residual"])
@pytest.mark.parametrize("bounds", [(-float("inf"), float("inf")), (-0.2, 2.0)], ids=["no clamp", "clamp after"])
def test_uint8_out_activation_with_residual_and_clamp(activation, with_residual, bounds, int8_build):
    """Hardswish on uint8 out runs on the output grid (its gate and product folded into the
    requantization), SiLU on floats: with a uint8 residual summed first (its zero point folded
    into the offset) and a clamp after, both give the reference integers, rarely one step off."""
    x, (w, mult, add), exact = _gemm_case()
    residual = torch.randint(0, 256, exact.shape, dtype=torch.uint8) if with_residual else None
    r_scale, r_zp = 0.02, 128
    summed = exact + (residual.double() - r_zp) * r_scale if with_residual else exact
    expected = ACTIVATIONS[activation](summed).clamp(*bounds)
    out_scale, out_zp = 0.02, 40
    ints = registry.op("qconv")(x, w, mult, add - r_zp * r_scale if with_residual else add,
                                None if residual is None else residual.reshape(*exact.shape, 1, 1), r_scale, *bounds,
                                out_scale, out_zp, 0, 255, False, activation).reshape(exact.shape)
    reference = (torch.round(expected / out_scale) + out_zp).clamp(0, 255).to(torch.uint8)
    assert_int8_close(ints, reference, activation)
    assert (ints == reference).double().mean() > 0.999


def _streamed_weights_limit() -> int:
    """conv_gemm_int8.c weights_streamed() of a linear: the L2 as glibc's sysconf reads it
    (getconf asks the same; Python's os.sysconf does not know the name), 256 KB where unknown."""
    try:
        l2 = int(subprocess.run(["getconf", "LEVEL2_CACHE_SIZE"], capture_output=True, text=True, check=True).stdout)
    except (OSError, ValueError, subprocess.CalledProcessError):
        l2 = -1
    return l2 if l2 > 0 else 256 * 1024


@needs_own_kernels
@pytest.mark.parametrize("cout", [400, 128], ids=["3-block tiles", "64-wide tiles"])
@pytest.mark.parametrize("beyond", [False, True], ids=["weights streamed", "weights beyond: row blocks"])
def test_both_loop_orders_give_the_exact_sums(cout, beyond, int8_build):
    """Weights up to the kernel's limit stream past each pixel tile; beyond it, output tiles go
    round blocks of rows, as many blocks for each thread. 301 rows leave a tail tile."""
    limit = _streamed_weights_limit()
    cin = (limit // cout + 4) // 4 * 4 if beyond else 768
    assert (cin * cout > limit) == beyond
    x, constants, exact = _gemm_case(rows=301, cin=cin, cout=cout)
    floats = registry.op("qconv")(x, *constants, None, 0.0, float("-inf"), float("inf"), 1.0, 0, 0, 255, True)
    torch.testing.assert_close(floats.reshape(exact.shape).double(), exact, atol=2e-6, rtol=1e-6)


@needs_own_kernels
@pytest.mark.parametrize("threads", [1, 3, 5])
def test_every_tile_is_computed_once_whichever_thread_takes_it(threads, int8_build):
    """A thread takes its own share of the tiles from the front, then the others' from their
    ends (conv_gemm_int8.c take_tiles): an odd team, more threads than cores (a descheduled
    one's share is taken from its end), 301 rows (a tail tile), 3-block tiles."""
    x, constants, exact = _gemm_case(rows=301, cin=64, cout=400)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        floats = registry.op("qconv")(x, *constants, None, 0.0, float("-inf"), float("inf"), 1.0, 0, 0, 255, True)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(floats.reshape(exact.shape).double(), exact, atol=2e-6, rtol=1e-6)


@needs_own_kernels
@pytest.mark.parametrize("rows, cin, cout", [(45, 132, 72), (45, 20, 24), (300, 200, 16), (7, 132, 72)],
                         ids=["K tail, 3 blocks", "K under one step", "rows outer", "7 rows"])
def test_any_input_width_and_row_count_gives_the_exact_sums(rows, cin, cout, int8_build):
    """Input widths that are not whole 64-byte steps (the AMX build's last step reads zero-padded
    weights, and past each row's end), outputs that leave a half tile, a last pixel tile of
    13 or 12 rows (read from a zero-padded copy), and 7 rows (under the AMX build's minimum: zmm)."""
    x, constants, exact = _gemm_case(rows=rows, cin=cin, cout=cout)
    floats = registry.op("qconv")(x, *constants, None, 0.0, float("-inf"), float("inf"), 1.0, 0, 0, 255, True)
    torch.testing.assert_close(floats.reshape(exact.shape).double(), exact, atol=2e-6, rtol=1e-6)


@needs_own_kernels
@pytest.mark.parametrize("activation", ["none", "swish"])
def test_float_residual_is_added_before_the_post_op(activation, int8_build):
    x, constants, exact = _gemm_case()
    residual = torch.randn(exact.shape)
    floats = registry.op("qconv")(x, *constants, residual.reshape(*exact.shape, 1, 1), 1.0, 0.0, float("inf"),
                                   1.0, 0, 0, 255, True, activation)
    summed = exact + residual.double()
    expected = (summed if activation == "none" else ACTIVATIONS[activation](summed)).clamp_min(0)
    torch.testing.assert_close(floats.reshape(exact.shape).double(), expected, atol=2e-6, rtol=1e-6)


@needs_own_kernels
@pytest.mark.parametrize("low", [-float("inf"), 0.0])  # no post-op; a ReLU
def test_nan_and_infinity_in_a_float_residual_come_out_as_the_reference_has_them(int8_build, low):
    """The reference clamps keeping a NaN, and its quantize clamps an infinity to the range's
    end and stores a NaN as 0: the epilogue had made a NaN -inf and an infinity INT_MIN."""
    x, constants, exact = _gemm_case()
    residual = torch.randn(exact.shape)
    residual.view(-1)[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, float("nan")])
    expected = (exact.float() + residual).clamp_min(low)  # (clamp_min keeps a NaN)
    args = (residual.reshape(*exact.shape, 1, 1), 1.0, low, float("inf"))
    floats = registry.op("qconv")(x, *constants, *args, 1.0, 0, 0, 255, True).reshape(exact.shape)
    assert torch.equal(floats.isnan(), expected.isnan()) and torch.equal(floats[expected.isinf()], expected[expected.isinf()])
    scale, zero_point = 0.05, 100
    integers = registry.op("qconv")(x, *constants, *args, scale, zero_point, 0, 255, False).reshape(exact.shape)
    reference = torch.ops.quantized_decomposed.quantize_per_tensor(expected, scale, zero_point, 0, 255, torch.uint8)
    assert torch.equal(integers.view(-1)[:6], reference.view(-1)[:6])


class ResidualThenLinear(nn.Module):
    """x + fc1(x), quantized for fc2: a float residual summed into an int8 output."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(x + self.fc1(x))


@needs_own_kernels
@pytest.mark.skipif(cpu_saturates(), reason="8-bit activations are kept before any kernel is chosen on a CPU without VNNI")
def test_a_signed_output_with_a_float_residual_stays_on_onednn():
    """XPU-quantized models run on CPU as uint8 + 128, where the reference's NaN is 128; the
    kernel would store a NaN residual's sum as 0."""
    from qbackend.pt2e_flow import quantize_xpu

    torch.manual_seed(0)
    x = torch.randn(4, 64)
    _, _, captured = compile_and_run(quantize_xpu(ResidualThenLinear().eval(), (x,), [(x,)]), (x,))
    fc1 = next(d for d in captured.report.decisions if d.source == "fc1")
    assert fc1.rule == "qlinear_add" and "stores a NaN as 128" in fc1.reason, str(captured.report)


@needs_own_kernels
def test_bad_activation_or_residual_is_a_clear_error():
    x, constants, exact = _gemm_case()
    kernel = registry.op("qconv")
    with pytest.raises(ValueError, match="activation 'silu' is not one of"):
        kernel(x, *constants, None, 0.0, 0.0, 6.0, 1.0, 0, 0, 255, True, "silu")
    with pytest.raises(ValueError, match="residual"):
        kernel(x, *constants, torch.randn(exact.shape[0], 8, 1, 1), 1.0, 0.0, 6.0, 1.0, 0, 0, 255, True)
    with pytest.raises(ValueError, match="takes uint8 CPU activations"):  # only float32 or uint8 residuals
        kernel(x, *constants, torch.randn(*exact.shape, 1, 1).bfloat16(), 1.0, 0.0, 6.0, 1.0, 0, 0, 255, True)


class FeedForward(nn.Module):
    """A transformer's MLP with its residual: x + fc2(gelu(fc1(x)))."""

    def __init__(self, approximate="none"):
        super().__init__()
        self.fc1, self.gelu, self.fc2 = nn.Linear(32, 64), nn.GELU(approximate), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.fc2(self.gelu(self.fc1(x)))


@needs_own_kernels
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_feed_forward_runs_on_the_own_kernel_with_its_post_ops(approximate):
    inputs = (torch.randn(2, 8, 32),)  # 16 rows: within every GEMM build's max_rows
    actual, expected, captured = compile_and_run(quantize(FeedForward(approximate).eval(), inputs), inputs)
    assert_outputs_close(actual, expected, f"feed-forward, gelu {approximate}")
    assert [(d.rule, d.op) for d in captured.report.decisions] == [("qlinear", OWN), ("qlinear_add", OWN)], str(captured.report)


def test_rows_above_the_limit_run_on_onednn():
    inputs = (torch.randn(2, onednn_linear_rows() // 2, 32),)
    actual, expected, captured = compile_and_run(quantize(FeedForward().eval(), inputs), inputs)
    assert_outputs_close(actual, expected, "feed-forward on oneDNN")
    assert [d.op for d in captured.report.decisions] == [ONEDNN, ONEDNN_ADD], str(captured.report)


@needs_own_kernels
def test_a_bf16_output_stays_on_onednn_with_the_reason():
    module, inputs = examples.linear_residual()
    inputs = tuple(t.bfloat16() for t in inputs)
    actual, expected, captured = compile_and_run(quantize(module.bfloat16(), inputs), inputs)
    assert_outputs_close(actual, expected, "bf16 residual")
    ops = {d.source: (d.op, d.reason) for d in captured.report.decisions}
    # oneDNN fuses the bf16 residual add only on CPUs with avx512_bf16 (the probe asks it)
    fused = linear_binary_post_op_refusal("cpu", "none", (), "", torch.bfloat16, torch.bfloat16) is None
    fc2 = "oneDNN, not qbackend's linear kernel: the kernel writes uint8 or float32, not torch.bfloat16"
    assert ops == {"fc1": (OWN, "qbackend's int8 GEMM kernel (10 rows)"),  # (its uint8 output is no bf16)
                   "fc2": (ONEDNN_ADD, fc2 + "; residual added out of place (l_x_ is a graph input or constant)")
                   if fused else (ONEDNN, fc2)}, str(captured.report)
