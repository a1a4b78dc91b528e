"""The XPU PT2E flow (XPUInductorQuantizer: signed int8 activations) lowered for XPU at graph
level on this CPU-only machine: a simulated XPU build says which ops have XPU kernels, the
lowered graph is pinned with expecttest and then run on fake XPU tensors (Meta kernels), which
checks every placed op has a Meta kernel and the shapes / dtypes fit. The same converted
models run on CPU through the CPU table, with numerics checked against the reference."""
import expecttest
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from qbackend.pipeline.backend import graph_device
from qbackend.patterns.examples import (HandQuantized, attention_block, conv_flatten_linear, conv_relu,
                                        grouped_query_attention, linear_relu, linear_residual, normed_linear,
                                        residual_block, squeeze_excitation, two_branch_cat)
from qbackend.pt2e_flow import quantize_xpu

from tests.helpers import (SATURATION_REASON, assert_matches_reference, cpu_saturates, lower_without_running, short_graph,
                      simulate_cpu)
from tests.xpu_builds import SimulatedXpuBuild, requires_xpu

EXAMPLES = {"qconv": conv_relu, "qconv_add": residual_block, "qlinear": linear_relu, "qlinear_add": linear_residual,
            "qcat": two_branch_cat, "qview": conv_flatten_linear, "sdpa": attention_block, "qscale": squeeze_excitation,
            "sdpa_fused": grouped_query_attention, "qlayernorm": normed_linear}


def xpu_converted(build):
    torch.manual_seed(0)
    module, inputs = build()
    return quantize_xpu(module, inputs, [inputs]), inputs


def run_on_fake_xpu(gm, inputs):
    """The lowered graph on fake XPU tensors: only Meta kernels run."""
    mode = FakeTensorMode()

    def fake(t):
        return FakeTensor(mode, t.to("meta"), torch.device("xpu"))

    copy = torch.fx.GraphModule(gm, gm.graph)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            setattr(copy, node.target, fake(getattr(gm, node.target)))
    args = [fake(t) for t in inputs]
    with mode:
        return copy(*args)


def lowered_for_xpu(build, rules=None, fake_run=True):
    """(short graph, report), after checking the graph on fake XPU tensors against the
    reference's output (and the rule of each conv / linear, when ``rules`` is given)."""
    model, inputs = xpu_converted(build)
    lowered, report = lower_without_running(model, inputs, SimulatedXpuBuild(), device="xpu", need_meta=True)
    if fake_run:
        (out,) = run_on_fake_xpu(lowered, inputs)
        expected = model(*inputs)
        assert (out.shape, out.dtype, out.device.type) == (expected.shape, expected.dtype, "xpu")
    assert rules is None or [d.rule for d in report.decisions] == rules, str(report)
    return short_graph(lowered), report


