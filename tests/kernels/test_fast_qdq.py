"""The q/dq kept in lowered graphs match the reference ops: dequantize bit for bit, quantize
except, on ATen's path, one step at exact rounding ties (it rounds its inverse scale differently)."""
import pytest
import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  registers the reference ops

from qbackend.kernels import fast_qdq
from qbackend.kernels import registry

from tests.helpers import needs_own_kernels

qd = torch.ops.quantized_decomposed

PARAMS = [(0.02, 128, 0, 255, torch.uint8), (0.05, 0, 0, 255, torch.uint8), (0.01, 0, -128, 127, torch.int8),
          (0.02, 64, 0, 127, torch.uint8)]  # the last: reduce_range's 7-bit activations


def _inputs(dtype, shape=(4, 16, 9, 9)):
    torch.manual_seed(0)
    x = torch.randn(*shape) * 3
    x.view(-1)[:100] = torch.arange(100) * 0.01  # exact .5 ties at scale 0.02
    return x.to(dtype)


def assert_equal_but_at_ties(actual, expected, x, scale):
    """Equal, except by one step where x / scale sits on a .5 rounding tie."""
    differ = actual.int() != expected.int()
    assert (actual.int() - expected.int()).abs().max() <= 1
    scaled = x.double()[differ] / scale
    assert ((scaled - scaled.floor() - 0.5).abs() < 1e-4).all(), scaled


