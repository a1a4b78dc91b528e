"""graph_constants.constant_value: the tensor behind a get_attr node, flat or dotted."""
import torch
import torch.fx

from qbackend.graph_constants import constant_value, set_constant


class Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.inner(x)


def _get_attr(gm: torch.fx.GraphModule, target: str) -> torch.fx.Node:
    return next(node for node in gm.graph.nodes if node.op == "get_attr" and node.target == target)


def test_a_dotted_target_is_followed_through_its_submodules():
    gm = torch.fx.symbolic_trace(Holder())
    gm.graph.get_attr("inner.weight")  # (symbolic_trace calls the Linear as a module: add the read)
    assert constant_value(gm, _get_attr(gm, "inner.weight")) is gm.inner.weight


def test_a_flat_constant_is_found_and_anything_else_is_none():
    gm = torch.fx.symbolic_trace(Holder())
    value = torch.ones(2)
    set_constant(gm, "_qb_frozen_0", value)
    flat = gm.graph.get_attr("_qb_frozen_0")
    missing = gm.graph.get_attr("inner.no_such")  # (FX warns: no such attribute)
    module = gm.graph.get_attr("inner")  # (a module, not a tensor)
    placeholder = next(node for node in gm.graph.nodes if node.op == "placeholder")
    assert constant_value(gm, flat) is value
    assert constant_value(gm, missing) is None
    assert constant_value(gm, module) is None
    assert constant_value(gm, placeholder) is None
    assert constant_value(gm, 3) is None
