"""A BatchNorm between a dequantize and a quantize in one pass (qbackend/passes/batch_norm_quantize.py):
the kernel gives the bytes of ATen's chain (dequantize, inference batch_norm, relu, quantize)
on the cat's inputs read in place, ATen's ops run what it does not take, and DenseNet-style
layers (norm and ReLU before the conv, on the cat of the features so far) lower to it."""
from unittest import mock

import expecttest
import pytest
import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)
import torch.nn as nn
import torch.nn.functional as F

from qbackend.pipeline import cleanup
from qbackend.kernels import choice_cache, isa
from qbackend.lowering import choice
from qbackend.kernels.batch_norm_quantize import batch_norm_quantize
from qbackend.passes.batch_norm_quantize import linear_terms

from tests.helpers import (assert_matches_reference, assert_one_chain_of_c_steps, compile_and_run, needs_own_kernels, quantize,
                           short_graph, with_and_without_chains)
from tests.kernels.test_kernel_choice import SimulatedMachine

pytestmark = needs_own_kernels
decomposed = torch.ops.quantized_decomposed


def _norm_params(channels: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(channels, generator=g), torch.randn(channels, generator=g), torch.randn(channels, generator=g),
            torch.rand(channels, generator=g) + 0.1)


def _reference_chain(pieces, weight, bias, mean, var, relu, out_zero_point):
    x = decomposed.dequantize_per_tensor(torch.cat(pieces, 1), 0.0353, 124, 0, 255, torch.uint8)
    y = torch.ops.aten.batch_norm.default(x, weight, bias, mean, var, False, 0.1, 1e-5, False)
    return decomposed.quantize_per_tensor(F.relu(y) if relu else y, 0.0182, out_zero_point, 0, 255, torch.uint8)


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("layout", ["channels last", "channel slices", "contiguous (ATen's ops)"])
def test_the_kernel_gives_the_bytes_of_atens_chain(relu, layout):
    channels = (5, 16, 29)  # (whole vectors of 8 and the rest)
    whole = torch.randint(0, 256, (2, sum(channels) + 3, 5, 7), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    whole = whole.contiguous(memory_format=torch.channels_last)
    starts = (0, 6, 23)
    pieces = [whole[:, s:s + c] for s, c in zip(starts, channels)]  # (pixel rows 53 apart, read in place)
    if layout != "channel slices":
        pieces = [p.clone() for p in pieces]
        if layout.startswith("contiguous"):
            pieces = [p.contiguous() for p in pieces]
    params = _norm_params(sum(channels), 2)
    out_zero_point = 0 if relu else 128
    out = batch_norm_quantize(pieces, 0.0353, 124, *linear_terms(*params, 1e-5), relu, 0.0182, out_zero_point, 0, 255)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out, _reference_chain(pieces, *params, relu, out_zero_point))


class DenseBlock(nn.Module):
    """DenseNet's layers: each normalizes the cat of the features so far, then ReLU and a conv."""

    def __init__(self, growth: int = 8, layers: int = 2):
        super().__init__()
        widths = [16 + growth * i for i in range(layers)]
        with torch.random.fork_rng():  # (the same weights whichever tests ran before: the graph test expects their scales)
            torch.manual_seed(2)
            self.stem = nn.Conv2d(3, 16, 3, padding=1)
            self.norms = nn.ModuleList(nn.BatchNorm2d(w) for w in widths)
            self.convs = nn.ModuleList(nn.Conv2d(w, growth, 3, padding=1) for w in widths)
        generator = torch.Generator().manual_seed(3)
        for norm in self.norms:  # (statistics a trained net has, not 0 / 1)
            norm.running_mean.copy_(torch.randn(norm.num_features, generator=generator))
            norm.running_var.copy_(torch.rand(norm.num_features, generator=generator) + 0.5)

    def forward(self, x):
        features = [self.stem(x)]
        for norm, conv in zip(self.norms, self.convs):
            features.append(conv(F.relu(norm(torch.cat(features, 1)))))
        return torch.cat(features, 1)


def test_dense_layers_run_the_kernel_with_the_references_numerics(monkeypatch):
    x = torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(0))
    model = quantize(DenseBlock().eval(), (x,))
    captured = assert_matches_reference(model, (x,))
    assert "2 batch norm(s) between a dequantize and a quantize in one pass (qbackend's kernel)" in str(captured.report)
    with monkeypatch.context() as patch:  # (the same bytes as the graph without the rewrite)
        patch.setattr(cleanup, "batch_norms_quantized", lambda gm: None)
        plain = compile_and_run(model, (x,))[2]
    with torch.no_grad():
        assert torch.equal(captured.lowered(x)[0], plain.lowered(x)[0])