class TestXpuGraphs(expecttest.TestCase):
    def test_every_xpu_rule_with_an_example_is_pinned(self):
        from qbackend.lowering import TABLES, Lowering

        runnable = {name for name, entry in TABLES["xpu"].items() if isinstance(entry, Lowering)}
        weight_only = {"int4_weight_linear", "int8_weight_linear"}  # pinned in test_xpu_weight_only.py
        smoothing = {"qsmooth"}  # plain ATen ops on every device; pinned in test_smooth_quant.py
        assert runnable - weight_only - smoothing == set(EXAMPLES)

    def test_qconv(self):
        graph, _ = lowered_for_xpu(EXAMPLES["qconv"], rules=["qconv", "qconv"])
        self.assertExpectedInline(graph, """\
l_input_ = input
quantize_per_tensor_default = fast_qdq.quantize_per_tensor(l_input_, 0.0253, -20, -128, 127, int8)
qconv_pointwise_default = onednn.qconv_pointwise(quantize_per_tensor_default, 0.0253, -20, <const>, <const>, <const>, <const>, [1, 1], [1, 1], [1, 1], 1, 0.00828, -128, int8, 'relu', [], '')
qconv_pointwise_default_1 = onednn.qconv_pointwise(qconv_pointwise_default, 0.00828, -128, <const>, <const>, <const>, <const>, [2, 2], [0, 0], [1, 1], 1, 1, 0, float32, 'none', [], '')
return (qconv_pointwise_default_1)""")

    def test_qconv_add(self):
        graph, _ = lowered_for_xpu(EXAMPLES["qconv_add"], rules=["qconv", "qconv", "qconv_add"])
        self.assertExpectedInline(graph, """\
l_input_ = input
quantize_per_tensor_default = fast_qdq.quantize_per_tensor(l_input_, 0.0259, -17, -128, 127, int8)
qconv_pointwise_default = onednn.qconv_pointwise(quantize_per_tensor_default, 0.0259, -17, <const>, <const>, <const>, <const>, [1, 1], [1, 1], [1, 1], 1, 0.00685, -128, int8, 'relu', [], '')
dequantize_per_tensor_default_3 = fast_qdq.dequantize_per_tensor(qconv_pointwise_default, 0.00685, -128, -128, 127, int8)
qconv_pointwise_default_1 = onednn.qconv_pointwise(qconv_pointwise_default, 0.00685, -128, <const>, <const>, <const>, <const>, [1, 1], [1, 1], [1, 1], 1, 0.00271, -128, int8, 'relu', [], '')
contiguous_default = aten.contiguous(dequantize_per_tensor_default_3, memory_format=torch.channels_last)
qconv2d_pointwise_binary = onednn.qconv2d_pointwise.binary(qconv_pointwise_default_1, 0.00271, -128, <const>, <const>, <const>, contiguous_default, <const>, [1, 1], [1, 1], [1, 1], 1, 1, 0, float32, 1, 0, 'sum', 1, 'relu', [], '')
return (qconv2d_pointwise_binary)""")

    def test_qlinear_nd_input_is_flattened_to_rows(self):
        graph, report = lowered_for_xpu(EXAMPLES["qlinear"])
        assert [d.op for d in report.decisions] == ["onednn::qlinear_pointwise"] * 2, str(report)
        self.assertExpectedInline(graph, """\
l_input_ = input
quantize_per_tensor_default = fast_qdq.quantize_per_tensor(l_input_, 0.0215, 11, -128, 127, int8)
reshape_default = quantize_per_tensor_default.reshape([-1, 16])
qlinear_pointwise_default = onednn.qlinear_pointwise(reshape_default, 0.0215, 11, <const>, <const>, <const>, <const>, 0.00736, -128, int8, 'relu', [], '')
reshape_default_1 = qlinear_pointwise_default.reshape([3, 5, 24])
reshape_default_2 = reshape_default_1.reshape([-1, 24])
qlinear_pointwise_default_1 = onednn.qlinear_pointwise(reshape_default_2, 0.00736, -128, <const>, <const>, <const>, <const>, 1, 0, float32, 'none', [], '')
reshape_default_3 = qlinear_pointwise_default_1.reshape([3, 5, 8])
return (reshape_default_3)""")

    def test_qlinear_add(self):
        graph, _ = lowered_for_xpu(EXAMPLES["qlinear_add"], rules=["qlinear", "qlinear_add"])
        self.assertExpectedInline(graph, """\
l_x_ = input
quantize_per_tensor_default = fast_qdq.quantize_per_tensor(l_x_, 0.0206, -23, -128, 127, int8)
reshape_default = quantize_per_tensor_default.reshape([-1, 16])
qlinear_pointwise_default = onednn.qlinear_pointwise(reshape_default, 0.0206, -23, <const>, <const>, <const>, <const>, 0.00642, -102, int8, 'gelu', [], 'none')
reshape_default_1 = qlinear_pointwise_default.reshape([2, 5, 64])
contiguous_default = aten.contiguous(l_x_)
qlinear_pointwise_binary = onednn.qlinear_pointwise.binary(reshape_default_1, 0.00642, -102, <const>, <const>, <const>, contiguous_default, <const>, 1, 0, float32, 1, 0, 'add', 1, 'none', [], '')
layer_norm = aten.layer_norm(qlinear_pointwise_binary, [16], <const>, <const>, 1e-05, False)
return (layer_norm)""")

    def test_sdpa(self):
        # (no fake run: on a CPU-only build, attention's backend choice asserts on an xpu device)
        graph, report = lowered_for_xpu(EXAMPLES["sdpa"], fake_run=False)
        assert [d.rule for d in report.decisions if d.kind == "attention"] == ["sdpa"], str(report)
        self.assertExpectedInline("\n".join(line for line in graph.splitlines() if "scaled_dot" in line), """\
scaled_dot_product_attention_default = aten.scaled_dot_product_attention(transpose, transpose_1, transpose_2, attn_mask=None, scale=0.354)
quantize_per_tensor_default_2 = fast_qdq.quantize_per_tensor(scaled_dot_product_attention_default, 0.00472, -4, -128, 127, int8)""")

    def test_sdpa_fused(self):
        graph, report = lowered_for_xpu(EXAMPLES["sdpa_fused"], fake_run=False)
        assert [d.rule for d in report.decisions if d.kind == "attention"] == ["sdpa_fused"], str(report)
        self.assertExpectedInline("\n".join(line for line in graph.splitlines() if "scaled_dot" in line), """\
scaled_dot_product_attention_default = aten.scaled_dot_product_attention(transpose, transpose_1, transpose_2, attn_mask=None, scale=0.25, enable_gqa=True)
quantize_per_tensor_default_2 = fast_qdq.quantize_per_tensor(scaled_dot_product_attention_default, 0.00527, 4, -128, 127, int8)""")

    def test_qcat(self):
        graph, report = lowered_for_xpu(EXAMPLES["qcat"])
        assert report.moves_line() == "int8 flow: 1 cat run on int8", str(report)
        self.assertExpectedInline(graph, """\
l_x_ = input
quantize_per_tensor_default = fast_qdq.quantize_per_tensor(l_x_, 0.025, 11, -128, 127, int8)
qconv_pointwise_default = onednn.qconv_pointwise(quantize_per_tensor_default, 0.025, 11, <const>, <const>, <const>, <const>, [1, 1], [1, 1], [1, 1], 1, 0.0103, -128, int8, 'relu', [], '')
qconv_pointwise_default_1 = onednn.qconv_pointwise(quantize_per_tensor_default, 0.025, 11, <const>, <const>, <const>, <const>, [1, 1], [0, 0], [1, 1], 1, 0.0103, -128, int8, 'relu', [], '')
cat_default = aten.cat([qconv_pointwise_default, qconv_pointwise_default_1], 1)
qconv_pointwise_default_2 = onednn.qconv_pointwise(cat_default, 0.0103, -128, <const>, <const>, <const>, <const>, [1, 1], [0, 0], [1, 1], 1, 1, 0, float32, 'none', [], '')
return (qconv_pointwise_default_2)""")

    def test_qscale(self):
        graph, report = lowered_for_xpu(EXAMPLES["qscale"])
        assert "1 channel scale fused into its quantize" in report.moves_line(), str(report)
        self.assertExpectedInline(graph, """\
l_x_ = input
quantize_per_tensor_default = fast_qdq.quantize_per_tensor(l_x_, 0.0229, -9, -128, 127, int8)
qconv_pointwise_default = onednn.qconv_pointwise(quantize_per_tensor_default, 0.0229, -9, <const>, <const>, <const>, <const>, [1, 1], [1, 1], [1, 1], 1, 1, 0, float32, 'swish', [], '')
quantize_dequantize_per_tensor = fast_qdq.quantize_dequantize_per_tensor(qconv_pointwise_default, 0.00821, -94, -128, 127, int8, out_dtype=None)
adaptive_avg_pool2d = aten.adaptive_avg_pool2d(quantize_dequantize_per_tensor, [1, 1])
quantize_per_tensor_default_2 = fast_qdq.quantize_per_tensor(adaptive_avg_pool2d, 0.00821, -94, -128, 127, int8)
qconv_pointwise_default_1 = onednn.qconv_pointwise(quantize_per_tensor_default_2, 0.00821, -94, <const>, <const>, <const>, <const>, [1, 1], [0, 0], [1, 1], 1, 0.00101, -17, int8, 'swish', [], '')
qconv_pointwise_default_2 = onednn.qconv_pointwise(qconv_pointwise_default_1, 0.00101, -17, <const>, <const>, <const>, <const>, [1, 1], [0, 0], [1, 1], 1, 1, 0, float32, 'none', [], '')
sigmoid = aten.sigmoid(qconv_pointwise_default_2)
scale_quantize_per_tensor = fast_qdq.scale_quantize_per_tensor(qconv_pointwise_default, sigmoid, 0.00387, -85, -128, 127, int8)
qconv_pointwise_default_3 = onednn.qconv_pointwise(scale_quantize_per_tensor, 0.00387, -85, <const>, <const>, <const>, <const>, [1, 1], [0, 0], [1, 1], 1, 1, 0, float32, 'none', [], '')
return (qconv_pointwise_default_3)""")

    def test_qlayernorm(self):
        graph, report = lowered_for_xpu(EXAMPLES["qlayernorm"])
        assert "1 LayerNorm fused into its quantize" in report.moves_line(), str(report)
        self.assertExpectedInline(graph, """\
l_x_ = input
quantize_per_tensor_default = fast_qdq.quantize_per_tensor(l_x_, 0.0211, -21, -128, 127, int8)
reshape_default = quantize_per_tensor_default.reshape([-1, 16])
qlinear_pointwise_default = onednn.qlinear_pointwise(reshape_default, 0.0211, -21, <const>, <const>, <const>, <const>, 1, 0, float32, 'none', [], '')
reshape_default_1 = qlinear_pointwise_default.reshape([2, 5, 16])
layer_norm_quantize_per_tensor = fast_qdq.layer_norm_quantize_per_tensor(reshape_default_1, <const>, <const>, 1e-05, 0.019, -4, -128, 127, int8)
reshape_default_2 = layer_norm_quantize_per_tensor.reshape([-1, 16])
qlinear_pointwise_default_1 = onednn.qlinear_pointwise(reshape_default_2, 0.019, -4, <const>, <const>, <const>, <const>, 1, 0, float32, 'none', [], '')
reshape_default_3 = qlinear_pointwise_default_1.reshape([2, 5, 8])
return (reshape_default_3)""")

    def test_qview(self):
        graph, report = lowered_for_xpu(EXAMPLES["qview"])
        hoisted = [move for move in report.moves if move.lowered and "quantize moved above the views" in move.reason]
        assert report.moves_line().endswith("2 view chains run on int8") and len(hoisted) == 1, str(report)
        self.assertExpectedInline(graph, """\
l_x_ = input
quantize_per_tensor_default = fast_qdq.quantize_per_tensor(l_x_, 0.0282, -5, -128, 127, int8)
qconv_pointwise_default = onednn.qconv_pointwise(quantize_per_tensor_default, 0.0282, -5, <const>, <const>, <const>, <const>, [2, 2], [0, 0], [1, 1], 1, 0.00599, -128, int8, 'relu', [], '')
flatten_using_ints = qconv_pointwise_default.flatten(1)
qlinear_pointwise_default = onednn.qlinear_pointwise(flatten_using_ints, 0.00599, -128, <const>, <const>, <const>, <const>, 0.00462, 11, int8, 'none', [], '')
view_default = qlinear_pointwise_default.reshape([-1, 2, 6])
permute_default = view_default.permute([0, 2, 1])
reshape_default = permute_default.reshape([-1, 12])
qlinear_pointwise_default_1 = onednn.qlinear_pointwise(reshape_default, 0.00462, 11, <const>, <const>, <const>, <const>, 1, 0, float32, 'none', [], '')
return (qlinear_pointwise_default_1)""")


