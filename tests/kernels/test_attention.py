"""Float attention between the quantized projections runs as fused scaled-dot-product
attention: with a scale by division or multiplication, an additive mask, or neither. On CPU
qbackend's own kernel (csrc/attention_f32.c) takes head dims that are multiples of 16; torch's
fused attention the rest, with the reason in the report."""
import math

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from qbackend.kernels import fast_qdq
from qbackend.passes import einsum
from qbackend.kernels import isa, registry
from qbackend.kernels import attention as attention_kernel
from qbackend.kernels.kernel_chain import KernelChain

from tests.helpers import (Captured, assert_matches_reference, compile_and_run, kernel_calls, quantize, short_graph,
                           needs_own_kernels)
from tests.tolerances import TOLERANCE


class MaskedAttention(nn.Module):
    def __init__(self, scale_by="div", dim=-1, heads=4):
        super().__init__()
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)
        self.scale_by, self.dim, self.heads = scale_by, dim, heads

    def forward(self, x, mask):
        head_dim = 32 // self.heads
        q, k, v = (t.view(2, 8, self.heads, head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        scores = torch.matmul(q, k.transpose(-2, -1))
        scores = scores / head_dim ** 0.5 if self.scale_by == "div" else scores * head_dim ** -0.5
        probs = torch.softmax(scores + mask, dim=self.dim)
        return self.out(torch.matmul(probs, v).transpose(1, 2).reshape(2, 8, 32))


def inputs():
    torch.manual_seed(0)
    mask = torch.zeros(2, 1, 1, 8)
    mask[0, ..., 6:] = -1e4  # padding of the first sequence, BERT-style
    return torch.randn(2, 8, 32), mask


@needs_own_kernels
@pytest.mark.parametrize("heads", [4, 2])  # head dim 8: torch's fused attention; 16: qbackend's kernel
@pytest.mark.parametrize("scale_by", ["div", "mul"])
def test_masked_attention_is_fused_with_reference_numerics(scale_by, heads):
    captured = assert_matches_reference(quantize(MaskedAttention(scale_by, heads=heads), inputs()), inputs())
    fused = [d for d in captured.report.decisions if d.kind == "attention"]
    assert [d.rule for d in fused] == ["sdpa"], str(captured.report)
    assert not captured.report.kept
    own = "qbackend::attention_f32.default" if heads == 2 else "aten::scaled_dot_product_attention"
    assert fused[0].op == own, str(captured.report)


@needs_own_kernels
def test_head_dim_the_kernel_does_not_take_says_why():
    captured = assert_matches_reference(quantize(MaskedAttention(heads=4), inputs()), inputs())
    [decision] = [d for d in captured.report.decisions if d.kind == "attention"]
    assert ("torch's fused attention, not qbackend's attention kernel: head dim 8: the kernel takes a multiple of 16"
            in decision.reason), str(captured.report)


def _heads(batch, heads, length, dim, seed):
    """q, k or v as a projection's output split into heads: a strided view, as in a model."""
    torch.manual_seed(seed)
    return torch.randn(batch, length, heads * dim).mul(3).view(batch, length, heads, dim).transpose(1, 2)


# (batch, heads, queries, keys, head dim, mask shape): lengths off every tile size (6 or 12 query
# rows, 64-row blocks, 16 or 32 keys, 16 or 32 head-dim columns); masks broadcast over each dim
KERNEL_CASES = [(1, 12, 128, 128, 64, None), (2, 3, 37, 45, 32, (2, 1, 1, 45)), (1, 2, 70, 5, 16, (1, 2, 70, 5)),
                (3, 1, 1, 200, 48, (1, 1, 1, 200)), (2, 2, 9, 17, 16, (9, 1)), (1, 1, 130, 33, 128, (1, 1, 130, 1)),
                (1, 4, 8, 600, 64, (1, 1, 1, 600))]  # (+ a decode step's 8 grouped rows over 600 keys)



@needs_own_kernels
@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_attention_kernel_matches_torch(case):
    batch, heads, length, keys, dim, mask_shape = case
    q, k, v = _heads(batch, heads, length, dim, 0), _heads(batch, heads, keys, dim, 1), _heads(batch, heads, keys, dim, 2)
    mask = None if mask_shape is None else torch.randn(mask_shape) * 4
    if mask is not None and mask.shape[-1] > 1:
        mask[..., :1] = -float("inf")  # a masked-out key: weight exactly 0
    for scale in (dim ** -0.5, 0.3):
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        for kernel in registry.own_kernel_forms("attention_f32"):  # the registered op and the plain function
            actual = kernel(q, k, v, mask, scale)
            torch.testing.assert_close(actual, expected, **TOLERANCE["attention_f32"])
            # [B, L, H, D] memory: the head merge after attention is a view
            assert actual.transpose(1, 2).is_contiguous()


@needs_own_kernels
@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_attention_quantize_writes_the_float_kernels_quantized_bytes(case):
    """The kernel's own quantize is the float32 result's quantize, bit for bit: rounding ties,
    the clamp at both ends (a scale that saturates), a NaN (a query with one) stored as 0."""
    batch, heads, length, keys, dim, mask_shape = case
    q, k, v = _heads(batch, heads, length, dim, 0), _heads(batch, heads, keys, dim, 1), _heads(batch, heads, keys, dim, 2)
    q[0, 0, 0, 0] = float("nan")
    mask = None if mask_shape is None else torch.randn(mask_shape) * 4
    for out_scale, zero_point, qmin, qmax in ((0.02, 128, 0, 255), (0.005, 40, 0, 127)):
        floats = attention_kernel.attention_f32(q, k, v, mask, dim ** -0.5)
        expected = fast_qdq.quantize_per_tensor(floats, out_scale, zero_point, qmin, qmax, torch.uint8).transpose(1, 2)
        assert expected.min() == qmin and expected.max() == qmax  # (both clamps reached)
        for kernel in registry.own_kernel_forms("attention_quantize"):
            actual = kernel(q, k, v, mask, dim ** -0.5, out_scale, zero_point, qmin, qmax)
            assert actual.dtype == torch.uint8 and actual.is_contiguous()  # [B, L, H, D]
            assert torch.equal(actual, expected)


@pytest.mark.skipif(isa._vnni_library()[0] is None, reason=f"no AVX-512 build here: {isa._vnni_library()[1]}")
@pytest.mark.parametrize("case", KERNEL_CASES + [(1, 4, 8, 300, 64, None)], ids=str)  # (+ a decode step's 8 grouped rows)
def test_the_avx512_and_avx2_builds_give_the_same_bits(case, monkeypatch):
    """Tiles of 8 rows of zmm or 6 of ymm pairs: each output element is the same chain of FMAs."""
    batch, heads, length, keys, dim, mask_shape = case
    q, k, v = _heads(batch, heads, length, dim, 0), _heads(batch, heads, keys, dim, 1), _heads(batch, heads, keys, dim, 2)
    mask = None if mask_shape is None else torch.randn(mask_shape) * 4
    results = []
    for build in (isa._vnni_library()[0], isa._load()[0]):
        monkeypatch.setattr(attention_kernel, "_attention_function", lambda: (attention_kernel._declare(build).qb_attention_f32, None, None))
        results.append((attention_kernel.attention_f32(q, k, v, mask, 0.3), attention_kernel.attention_quantize(q, k, v, mask, 0.3, 0.02, 128, 0, 255),
                        attention_kernel.attention_f32(q, k, v, None, 0.3, is_causal=True)))
    for avx512, avx2 in zip(*results):
        assert torch.equal(avx512, avx2)


@needs_own_kernels
def test_attention_quantize_leaves_grouped_queries_to_the_float_kernel():
    """(its rows would come out in another order; tests/kernels/test_bad_arguments.py has the rest)"""
    q, kv = torch.randn(1, 2, 4, 16), torch.randn(1, 1, 6, 16)
    with pytest.raises(ValueError, match="grouped-query attention"):
        attention_kernel.attention_quantize(q, kv, kv, None, 0.25, 0.1, 128, 0, 255)


@pytest.mark.parametrize("bad, message", [
    (dict(q=torch.randn(1, 2, 4, 8), k=torch.randn(1, 2, 6, 8), v=torch.randn(1, 2, 6, 8)),
     "head dim 8: the kernel takes a multiple of 16"),
    (dict(k=torch.randn(1, 2, 5, 32)), "differ in batch, heads or head dim"),
    (dict(mask=torch.randn(3, 2, 4, 6)), "does not broadcast to the scores"),
    (dict(mask=torch.zeros(1, 1, 4, 6, dtype=torch.bool)), "not an additive float32 one"),
    (dict(v=torch.randn(1, 2, 6, 16, dtype=torch.float64)), "float32 CPU"),
])
@needs_own_kernels
def test_attention_kernel_rejects_what_it_cannot_compute(bad, message):
    args = dict(q=torch.randn(1, 2, 4, 16), k=torch.randn(1, 2, 6, 16), v=torch.randn(1, 2, 6, 16), mask=None)
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        registry.op("attention_f32")(args["q"], args["k"], args["v"], args["mask"], 0.25)


def test_softmax_over_another_dim_is_not_attention():
    model = quantize(MaskedAttention(dim=-2), inputs())
    actual, expected, captured = compile_and_run(model, inputs())
    torch.testing.assert_close(actual, expected)
    assert "softmax is not over the last dim" in captured.report.kept[0].reason, str(captured.report)


class TestAttentionGraph(expecttest.TestCase):
    def test_fused_attention_graph(self):  # head dim 8: torch's fused attention
        _, _, captured = compile_and_run(quantize(MaskedAttention(), inputs()), inputs())
        graph = short_graph(captured.lowered)
        sdpa = [line for line in graph.splitlines() if "scaled_dot_product" in line]
        self.assertExpectedInline("\n".join(sdpa), """\
scaled_dot_product_attention_default = aten.scaled_dot_product_attention(transpose, transpose_1, transpose_2, attn_mask=l_mask_, scale=0.354)
quantize_per_tensor_default_2 = fast_qdq.quantize_per_tensor(scaled_dot_product_attention_default, 0.0131, 53, 0, 127, uint8)
kernel_chain_1 = kernel_chain(scaled_dot_product_attention_default) of 5 steps -> (qconv_1)""")
        assert "softmax" not in graph and "matmul" not in graph

    @needs_own_kernels
    def test_own_attention_kernel_graph(self):  # head dim 16: qbackend's kernel
        torch.manual_seed(0)
        _, _, captured = compile_and_run(quantize(MaskedAttention(heads=2), inputs()), inputs())
        graph = short_graph(captured.lowered)
        attention = [line for line in graph.splitlines() if "attention" in line]
        self.assertExpectedInline("\n".join(attention), """\
attention_quantize = attention.attention_quantize(transpose, transpose_1, transpose_2, l_mask_, 0.25, 0.0131, 65, 0, 127)
reshape_default_5 = attention_quantize.reshape([16, 32, 1, 1])""")
        assert "softmax" not in graph and "matmul" not in graph


class SelfAttention(nn.Module):
    """BERT's self-attention: q, k, v linears of one input (merged into one projection), split
    into 2 heads of 16; ``cross``: keys and values from another input (two projections)."""

    def __init__(self, cross=False):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(32, 32) for _ in range(4))
        self.cross = cross

    def forward(self, x, mask):
        source = x.flip(1) if self.cross else x
        q, k, v = (t.view(2, 8, 2, 16).transpose(1, 2) for t in (self.q(x), self.k(source), self.v(source)))
        heads = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(heads.transpose(1, 2).reshape(2, 8, 32))


class TestAttentionProjection(expecttest.TestCase):
    @needs_own_kernels
    def test_attention_reads_its_projection_and_writes_the_out_projections_bytes(self):
        torch.manual_seed(0)
        captured = assert_matches_reference(quantize(SelfAttention(), inputs()), inputs())
        graph = short_graph(captured.lowered)
        # (the projection: the merged q / k / v linear on qbackend's GEMM, [16 rows, 96, 1, 1])
        self.assertExpectedInline(graph[graph.index("\nattention_from_projection") + 1:], """\
attention_from_projection = attention.attention_from_projection(qconv_4, ((16, 96, 1, 1), (2, 2, 8, 16), 8, (0, 32, 64), ((768, 16, 96), (768, 16, 96), (768, 16, 96))), l_mask_, 0.25, (0.0107, 58, 0, 127))
reshape_default_10 = attention_from_projection.reshape([16, 32, 1, 1])
qconv_3 = conv_gemm.qconv(reshape_default_10, <const>, <const>, <const>, None, 0, -inf, inf, 1, 0, 0, 255, True, 'none')
kernel_chain_0 = kernel_chain(l_x_, l_mask_) of 6 steps -> (qconv_3)
getitem = _operator.getitem(kernel_chain_0, 0)
reshape_default_8 = getitem.reshape([2, 8, 32])
return (reshape_default_8)""")
        assert "1 attention call(s) read q / k / v inside their projection" in captured.report.notes, str(captured.report)
        (chain,) = [n.target for n in captured.lowered.graph.nodes if isinstance(n.target, KernelChain)]
        assert list(chain._programs.values()) and None not in chain._programs.values(), "the block ran node by node"

    @needs_own_kernels
    def test_cross_attention_keeps_the_views_of_its_two_projections(self):
        captured = assert_matches_reference(quantize(SelfAttention(cross=True), inputs()), inputs())
        graph = short_graph(captured.lowered)
        assert "attention.attention_quantize(transpose" in graph and "attention_from_projection" not in graph, graph


@needs_own_kernels
@pytest.mark.parametrize("projection, mask, message", [
    (torch.randn(2, 8, 96), None, r"not float32 \(2, 8, 48\)"),
    (torch.randn(2, 8, 48).double(), None, "float64"),
    (torch.randn(2, 8, 48), torch.zeros(2, 1, 1, 8, dtype=torch.bool), "not an additive float32 one"),
    (torch.randn(2, 8, 48), torch.zeros(3, 1, 1, 8), "expanded size"),
])
def test_attention_from_projection_checks_what_it_reads(projection, mask, message):
    """What the lowering fixed (the views' geometry) holds only for the projection it saw."""
    geometry = ((2, 8, 48), (2, 1, 8, 16), 8, (0, 16, 32), ((384, 16, 48),) * 3)
    good = torch.randn(2, 8, 48)
    expected = attention_kernel.attention_f32(*(good.narrow(2, 16 * i, 16).view(2, 8, 1, 16).transpose(1, 2) for i in range(3)), None, 0.25)
    torch.testing.assert_close(attention_kernel.attention_from_projection(good, geometry, None, 0.25), expected, rtol=0, atol=0)
    with pytest.raises((ValueError, RuntimeError), match=message):
        attention_kernel.attention_from_projection(projection, geometry, mask, 0.25)


class TwoAttentionsOneMask(nn.Module):
    """Two fused attentions reading one boolean padding mask, as every layer of a BERT does:
    2 heads of ``head_dim`` (8: torch's fused attention; 16: qbackend's kernel)."""

    def __init__(self, head_dim=8):
        super().__init__()
        self.head_dim, self.fc = head_dim, nn.Linear(2 * head_dim, 2 * head_dim)

    def forward(self, x, mask):
        q = self.fc(x).view(2, 8, 2, self.head_dim).transpose(1, 2)
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        return torch.nn.functional.scaled_dot_product_attention(a, a, a, attn_mask=mask)


def test_a_boolean_mask_read_by_several_attentions_is_converted_once():
    torch.manual_seed(0)
    mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    mask[0, ..., 5:] = False  # padding of the first sequence
    inputs = (torch.randn(2, 8, 16), mask)
    captured = assert_matches_reference(quantize(TwoAttentionsOneMask().eval(), inputs), inputs)
    nodes = list(captured.lowered.graph.nodes)
    fills = [n for n in nodes if n.target is torch.ops.aten.masked_fill.Scalar]
    attentions = [n for n in nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(fills) == 1 and len(attentions) == 2, captured.lowered.graph
    assert all(fills[0] in a.all_input_nodes for a in attentions), captured.lowered.graph
    assert "2 attention calls share 1 float mask(s) built once" in captured.report.notes


@needs_own_kernels
def test_a_boolean_mask_runs_on_the_kernel_made_additive_once():
    """A padded batch of a BERT-style model: its bool mask becomes one additive float mask
    that both kernel calls read (it had kept torch's fused attention, 4 ms a layer on
    all-MiniLM-L6-v2 at batch 8)."""
    torch.manual_seed(0)
    mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    mask[0, ..., 5:] = False  # padding of the first sequence
    inputs = (torch.randn(2, 8, 32), mask)
    captured = assert_matches_reference(quantize(TwoAttentionsOneMask(head_dim=16).eval(), inputs), inputs)
    assert [d[:2] for d in _attention_decisions(captured.report)] == [("sdpa_fused", "qbackend::attention_f32.default")] * 2
    nodes = list(captured.lowered.graph.nodes)
    [additive] = [n for n in nodes if n.target is torch.ops.aten.masked_fill.Scalar]
    assert additive.args[0].target is torch.ops.aten.zeros_like.default and additive.args[2] == -math.inf
    assert additive.args[1].target is torch.ops.aten.logical_not.default and additive.args[1].args[0] in nodes
    # (the first reads its projection's views inside it: attention_from_projection, mask third, a
    # step of a kernel chain that takes the mask as an input; the second, with a mask, a call)
    (chain,) = [n for n in nodes if isinstance(n.target, KernelChain)]
    masks = [chain.args[step.args[2].index] for step in chain.target.steps if step.kernel == "attention_from_projection"]
    masks += [n.args[3] for n in nodes if n.target in registry.own_kernel_forms("attention_f32")]
    assert len(masks) == 2 and all(mask is additive for mask in masks), captured.lowered.graph


@needs_own_kernels
def test_a_row_masked_whole_comes_out_zero_as_torchs():
    """torch's CPU attention gives 0 for a query row whose keys are all masked (its math path
    would give NaN); the kernel had given NaN (0 * inf)."""
    q, k, v = _heads(2, 3, 5, 32, 0), _heads(2, 3, 5, 32, 1), _heads(2, 3, 5, 32, 2)
    mask = torch.rand(2, 1, 5, 5, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[0, 0, 1] = False
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(expected[0, :, 1], torch.zeros(3, 32))
    for kernel in registry.own_kernel_forms("attention_f32"):
        actual = kernel(q, k, v, torch.where(mask, 0.0, -math.inf), 32 ** -0.5)
        torch.testing.assert_close(actual, expected, **TOLERANCE["attention_f32"])


@needs_own_kernels
@pytest.mark.parametrize("mask_rows", [1, 6], ids=["static cache", "a tail per row"])
def test_keys_past_a_masks_infinite_tail_are_not_read(mask_rows):
    """A static cache's mask is -inf past the filled rows: the kernel reads no key or value there
    (as past a causal row's position), so what the unfilled rows hold cannot reach the output."""
    q, k, v = _heads(1, 4, 6, 32, 0), _heads(1, 4, 200, 32, 1).clone(), _heads(1, 4, 200, 32, 2).clone()
    mask = torch.randn(1, 1, mask_rows, 200)
    ends = [37, 20, 150, 0, 90, 37][:mask_rows]  # (0: a row masked whole)
    for row, end in enumerate(ends):
        mask[..., row, end:] = -math.inf
    k[:, :, 150:], v[:, :, 150:] = float("nan"), float("inf")  # (past every row's end)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :150], v[:, :, :150], attn_mask=mask[..., :150])
    for kernel in registry.own_kernel_forms("attention_f32"):
        actual = kernel(q, k, v, mask, 32 ** -0.5)
        assert actual.isfinite().all()
        torch.testing.assert_close(actual, expected, **TOLERANCE["attention_f32"])


@needs_own_kernels
@pytest.mark.parametrize("where", ["query", "key", "inf score"])
def test_a_nan_or_infinite_score_makes_the_rows_softmax_makes_nan(where):
    q, k, v = _heads(1, 2, 20, 16, 0), _heads(1, 2, 20, 16, 1), _heads(1, 2, 20, 16, 2)
    q, k = q.clone(), k.clone()
    if where == "query":
        q[0, 1, 5, 3] = float("nan")  # one query row of head 1: that output row
    elif where == "key":
        k[0, 0, 9, 0] = float("nan")  # one key of head 0: every row of head 0
    else:
        q[0, 1, 7, :] = float("inf")  # scores of +-inf: inf - inf in the softmax
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.25)
    assert expected.isnan().any()
    for kernel in registry.own_kernel_forms("attention_f32"):
        actual = kernel(q, k, v, None, 0.25)
        assert torch.equal(actual.isnan(), expected.isnan())
        torch.testing.assert_close(actual.nan_to_num(), expected.nan_to_num(), **TOLERANCE["attention_f32"])


class TorchMultiheadAttention(nn.Module):
    """ViT's encoder attention: torch's MultiheadAttention (its projections stay float), then a
    residual; ``returned_copy`` also returns a contiguous copy of a transpose (kept: the caller
    sees its strides)."""

    def __init__(self, returned_copy=False, batch_first=True):
        super().__init__()
        self.ln, self.fc, self.returned_copy = nn.LayerNorm(32), nn.Linear(32, 32), returned_copy
        self.attention = nn.MultiheadAttention(32, 2, batch_first=batch_first)

    def forward(self, x):
        h = self.ln(x)
        h, _ = self.attention(h, h, h, need_weights=False)
        y = self.fc(h + x)
        return (y, y.transpose(1, 2).contiguous()) if self.returned_copy else y


@pytest.mark.parametrize("returned_copy", [False, True], ids=["attention only", "a returned copy too"])
def test_multihead_attentions_projection_is_not_copied_before_attention(returned_copy):
    torch.manual_seed(0)
    inputs = (torch.randn(3, 10, 32),)
    captured = assert_matches_reference(quantize(TorchMultiheadAttention(returned_copy).eval(), inputs), inputs)
    copies = [n for n in captured.lowered.graph.nodes if n.target is torch.ops.aten.contiguous.default]
    assert len(copies) == (1 if returned_copy else 0), captured.lowered.graph
    assert "1 copy(s) before fused attention left out (it reads the strided views)" in captured.report.notes
    if returned_copy:
        assert copies[0].users and next(iter(copies[0].users)).op == "output"


@needs_own_kernels
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch first", "length first"])
def test_multihead_attention_of_a_batch_reads_its_projection_in_place(batch_first):
    """Splitting a batch's projection into heads copies (``view(L, B * H, D)`` of [L, B, 3E]
    rows): the attention reads the heads where the projection wrote them instead, in the
    rows' order (batch first: [B, L, 3E], the in-projection reading its input untransposed,
    qbackend/passes/batch_major.py), and writes them in that order: the head merge is a view."""
    torch.manual_seed(0)
    inputs = (torch.randn(3, 10, 32) if batch_first else torch.randn(10, 3, 32),)
    captured = assert_matches_reference(quantize(TorchMultiheadAttention(batch_first=batch_first).eval(), inputs, every_linear=False),
                                        inputs)
    [attention] = [n for n in captured.lowered.graph.nodes if n.target is attention_kernel.attention_from_projection]
    projection, geometry = attention.args[:2]
    assert list(projection.users) == [attention], captured.lowered.graph  # (no views, no copies of it)
    # 3 x 2 heads of 16 a row; q[b, h, l, d] at b * 960 + l * 96 + h * 16 + d ([B, L, 3E] rows),
    # or at l * 288 + b * 96 + h * 16 + d ([L, B, 3E])
    rows, strides = ((3, 10, 96), (960, 16, 96)) if batch_first else ((10, 3, 96), (96, 16, 288))
    assert geometry == (rows, (3, 2, 10, 16), 10, (0, 32, 64), (strides,) * 3)
    heads = attention_kernel.attention_from_projection(torch.randn(rows), geometry, None, 0.25)
    merged = heads.transpose(1, 2).reshape(30, 32) if batch_first else heads.permute(2, 0, 1, 3).reshape(30, 32)
    assert merged.data_ptr() == heads.data_ptr() and merged.is_contiguous()


class GroupedQueryProjection(nn.Module):
    """4 query heads and 2 key / value heads of 16, split from one projection."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(32, 128), nn.Linear(64, 32)

    def forward(self, x):
        qkv = self.qkv(x)
        q = qkv[..., :64].reshape(2, 8, 4, 16).transpose(1, 2)
        k, v = (qkv[..., start:start + 32].reshape(2, 8, 2, 16).transpose(1, 2) for start in (64, 96))
        heads = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.out(heads.transpose(1, 2).reshape(2, 8, 64))


@needs_own_kernels
def test_grouped_query_heads_of_one_projection_keep_their_views():
    """(attention_from_projection takes equal heads; the float kernel regroups the queries)"""
    torch.manual_seed(0)
    inputs = (torch.randn(2, 8, 32),)
    captured = assert_matches_reference(quantize(GroupedQueryProjection().eval(), inputs), inputs)
    targets = [n.target for n in captured.lowered.graph.nodes]
    assert kernel_calls(captured.lowered, "attention_f32") and attention_kernel.attention_from_projection not in targets, \
        captured.lowered.graph


class DecodeStepAttention(nn.Module):
    """One Llama decode step's attention as Dynamo captures it from transformers: a new token's
    8 query heads against a cache of 2 key / value heads (``enable_gqa``), head dim 16, and an
    optional additive mask over the cached positions."""

    def forward(self, q, k, v, mask=None):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)


def _decode_step(length: int, cached: int, mask_shape=None):
    generator = torch.Generator().manual_seed(cached)
    q = torch.randn(1, 8, length, 16, generator=generator)
    k, v = (torch.randn(1, 2, cached, 16, generator=generator) for _ in range(2))
    mask = None if mask_shape is None else torch.randn(*mask_shape, generator=generator)
    return q, k, v, mask


def _attention_decisions(report):
    return [(d.rule, d.op, d.reason) for d in report.decisions if d.kind == "attention"]


@needs_own_kernels
@pytest.mark.parametrize("cached, mask_shape", [(37, None), (64, (1, 1, 1, 64)), (64, (1, 8, 1, 64))],
                         ids=["no mask", "a mask for all heads", "a mask per head"])
def test_grouped_query_decode_runs_on_the_kernel_with_torchs_numerics(cached, mask_shape):
    """Each key / value head is read once for its 4 query heads (torch reads it 4 times)."""
    inputs = _decode_step(1, cached, mask_shape)
    actual, expected, captured = compile_and_run(DecodeStepAttention(), inputs)
    torch.testing.assert_close(actual, expected, **TOLERANCE["attention_f32"])
    assert _attention_decisions(captured.report) == [("sdpa_fused", "qbackend::attention_f32.default",
                                                      "qbackend's float32 attention kernel")], str(captured.report)


@needs_own_kernels
def test_grouped_queries_with_a_mask_per_row_keep_torchs_attention_and_say_why():
    inputs = _decode_step(5, 40, (1, 1, 5, 40))
    actual, expected, captured = compile_and_run(DecodeStepAttention(), inputs)
    torch.testing.assert_close(actual, expected, **TOLERANCE["attention_f32"])
    [(rule, op, reason)] = _attention_decisions(captured.report)
    assert (rule, op) == ("sdpa_fused", "aten::scaled_dot_product_attention"), str(captured.report)
    assert "grouped-query attention with a mask per head or per query row" in reason, reason


@needs_own_kernels
def test_a_converted_models_fused_attention_call_runs_on_the_kernel():
    from qbackend.patterns.examples import grouped_query_attention

    module, example = grouped_query_attention()
    captured = assert_matches_reference(quantize(module, example), example)
    assert [d[:2] for d in _attention_decisions(captured.report)] == [("sdpa_fused", "qbackend::attention_f32.default")]


@needs_own_kernels
@pytest.mark.parametrize("heads, kv_heads, length, cached", [(8, 2, 37, 37), (4, 4, 100, 100), (8, 2, 130, 130), (4, 2, 5, 40)],
                         ids=["grouped", "heads equal, blocks of 64 rows", "grouped, a block spanning two heads",
                              "fewer queries than keys: top-left, as torch"])
def test_causal_attention_matches_torchs(heads, kv_heads, length, cached):
    generator = torch.Generator().manual_seed(length)
    q = torch.randn(1, length, heads, 16, generator=generator).transpose(1, 2)
    k, v = (torch.randn(1, kv_heads, cached, 16, generator=generator) for _ in range(2))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(attention_kernel.attention_f32(q, k, v, None, 0.25, True), expected, **TOLERANCE["attention_f32"])
    with pytest.raises(ValueError, match="a mask and is_causal both given"):
        attention_kernel.attention_f32(q, k, v, torch.zeros(1, 1, length, cached), 0.25, True)


@needs_own_kernels
def test_a_causal_fused_attention_call_runs_on_the_kernel():
    from qbackend.patterns.examples import causal_fused_attention

    converted, example = causal_fused_attention()
    captured = assert_matches_reference(converted, example)
    [(rule, op, reason)] = _attention_decisions(captured.report)
    assert (rule, op) == ("sdpa_fused", "qbackend::attention_f32.default"), str(captured.report)
    assert "causal: each block of query rows reads the keys up to its last position" in reason, reason
    [args] = kernel_calls(captured.lowered, "attention_f32")
    assert args[5:] == (True,)


class ShiftedWindowAttention(nn.Module):
    """torchvision Swin's shifted-window attention over ``windows`` windows of 16 tokens: the
    scores plus a relative position bias, viewed per window, plus the shift's window mask,
    viewed back (``shifted_window_attention``); ``cosine``: Swin V2's, normalized queries and
    keys, the scores times a logit scale per head."""

    def __init__(self, heads=2, head_dim=16, windows=4, cosine=False):
        super().__init__()
        generator = torch.Generator().manual_seed(5)
        self.heads, self.head_dim, self.windows, self.cosine = heads, head_dim, windows, cosine
        self.logit_scale = nn.Parameter(torch.log(10 * torch.rand(heads, 1, 1, generator=generator) + 1))
        self.qkv, self.out = nn.Linear(heads * head_dim, 3 * heads * head_dim), nn.Linear(heads * head_dim, heads * head_dim)
        self.bias = nn.Parameter(torch.randn(1, heads, 16, 16, generator=generator))
        mask = torch.zeros(windows, 16, 16)
        mask[1:, :, 8:] = -100.0  # (torchvision's value for tokens from another region)
        self.register_buffer("window_mask", mask)

    def forward(self, x):
        b, length, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, length, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.cosine:
            scores = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
            scores = scores * torch.clamp(self.logit_scale, max=4.6).exp() + self.bias
        else:
            scores = (q * self.head_dim ** -0.5).matmul(k.transpose(-2, -1)) + self.bias
        scores = scores.view(b // self.windows, self.windows, self.heads, length, length) + self.window_mask.unsqueeze(1).unsqueeze(0)
        probs = torch.softmax(scores.view(-1, self.heads, length, length), dim=-1)
        return self.out(probs.matmul(v).transpose(1, 2).reshape(b, length, -1))


@pytest.mark.parametrize("cosine", [False, True], ids=["Swin", "Swin V2: a logit scale per head"])
@pytest.mark.parametrize("head_dim, op", [(16, "qbackend::attention_f32.default"), (8, "aten::scaled_dot_product_attention")])
def test_shifted_window_attention_is_fused_with_its_two_masks_as_one(head_dim, op, cosine):
    inputs = (torch.randn(8, 16, 2 * head_dim, generator=torch.Generator().manual_seed(0)),)
    model = ShiftedWindowAttention(head_dim=head_dim, cosine=cosine).eval()
    captured = assert_matches_reference(quantize(model, inputs), inputs)
    [(rule, fused, _)] = _attention_decisions(captured.report)
    assert (rule, fused) == ("sdpa", op), str(captured.report)
    assert not any("softmax" in str(n.target) for n in captured.lowered.graph.nodes)


class GridAttention(nn.Module):
    """torchvision MaxViT's attention: [batch, grid, heads, length, dim] operands, the keys
    scaled, two einsums around a softmax of the scores plus a relative position bias per head."""

    def __init__(self, heads=2, head_dim=16):
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.heads, self.head_dim = heads, head_dim
        self.qkv, self.merge = nn.Linear(heads * head_dim, 3 * heads * head_dim), nn.Linear(heads * head_dim, heads * head_dim)
        self.bias = nn.Parameter(torch.randn(heads, 16, 16, generator=generator))

    def forward(self, x):
        b, g, p, d = x.shape
        q, k, v = (t.reshape(b, g, p, self.heads, self.head_dim).permute(0, 1, 3, 2, 4) for t in self.qkv(x).chunk(3, dim=-1))
        k = k * self.head_dim ** -0.5
        scores = torch.einsum("B G H I D, B G H J D -> B G H I J", q, k)
        probs = F.softmax(scores + self.bias.unsqueeze(0), dim=-1)
        out = torch.einsum("B G H I J, B G H J D -> B G H I D", probs, v)
        return self.merge(out.permute(0, 1, 3, 2, 4).reshape(b, g, p, d))


@pytest.mark.parametrize("head_dim, op", [(16, "qbackend::attention_f32.default"), (8, "aten::scaled_dot_product_attention")])
def test_grid_attention_of_einsums_is_fused_with_the_key_scale_in_its_scale(head_dim, op):
    inputs = (torch.randn(2, 3, 16, 2 * head_dim, generator=torch.Generator().manual_seed(0)),)
    captured = assert_matches_reference(quantize(GridAttention(head_dim=head_dim).eval(), inputs), inputs)
    [(rule, fused, _)] = _attention_decisions(captured.report)
    assert (rule, fused) == ("sdpa", op), str(captured.report)
    targets = [str(n.target) for n in captured.lowered.graph.nodes if n.op == "call_function"]
    assert not any(name in t for t in targets for name in ("einsum", "softmax", "aten.mul")), targets
    [call] = [n for n in captured.lowered.graph.nodes if n.op == "call_function" and "attention" in str(n.target)]
    assert head_dim ** -0.5 in (*call.args, *call.kwargs.values())


@pytest.mark.parametrize("equation, form", [
    ("bghid,bghjd->bghij", True), ("B G H I J, B G H J D -> B G H I D", False), ("ik,jk->ij", True),
    ("bij,jk->bik", None),  # (the second operand without the batch label: a broadcast)
    ("bik,bjk->bji", None), ("bii,bjk->bij", None), ("...ik,...kj->...ij", None), ("bik,bkj,bjl->bil", None),
    ("bik,bkj", None), ("bik,bkj->bi", None)])
def test_only_einsums_that_are_matrix_products_become_matmuls(equation, form):
    assert einsum.matmul_form(equation) is form



class RepeatedKeysAttention(nn.Module):
    """A static KV cache's decode step as transformers runs it with a mask: repeat_kv (each of
    2 key / value heads repeated for its 4 query heads: a copy of the cache) before attention.
    ``tiled``: heads repeated as a whole instead (h -> kv head h % 2: not repeat_kv's order);
    ``write``: the keys' cache written after the repeat (the attention reads the copy's values)."""

    def __init__(self, tiled=False, write=False):
        super().__init__()
        self.tiled, self.write = tiled, write

    def repeated(self, x):
        if self.tiled:
            return x.repeat(1, 4, 1, 1)
        b, heads, length, dim = x.shape
        return x[:, :, None, :, :].expand(b, heads, 4, length, dim).reshape(b, heads * 4, length, dim)

    def forward(self, q, k_cache, v_cache, mask):
        k, v = self.repeated(k_cache), self.repeated(v_cache)
        if self.write:
            k_cache.mul_(2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)


def _repeated_keys_run(module, dynamic=False):
    """(compiled, eager, Captured) on fresh copies of one static-cache decode step's inputs
    (``dynamic``: their sizes symbolic, as Dynamo makes a cache length that changed)."""
    inputs = _decode_step(1, 48, (1, 1, 1, 48))

    def fresh():
        return [t.clone() for t in inputs]

    with torch.no_grad():
        expected = module(*fresh())
    torch._dynamo.reset()
    captured = Captured()
    with torch.no_grad():
        actual = torch.compile(module, backend=captured, dynamic=dynamic)(*fresh())
    return actual, expected, captured


@needs_own_kernels
@pytest.mark.parametrize("tiled, write, dynamic, unrepeated", [(False, False, False, True), (False, False, True, True),
                                                               (True, False, False, False), (False, True, False, False)],
                         ids=["repeat_kv", "repeat_kv, symbolic sizes", "tiled: another head order", "a write after the repeat"])
def test_repeated_keys_and_values_go_to_the_kernel_unrepeated(tiled, write, dynamic, unrepeated):
    """The kernel reads each key / value head once for its group of query heads: the repeat's
    copy of the cache goes, where the order is repeat_kv's and nothing writes the cache after it."""
    actual, expected, captured = _repeated_keys_run(RepeatedKeysAttention(tiled, write), dynamic)
    torch.testing.assert_close(actual, expected, **TOLERANCE["attention_f32"])
    lowered = captured.graphs[0][2]
    [attention] = [node for node in lowered.graph.nodes if node.target is attention_kernel.attention_f32]
    assert all((arg.op == "placeholder") == unrepeated for arg in attention.args[1:3]), short_graph(lowered)
    notes = " ".join(captured.report.notes)
    assert ("1 attention call(s) read grouped keys / values unrepeated" in notes) == unrepeated, notes
