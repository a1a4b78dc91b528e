"""``F.normalize(x, dim=-1)`` as one call (qbackend/passes/l2_normalize.py): torch's values within the
norm's rounding on the strided head views attention reads, and the graphs it rewrites."""
import pytest
import torch
import torch.nn.functional as F

from qbackend.kernels import l2_normalize

from tests.helpers import assert_matches_reference, needs_own_kernels, quantize
from tests.kernels.test_attention import ShiftedWindowAttention
from tests.tolerances import TOLERANCE


def _heads(length, head_dim, seed=0):
    """Queries as Swin splits its merged projection: [B, H, L, D] views, no run of rows evenly strided."""
    projection = torch.randn(2, length, 3, 4, head_dim, generator=torch.Generator().manual_seed(seed)) * 3
    return projection.permute(2, 0, 3, 1, 4)[0]


@needs_own_kernels
@pytest.mark.parametrize("shape", [(49, 32), (5, 13), (1, 7)], ids=["Swin V2's windows", "a tail", "shorter than a vector"])
def test_kernel_matches_torch_on_strided_heads(shape):
    q = _heads(*shape)
    assert not q.is_contiguous()
    actual = l2_normalize.l2_normalize(q, 1e-12)
    torch.testing.assert_close(actual, F.normalize(q, dim=-1), **TOLERANCE["l2_normalize"])
    assert actual.is_contiguous()


@needs_own_kernels
def test_zero_nan_and_infinite_rows_as_torch():
    x = torch.tensor([[0.0] * 9, [float("nan")] + [1.0] * 8, [float("inf")] + [1.0] * 8, [1e-30] * 9, [3.0, -4.0] + [0.0] * 7])
    actual, expected = l2_normalize.l2_normalize(x, 1e-6), F.normalize(x, dim=-1, eps=1e-6)
    assert torch.equal(actual.isnan(), expected.isnan()), (actual, expected)
    torch.testing.assert_close(actual.nan_to_num(), expected.nan_to_num(), **TOLERANCE["l2_normalize"])


@pytest.mark.parametrize("x", [torch.randn(4, 8, dtype=torch.float64), torch.randn(2, 2, 2, 3, 8), torch.randn(8, 4).t()],
                         ids=["float64", "rank 5", "last dim not contiguous"])
def test_what_the_kernel_does_not_take_runs_torchs_ops(x):
    torch.testing.assert_close(l2_normalize.l2_normalize(x, 1e-12), F.normalize(x, dim=-1))


def test_swin_v2_queries_and_keys_are_normalized_by_one_call_each():
    inputs = (torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(0)),)
    captured = assert_matches_reference(quantize(ShiftedWindowAttention(cosine=True).eval(), inputs), inputs)
    targets = [n.target for n in captured.lowered.graph.nodes if n.op == "call_function"]
    expected_calls = 2 if l2_normalize.kernel() is not None else 0
    assert targets.count(l2_normalize.l2_normalize) == expected_calls, targets
    assert not expected_calls or torch.ops.aten.linalg_vector_norm.default not in targets, targets


class NormalizedLinear(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc, self.dim = torch.nn.Linear(32, 32), dim

    def forward(self, x):
        return F.normalize(self.fc(x), dim=self.dim)


@pytest.mark.parametrize("dim, fused", [(-1, True), (1, False)], ids=["over the last dim", "over another dim: left alone"])
def test_only_a_normalization_over_the_last_dim_is_rewritten(dim, fused):
    inputs = (torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1)),)
    captured = assert_matches_reference(quantize(NormalizedLinear(dim).eval(), inputs), inputs)
    targets = [n.target for n in captured.lowered.graph.nodes if n.op == "call_function"]
    assert (l2_normalize.l2_normalize in targets) == (fused and l2_normalize.kernel() is not None), targets
    assert (torch.ops.aten.linalg_vector_norm.default in targets) == (not fused or l2_normalize.kernel() is None), targets
