"""Calls of a compiled model do not change each other (qbackend/passes/constant_writes.py): a graph
that writes in place into a value made of constants (T5's relative position buckets) has the
write folded with it, or the value copied on every call; a model tensor the graph writes into
is its state, updated and read as eager does. Through both paths, three calls each."""
import copy
import math

import expecttest
import pytest
import torch
import torch.nn as nn

import qbackend
from qbackend.pipeline.cleanup import fold_constants
from qbackend.passes.dead_code import eliminate_dead_code
from qbackend.pipeline.direct import _frozen_copy

from tests.helpers import quantize, short_graph
from tests.tolerances import assert_outputs_close

PATHS = ("torch.compile", "qbackend.compile")


class RelativePositionBias(nn.Module):
    """T5's bidirectional relative position buckets (transformers'
    ``T5Attention._relative_position_bucket``): ``buckets = 0; buckets += ...`` then
    ``buckets += torch.where(...)``, in place on a value made from ``arange``, looked up in an
    embedding and added to the scores (here a linear's output). ``shift``: the buckets then also
    move by a value of the input (written at run time); ``returned``: the buckets are returned."""

    def __init__(self, length=8, buckets=8, max_distance=16, shift=False, returned=False):
        super().__init__()
        self.buckets, self.max_distance, self.shift, self.returned = buckets, max_distance, shift, returned
        self.table = nn.Embedding(buckets + 1, 1)
        self.linear = nn.Linear(length, length)

    def forward(self, x):
        length = x.shape[-1]
        relative = torch.arange(length)[None, :] - torch.arange(length)[:, None]
        half = self.buckets // 2
        buckets = 0
        buckets += (relative > 0).to(torch.long) * half
        relative = torch.abs(relative)
        exact = half // 2
        large = exact + (torch.log(relative.float() / exact) / math.log(self.max_distance / exact) * (half - exact)).to(torch.long)
        large = torch.min(large, torch.full_like(large, half - 1))
        buckets += torch.where(relative < exact, relative, large)
        if self.shift:
            buckets += (x.amax() > 0).long()
        out = self.linear(x) + self.table(buckets).squeeze(-1)
        return (out, buckets) if self.returned else out


