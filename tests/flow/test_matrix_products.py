"""``addmm`` / ``mm`` of a constant weight (Hugging Face's ``Conv1D``: GPT-2's projections) become
linears before quantization, so they are quantized and lowered like any linear; a product of
two activations is left as it was."""
import torch

from qbackend.pt2e_flow import _matrix_products_as_linears

from tests.helpers import assert_matches_reference, quantize


class Conv1DBlock(torch.nn.Module):
    """Two projections as transformers' Conv1D writes them (weight [in, out]), one without bias,
    and a product of two activations."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(16, 32) / 4)
        self.bias = torch.nn.Parameter(torch.randn(32))
        self.down = torch.nn.Parameter(torch.randn(32, 16) / 6)

    def forward(self, x):
        rows = x.view(-1, x.size(-1))
        hidden = torch.relu(torch.addmm(self.bias, rows, self.weight))
        out = torch.mm(hidden, self.down)
        return torch.mm(out, out.t()), out.view(*x.shape[:-1], 16)


def _targets(gm) -> list:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and n.target in
            (torch.ops.aten.addmm.default, torch.ops.aten.mm.default, torch.ops.aten.linear.default)]


def test_constant_weight_products_become_linears_and_an_activation_product_stays():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    exported = torch.export.export(Conv1DBlock(), (x,)).module()
    expected = exported(x)
    assert _matrix_products_as_linears(exported) == 2
    assert _targets(exported) == ["aten.linear.default", "aten.linear.default", "aten.mm.default"]
    for got, want in zip(exported(x), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert exported.weight.shape == (16, 32)  # (the model's own weight is left as it was)


def test_conv1d_projections_are_quantized_and_lowered():
    torch.manual_seed(0)
    x = (torch.randn(2, 8, 16),)
    model = quantize(Conv1DBlock(), x)
    assert "aten.addmm.default" not in _targets(model)
    report = assert_matches_reference(model, x, intermediates=False).report
    linears = [d for d in report.decisions if d.kind == "linear"]
    assert len(linears) == 2 and all(d.lowered for d in linears), str(report)
