"""qbackend.runtime.runnable: the callable the backend returns calls each op's C++ entry point."""
import inspect
import operator

import torch
import torch.nn as nn

import qbackend

from qbackend.pipeline.backend import Options, compile_graph
from qbackend.runtime.runnable import direct_calls
from qbackend.runtime.stack_room import StackRoom

from tests.helpers import quantize
from tests.tolerances import assert_outputs_close

aten = torch.ops.aten


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = torch.relu(self.conv(x)).mean((2, 3))
        return self.fc(y).reshape(2, 2, 2).transpose(1, 2)


def test_the_returned_callable_runs_a_copy_without_op_overloads():
    # (numerics through this callable: every other test that compiles a model)
    inputs = (torch.randn(2, 3, 8, 8),)
    converted = quantize(Block().eval(), inputs)
    returned = []

    def backend(gm, example_inputs):
        runner, _, lowered = compile_graph(gm, example_inputs, Options())
        returned.append((runner, lowered))
        return runner

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(converted, backend=backend)(*inputs)
    (room, lowered), = returned
    assert isinstance(room, StackRoom)
    copy = inspect.getclosurevars(room.fn).nonlocals["graph"].__self__  # (the forward behind the input filter)
    assert [n for n in lowered.graph.nodes if isinstance(n.target, torch._ops.OpOverload)], \
        "the lowered graph the report and tests read keeps its op overloads"
    assert not [n for n in copy.graph.nodes if isinstance(n.target, torch._ops.OpOverload)]
    assert "torch.ops." in lowered.code and "torch.ops." not in copy.code
    assert [n.name for n in copy.graph.nodes] == [n.name for n in lowered.graph.nodes]


def test_direct_calls_pass_keyword_arguments_and_share_constants():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    weight = graph.get_attr("weight")
    total = graph.call_function(aten.sum.dim_IntList, (x, [1]), {"keepdim": True})
    scaled = graph.call_function(aten.mul.Tensor, (total, weight))
    first = graph.call_function(operator.getitem, (graph.call_function(aten.split.Tensor, (scaled, 1)), 0))
    graph.output(first)
    root = nn.Module()
    root.weight = torch.tensor(3.0)
    gm = torch.fx.GraphModule(root, graph)
    copy = direct_calls(gm)
    value = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(copy(value), gm(value))
    assert copy.weight is gm.weight
    assert operator.getitem in [n.target for n in copy.graph.nodes]  # (not an op overload: kept)


def test_an_input_that_requires_grad_runs_as_in_eager():
    """#20: oneDNN's in-place sum into a LayerNorm output that autograd recorded raised "cannot
    resize variables that require grad"; the lowered graph runs with grad mode off."""
    from qbackend import models

    model = models.bert_encoder_like(num_layers=1).eval()
    inputs = models.example_inputs("bert_encoder_like", 1)
    converted = quantize(model, inputs)
    x = inputs[0].clone().requires_grad_(True)
    with torch.no_grad():
        expected = converted(inputs[0])
    torch._dynamo.reset()
    for compiled in (qbackend.compile(converted), torch.compile(converted, backend="qbackend")):
        assert torch.is_grad_enabled()
        assert_outputs_close(compiled(x), expected, "input requiring grad")
