"""qbackend's add-and-quantize kernel (csrc/add_quantize.c): the float sum bit for bit and its
quantize as the reference's integers, in any layout of either operand; a residual sum with a
float reader and a quantized one lowers onto it."""
import pytest
import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)

from qbackend.kernels import add_quantize, choice_cache, registry
from qbackend.lowering import choice
from qbackend.patterns import examples

from tests.helpers import (assert_fused_into_quantize, assert_matches_reference, assert_one_chain_of_c_steps,
                           needs_own_kernels, quantize, short_graph, with_and_without_chains)
from tests.kernels.test_kernel_choice import SimulatedMachine

pytestmark = needs_own_kernels

LAYOUTS = {"contiguous": lambda t: t.contiguous(), "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
           "strided": lambda t: torch.cat([t, t], dim=3)[..., ::2]}


@pytest.mark.parametrize("a_layout", sorted(LAYOUTS))
@pytest.mark.parametrize("b_layout", sorted(LAYOUTS))
@pytest.mark.parametrize("qparams", [(0.02, 128, 0, 255), (0.05, 0, 0, 127)], ids=["full range", "7-bit"])
def test_sum_and_integers_are_the_references(a_layout, b_layout, qparams):
    torch.manual_seed(0)
    a, b = torch.randn(2, 13, 5, 7) * 3, torch.randn(2, 13, 5, 7)
    a.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
    a, b = LAYOUTS[a_layout](a), LAYOUTS[b_layout](b)
    expected_sum = a + b
    expected = torch.ops.quantized_decomposed.quantize_per_tensor(expected_sum, *qparams, torch.uint8)
    for q, total in (add_quantize.add_quantize(a, b, *qparams), registry.op("add_quantize")(a, b, *qparams)):
        torch.testing.assert_close(total, expected_sum, rtol=0, atol=0, equal_nan=True)
        # NaN: the reference casts NaN to uint8 (undefined in C, 0 here); the kernel gives qmin
        assert q.flatten()[0] == qparams[2] and torch.equal(q.flatten()[1:], expected.flatten()[1:])
        if a_layout != "strided":
            assert total.stride() == a.stride() and q.stride() == a.stride()  # (the next conv reads a's layout)


def test_a_residual_sum_read_as_float_and_quantized_lowers_onto_the_kernel():
    assert_fused_into_quantize(examples.residual_sum_quantized, "add_quantize", "aten.add", "1 float sum fused into its quantize")


def test_the_in_place_form_writes_the_sum_into_its_target():
    torch.manual_seed(0)
    a, b = torch.randn(2, 8, 5, 5).contiguous(memory_format=torch.channels_last), torch.randn(2, 8, 5, 5)
    expected_sum = a + b
    q = add_quantize.add_quantize_(a, b, 0.02, 128, 0, 255)
    assert torch.equal(a, expected_sum)
    assert torch.equal(q, torch.ops.quantized_decomposed.quantize_per_tensor(expected_sum, 0.02, 128, 0, 255, torch.uint8))


class InPlaceResidual(torch.nn.Module):
    """ConvNeXt's ``x = residual + layer_scale(x)`` written as torchvision's in-place form."""

    def __init__(self):
        super().__init__()
        self.branch, self.next = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 1)

    def forward(self, x):
        total = self.branch(x) * 0.5
        total += x
        return self.next(total), total


def test_an_in_place_residual_sum_lowers_onto_the_in_place_form():
    torch.manual_seed(0)
    inputs = (torch.randn(2, 8, 6, 6),)
    captured = assert_matches_reference(quantize(InPlaceResidual(), inputs), inputs)
    graph = short_graph(captured.lowered)
    assert "add_quantize.add_quantize_(" in graph and "aten.add" not in graph, graph


class ViewedInPlaceResidual(torch.nn.Module):
    """ConvNeXt's later stages: the add writes into a view (permute) of a view (reshape) of the
    branch's linear output."""

    def __init__(self):
        super().__init__()
        self.fc, self.next = torch.nn.Linear(8, 8), torch.nn.Conv2d(8, 8, 1)

    def forward(self, x):
        total = self.fc(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        total += x
        return self.next(total), total


def test_an_in_place_sum_into_a_chain_of_views_lowers_onto_the_in_place_form(tmp_path, monkeypatch):
    """(the own GEMM measured faster, as on ConvNeXt's later stages: it runs the linear on
    rows, so its output is reshaped back, then permuted)"""
    monkeypatch.setenv("QBACKEND_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(choice_cache, "_shared", None)
    monkeypatch.setattr(choice, "measure", SimulatedMachine(own_us=100, onednn_us=300))
    torch.manual_seed(0)
    inputs = (torch.randn(2, 8, 6, 6),)
    captured = assert_matches_reference(quantize(ViewedInPlaceResidual(), inputs), inputs, kernel_choice="measure")
    graph = short_graph(captured.lowered)
    assert "conv_gemm.qconv(reshape" in graph and "add_quantize.add_quantize_(permute" in graph and "aten.add" not in graph, graph


class TwoViewedInPlaceResiduals(torch.nn.Module):
    """Two ConvNeXt blocks' ends: each sum written into a view of its linear's output, the
    second block reading the first's sum as its residual."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.next = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Conv2d(8, 8, 1)

    def forward(self, x):
        first = self.fc1(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        first += x
        second = self.fc2(first.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        second += first
        return self.next(second), second


def test_in_place_residual_sums_are_steps_of_the_blocks_chain(tmp_path, monkeypatch):
    """ConvNeXt's residual sum had ended the kernel chain at every block (22 chains a forward):
    the in-place sum into a step's value is a step; the chain gives the separate calls' bytes,
    the written sum too, on every call."""
    monkeypatch.setenv("QBACKEND_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(choice_cache, "_shared", None)
    monkeypatch.setattr(choice, "measure", SimulatedMachine(own_us=100, onednn_us=300))
    torch.manual_seed(0)
    inputs = (torch.randn(2, 8, 6, 6),)
    model = quantize(TwoViewedInPlaceResiduals(), inputs)
    chained, separate = with_and_without_chains(lambda: assert_matches_reference(model, inputs, kernel_choice="measure"),
                                                monkeypatch)
    assert_one_chain_of_c_steps(chained, separate, ["quantize_per_tensor", "qconv", "add_quantize_", "qconv", "add_quantize_",
                                                    "qconv"], [torch.randn(2, 8, 6, 6) for _ in range(3)])
