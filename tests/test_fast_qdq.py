"""The q/dq kept in lowered graphs are bit-exact with the reference ops."""
import pytest
import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  registers the reference ops

from qbackend import fast_qdq

qd = torch.ops.quantized_decomposed

PARAMS = [(0.02, 128, 0, 255, torch.uint8), (0.05, 0, 0, 255, torch.uint8), (0.01, 0, -128, 127, torch.int8)]


def _inputs(dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 16, 9, 9) * 3
    x.view(-1)[:100] = torch.arange(100) * 0.01  # exact .5 ties at scale 0.02
    return x.to(dtype)


@pytest.mark.parametrize("params", PARAMS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_dequantize_bit_exact(params, dtype):
    x = _inputs(dtype)
    q_ref = qd.quantize_per_tensor.default(x, *params)
    assert torch.equal(fast_qdq.quantize_per_tensor(x, *params), q_ref)
    assert torch.equal(fast_qdq.dequantize_per_tensor(q_ref, *params), qd.dequantize_per_tensor.default(q_ref, *params))
    fused = fast_qdq.quantize_dequantize_per_tensor(x, *params)
    assert torch.equal(fused, qd.dequantize_per_tensor.default(q_ref, *params))


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
def test_tensor_overloads_bit_exact(params):
    x = _inputs(torch.float32)
    scale, zero_point, *rest = params
    scale_t, zp_t = torch.tensor([scale]), torch.tensor([zero_point])
    q_ref = qd.quantize_per_tensor.tensor(x, scale_t, zp_t, *rest)
    assert torch.equal(fast_qdq.quantize_per_tensor_tensor(x, scale_t, zp_t, *rest), q_ref)
    assert torch.equal(fast_qdq.dequantize_per_tensor_tensor(q_ref, scale_t, zp_t, *rest),
                       qd.dequantize_per_tensor.tensor(q_ref, scale_t, zp_t, *rest))
