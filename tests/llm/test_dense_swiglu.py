"""A prompt's Llama MLP as one call over dense slices (qbackend/llm/dense_swiglu.py): the bits of
the unfused dense path, the bf16 SiLU-and-multiply it runs, the rewritten graph, and the MLPs
it leaves alone."""
import expecttest
import pytest
import torch
import torch.nn.functional as F

import qbackend
from qbackend.kernels import silu_mul
from qbackend.llm import dense_swiglu, dense_weight_only
from qbackend.kernels import registry

from tests.helpers import compile_and_run, needs_own_kernels, short_graph
from tests.llm.test_dense_weight_only import packed, simulated
from tests.tolerances import assert_weight_only_close

pytestmark = needs_own_kernels


def test_the_bf16_silu_mul_rounds_the_float32_kernels_product_as_torch_does():
    torch.manual_seed(0)
    product = (torch.randn(40, 2 * 77) * 4).bfloat16()
    product[3, 5] = float("nan")
    a, b = product[:, :77], product[:, 77:]  # (77 columns: two vectors of 32, then a tail)
    out = torch.zeros(40, 100, dtype=torch.bfloat16)
    silu_mul.silu_mul_bf16_into(a, b, out[:, 10:87])
    expected = silu_mul.silu_mul(a.float(), b.float()).bfloat16()
    torch.testing.assert_close(out[:, 10:87], expected, rtol=0, atol=0, equal_nan=True)  # (bits, but NaN's: any NaN)
    assert out[3, 15].isnan()  # (a NaN operand)
    assert not out[:, :10].any() and not out[:, 87:].any()


def test_the_bf16_silu_mul_checks_its_operands():
    a = torch.randn(4, 32).bfloat16()
    with pytest.raises(ValueError, match="b must be a CPU bf16 matrix"):
        silu_mul.silu_mul_bf16_into(a, a.float(), a.clone())
    with pytest.raises(ValueError, match="out must be a CPU bf16 matrix"):
        silu_mul.silu_mul_bf16_into(a, a, torch.empty(32, 4, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="b must be a CPU bf16 matrix"):
        silu_mul.silu_mul_bf16_into(a, a[:, :16], a.clone())


@pytest.mark.parametrize("bits", [4, 8])
def test_the_fused_mlp_gives_the_unfused_dense_paths_bits(bits, monkeypatch):
    monkeypatch.setattr(dense_weight_only, "CHUNK_BYTES", 96 * 256 * 2)  # 48 gate and 48 up rows a slice, then the rest
    inner = 128  # (the kernels: K a multiple of 64)
    _, gate_up = packed(bits, n=2 * inner, k=256, seed=1)
    _, down = packed(bits, n=256, k=inner, seed=2)
    x = torch.randn(24, 256)
    dense = ((8, 8, torch.bfloat16, bits, *gate_up), (8, 8, torch.bfloat16, bits, *down))
    y = dense_weight_only.kernel_or_dense(x, *dense[0])
    unfused = dense_weight_only.kernel_or_dense(silu_mul.silu_mul(y[:, :inner], y[:, inner:]), *dense[1])
    assert torch.equal(dense_swiglu.swiglu(x, *dense), unfused)
    # fewer rows than the down linear's switch: the merged one dense, the down one on the kernel
    kernel = registry.PLAIN[f"int{bits}_mm_int16"]
    y = dense_weight_only.dense_slices(x, bits, torch.bfloat16, *gate_up)
    expected = kernel(silu_mul.silu_mul(y[:, :inner], y[:, inner:]), *down)
    assert torch.equal(dense_swiglu.swiglu(x, dense[0], (25, 25, torch.bfloat16, bits, *down)), expected)
    # a float32 dense dtype: not fused (the fusion's gain is the bf16 passes it saves)
    y = dense_weight_only.dense_slices(x, bits, torch.float32, *gate_up)
    expected = dense_weight_only.dense_slices(silu_mul.silu_mul(y[:, :inner], y[:, inner:]), bits, torch.float32, *down)
    assert torch.equal(dense_swiglu.swiglu(x, (8, 8, torch.float32, bits, *gate_up), (8, 8, torch.float32, bits, *down)), expected)


class LlamaMLP(torch.nn.Module):
    """transformers' LlamaMLP; ``product_read``: the gated product is also returned."""

    def __init__(self, product_read=False, hidden=256, inner=512):
        super().__init__()
        torch.manual_seed(0)
        self.gate_proj, self.up_proj = (torch.nn.Linear(hidden, inner, bias=False) for _ in range(2))
        self.down_proj = torch.nn.Linear(inner, hidden, bias=False)
        self.product_read = product_read

    def forward(self, x):
        product = F.silu(self.gate_proj(x)) * self.up_proj(x)
        out = self.down_proj(product)
        return (out, product) if self.product_read else out


def quantized_and_reference(**kwargs):
    model = qbackend.quantize_weights(LlamaMLP(**kwargs).eval(), bits=4, group_size=128)
    reference = LlamaMLP(**kwargs).eval()
    reference.load_state_dict(model.state_dict())  # (the dequantized weights)
    return model, reference


class TestSwigluInTheGraph(expecttest.TestCase):
    @pytest.fixture(autouse=True)
    def _dense_from_16_rows(self, cache_dir, monkeypatch):
        monkeypatch.setattr(dense_weight_only, "_measured", simulated({"dtype": "bf16", "from": 16, "ms": {}})[1])

    def test_a_dense_mlp_becomes_one_call(self):
        model, reference = quantized_and_reference()
        x = torch.randn(1, 32, 256)
        actual, _, captured = compile_and_run(model, (x,), kernel_choice="measure")
        self.assertExpectedInline(short_graph(captured.lowered), """\
l_x_ = input
reshape_default = l_x_.reshape([-1, 256])
swiglu = dense_swiglu.swiglu(reshape_default, (16, 16, bfloat16, 4, <const>, <const>, <const>, 128), (16, 16, bfloat16, 4, <const>, <const>, <const>, 128))
unflatten_rows_2 = weight_only_linear.unflatten_rows(swiglu, l_x_)
return (unflatten_rows_2)""")
        assert "1 SwiGLU MLP(s) with dense gate / up and down linears run as one call" in str(captured.report)
        with torch.no_grad():
            assert_weight_only_close(actual, reference(x), "32 rows, dense bf16")

    def test_a_gated_product_read_elsewhere_keeps_the_calls_apart(self):
        model, reference = quantized_and_reference(product_read=True)
        x = torch.randn(1, 32, 256)
        (out, product), _, captured = compile_and_run(model, (x,), kernel_choice="measure")
        graph = short_graph(captured.lowered)
        assert "swiglu" not in graph and graph.count("kernel_or_dense") == 2 and "silu_mul.silu_mul(" in graph
        with torch.no_grad():
            expected_out, expected_product = reference(x)
        assert_weight_only_close(out, expected_out, "32 rows, dense bf16")
        assert_weight_only_close(product, expected_product, "32 rows, dense bf16")
