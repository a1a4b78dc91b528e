"""A tensor the graph builds by writing fixed values into a fresh one (Swin's window mask) is
folded at compile time with the ops that read it (qbackend/passes/constant_fills.py); a write of a
value known only at run time, or a fresh tensor the graph returns, keeps the graph's ops. (On
the ATen graphs of converted PT2E models, where Swin's mask appears.)"""
import pytest
import torch
import torch.nn as nn

from tests.helpers import assert_matches_reference, chained_convs, quantize, short_graph


class RegionMask(nn.Module):
    """Swin's shifted-window mask: regions of a fresh [8, 8] tensor numbered by ``fill_``
    through slices, then -100 where two positions' regions differ; ``runtime_fill`` also writes
    a value of the input into it, ``returned`` returns the fresh tensor too."""

    def __init__(self, runtime_fill=False, returned=False):
        super().__init__()
        self.runtime_fill, self.returned = runtime_fill, returned
        self.linear = nn.Linear(64, 64)

    def forward(self, x):
        regions = x.new_zeros((8, 8))
        count = 0
        for rows in (slice(0, 4), slice(4, 6), slice(6, None)):
            for cols in (slice(0, 4), slice(4, None)):
                regions[rows, cols] = count
                count += 1
        if self.runtime_fill:
            regions[0, 0] = x.sum()
        flat = regions.view(-1)
        diff = flat.unsqueeze(0) - flat.unsqueeze(1)
        mask = diff.masked_fill(diff != 0, -100.0).masked_fill(diff == 0, 0.0)
        out = torch.softmax(self.linear(x) + mask, dim=-1)
        return (out, regions) if self.returned else out


def _ops(captured) -> str:
    return short_graph(captured.lowered)


def _converted(module, x):
    return quantize(module.eval(), (x,))


def test_the_mask_folds_into_one_constant():
    x = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(0))
    captured = assert_matches_reference(_converted(RegionMask(), x), (x,))
    graph = _ops(captured)
    assert "new_zeros" not in graph and "fill_" not in graph and "masked_fill" not in graph, graph
    with torch.no_grad():  # (a second call: the folded constant unchanged)
        first, second = (captured.lowered(x)[0] for _ in range(2))
    assert torch.equal(first, second)


@pytest.mark.parametrize("module", [RegionMask(runtime_fill=True), RegionMask(returned=True)],
                         ids=["a value of the input written into it", "the fresh tensor returned"])
def test_what_may_change_between_calls_keeps_the_graphs_ops(module):
    model = _converted(module, torch.randn(2, 64, 64))
    for seed in range(2):
        x = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(seed))
        assert "new_zeros" in _ops(assert_matches_reference(model, (x,)))


class ConstantMLPBias(nn.Module):
    """Swin V2's continuous position bias: an MLP of a constant table, added to the scores (here
    to a linear's output)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(16, 8, generator=torch.Generator().manual_seed(1)))
        self.mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return self.linear(x) + 16 * torch.sigmoid(self.mlp(self.table))


def test_own_kernel_calls_on_constants_fold_with_what_reads_them():
    from qbackend.kernels import registry

    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0))
    captured = assert_matches_reference(_converted(ConstantMLPBias(), x), (x,))
    kernels = [n for n in captured.lowered.graph.nodes if n.target in registry.PLAIN.values()
               or "qlinear" in str(n.target) or "sigmoid" in str(n.target)]
    assert len(kernels) + len(chained_convs(captured.lowered)) == 1, short_graph(captured.lowered)  # (x's linear alone)
