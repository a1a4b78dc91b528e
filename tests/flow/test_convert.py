"""qbackend.flow.convert: torchao's convert_pt2e, the same graph, without its QAT conv-BatchNorm
fold on a post-training graph that keeps a BatchNorm (DenseNet's after a cat): that fold
exported ~96 pattern graphs per convert (42 s on a Zen 3), for a pattern such a graph cannot hold."""
import copy

import torch
import torch.nn as nn
import torchao.quantization.pt2e.qat_utils as qat_utils
import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
from torchao.quantization.pt2e import quantize_pt2e
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from qbackend.flow.convert import convert


class NormAfterCat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.conv = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1), nn.Conv2d(8, 4, 3)
        self.norm = nn.BatchNorm2d(8)

    def forward(self, x):
        return self.conv(torch.relu(self.norm(torch.cat([self.a(x), self.b(x)], 1))))


def _prepared():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    m = torch.export.export(NormAfterCat().eval(), (x,), strict=True).module()
    m = prepare_pt2e(m, xiq.X86InductorQuantizer().set_global(xiq.get_default_x86_inductor_quantization_config()))
    m(x)
    return m, x


def test_the_graph_is_torchaos_and_the_qat_fold_does_not_run(monkeypatch):
    prepared, x = _prepared()
    copied = copy.deepcopy(prepared)  # (convert_pt2e changes the module it converts)
    folds = []
    original = qat_utils._fold_conv_bn_qat_helper
    monkeypatch.setattr(qat_utils, "_fold_conv_bn_qat_helper", lambda *a, **k: folds.append(1) or original(*a, **k))
    actual = convert(prepared)
    # (torchao's own convert of it, its QAT fold skipped: finding nothing here, it leaves the graph
    # as it is; tests/kernels/test_batch_norm_quantize.py pins a DenseNet block's graph converted
    # with the fold)
    with monkeypatch.context() as patch:
        patch.setattr(quantize_pt2e, "_fold_conv_bn_qat", lambda m: m)
        expected = convert_pt2e(copied)
    assert any(n.target == torch.ops.aten.batch_norm.default for n in expected.graph.nodes)  # (kept: after a cat)
    assert folds == []
    assert actual.code == expected.code
    assert "_batch_norm_during_convert" not in prepared.code + actual.code
    with torch.no_grad():
        assert torch.equal(actual(x), expected(x))


def test_a_qat_graph_keeps_the_fold(monkeypatch):
    prepared, _ = _prepared()
    folds = []  # (recorded, not run: the fold itself is the 30 s this spares post-training graphs)
    monkeypatch.setattr(qat_utils, "_fold_conv_bn_qat_helper", lambda m, *a, **k: folds.append(1) or m)
    convert(prepared, is_qat=True)
    assert folds
