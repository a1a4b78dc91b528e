"""A rotary embedding's cos / sin read from tables (qbackend/llm/rotary_table.py): the graph's
values bit for bit at any positions, the tables grown when a position passes them, and the
computations that depend on more than a position left alone."""
import threading

import expecttest
import torch
import torch.nn as nn

from qbackend.llm.rotary_table import RotaryTables

from tests.helpers import Captured, in_threads, short_graph


class RotaryEmbedding(nn.Module):
    """transformers' LlamaRotaryEmbedding.forward, with an attention_scaling."""

    def __init__(self, dim=64, scaling=1.0, cat_dim=-1):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)
        self.scaling, self.cat_dim = scaling, cat_dim

    def freqs(self, x, position_ids):
        return position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)

    def forward(self, x, position_ids):
        freqs = self.freqs(x, position_ids)
        emb = torch.cat((freqs, freqs), dim=self.cat_dim)
        cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class PerRowFrequencies(RotaryEmbedding):
    """A near miss: each position row has frequencies of its own (a constant as long as the
    positions), so a row depends on where it sits, not only on its position."""

    def __init__(self):
        super().__init__()
        self.register_buffer("row_freq", self.inv_freq * torch.arange(1, 4)[:, None], persistent=False)

    def freqs(self, x, position_ids):
        return position_ids[..., None].float() * self.row_freq


def _compiled(module, x, positions):
    torch._dynamo.reset()
    captured = Captured()
    return torch.compile(module, backend=captured), captured


def _tables(captured) -> list:
    """The table holders of a Captured's one graph, or of one of its (gm, inputs, lowered, report)."""
    lowered = captured.lowered if isinstance(captured, Captured) else captured[2]
    return [n.target for n in lowered.graph.nodes if isinstance(n.target, RotaryTables)]


class TestRotaryTables(expecttest.TestCase):
    def test_every_position_reads_the_graphs_values(self):
        module, x = RotaryEmbedding(scaling=0.7), torch.randn(1, 1, 64)
        compiled, captured = _compiled(module, x, None)
        sizes = []
        with torch.no_grad():
            for position in (5, 300, 1000, 2):  # (one graph: a decode step's shape)
                for actual, expected in zip(compiled(x, torch.tensor([[position]])), module(x, torch.tensor([[position]]))):
                    assert torch.equal(actual, expected), position
                sizes.append(_tables(captured)[0].tables[0].shape[0])
            assert sizes == [256, 512, 1024, 1024]  # (grown to the next power of two past a position)
            self.assertExpectedInline("\n".join(line for line in short_graph(captured.lowered).splitlines()
                                                if "rotary" in line or "getitem" in line or "return" in line), """\
rotary_tables = rotary_table.rotary_tables(l_position_ids_)
getitem_1 = _operator.getitem(rotary_tables, 0)
getitem_2 = _operator.getitem(rotary_tables, 1)
return (getitem_1, getitem_2)""")
            assert "1 rotary cos / sin computation(s) read from tables" in captured.report.notes
            for positions in (torch.arange(512)[None], torch.tensor([[2, 9], [40, 1]]), torch.tensor([[7]], dtype=torch.int32)):
                for actual, expected in zip(compiled(x, positions), module(x, positions)):
                    assert torch.equal(actual, expected), positions
        assert all(_tables(graph) for graph in captured.graphs)  # (a prefill's graph and the others too)

    def test_bf16_tables_hold_the_graphs_rounding(self):
        module, x = RotaryEmbedding(dim=32), torch.randn(1, 1, 32, dtype=torch.bfloat16)
        compiled, captured = _compiled(module, x, None)
        with torch.no_grad():
            for positions in (torch.tensor([[3]]), torch.arange(100)[None]):
                for actual, expected in zip(compiled(x, positions), module(x, positions)):
                    assert actual.dtype == torch.bfloat16 and torch.equal(actual, expected)

    def test_negative_or_far_positions_run_the_graphs_ops(self):
        module, x = RotaryEmbedding(), torch.randn(1, 1, 64)
        compiled, captured = _compiled(module, x, None)
        with torch.no_grad():
            compiled(x, torch.tensor([[4]]))
            for positions in (torch.tensor([[-3]]), torch.tensor([[-300]]), torch.tensor([[10 ** 7]])):  # (one graph; the
                # last one's table would pass MAX_TABLE_BYTES)
                for actual, expected in zip(compiled(x, positions), module(x, positions)):
                    assert torch.equal(actual, expected), positions
            assert _tables(captured)[0].tables[0].shape[0] == 256  # (not grown for them)
            positions = torch.tensor([[7, -1]])
            for actual, expected in zip(compiled(x, positions), module(x, positions)):
                assert torch.equal(actual, expected)

    def test_what_depends_on_more_than_a_position_is_computed(self):
        x = torch.randn(1, 3, 64)
        for module in (PerRowFrequencies(), RotaryEmbedding(cat_dim=-2)):
            compiled, captured = _compiled(module, x, None)
            positions = torch.tensor([[1, 2, 3]])
            with torch.no_grad():
                for actual, expected in zip(compiled(x, positions), module(x, positions)):
                    assert torch.equal(actual, expected)
            assert _tables(captured) == [] and not any("tables" in note for note in captured.report.notes)
            assert any(n.target == "cos" for n in captured.lowered.graph.nodes), type(module).__name__


def test_a_thread_that_tabulated_fewer_positions_keeps_the_larger_tables():
    """Two threads past the tables at once, to positions 10 and 300 (tables of 256 and 512
    rows); the one of 256 finishes last: the 512 rows stay (they had been replaced, so the
    next far position tabulated again), and each thread reads its positions' values."""
    def compute(positions):
        return (positions[..., None].float() * torch.arange(1.0, 9.0),)

    tables, near_waits, far_done = RotaryTables(compute, [(8,)], 32), threading.Event(), threading.Event()
    tabulated = tables._tabulated

    def held(count, dtype):  # (the near thread's rows come after the far thread's call)
        if count == 256:
            near_waits.set()
            far_done.wait(30)
        return tabulated(count, dtype)

    tables._tabulated = held
    positions = {"near": torch.tensor([[10]]), "far": torch.tensor([[300]])}

    def far():
        near_waits.wait(30)
        try:
            return tables(positions["far"])
        finally:
            far_done.set()

    results = in_threads([lambda: tables(positions["near"]), far], far_done.set)
    for (value,), where in zip(results, ("near", "far")):
        assert torch.equal(value, compute(positions[where])[0])
    assert tables.tables[0].shape[0] == 512
