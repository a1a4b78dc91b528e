"""An inference dropout between a linear and its residual add (HF BERT's dense -> dropout ->
+ input) is dropped before lowering, so the add folds into the linear."""
import torch
import torch.nn as nn

from tests.helpers import assert_matches_reference, quantize


class DenseDropoutResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense, self.dropout, self.norm = nn.Linear(16, 16), nn.Dropout(0.1), nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(self.dropout(self.dense(x)) + x)


def test_eval_dropout_does_not_hide_the_residual_add():
    torch.manual_seed(0)
    inputs = (torch.randn(2, 5, 16),)
    converted = quantize(DenseDropoutResidual().eval(), inputs)
    assert any(n.target is torch.ops.aten.dropout.default for n in converted.graph.nodes)
    report = assert_matches_reference(converted, inputs).report
    assert [d.rule for d in report.decisions] == ["qlinear_add"], str(report)