def test_dense_layers_norms_are_steps_of_the_blocks_chain(tmp_path, monkeypatch):
    """The norm read its pieces' layouts at every call (~7 us a piece, DenseNet-121 ~600 pieces an
    image): as a chain step, its pieces (the chain's input, earlier steps' values) placed once per
    signature, the block is one chain, with the separate calls' bytes on every call."""
    monkeypatch.setenv("QBACKEND_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(choice_cache, "_shared", None)
    monkeypatch.setattr(choice, "measure", SimulatedMachine(own_us=100, onednn_us=300))
    x = torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(0))
    model = quantize(DenseBlock().eval(), (x,))
    chained, separate = with_and_without_chains(lambda: assert_matches_reference(model, (x,), kernel_choice="measure"),
                                                monkeypatch)
    assert_one_chain_of_c_steps(chained, separate, ["qconv_stem", "batch_norm_quantize", "qconv", "batch_norm_quantize", "qconv"],
                                [torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(k)) for k in range(1, 4)])


class TestDenseGraph(expecttest.TestCase):
    def test_the_cat_dequantize_norm_relu_quantize_chain_becomes_one_call(self):
        x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))
        with mock.patch.object(cleanup, "chain_own_kernels", lambda gm, **_: None):  # (the rewrite's graph; chains: above)
            captured = compile_and_run(quantize(DenseBlock().eval(), (x,)), (x,))[2]
        lines = "\n".join(line for line in short_graph(captured.lowered).splitlines() if "norm" in line or "cat" in line or "relu" in line)
        if isa.int8_build() != "avx512_vnni":  # (LIMITS["avx2"]: oneDNN runs these 3x3 convs)
            self.assertExpectedInline(lines, """\
batch_norm_quantize = batch_norm_quantize.batch_norm_quantize([qconv_stem], 0.0263, 60, <const>, <const>, True, 0.0299, 0, 0, 127)
qconv_pointwise_default = onednn.qconv_pointwise(batch_norm_quantize, 0.0299, 0, <const>, <const>, <const>, <const>, [1, 1], [1, 1], [1, 1], 1, 0.0263, 60, uint8, 'hardtanh', [-1.58, 1.76], '')
batch_norm_quantize_1 = batch_norm_quantize.batch_norm_quantize([qconv_stem, qconv_pointwise_default], 0.0263, 60, <const>, <const>, True, 0.0269, 0, 0, 127)
qconv_pointwise_default_1 = onednn.qconv_pointwise(batch_norm_quantize_1, 0.0269, 0, <const>, <const>, <const>, <const>, [1, 1], [1, 1], [1, 1], 1, 0.0263, 60, uint8, 'hardtanh', [-1.58, 1.76], '')
cat_default_2 = aten.cat([qconv_stem, qconv_pointwise_default, qconv_pointwise_default_1], 1)
dequantize_per_tensor_default_21 = fast_qdq.dequantize_per_tensor(cat_default_2, 0.0263, 60, 0, 127, uint8)""")
            return
        self.assertExpectedInline(lines, """\
batch_norm_quantize = batch_norm_quantize.batch_norm_quantize([qconv_stem], 0.0263, 60, <const>, <const>, True, 0.0299, 0, 0, 127)
qconv = conv_gemm.qconv(batch_norm_quantize, <const>, <const>, <const>, None, 0, -inf, inf, 0.0263, 60, 0, 127, False, 'none', (3, 3), (1, 1), (1, 1), (1, 1), 0)
batch_norm_quantize_1 = batch_norm_quantize.batch_norm_quantize([qconv_stem, qconv], 0.0263, 60, <const>, <const>, True, 0.0269, 0, 0, 127)
qconv_1 = conv_gemm.qconv(batch_norm_quantize_1, <const>, <const>, <const>, None, 0, -inf, inf, 0.0263, 60, 0, 127, False, 'none', (3, 3), (1, 1), (1, 1), (1, 1), 0)
cat_default_2 = aten.cat([qconv_stem, qconv, qconv_1], 1)
dequantize_per_tensor_default_21 = fast_qdq.dequantize_per_tensor(cat_default_2, 0.0263, 60, 0, 127, uint8)""")
