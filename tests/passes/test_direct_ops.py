"""Python-level spellings rewritten to the one ATen call they make (qbackend/passes/direct_ops.py):
the graph after the rewrite, the same values at every position and token, and the calls
whose arguments make the wrapper do more (max_norm, a tensor offset) left as they are."""
import expecttest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers import Captured, short_graph


class Positions(nn.Module):
    """transformers' token embedding and position ids of a decode step: past length + arange."""

    def __init__(self, max_norm=None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(50, 8, generator=torch.Generator().manual_seed(0)), requires_grad=False)
        self.max_norm = max_norm

    def forward(self, ids, past):
        embedded = F.embedding(ids, self.weight, None, self.max_norm)
        positions = (torch.arange(ids.shape[1]) + past.shape[2]).unsqueeze(0)
        return embedded, positions


def _run(module, steps):
    torch._dynamo.reset()
    captured = Captured()
    compiled = torch.compile(module, backend=captured)
    with torch.no_grad():
        for ids, past in steps:
            expected = module(ids, past)
            actual = compiled(ids, past)
            for a, e in zip(actual, expected):
                assert a.dtype == e.dtype and torch.equal(a, e)
    return captured


def _lines(captured) -> str:
    """The last graph's (the decode steps' after the first: dynamic lengths)."""
    return "\n".join(line for line in short_graph(captured.graphs[-1][2]).splitlines()
                     if "embedding" in line or "arange" in line or "add" in line)


class TestDirectOps(expecttest.TestCase):
    def test_embedding_and_offset_arange_call_their_aten_ops(self):
        steps = [(torch.tensor([[3]]), torch.zeros(1, 2, length, 4)) for length in (5, 6, 7, 40)]
        captured = _run(Positions(), steps + [(torch.tensor([[49]]), torch.zeros(1, 2, 9, 4))])
        self.assertExpectedInline(_lines(captured), """\
embedded = torch.embedding(<const>, l_ids_)
add_1 = _operator.add(s93, 1)
add = torch.arange(s93, add_1)
positions = add.unsqueeze(0)""")
        assert "2 embedding / position op(s) called as their ATen op" in captured.graphs[-1][3].notes

    def test_max_norm_keeps_the_functional_and_an_out_of_range_token_still_raises(self):
        captured = _run(Positions(max_norm=1.0), [(torch.tensor([[3]]), torch.zeros(1, 2, n, 4)) for n in (5, 6)])
        assert "functional.embedding(l_ids_, <const>, None, 1)" in _lines(captured)  # (F.embedding renormalizes the weight rows it reads)
        compiled = torch.compile(Positions(), backend=Captured())
        with torch.no_grad(), self.assertRaises(IndexError):
            compiled(torch.tensor([[50]]), torch.zeros(1, 2, 5, 4))
