"""Whole models: every conv and linear lowered, reference numerics."""
import pytest
import torch

from qbackend.kernels import fast_qdq
from qbackend.models import bert_encoder_like, resnet18_like, tiny_resnet
from qbackend.patterns import RULES
from qbackend.patterns.qconv import CONV_OPS

from tests.helpers import assert_matches_reference, quantize


@pytest.mark.parametrize("build,shape", [(tiny_resnet, (2, 3, 32, 32)), (resnet18_like, (1, 3, 224, 224))],
                         ids=["tiny_resnet", "resnet18_like"])
def test_resnet_everything_lowered(build, shape):
    inputs = (torch.randn(*shape),)
    captured = assert_matches_reference(quantize(build(), inputs), inputs, intermediates=False)
    report = captured.report
    assert not report.kept, str(report)
    kinds = [d.kind for d in report.decisions]
    assert kinds.count("linear") == 1 and kinds.count("conv") >= 7
    assert {d.rule for d in report.decisions} == {"qconv", "qconv_add", "qlinear", "qmaxpool2d", "qavgpool"}
    assert kinds.count("pool") == 1 and kinds.count("avgpool") == 1
    float_convs = [n for _, _, lowered, _ in captured.graphs for n in lowered.graph.nodes if n.target in CONV_OPS]
    assert not float_convs, float_convs


def test_small_encoder_every_linear_lowered_and_attention_fused():
    inputs = (torch.randn(2, 16, 64),)
    model = bert_encoder_like(num_layers=2, hidden=64, heads=4, ffn=128)
    report = assert_matches_reference(quantize(model, inputs), inputs, intermediates=False).report
    kinds = [d.kind for d in report.decisions]
    assert not report.kept and kinds.count("linear") == 12 and kinds.count("attention") == 2, str(report)


def test_every_prepack_is_tuned_for_the_static_input_shape():
    """Each lowered op's input keeps its recorded shape, so prepacks pick the kernel for it
    (without it oneDNN falls back to a generic weight layout: ResNet-18 ran 20% slower)."""
    from qbackend.lowering.common import static_shape

    inputs = (torch.randn(2, 3, 32, 32),)
    captured = assert_matches_reference(quantize(tiny_resnet(), inputs), inputs, intermediates=False)
    kind = {rule.name: rule.anchors for rule in RULES}
    lowered = [n for n in captured.lowered.graph.nodes if kind.get(n.meta.get("qbackend_rule")) in ("conv", "linear")]
    assert sum(d.lowered for d in captured.report.decisions if d.kind in ("conv", "linear")) == 11  # 10 convs and the fc
    kernels = [n.args[0] if n.target is fast_qdq.clamp_to_range_ else n for n in lowered]  # 7-bit outputs: kernel, clamp
    assert all(static_shape(n.args[0]) is not None for n in kernels)
