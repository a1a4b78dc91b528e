"""Writes whose results nobody reads survive dead-code elimination (qbackend/passes/dead_code.py): a
static KV cache's ``index_copy_`` update, ``x[i] = v``, ``x += v``. FX's own elimination treats
Tensor methods as pure and dropped them; the graphs then ran on stale values."""
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import Captured
from tests.tolerances import TOLERANCE


class StaticCacheStep(torch.nn.Module):
    """transformers' StaticCache update (index_copy_ into preallocated keys / values), then
    attention over the whole cache with an additive mask for the rows not yet written."""

    def forward(self, q, k, v, cache_k, cache_v, positions, mask):
        cache_k.index_copy_(2, positions, k)
        cache_v.index_copy_(2, positions, v)
        return F.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=mask, scale=0.25)


class SetItemAndAdd(torch.nn.Module):
    def forward(self, x, buffer):
        buffer[:, 0] = x.sum(-1)
        buffer += 1
        return buffer * 2


def _inputs(module):
    generator = torch.Generator().manual_seed(0)
    if isinstance(module, StaticCacheStep):
        q, k, v = (torch.randn(1, 2, 3, 16, generator=generator) for _ in range(3))
        mask = torch.full((1, 1, 3, 8), float("-inf")).triu(1)  # (rows 0-2 see positions up to their own)
        return q, k, v, torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16), torch.arange(3), mask
    return torch.randn(4, 5, generator=generator), torch.zeros(4, 3)


@pytest.mark.parametrize("module", [StaticCacheStep(), SetItemAndAdd()], ids=["static cache", "setitem and +="])
def test_a_write_nobody_reads_still_happens(module):
    expected_inputs, actual_inputs = _inputs(module), _inputs(module)
    torch._dynamo.reset()
    with torch.no_grad():
        expected = module(*expected_inputs)
        actual = torch.compile(module, backend=Captured())(*actual_inputs)
    torch.testing.assert_close(actual, expected, **TOLERANCE["attention_f32"])
    for got, want in zip(actual_inputs, expected_inputs):
        assert torch.equal(got, want), "the compiled graph left an input unwritten"