@pytest.mark.parametrize("params", PARAMS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_dequantize_match_the_reference(params, dtype):
    x = _inputs(dtype)
    q_ref = qd.quantize_per_tensor.default(x, *params)
    q = fast_qdq.quantize_per_tensor(x, *params)
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape
    assert_equal_but_at_ties(q, q_ref, x, params[0])
    assert torch.equal(fast_qdq.dequantize_per_tensor(q_ref, *params), qd.dequantize_per_tensor.default(q_ref, *params))
    fused = fast_qdq.quantize_dequantize_per_tensor(x, *params)  # (exact either way: no tie off)
    assert torch.equal(fused, qd.dequantize_per_tensor.default(q_ref, *params))


def test_quantize_keeps_channels_last_and_owns_its_memory():
    x = _inputs(torch.float32).contiguous(memory_format=torch.channels_last)
    q = fast_qdq.quantize_per_tensor(x, *PARAMS[0])
    assert q.is_contiguous(memory_format=torch.channels_last) and q.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert_equal_but_at_ties(q, qd.quantize_per_tensor.default(x, *PARAMS[0]), x, PARAMS[0][0])


def test_dequantize_to_bfloat16_matches_reference():
    q = qd.quantize_per_tensor.default(_inputs(torch.float32), *PARAMS[0])
    expected = qd.dequantize_per_tensor.default(q, *PARAMS[0], out_dtype=torch.bfloat16)
    assert torch.equal(fast_qdq.dequantize_per_tensor(q, *PARAMS[0], out_dtype=torch.bfloat16), expected)
    fused = fast_qdq.quantize_dequantize_per_tensor(_inputs(torch.float32), *PARAMS[0], out_dtype=torch.bfloat16)
    assert torch.equal(fused, expected)


def test_inputs_are_not_modified():
    x = _inputs(torch.float32)
    before = x.clone()
    fast_qdq.quantize_dequantize_per_tensor(x, *PARAMS[0])
    assert torch.equal(x, before)


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_tensor_overloads_match_the_reference(params):
    x = _inputs(torch.float32)
    scale, zero_point, *rest = params
    scale_t, zp_t = torch.tensor([scale]), torch.tensor([zero_point])
    q_ref = qd.quantize_per_tensor.tensor(x, scale_t, zp_t, *rest)
    assert_equal_but_at_ties(fast_qdq.quantize_per_tensor_tensor(x, scale_t, zp_t, *rest), q_ref, x, scale)
    assert torch.equal(fast_qdq.dequantize_per_tensor_tensor(q_ref, scale_t, zp_t, *rest),
                       qd.dequantize_per_tensor.tensor(q_ref, scale_t, zp_t, *rest))


@needs_own_kernels
@pytest.mark.parametrize("params", PARAMS, ids=str)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("shape", [(4, 16, 9, 9), (2, 3, 33, 35)], ids=["16 channels", "RGB"])
def test_quantize_for_a_conv_is_channels_last_and_the_reference_bit_for_bit(params, layout, shape):
    """A conv's input quantize: qbackend's kernel for uint8 NCHW float32 inputs (9x9: a tail of
    pixels; RGB: its 3-channel path, 1155 pixels = a 1024-pixel chunk and one with a tail of 3
    after 16-pixel steps), the vectorised quantize elsewhere (int8, a channels-last input),
    channels-last out. The kernel multiplies by the reference's inverse scale: exact even at
    rounding ties."""
    scale, zero_point, qmin, qmax, dtype = params
    x = _inputs(torch.float32, shape)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    actual = fast_qdq.quantize_per_tensor_channels_last(x, scale, zero_point, qmin, qmax, dtype)
    expected = qd.quantize_per_tensor(x, scale, zero_point, qmin, qmax, dtype)
    assert actual.is_contiguous(memory_format=torch.channels_last) and actual.dtype == dtype
    if dtype == torch.uint8 and layout == "nchw":
        assert torch.equal(actual, expected)
    else:
        assert_equal_but_at_ties(actual, expected, x, scale)


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_quantize_of_a_permuted_tensor_keeps_its_strides(params):
    """Attention's output is a [B, H, L, D] view of [B, L, H, D] memory: quantized in memory
    order, so the [B, L, H * D] reshape after it is a view, not a copy."""
    x = _inputs(torch.float32).permute(0, 2, 1, 3)
    q = fast_qdq.quantize_per_tensor(x, *params)
    assert q.stride() == x.stride()
    assert_equal_but_at_ties(q, qd.quantize_per_tensor(x, *params), x, params[0])
    sliced = x[:, :, :3]  # not dense: quantized as ATen does it (contiguous)
    assert fast_qdq.quantize_per_tensor(sliced, *params).is_contiguous()


SPECIAL_VALUES = [float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.0, 0.01, -0.03]


@pytest.mark.parametrize("params", PARAMS, ids=str)
@pytest.mark.parametrize("count", [7, 64, 100, 16384 + 33])  # the kernel's scalar tail, its 64- and 16-wide steps, two tasks
def test_quantize_is_the_reference_bit_for_bit_with_nan_and_infinity(params, count):
    """A NaN is stored as 0, as the reference's integer conversion does (ATen's quantize gives
    qmax: filled in after it when the own kernel is off); infinities and huge values clamp;
    ties round half to even (the own kernel; ATen's may land one step off)."""
    scale, zero_point, qmin, qmax, dtype = params
    torch.manual_seed(0)
    x = torch.randn(count) * 3
    x[torch.randint(0, count, (count // 3 + 1,))] = torch.tensor(SPECIAL_VALUES)[torch.randint(0, 8, (count // 3 + 1,))]
    expected = qd.quantize_per_tensor(x, scale, zero_point, qmin, qmax, dtype)
    assert_exact_but_at_ties(fast_qdq.quantize_per_tensor(x, scale, zero_point, qmin, qmax, dtype), expected, x, scale)
    expected_float = qd.dequantize_per_tensor(expected, scale, zero_point, qmin, qmax, dtype)
    assert torch.equal(fast_qdq.quantize_dequantize_per_tensor(x, scale, zero_point, qmin, qmax, dtype), expected_float)


def assert_exact_but_at_ties(actual, expected, x, scale):
    """NaN, infinities and huge values exactly as the reference; the rest bit for bit with the
    own kernel, else (ATen's quantize) but at rounding ties."""
    special = ~x.isfinite() | (x.abs() > 1e20)
    assert torch.equal(actual[special], expected[special])
    if registry.available() is None:
        assert torch.equal(actual, expected)
    assert_equal_but_at_ties(actual[~special], expected[~special], x[~special], scale)


@pytest.mark.parametrize("count", [7, 100, 16384 + 33])
def test_a_signed_quantize_run_as_unsigned_stores_nan_as_the_references_zero(count):
    """lowering/signed_int8.py runs an int8 quantize as uint8 with zero point + 128: the
    reference's NaN (int8 0) is then 128, which ``nan_as`` asks for."""
    torch.manual_seed(0)
    x = torch.randn(count) * 3
    x[torch.randint(0, count, (count // 3 + 1,))] = torch.tensor(SPECIAL_VALUES)[torch.randint(0, 8, (count // 3 + 1,))]
    signed = qd.quantize_per_tensor(x, 0.02, 5, -128, 127, torch.int8)
    expected = (signed.int() + 128).to(torch.uint8)
    assert_exact_but_at_ties(fast_qdq.quantize_per_tensor(x, 0.02, 133, 0, 255, torch.uint8, nan_as=128), expected, x, 0.02)
    channels_last = fast_qdq.quantize_per_tensor_channels_last(x.view(1, 1, 1, -1), 0.02, 133, 0, 255, torch.uint8, nan_as=128)
    assert_exact_but_at_ties(channels_last.flatten(), expected, x, 0.02)
