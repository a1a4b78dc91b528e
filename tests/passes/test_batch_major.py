"""Linears in the row order their neighbours keep (qbackend/passes/batch_major.py): a batch-first
MultiheadAttention runs on [B, L] rows, bit-identical, without the row copies of its
transposes."""
import copy

import pytest
import torch
from expecttest import assert_expected_inline
from torch import nn

from qbackend.passes.batch_major import linears_in_row_order

from tests.helpers import assert_matches_reference, dynamo_graph, quantize, short_graph
from tests.kernels.test_attention import TorchMultiheadAttention


def _rewritten(module, inputs):
    """(note, the rewritten graph, its output, the Dynamo graph's output)"""
    gm, example_inputs = dynamo_graph(module, inputs)
    work = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    note = linears_in_row_order(work)
    work.recompile()
    with torch.no_grad():
        return note, work, work(*example_inputs), gm(*example_inputs)


def _lines_between(gm, first: str, last: str) -> str:
    """The graph's lines from the first holding ``first`` to the first after it holding ``last``."""
    lines = short_graph(gm).splitlines()
    start = next(i for i, line in enumerate(lines) if first in line)
    end = next(i for i, line in enumerate(lines) if i > start and last in line)
    return "\n".join(lines[start:end + 1])


def test_batch_first_attention_runs_on_batch_major_rows():
    """The in-projection reads the LayerNorm's rows as they are (its transpose now after it,
    read only by the head split), the out-projection reads the attention output as [B, L, E]
    and its result is the residual add's operand itself: no transpose back."""
    torch.manual_seed(0)
    inputs = (torch.randn(3, 10, 32),)
    note, work, actual, expected = _rewritten(quantize(TorchMultiheadAttention().eval(), inputs, every_linear=False), inputs)
    assert note == ("1 linear(s) read their rows untransposed, 1 write theirs in the order read after them "
                    "(batch-first MultiheadAttention: no row copies around attention)")
    assert torch.equal(actual[0], expected[0])
    assert_expected_inline(_lines_between(work, "aten.layer_norm", "add ="), """\
layer_norm = aten.layer_norm(l_x_, [32], <const>, <const>, 1e-05, False)
linear_default = aten.linear(layer_norm, <const>, <const>)
transpose_int = aten.transpose.int(linear_default, 1, 0)
unflatten = aten.unflatten.int(transpose_int, -1, [3, 32])
unsqueeze = aten.unsqueeze(unflatten, 0)
transpose_1 = aten.transpose.int(unsqueeze, 0, -2)
squeeze = aten.squeeze.dim(transpose_1, -2)
contiguous = aten.contiguous(squeeze)
select = aten.select.int(contiguous, 0, 0)
select_1 = aten.select.int(contiguous, 0, 1)
select_2 = aten.select.int(contiguous, 0, 2)
view = aten.view(select, [10, 6, 16])
transpose_2 = aten.transpose.int(view, 0, 1)
view_1 = aten.view(select_1, [10, 6, 16])
transpose_3 = aten.transpose.int(view_1, 0, 1)
view_2 = aten.view(select_2, [10, 6, 16])
transpose_4 = aten.transpose.int(view_2, 0, 1)
view_3 = aten.view(transpose_2, [3, 2, 10, 16])
view_4 = aten.view(transpose_3, [3, 2, 10, 16])
view_5 = aten.view(transpose_4, [3, 2, 10, 16])
scaled_dot_product_attention = aten.scaled_dot_product_attention(view_3, view_4, view_5)
permute_default = aten.permute(scaled_dot_product_attention, [0, 2, 1, 3])
reshape_default = aten.reshape(permute_default, [3, 10, 32])
linear_default_1 = aten.linear(reshape_default, <const>, <const>)
add = aten.add.Tensor(linear_default_1, l_x_)""")


class TransposedLinearReadByRelu(nn.Module):
    """A linear of transposed rows whose result an elementwise op reads (not attention)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return torch.relu(self.fc(x.transpose(0, 1)))


class RowsKeptInOrder(nn.Module):
    """A linear whose result views only reshape (the rows come out in the order read)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return self.fc(x.transpose(1, 2).reshape(3, 10, 32)).reshape(30, 32)


class ColumnsPermutedInRows(nn.Module):
    """A linear of L-major rows whose result views put the rows back B-major but also permute
    the columns inside each row: no order of the rows read gives that."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 12)

    def forward(self, x):
        y = self.fc(x.transpose(0, 1).reshape(-1, 12))
        return y.view(4, 3, 2, 6).permute(1, 0, 3, 2).reshape(3, 4, 12)


@pytest.mark.parametrize("example", [
    (lambda: (TransposedLinearReadByRelu(), (torch.randn(3, 10, 32),))),
    (lambda: (RowsKeptInOrder(), (torch.randn(3, 32, 10),))),
    (lambda: (ColumnsPermutedInRows(), (torch.randn(3, 4, 12),))),
], ids=["result read by an elementwise op", "rows already in order", "columns permuted inside the rows"])
def test_near_misses_are_left_as_they_are(example):
    torch.manual_seed(0)
    module, inputs = example()
    gm, _ = dynamo_graph(quantize(module.eval(), inputs, every_linear=True), inputs)
    work = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    assert linears_in_row_order(work) is None
    assert short_graph(work) == short_graph(gm)


@pytest.mark.parametrize("batch_first, batch", [(True, 3), (True, 1), (False, 3)],
                         ids=["batch first", "batch first, batch of 1", "length first"])
def test_quantized_out_projection_of_batch_first_attention_adds_the_residual(batch_first, batch):
    """Every linear int8 (``every_linear``): batch first, the out-projection adds the residual
    in its epilogue (the add had read its transposed result; at batch 1 the transposes move
    no rows, yet they hid the result from the add); length first, the graph has no transposes
    to move."""
    torch.manual_seed(0)
    inputs = (torch.randn(batch, 10, 32) if batch_first else torch.randn(10, batch, 32),)
    captured = assert_matches_reference(quantize(TorchMultiheadAttention(batch_first=batch_first).eval(), inputs, every_linear=True), inputs)
    fused_adds = [d.line() for d in captured.report.decisions if d.rule == "qlinear_add"]
    assert len(fused_adds) == (1 if batch_first else 0), str(captured.report)
    if batch_first:
        assert not [n for n in captured.lowered.graph.nodes if n.target is torch.ops.aten.add.Tensor], captured.lowered.graph
    assert any("in the order read after them" in note for note in captured.report.notes) == batch_first


def test_columns_permuted_inside_the_rows_keep_their_place():
    """End to end: the permute inside the rows stays (the rewrite had dropped it: values up to
    2.7 off the reference)."""
    torch.manual_seed(0)
    inputs = (torch.randn(3, 4, 12),)
    assert_matches_reference(quantize(ColumnsPermutedInRows().eval(), inputs, every_linear=True), inputs)