def test_xpu_linear_weight_is_the_transposed_weight_stored_dense():
    model, inputs = xpu_converted(linear_relu)
    lowered, _ = lower_without_running(model, inputs, SimulatedXpuBuild(), device="xpu")
    qlinear = next(n for n in lowered.graph.nodes if n.target is torch.ops.onednn.qlinear_pointwise.default)
    weight = getattr(lowered, qlinear.args[3].target)
    assert weight.shape == (16, 24) and weight.is_contiguous() and weight.dtype == torch.int8


@pytest.mark.parametrize("rank", [1, 3])
def test_xpu_conv1d_conv3d_take_no_post_op(rank):
    """torch's XPU qconv refuses any post-op for conv1d / conv3d: the conv is lowered with a
    float output, relu and the quantize stay in the graph, and the report says why."""
    inputs = (torch.randn(2, 8, *[6] * rank),)
    _, report = lower_without_running(HandQuantized(rank=rank), inputs, SimulatedXpuBuild(), device="xpu")
    decision = report.decisions[0]
    assert decision.lowered and decision.post_ops == ["torch.float32 out"], str(report)
    assert f"the XPU int8 conv{rank}d takes post-ops none, not relu" in decision.reason


def test_xpu_int8_output_must_match_the_input_dtype():
    """HandQuantized quantizes its output to uint8 while its input is uint8: fine; a signed
    input with an unsigned output quantize would come out signed from the XPU kernel."""
    from qbackend.lowering.xpu import _output_dtype
    from qbackend.patterns.base import Match, QParams, QuantizedValue

    signed, unsigned = QParams(0.1, 0, -128, 127, torch.int8), QParams(0.1, 0, 0, 255, torch.uint8)
    match = Match(None, None, (), x=QuantizedValue(None, signed), output_quant=unsigned)
    assert "write their input's integer dtype (torch.int8)" in _output_dtype(match)


