"""Llama's RMSNorm, and the residual add before it, as one call (qbackend/llm/rms_norm.py): the
graph's values (the mean of squares summed in another order), the chains it rewrites, and the
near misses it leaves as they are."""
import re

import expecttest
import pytest
import torch

from qbackend.kernels import rms_norm

from tests.helpers import lowered_lines, needs_own_kernels
from tests.tolerances import TOLERANCE, assert_outputs_close


class LlamaRMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm, op for op."""

    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.weight, self.variance_epsilon = torch.nn.Parameter(torch.randn(width)), eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _reference(x, weight, eps):
    """LlamaRMSNorm's ops without its casts to float32 (no-ops on the float32 rows the graph
    rewrite takes)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@needs_own_kernels
@pytest.mark.parametrize("shape", [(1, 1, 2048), (64, 40), (3, 13), (2, 5, 7)], ids=["decode row", "rows in parallel", "a tail", "3-D"])
def test_kernel_matches_the_graphs_ops(shape):
    generator = torch.Generator().manual_seed(len(shape))
    a, b = (torch.randn(shape, generator=generator) * 3 for _ in range(2))
    weight = torch.randn(shape[-1], generator=generator)
    torch.testing.assert_close(rms_norm.rms_norm(a, weight, 1e-6), _reference(a, weight, 1e-6), **TOLERANCE["rms_norm"])
    total, normed = rms_norm.add_rms_norm(a, b, weight, 1e-5)
    assert torch.equal(total, a + b)
    torch.testing.assert_close(normed, _reference(a + b, weight, 1e-5), **TOLERANCE["rms_norm"])


@needs_own_kernels
def test_a_nan_or_infinity_spreads_over_its_row_as_in_the_graph():
    x = torch.randn(3, 32)
    x[0, 5], x[1, 7] = float("nan"), float("inf")
    actual, expected = rms_norm.rms_norm(x, torch.ones(32), 1e-6), _reference(x, torch.ones(32), 1e-6)
    assert torch.equal(actual.isnan(), expected.isnan()) and actual[0].isnan().all() and actual[1].isnan().any()
    torch.testing.assert_close(actual[2], expected[2], **TOLERANCE["rms_norm"])


@pytest.mark.parametrize("x, weight", [
    (torch.randn(2, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)),  # not float32
    (torch.randn(2, 8), torch.randn(2, 8)),  # a 2-D weight
    (torch.randn(2, 8), torch.randn(4)),  # broadcast by the graph's ops: [2, 8] * [4] raises there too
    (torch.randn(0, 8), torch.randn(8)),  # no rows
], ids=["float64", "2-D weight", "other width", "empty"])
def test_what_the_kernel_does_not_take_runs_the_graphs_ops(x, weight):
    try:
        expected = _reference(x, weight, 1e-6)
    except RuntimeError as error:
        with pytest.raises(RuntimeError, match=re.escape(str(error))):
            rms_norm.rms_norm(x, weight, 1e-6)
        return
    assert torch.equal(rms_norm.rms_norm(x, weight, 1e-6), expected)


class DecoderNorms(torch.nn.Module):
    """A decoder layer's norms: the input norm, the residual add and the norm after it, whose
    sum the next residual add reads."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.proj = LlamaRMSNorm(32), LlamaRMSNorm(32), torch.nn.Linear(32, 32)

    def forward(self, x):
        attended = self.proj(self.first(x))
        residual = x + attended
        return residual + self.proj(self.second(residual))


@needs_own_kernels
class TestRMSNormGraph(expecttest.TestCase):
    def test_norms_and_the_residual_add_become_calls(self):
        actual, expected, captured, lines = lowered_lines(DecoderNorms(), (torch.randn(1, 3, 32),), "norm", "getitem")
        assert_outputs_close(actual, expected)  # (a norm's 1-ulp differences pass through a linear)
        self.assertExpectedInline(lines, """\
rms_norm = rms_norm.rms_norm(l_x_, <const>, 1e-06)
attended = _nn.linear(rms_norm, <const>, <const>)
add_rms_norm = rms_norm.add_rms_norm(l_x_, attended, <const>, 1e-06)
getitem = _operator.getitem(add_rms_norm, 0)
getitem_1 = _operator.getitem(add_rms_norm, 1)
linear_1 = _nn.linear(getitem_1, <const>, <const>)
add_3 = _operator.add(getitem, linear_1)""")
        assert "RMSNorm(s) in one pass (1 with the residual add before it)" in " ".join(captured.report.notes)

    def test_a_mean_over_another_dim_is_not_rmsnorm(self):
        class OtherDim(LlamaRMSNorm):
            def forward(self, hidden_states):
                return self.weight * (hidden_states * torch.rsqrt(hidden_states.pow(2).mean(0, keepdim=True) + 1e-6))

        actual, expected, _, lines = lowered_lines(OtherDim(32), (torch.randn(4, 32),), "rms_norm")
        assert torch.equal(actual, expected) and not lines