class StepCounter(nn.Module):
    """A buffer the model updates through a view of it (export: ``slice`` then ``add_``) and
    then reads: its state, not a constant."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(2))
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        first = self.steps[:1]
        first += 1
        return self.linear(x), self.steps * 2


def _x(seed=0):
    return torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(seed))


def _compiled(model, path, reports):
    torch._dynamo.reset()
    options = {"report_sink": reports.append}
    return torch.compile(model, backend="qbackend", options=options) if path == "torch.compile" else qbackend.compile(model, options)


def _three_calls(module, path):
    """(the converted model's output, three compiled calls' outputs on the same input, the notes)."""
    x = _x()
    model = quantize(module.eval(), (x,))
    reports = []
    compiled = _compiled(model, path, reports)
    with torch.no_grad():
        expected = model(x)
        calls = [compiled(x) for _ in range(3)]
    return expected, calls, [note for report in reports for note in report.notes]


@pytest.mark.parametrize("path", PATHS)
def test_buckets_written_in_place_fold_with_their_lookup(path):
    """The second call raised ``IndexError: index out of range in self`` in the embedding:
    ``add_`` had moved the folded buckets again."""
    expected, calls, notes = _three_calls(RelativePositionBias(), path)
    assert_outputs_close(calls[0], expected, "RelativePositionBias")
    assert all(torch.equal(call, calls[0]) for call in calls[1:])
    assert not [n for n in notes if "copied" in n], notes


@pytest.mark.parametrize("path", PATHS)
def test_buckets_written_at_run_time_are_copied_on_every_call(path):
    expected, calls, notes = _three_calls(RelativePositionBias(shift=True), path)
    assert_outputs_close(calls[0], expected, "RelativePositionBias")
    assert all(torch.equal(call, calls[0]) for call in calls[1:])
    assert "constant _folded_add copied on every call: add_.Tensor writes into it at run time" in notes, notes


@pytest.mark.parametrize("path", PATHS)
def test_a_returned_constant_is_the_callers_to_change(path):
    x = _x()
    model = quantize(RelativePositionBias(returned=True).eval(), (x,))
    reports = []
    compiled = _compiled(model, path, reports)
    with torch.no_grad():
        expected = model(x)[1].clone()
        for _ in range(3):
            buckets = compiled(x)[1]
            assert torch.equal(buckets, expected)
            buckets += 100  # (the caller's tensor: the next call's is another)
    assert "constant _folded_add copied on every call: the graph returns it" in reports[0].notes, str(reports[0])


@pytest.mark.parametrize("path", PATHS)
def test_a_buffer_written_through_a_view_is_the_models_state(path):
    """Folded at compile time, the buffer's reader gave its first value while each call
    added 1 to the buffer."""
    x = _x()
    model = quantize(StepCounter().eval(), (x,))
    reference = copy.deepcopy(model)
    compiled = _compiled(model, path, [])
    with torch.no_grad():
        for _ in range(3):
            (out, steps), (expected, expected_steps) = compiled(x), reference(x)
            assert_outputs_close(out, expected, "StepCounter")
            assert torch.equal(steps, expected_steps), (steps, expected_steps)
    assert torch.equal(model.steps, reference.steps)


def test_a_write_through_out_is_a_write():
    """``out=`` is a keyword argument: the schema marks it written all the same."""
    graph = torch.fx.Graph()
    x, table = graph.placeholder("x"), graph.get_attr("table")
    doubled = graph.call_function(torch.ops.aten.mul.Tensor, (table, 2))
    graph.output((graph.call_function(torch.ops.aten.add.out, (x, 1), {"out": doubled}),))
    root = torch.nn.Module()
    root.register_buffer("table", torch.arange(4.0))
    gm = torch.fx.GraphModule(root, graph)
    assert fold_constants(gm) == ["constant _folded_mul_tensor copied on every call: add.out writes into it at run time"]
    gm.recompile()
    for seed in range(3):
        x = _x(seed)[0, 0, :4]
        out = gm(x)[0]
        assert torch.equal(out, x + 1)
        out.zero_()  # (the caller's)
    assert torch.equal(gm._folded_mul_tensor, torch.arange(4.0) * 2)


class TestFoldedGraphs(expecttest.TestCase):
    def _folded(self, module, notes_expected) -> str:
        """The graph fold_constants leaves of the float module's export, whose three calls
        give the module's output."""
        x = _x()
        gm = _frozen_copy(torch.export.export(module.eval(), (x,)).module())  # (as qbackend.compile lowers it)
        self.assertEqual(fold_constants(gm), notes_expected)
        eliminate_dead_code(gm)
        gm.recompile()
        with torch.no_grad():
            expected = module(x)
            for _ in range(3):
                torch.testing.assert_close(gm(x)[0], expected)  # (outputs flat)
        return short_graph(gm)

    def test_the_buckets_and_their_lookup_fold_into_one_constant(self):
        self.assertExpectedInline(self._folded(RelativePositionBias(), []), """\
x = input
linear = aten.linear(x, <const>, <const>)
add_2 = aten.add.Tensor(linear, <const>)
return (add_2)""")

    def test_a_write_of_a_value_of_the_input_runs_on_a_copy(self):
        notes = ["constant _folded_add copied on every call: add_.Tensor writes into it at run time"]
        self.assertExpectedInline(self._folded(RelativePositionBias(shift=True), notes), """\
x = input
amax = aten.amax(x)
gt_1 = aten.gt.Scalar(amax, 0)
_assert_tensor_metadata_default_3 = aten._assert_tensor_metadata(gt_1, dtype=bool, device=device(type='cpu'), layout=torch.strided)
to_3 = aten.to.dtype(gt_1, int64)
clone_default = aten.clone(<const>)
add__1 = aten.add_.Tensor(clone_default, to_3)
linear = aten.linear(x, <const>, <const>)
embedding = aten.embedding(<const>, add__1)
squeeze = aten.squeeze.dim(embedding, -1)
add_2 = aten.add.Tensor(linear, squeeze)
return (add_2)""")