@pytest.mark.parametrize("build", list(EXAMPLES.values()), ids=list(EXAMPLES))
def test_xpu_flow_on_cpu_lowers_through_the_cpu_table(build, monkeypatch):
    """The XPUInductorQuantizer model on CPU: signed activations become uint8 ones (exact).
    With VNNI every conv / linear is lowered; without it (8-bit activations overflow oneDNN's
    int16 pair sums) those no exact own kernel takes are kept with that reason. Numerics hold
    on this machine either way."""
    model, inputs = xpu_converted(build)
    report = assert_matches_reference(model, inputs).report
    assert report.device == "cpu" and any(note.startswith("signed int8 activations:") for note in report.notes), report.notes
    if cpu_saturates():
        assert all(SATURATION_REASON in d.reason for d in report.kept), str(report)
    else:
        assert not report.kept, str(report)
    simulate_cpu(monkeypatch, saturates=False)
    _, report = lower_without_running(model, inputs)
    assert all(d.lowered for d in report.decisions), str(report)


def test_device_comes_from_the_inputs_and_the_option_overrides_it(monkeypatch):
    simulate_cpu(monkeypatch, saturates=False)
    model, inputs = xpu_converted(conv_relu)
    assert graph_device([torch.empty(1, device="meta")], None) == "meta"
    _, report = lower_without_running(model, inputs)
    assert report.device == "cpu" and report.lowered
    _, report = lower_without_running(model, inputs, SimulatedXpuBuild(), device="xpu")
    assert report.device == "xpu" and report.lowered


@requires_xpu
@pytest.mark.parametrize("rule", ["qconv", "qconv_add", "qlinear", "qlinear_add"])
def test_xpu_end_to_end_matches_the_reference(rule):
    """On an Intel GPU: the XPU flow's model, compiled with qbackend on the device, against the
    converted model run eagerly there (int4 / int8 weight-only: test_xpu_weight_only.py)."""
    model, inputs = xpu_converted(EXAMPLES[rule])
    model, inputs = model.to("xpu"), tuple(t.to("xpu") for t in inputs)
    report = assert_matches_reference(model, inputs).report
    assert report.device == "xpu" and rule in {d.rule for d in report.decisions if d.lowered}, str(report)
