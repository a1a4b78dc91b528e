"""A chain of views that only restores row-major order runs as one reshape; any other chain,
or one whose tensors an op writes into, stays as it was."""
import expecttest
import torch
from torch.fx import Graph, GraphModule

from qbackend.passes.view_chains import view_chains_collapsed

from tests.helpers import short_graph

aten = torch.ops.aten
HEADS_MERGED = [(aten.transpose.int, 1, 2), (aten.reshape.default, [2, -1, 5, 4]), (aten.transpose.int, 1, 2),
                (aten.reshape.default, [2, 5, 12])]  # attention's [B, L, H, D] output, seen as heads, merged again
HEADS_SPLIT = [(aten.transpose.int, 1, 2), (aten.reshape.default, [2, 3, 20])]  # the values move


def chain_graph(views, write_input=False) -> GraphModule:
    """x -> views -> * 2, with example values as Dynamo records them; ``write_input``: x.add_(1)
    after the chain."""
    graph, value = Graph(), torch.randn(2, 5, 3, 4)
    node = x = graph.placeholder("x")
    x.meta["example_value"] = value
    for target, *args in views:
        node = graph.call_function(target, (node, *args))
        value = node.meta["example_value"] = target(value, *args)
    if write_input:
        graph.call_function(aten.add_.Tensor, (x, 1))
    graph.output(graph.call_function(aten.mul.Tensor, (node, 2)))
    return GraphModule(torch.nn.Module(), graph)


def collapsed(views, write_input=False):
    gm, reference = chain_graph(views, write_input), chain_graph(views, write_input)
    note = view_chains_collapsed(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    x = torch.randn(2, 5, 3, 4)
    torch.testing.assert_close(gm(x.clone()), reference(x.clone()), rtol=0, atol=0)
    return note, short_graph(gm)


class TestViewChains(expecttest.TestCase):
    def test_a_chain_back_to_row_major_order_is_one_reshape(self):
        note, graph = collapsed(HEADS_MERGED)
        self.assertEqual(note, "4 view op(s) folded into reshapes")
        self.assertExpectedInline(graph, """\
x = input
reshape_default_2 = aten.reshape(x, [2, 5, 12])
mul_tensor = aten.mul.Tensor(reshape_default_2, 2)
return mul_tensor""")

    def test_a_chain_that_moves_values_stays(self):
        note, graph = collapsed(HEADS_SPLIT)
        self.assertIsNone(note)
        self.assertExpectedInline(graph, """\
x = input
transpose_int = aten.transpose.int(x, 1, 2)
reshape_default = aten.reshape(transpose_int, [2, 3, 20])
mul_tensor = aten.mul.Tensor(reshape_default, 2)
return mul_tensor""")

    def test_a_chain_over_a_tensor_written_in_place_stays(self):
        note, graph = collapsed(HEADS_MERGED, write_input=True)
        self.assertIsNone(note)
        self.assertExpectedInline(graph, """\
x = input
transpose_int = aten.transpose.int(x, 1, 2)
reshape_default = aten.reshape(transpose_int, [2, -1, 5, 4])
transpose_int_1 = aten.transpose.int(reshape_default, 1, 2)
reshape_default_1 = aten.reshape(transpose_int_1, [2, 5, 12])
add__tensor = aten.add_.Tensor(x, 1)
mul_tensor = aten.mul.Tensor(reshape_default_1, 2)
return mul_tensor""")
