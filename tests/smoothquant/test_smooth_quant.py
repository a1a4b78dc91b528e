"""SmoothQuant pre-pass: every placement of 1/s leaves the float model unchanged, the hazards
(shared / scalar-shaped constants, a LayerNorm read by a residual) fall back to an explicit
multiply with the reason in the report, and the smoothed int8 model lowers completely."""
import pytest
import torch
from expecttest import assert_expected_inline

import qbackend
from qbackend.pt2e_flow import quantize_x86

from tests import smooth_models as sm
from tests.helpers import assert_matches_reference, needs_own_kernels, short_graph

FLOAT_RELATIVE = 1e-5  # the bound for "the float model is unchanged"


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # the models' initial weights (the pinned graph shows qparams)


def _smooth(module, alpha=0.5, **options):
    inputs = sm.outlier_inputs()
    gm = torch.export.export(module.eval(), inputs, strict=True).module()
    with torch.no_grad():
        before = gm(*inputs)
        report = qbackend.smooth_quant(gm, [inputs, sm.outlier_inputs(seed=1)], alpha=alpha, **options)
        after = gm(*inputs)
    relative = ((after - before).abs().max() / before.abs().max()).item()
    assert relative <= FLOAT_RELATIVE, f"float output moved by {relative:.2e}\n{report}"
    return report


def _only(report, source):
    lines = [line for line in report.lines if line.source == source]
    assert len(lines) == 1, str(report)
    return lines[0]


@pytest.mark.parametrize("module,source,placed", [
    (sm.PreNormQKV, "q", "folded into layer_norm"),
    (sm.PreNormQKV, "v", "folded into layer_norm"),
    (sm.LinearLinear, "fc2", "folded into linear"),
    (sm.RMSScale, "fc", "folded into mul_"),
    (sm.LinearLinear, "fc1", "explicit multiply"),  # reads the graph input
], ids=["layer_norm-q", "layer_norm-v", "linear_rows", "per_channel_mul", "graph_input"])
def test_each_placement_keeps_the_float_model(module, source, placed):
    line = _only(_smooth(module()), source)
    assert line.smoothed and line.placed.startswith(placed) and line.alpha == 0.5, line.line()


@pytest.mark.parametrize("module,source,reason", [
    (sm.PostNormResidual, "fc", "output of layer_norm is also read by add"),
    (sm.SharedHalfGelu, "fc2", "has shape [1], not [32]"),
    (sm.SharedHalfGelu, "fc2", "is also read by mul_"),
    (sm.SharedChannelConstant, "fc", "constant gain is also read by mul_"),
    (sm.OneElementScale, "fc", "mul constant scale has shape [1], not [16]"),
], ids=["layer_norm_feeds_residual", "gelu_half_is_one_element", "gelu_half_is_shared", "constant_of_two_muls",
        "one_element_constant"])
def test_hazards_get_an_explicit_multiply_and_the_reason(module, source, reason):
    line = _only(_smooth(module()), source)
    assert line.smoothed and line.placed.startswith("explicit multiply"), line.line()
    assert reason in line.reason, line.line()
    assert "not folded: " + line.reason in line.line()


def test_the_users_model_is_not_modified():
    module = sm.PreNormQKV()
    state = {k: v.clone() for k, v in module.state_dict().items()}
    _smooth(module)
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in state.items())


def test_alpha_per_layer_and_search():
    report = _smooth(sm.TinyPostLNBlock(), alpha={"fc1": 0.6})
    assert [(l.source, l.smoothed, l.alpha) for l in report.lines] == [("fc1", True, 0.6), ("fc2", False, None)]
    assert "NOT SMOOTHED linear_1 (fc2): no alpha given for it" in str(report)
    searched = _smooth(sm.TinyPostLNBlock(), alpha="search")
    assert all(line.losses and None in line.losses for line in searched.lines), str(searched)
    fc1 = _only(searched, "fc1")
    assert fc1.smoothed and fc1.losses[fc1.alpha] < fc1.losses[None], str(searched)


def test_search_simulates_the_weights_range():
    """7-bit weights (the default on CPUs without VNNI) quantize coarser: the search's loss of
    every choice is higher than with 8-bit weights, so it weighs them as they will run."""
    eight = _only(_smooth(sm.TinyPostLNBlock(), alpha="search"), "fc1").losses
    seven = _only(_smooth(sm.TinyPostLNBlock(), alpha="search", weight_range=(-64, 63)), "fc1").losses
    assert eight.keys() == seven.keys() and all(seven[a] > eight[a] for a in eight), (eight, seven)


@needs_own_kernels
def test_smoothed_int8_model_lowers_every_linear_and_the_multiply():
    module, inputs = sm.TinyPostLNBlock().eval(), sm.outlier_inputs()
    converted = quantize_x86(module, inputs, [inputs, sm.outlier_inputs(seed=1)], reduce_range=True, smooth={"alpha": 0.5})
    assert len(converted.meta["smooth_quant"].smoothed) == 2
    captured = assert_matches_reference(converted, inputs)
    report = captured.report
    assert not report.kept and len(report.lowered) == 2, str(report)
    assert "2 smoothing multiplies fused into their quantize" in str(report), str(report)
    assert_expected_inline(short_graph(captured.lowered), """\
l_x_ = input
layer_norm = aten.layer_norm(l_x_, [16], <const>, <const>, 1e-05, False)
scale_quantize_per_tensor = fast_qdq.scale_quantize_per_tensor(layer_norm, <const>, 0.0532, 63, 0, 127, uint8)
reshape_default = scale_quantize_per_tensor.reshape([10, 16, 1, 1])
qconv = conv_gemm.qconv(reshape_default, <const>, <const>, <const>, None, 0, -inf, inf, 1, 0, 0, 255, True, 'gelu')
reshape_default_1 = qconv.reshape([2, 5, 64])
scale_quantize_per_tensor_1 = fast_qdq.scale_quantize_per_tensor(reshape_default_1, <const>, 0.0114, 5, 0, 127, uint8)
reshape_default_2 = scale_quantize_per_tensor_1.reshape([10, 64, 1, 1])
reshape_default_3 = layer_norm.reshape([10, 16, 1, 1])
qconv_1 = conv_gemm.qconv(reshape_default_2, <const>, <const>, <const>, reshape_default_3, 1, -inf, inf, 1, 0, 0, 255, True, 'none')
reshape_default_4 = qconv_1.reshape([2, 5, 16])
layer_norm_1 = aten.layer_norm(reshape_default_4, [16], <const>, <const>, 1e-05, False)
return (layer_norm_1)""")
