"""cleanup.fold_constants: what depends on constants only runs once, at compile time; a
folded value the graph writes into at run time is copied on every call (constant_writes.py)."""
import torch
import torch.nn as nn

from tests.helpers import Captured, assert_matches_reference, quantize

aten = torch.ops.aten


class PositionMask(nn.Module):
    """A transformer's mask prelude: positions from ``arange`` compared with the real lengths."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, lengths):
        positions = torch.arange(x.shape[1]).unsqueeze(0)  # [1, L]: the same every call
        keep = (positions < lengths.unsqueeze(1)).unsqueeze(-1)
        return self.fc(x) * keep


class WrittenZeros(nn.Module):
    """A ``zeros`` buffer the graph then writes into: it must be new on every call."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, lengths):
        totals = torch.zeros(x.shape[0], 16)
        totals[:, 0] += lengths.float()  # (an in-place write through a view of the zeros)
        return self.fc(x).sum(1) + totals


def _inputs(seed):
    torch.manual_seed(seed)
    return torch.randn(2, 8, 16), torch.randint(1, 9, (2,))


def test_a_mask_from_arange_is_built_at_compile_time():
    captured = assert_matches_reference(quantize(PositionMask().eval(), _inputs(0)), _inputs(0))
    targets = [n.target for n in captured.lowered.graph.nodes]
    assert aten.arange.default not in targets and aten.arange.start not in targets, captured.lowered.graph


def test_a_factory_written_in_place_is_copied_on_every_call():
    model = quantize(WrittenZeros().eval(), _inputs(0))
    captured = Captured()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=captured)
    with torch.no_grad():
        for seed in (0, 1, 1):  # (one compiled graph: a shared buffer would keep the lengths of the calls before)
            inputs = _inputs(seed)
            torch.testing.assert_close(compiled(*inputs)[:, 0], model(*inputs)[:, 0], atol=0.1, rtol=0)
    assert "constant _folded_zeros, _folded_select copied on every call: add_.Tensor writes into it at run time" \
        in captured.report.notes, str(captured.report)
