"""The exact rewritten graphs, pinned with expecttest (regenerate: EXPECTTEST_ACCEPT=1)."""
import expecttest
import pytest
import torch

from qbackend.patterns.examples import (HandQuantized, conv_flatten_linear, conv_relu, inplace_residual_block, linear_relu,
                                        residual_block, two_branch_cat)

from tests.helpers import compile_and_run, dense_convs_on_onednn, needs_own_kernels, onednn_only, quantize, short_graph


def lowered_graph(module, inputs, quantized=True, **options) -> str:
    torch.manual_seed(0)
    module = quantize(module, inputs) if quantized else module
    _, _, captured = compile_and_run(module, inputs, **options)
    return short_graph(captured.lowered)


def seeded(build):
    """The example built from a fixed seed: its weights and inputs, and so its qparams, are
    the same whichever tests ran before."""
    torch.manual_seed(0)
    return build()


class TestLoweredGraphs(expecttest.TestCase):
    @pytest.fixture(autouse=True)
    def _same_graphs_on_every_cpu(self, monkeypatch):
        """Dense 3x3 convs on oneDNN, as on every GEMM build but zmm (whose limit for them is
        tested in test_own_conv_kernels): one pinned graph whatever the CPU."""
        dense_convs_on_onednn(monkeypatch)
        self.monkeypatch = monkeypatch

    @needs_own_kernels
    def test_conv_relu_then_conv(self):
        self.assertExpectedInline(lowered_graph(*conv_relu()), """\
l_input_ = input
quantize_per_tensor_default = fast_qdq.quantize_per_tensor_channels_last(l_input_, 0.0509, 54, 0, 127, uint8)
qconv = conv_gemm.qconv(quantize_per_tensor_default, <const>, <const>, <const>, None, 0, 0, inf, 0.0166, 0, 0, 127, False, 'none', (3, 3), (1, 1), (1, 1), (1, 1), 54)
qconv_pointwise_default = onednn.qconv_pointwise(qconv, 0.0166, 0, <const>, <const>, <const>, <const>, [2, 2], [0, 0], [1, 1], 1, 1, 0, float32, 'none', [], '')
return (qconv_pointwise_default)""")

    def test_residual_block(self):
        onednn_only(self.monkeypatch)
        self.assertExpectedInline(lowered_graph(*seeded(residual_block)), """\
l_input_ = input
quantize_per_tensor_default = fast_qdq.quantize_per_tensor_channels_last(l_input_, 0.052, 55, 0, 127, uint8)
qconv_pointwise_default = onednn.qconv_pointwise(quantize_per_tensor_default, 0.052, 55, <const>, <const>, <const>, <const>, [1, 1], [1, 1], [1, 1], 1, 0.0137, 0, uint8, 'hardtanh', [0, 1.75], '')
dequantize_per_tensor_default_3 = fast_qdq.dequantize_per_tensor(qconv_pointwise_default, 0.0137, 0, 0, 127, uint8)
qconv_pointwise_default_1 = onednn.qconv_pointwise(qconv_pointwise_default, 0.0137, 0, <const>, <const>, <const>, <const>, [1, 1], [1, 1], [1, 1], 1, 0.00543, 0, uint8, 'hardtanh', [0, 0.69], '')
contiguous_default = aten.contiguous(dequantize_per_tensor_default_3, memory_format=torch.channels_last)
qconv2d_pointwise_binary = onednn.qconv2d_pointwise.binary(qconv_pointwise_default_1, 0.00543, 0, <const>, <const>, <const>, contiguous_default, <const>, [1, 1], [1, 1], [1, 1], 1, 1, 0, float32, 1, 0, 'sum', 1, 'relu', [], '')
return (qconv2d_pointwise_binary)""")

    @needs_own_kernels
    def test_inplace_residual_add_fuses_like_the_out_of_place_one(self):
        # torchvision's ``out += identity``: the conv sums its residual, no float add left
        self.assertExpectedInline(lowered_graph(*seeded(inplace_residual_block)), """\
l_input_ = input
quantize_per_tensor_default = fast_qdq.quantize_per_tensor_channels_last(l_input_, 0.0509, 54, 0, 127, uint8)
qconv = conv_gemm.qconv(quantize_per_tensor_default, <const>, <const>, <const>, None, 0, 0, inf, 0.0143, 0, 0, 127, False, 'none', (3, 3), (1, 1), (1, 1), (1, 1), 54)
qconv_1 = conv_gemm.qconv(qconv, <const>, <const>, <const>, None, 0, 0, inf, 0.00524, 0, 0, 127, False, 'none', (1, 1), (1, 1), (0, 0), (1, 1), 0)
kernel_chain_0 = kernel_chain(quantize_per_tensor_default) of 2 steps -> (qconv_1)
getitem = _operator.getitem(kernel_chain_0, 0)
dequantize_per_tensor_default_3 = fast_qdq.dequantize_per_tensor(getitem, 0.00524, 0, 0, 127, uint8)
contiguous_default = aten.contiguous(dequantize_per_tensor_default_3, memory_format=torch.channels_last)
qconv2d_pointwise_binary = onednn.qconv2d_pointwise.binary(getitem, 0.00524, 0, <const>, <const>, <const>, contiguous_default, <const>, [1, 1], [1, 1], [1, 1], 1, 1, 0, float32, 1, 0, 'sum', 1, 'relu', [], '')
return (qconv2d_pointwise_binary)""")

    @needs_own_kernels
    def test_linear_nd_relu(self):
        self.assertExpectedInline(lowered_graph(*seeded(linear_relu)), """\
l_input_ = input
quantize_per_tensor_default = fast_qdq.quantize_per_tensor(l_input_, 0.0431, 69, 0, 127, uint8)
reshape_default = quantize_per_tensor_default.reshape([15, 16, 1, 1])
qconv = conv_gemm.qconv(reshape_default, <const>, <const>, <const>, None, 0, 0, inf, 0.0148, 0, 0, 127, False, 'none')
reshape_default_4 = qconv.reshape([15, 24, 1, 1])
qconv_1 = conv_gemm.qconv(reshape_default_4, <const>, <const>, <const>, None, 0, -inf, inf, 1, 0, 0, 255, True, 'none')
kernel_chain_0 = kernel_chain(l_input_) of 5 steps -> (qconv_1)
getitem = _operator.getitem(kernel_chain_0, 0)
reshape_default_3 = getitem.reshape([3, 5, 8])
return (reshape_default_3)""")

    def test_conv3d_relu_is_a_clamp_of_its_uint8_output(self):
        inputs = (torch.randn(2, 8, 6, 6, 6),)
        self.assertExpectedInline(lowered_graph(HandQuantized(rank=3), inputs, quantized=False), """\
l_x_ = input
quantize_per_tensor_default = fast_qdq.quantize_per_tensor(l_x_, 0.04, 64, 0, 127, uint8)
qconv_pointwise_default = onednn.qconv_pointwise(quantize_per_tensor_default, 0.04, 64, <const>, <const>, <const>, <const>, [1, 1, 1], [1, 1, 1], [1, 1, 1], 1, 0.06, 50, uint8, 'none', [], '')
clamp_to_range_ = fast_qdq.clamp_to_range_(qconv_pointwise_default, 50, 127)
y_2 = fast_qdq.dequantize_per_tensor(clamp_to_range_, 0.06, 50, 0, 127, uint8)
return (y_2)""")

    def test_cat_on_int8(self):
        onednn_only(self.monkeypatch)
        self.assertExpectedInline(lowered_graph(*seeded(two_branch_cat)), """\
l_x_ = input
quantize_per_tensor_default = fast_qdq.quantize_per_tensor_channels_last(l_x_, 0.0501, 69, 0, 127, uint8)
qconv_pointwise_default = onednn.qconv_pointwise(quantize_per_tensor_default, 0.0501, 69, <const>, <const>, <const>, <const>, [1, 1], [1, 1], [1, 1], 1, 0.0206, 0, uint8, 'hardtanh', [0, 2.62], '')
qconv_pointwise_default_1 = onednn.qconv_pointwise(quantize_per_tensor_default, 0.0501, 69, <const>, <const>, <const>, <const>, [1, 1], [0, 0], [1, 1], 1, 0.0206, 0, uint8, 'hardtanh', [0, 2.62], '')
cat_default = aten.cat([qconv_pointwise_default, qconv_pointwise_default_1], 1)
qconv_pointwise_default_2 = onednn.qconv_pointwise(cat_default, 0.0206, 0, <const>, <const>, <const>, <const>, [1, 1], [0, 0], [1, 1], 1, 1, 0, float32, 'none', [], '')
return (qconv_pointwise_default_2)""")

    def test_views_on_int8_and_quantize_moved_above_views(self):
        onednn_only(self.monkeypatch)
        self.assertExpectedInline(lowered_graph(*seeded(conv_flatten_linear)), """\
l_x_ = input
quantize_per_tensor_default = fast_qdq.quantize_per_tensor_channels_last(l_x_, 0.0567, 61, 0, 127, uint8)
qconv_pointwise_default = onednn.qconv_pointwise(quantize_per_tensor_default, 0.0567, 61, <const>, <const>, <const>, <const>, [2, 2], [0, 0], [1, 1], 1, 0.012, 0, uint8, 'hardtanh', [0, 1.53], '')
flatten_using_ints = qconv_pointwise_default.flatten(1)
qlinear_pointwise_default = onednn.qlinear_pointwise(flatten_using_ints, 0.012, 0, <const>, <const>, <const>, <const>, 0.00928, 69, uint8, 'hardtanh', [-0.64, 0.538], '')
view_default = qlinear_pointwise_default.reshape([-1, 2, 6])
permute_default = view_default.permute([0, 2, 1])
reshape_default = permute_default.reshape([-1, 12])
qlinear_pointwise_default_1 = onednn.qlinear_pointwise(reshape_default, 0.00928, 69, <const>, <const>, <const>, <const>, 1, 0, float32, 'none', [], '')
return (qlinear_pointwise_default_1)""")


class Slices(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 24)

    def forward(self, x):
        y = self.fc(x)
        return y[:, 2:100], y[:, ::2], y[:, -3:], y.transpose(0, 1)


def test_views_run_as_tensor_methods_where_the_same():
    """cleanup.views_as_tensor_methods: a unit-step slice within the static size (its end past
    the size is clamped, as slice does) becomes narrow; a stepped or negative-start slice stays
    aten.slice; transpose becomes the method. Values: the reference's (compile_and_run)."""
    x = torch.randn(5, 16)
    _, _, captured = compile_and_run(quantize(Slices().eval(), (x,)), (x,))
    graph = short_graph(captured.lowered)
    y = next(n for n in captured.lowered.graph.nodes if n.name == "transpose").args[0].name  # (the linear's result)
    lines = [line.replace(y, "y") for line in graph.splitlines() if line.startswith(("slice", "transpose"))]
    assert lines == ["slice_1 = y.narrow(1, 2, 22)", "slice_2 = aten.slice.Tensor(y, 1, 0, 9223372036854775807, 2)",
                     "slice_3 = aten.slice.Tensor(y, 1, -3, 9223372036854775807)", "transpose = y.transpose(0, 1)"], graph
