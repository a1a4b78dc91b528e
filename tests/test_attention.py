"""Float attention between the quantized projections runs as fused scaled-dot-product
attention: with a scale by division or multiplication, an additive mask, or neither."""
import expecttest
import pytest
import torch
import torch.nn as nn

from .helpers import assert_matches_reference, compile_and_run, quantize, short_graph


class MaskedAttention(nn.Module):
    def __init__(self, scale_by="div", dim=-1):
        super().__init__()
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)
        self.scale_by, self.dim = scale_by, dim

    def forward(self, x, mask):
        q, k, v = (t.view(2, 8, 4, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        scores = torch.matmul(q, k.transpose(-2, -1))
        scores = scores / 8 ** 0.5 if self.scale_by == "div" else scores * 0.125
        probs = torch.softmax(scores + mask, dim=self.dim)
        return self.out(torch.matmul(probs, v).transpose(1, 2).reshape(2, 8, 32))


def inputs():
    torch.manual_seed(0)
    mask = torch.zeros(2, 1, 1, 8)
    mask[0, ..., 6:] = -1e4  # padding of the first sequence, BERT-style
    return torch.randn(2, 8, 32), mask


@pytest.mark.parametrize("scale_by", ["div", "mul"])
def test_masked_attention_is_fused_with_reference_numerics(scale_by):
    captured = assert_matches_reference(quantize(MaskedAttention(scale_by), inputs()), inputs())
    fused = [d for d in captured.report.decisions if d.kind == "attention"]
    assert [d.rule for d in fused] == ["sdpa"], str(captured.report)
    assert not captured.report.kept


def test_softmax_over_another_dim_is_not_attention():
    model = quantize(MaskedAttention(dim=-2), inputs())
    actual, expected, captured = compile_and_run(model, inputs())
    torch.testing.assert_close(actual, expected)
    assert "softmax is not over the last dim" in captured.report.kept[0].reason, str(captured.report)


class TestAttentionGraph(expecttest.TestCase):
    def test_fused_attention_graph(self):
        _, _, captured = compile_and_run(quantize(MaskedAttention(), inputs()), inputs())
        graph = short_graph(captured.lowered)
        sdpa = [line for line in graph.splitlines() if "scaled_dot_product" in line]
        self.assertExpectedInline("\n".join(sdpa), """\
scaled_dot_product_attention_default = aten.scaled_dot_product_attention(transpose, transpose_1, transpose_2, attn_mask=l_mask_, scale=0.354)
quantize_per_tensor_default_2 = fast_qdq.quantize_per_tensor(scaled_dot_product_attention_default, 0.0131, 53, 0, 127, uint8)""")
        assert "softmax" not in graph and "matmul" not in graph
