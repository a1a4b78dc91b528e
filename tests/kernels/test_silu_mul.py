"""SwiGLU's gate, silu(a) * b, as one call (qbackend/llm/silu_mul.py): torch's values within the
SiLU's rounding, the graphs it rewrites and those it leaves alone."""
import expecttest
import pytest
import torch
import torch.nn.functional as F

from qbackend.kernels import silu_mul

from tests.helpers import lowered_lines, needs_own_kernels
from tests.tolerances import TOLERANCE, assert_outputs_close


@needs_own_kernels
@pytest.mark.parametrize("rows, n", [(1, 5632), (40, 77), (3, 13)], ids=["decode row", "rows in parallel", "a tail"])
def test_kernel_matches_torch_on_slices_of_one_output(rows, n):
    merged = torch.randn(rows, 1, 2 * n, generator=torch.Generator().manual_seed(n)) * 4
    a, b = merged[..., :n], merged[..., n:]
    actual = silu_mul.silu_mul(a, b)
    torch.testing.assert_close(actual, F.silu(a) * b, **TOLERANCE["silu_mul"])
    assert actual.is_contiguous()


@needs_own_kernels
def test_nan_infinities_and_signed_zeros_as_torch():
    a = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 100.0, -100.0, 1e-30, 3.0] * 2)
    b = torch.ones_like(a).index_fill_(0, torch.tensor([9, 12]), -0.0)
    actual, expected = silu_mul.silu_mul(a, b), F.silu(a) * b
    numbers = ~expected.isnan()  # (a NaN's sign means nothing)
    assert torch.equal(actual.isnan(), expected.isnan()) and torch.equal(actual[numbers].signbit(), expected[numbers].signbit())
    torch.testing.assert_close(actual.nan_to_num(), expected.nan_to_num(), **TOLERANCE["silu_mul"])


@pytest.mark.parametrize("a, b", [
    (torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)),
    (torch.randn(4, 8), torch.randn(8)),  # broadcast
    (torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),) * 2,  # last dim not contiguous
    (torch.randn(4, 8).t(), torch.randn(8, 4)),
], ids=["float64", "broadcast", "channels last", "transposed"])
def test_what_the_kernel_does_not_take_runs_torchs_ops(a, b):
    actual, expected = silu_mul.silu_mul(a, b), F.silu(a) * b
    assert torch.equal(actual, expected) and actual.stride() == expected.stride()


class GatedMLP(torch.nn.Module):
    """transformers' LlamaMLP; ``silu_read``: the SiLU's output is also returned."""

    def __init__(self, silu_read=False):
        super().__init__()
        torch.manual_seed(0)
        self.gate_proj, self.up_proj, self.down_proj = (torch.nn.Linear(*shape) for shape in ((16, 32), (16, 32), (32, 16)))
        self.silu_read = silu_read

    def forward(self, x):
        gate = F.silu(self.gate_proj(x))
        out = self.down_proj(gate * self.up_proj(x))
        return (out, gate) if self.silu_read else out


def _compiled(module):
    return lowered_lines(module, (torch.randn(2, 5, 16),), "silu", "mul")


@needs_own_kernels
class TestSiluMulGraph(expecttest.TestCase):
    def test_the_gate_becomes_one_call(self):
        actual, expected, captured, lines = _compiled(GatedMLP())
        assert_outputs_close(actual, expected)
        self.assertExpectedInline(lines, """\
silu_mul = silu_mul.silu_mul(linear, linear_1)
out = _nn.linear(silu_mul, <const>, <const>)""")
        assert "1 SiLU-and-multiply(s) in one pass" in captured.report.notes

    def test_a_silu_read_elsewhere_stays(self):
        (out, gate), (expected_out, expected_gate), _, lines = _compiled(GatedMLP(silu_read=True))
        assert torch.equal(gate, expected_gate)
        self.assertExpectedInline(lines, """\
gate = functional.silu(linear)
mul = _operator.mul(gate, linear_1)
out = _nn.linear(mul, <const>, <const>)""")
