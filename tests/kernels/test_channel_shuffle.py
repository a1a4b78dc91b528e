"""ShuffleNet's channel shuffle in one pass (qbackend/passes/channel_shuffle.py): the kernel gives the
reference's values for every layout it takes and ATen's ops run the rest; the lowered graph of
ShuffleNetV2 blocks calls it in place of cat / view / transpose / contiguous / chunk, with the
bytes of the graph without the rewrite; shuffles it cannot serve stay as they are."""
import expecttest
import pytest
import torch
import torch.nn as nn

from qbackend.kernels import fast_qdq
from qbackend.kernels import channel_shuffle
from qbackend.pipeline import cleanup
from qbackend.kernels.channel_shuffle import _reference, shuffle_halves, shuffle_pair

from tests.helpers import assert_matches_reference, compile_and_run, needs_own_kernels, quantize, short_graph

pytestmark = needs_own_kernels


def _shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    """torchvision's ShuffleNetV2 ``channel_shuffle``."""
    n, c, h, w = x.shape
    return x.view(n, groups, c // groups, h, w).transpose(1, 2).contiguous().view(n, c, h, w)


class ShuffleBlock(nn.Module):
    """ShuffleNetV2's stride-1 unit: half the channels through 1x1 / depthwise 3x3 / 1x1, the
    other half passed on, concatenated and shuffled; two of them, as in a stage."""

    def __init__(self, channels: int = 16, units: int = 2, groups: int = 2, return_shuffled: bool = False):
        super().__init__()
        half = channels // 2
        self.groups, self.return_shuffled = groups, return_shuffled
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.ReLU())
        self.branches = nn.ModuleList(nn.Sequential(
            nn.Conv2d(half, half, 1), nn.BatchNorm2d(half), nn.ReLU(),
            nn.Conv2d(half, half, 3, padding=1, groups=half), nn.BatchNorm2d(half),
            nn.Conv2d(half, half, 1), nn.BatchNorm2d(half), nn.ReLU()) for _ in range(units))
        self.head = nn.Conv2d(channels, 8, 1)

    def forward(self, x):
        x = self.stem(x)
        for branch in self.branches:
            x1, x2 = x.chunk(2, dim=1)
            x = _shuffle(torch.cat((x1, branch(x2)), dim=1), self.groups)
        return x if self.return_shuffled else self.head(x)


class DownsamplingStage(nn.Module):
    """ShuffleNetV2's stage start: a stride-2 unit whose two branches read the whole input
    (their uint8 outputs concatenated, then shuffled), then a stride-1 unit."""

    def __init__(self, channels: int = 8, out: int = 16):
        super().__init__()
        half = out // 2
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.ReLU())
        self.branch1 = nn.Sequential(nn.Conv2d(channels, channels, 3, 2, 1, groups=channels), nn.BatchNorm2d(channels),
                                     nn.Conv2d(channels, half, 1), nn.BatchNorm2d(half), nn.ReLU())
        self.branch2 = nn.Sequential(nn.Conv2d(channels, half, 1), nn.BatchNorm2d(half), nn.ReLU(),
                                     nn.Conv2d(half, half, 3, 2, 1, groups=half), nn.BatchNorm2d(half),
                                     nn.Conv2d(half, half, 1), nn.BatchNorm2d(half), nn.ReLU())
        self.unit = ShuffleBlock(channels=out, units=1, return_shuffled=True).branches[0]
        self.head = nn.Conv2d(out, 8, 1)

    def forward(self, x):
        x = self.stem(x)
        x = _shuffle(torch.cat((self.branch1(x), self.branch2(x)), dim=1), 2)
        x1, x2 = x.chunk(2, dim=1)
        return self.head(_shuffle(torch.cat((x1, self.unit(x2)), dim=1), 2))


@pytest.mark.parametrize("half", [1, 5, 8, 29, 58])
@pytest.mark.parametrize("layout", ["channels last", "channel slices", "contiguous (ATen's ops)"])
def test_the_kernel_gives_the_references_values(half, layout):
    torch.manual_seed(half)
    whole = torch.randn(2, 2 * half + 3, 5, 7).contiguous(memory_format=torch.channels_last)
    if layout == "channel slices":
        a, b = whole[:, 1:half + 1], whole[:, half + 2:2 * half + 2]  # (pixel rows 2 * half + 3 apart)
    else:
        a, b = whole[:, :half].clone(), whole[:, half:2 * half].clone()
        if layout.startswith("contiguous"):
            a, b = a.contiguous(), b.contiguous()
    expected = _shuffle(torch.cat([a, b], 1), 2)
    out = shuffle_pair(a, b)
    assert torch.equal(out, expected) and out.is_contiguous(memory_format=torch.channels_last)
    if half % 2 == 0:
        first, second = shuffle_halves(a, b)
        assert torch.equal(first, expected[:, :half]) and torch.equal(second, expected[:, half:])
        assert all(t.is_contiguous(memory_format=torch.channels_last) for t in (first, second))


def _same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """The same values bit for bit (a NaN where the expected one has one), channels-last."""
    assert actual.dtype == expected.dtype and actual.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("half", [2, 10, 16, 58])
@pytest.mark.parametrize("uint8_in", [False, True], ids=["float32 in", "uint8 in"])
@pytest.mark.parametrize("qparams", [(0.05, 0, 0, 255), (0.013, 37, 0, 255), (0.02, 3, 0, 127)], ids=["zp 0", "zp 37", "reduce range"])
def test_dequantized_inputs_and_quantized_outputs_are_the_references_bytes(half, uint8_in, qparams):
    """uint8 inputs are read as the reference's dequantize gives them ((q - zero point) *
    scale); the whole shuffle, or its second half, is written as quantize_per_tensor gives it
    (a NaN or an infinity among float inputs too)."""
    torch.manual_seed(half)
    if uint8_in:
        whole = torch.randint(0, 256, (2, 2 * half + 1, 5, 7), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
        dequantized, floats = (0.037, 11), (whole.to(torch.float32) - 11) * 0.037
    else:
        whole = (torch.randn(2, 2 * half + 1, 5, 7) * 4).contiguous(memory_format=torch.channels_last)
        whole[0, :, 1, 2] = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(half)[:2 * half + 1]
        dequantized, floats = None, whole
    a, b = whole[:, :half], whole[:, half + 1:]  # (channel slices, read in place)
    expected = _shuffle(torch.cat([floats[:, :half], floats[:, half + 1:]], 1), 2).contiguous(memory_format=torch.channels_last)

    def quantized(t):
        return fast_qdq.quantize_per_tensor_channels_last(t.contiguous(memory_format=torch.channels_last), *qparams,
                                                          torch.uint8, nan_as=qparams[2])

    _same(shuffle_pair(a, b, dequantized), expected)
    _same(shuffle_pair(a, b, dequantized, qparams), quantized(expected))
    first, second = shuffle_halves(a, b, dequantized, qparams)
    _same(first, expected[:, :half].contiguous(memory_format=torch.channels_last))
    _same(second, quantized(expected[:, half:]))


def test_tensors_the_kernel_does_not_take_run_atens_ops():
    a, b = torch.randn(1, 4, 3, 3), torch.randn(1, 4, 3, 3)
    assert channel_shuffle._call(a.double(), b.double(), False, None, None) is None
    assert channel_shuffle._call(a.to("meta"), b.to("meta"), False, None, None) is None
    assert channel_shuffle._call(a, b, False, (0.1, 0), None) is None  # (float32 inputs said to be uint8)
    assert torch.equal(shuffle_pair(a.double(), b.double()), _reference(a.double(), b.double()))
    assert shuffle_pair(a.to("meta"), b.to("meta")).shape == (1, 8, 3, 3)


def _lowered(model, x, monkeypatch, rewrite: bool):
    with monkeypatch.context() as patch:
        if not rewrite:
            patch.setattr(cleanup, "shuffles_in_one_pass", lambda gm: None)
        return compile_and_run(model, (x,))[2]


def test_shufflenet_units_run_the_kernel_with_the_bytes_of_atens_ops(monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 12)
    model = quantize(ShuffleBlock().eval(), (x,))
    rewritten, plain = (_lowered(model, x, monkeypatch, flag) for flag in (True, False))
    graph = short_graph(rewritten.lowered)  # (with the steps of its chain: the shuffles are steps of it)
    assert graph.count("channel_shuffle.shuffle_halves(") == 1 and graph.count("channel_shuffle.shuffle_pair(") == 1, graph
    assert graph.count("kernel_chain(") == 1 and "transpose" not in graph and "quantize_per_tensor(" not in graph, graph
    assert "2 channel shuffle(s) in one pass (qbackend's kernel)" in str(rewritten.report)
    with torch.no_grad():
        for seed in range(3):
            inputs = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(seed))
            assert torch.equal(rewritten.lowered(inputs)[0], plain.lowered(inputs)[0])
    assert_matches_reference(model, (x,))


class TestShuffleGraph(expecttest.TestCase):
    def test_the_units_shuffles_become_kernel_calls(self):
        torch.manual_seed(0)
        x = torch.randn(1, 3, 8, 8)
        model = quantize(ShuffleBlock(channels=8).eval(), (x,))
        captured = compile_and_run(model, (x,))[2]
        lines = [line for line in short_graph(captured.lowered).splitlines() if "shuffle" in line or "chunk" in line
                 or "cat" in line or "view" in line or "getitem" in line]
        self.assertExpectedInline("\n".join(lines), """\
chunk_default = aten.chunk(qconv, 2, 1)
getitem = _operator.getitem(chunk_default, 0)
getitem_1 = _operator.getitem(chunk_default, 1)
quantize_per_tensor_default_1 = fast_qdq.quantize_per_tensor_channels_last(getitem_1, 0.0122, 0, 0, 127, uint8)
shuffle_halves = channel_shuffle.shuffle_halves(getitem, qconv_2, None, (0.01, 0, 0, 127))
getitem_2 = shuffle_halves[0]
getitem_3 = shuffle_halves[1]
qconv_3 = conv_gemm.qconv(getitem_3, <const>, <const>, <const>, None, 0, 0, inf, 0.00475, 0, 0, 127, False, 'none', (1, 1), (1, 1), (0, 0), (1, 1), 0)
shuffle_pair = channel_shuffle.shuffle_pair(getitem_2, qconv_4, None, (0.0124, 0, 0, 127))
view_default_1 = shuffle_pair.view([1, 4, 2, 8, 8])
view_default = view_default_1.reshape([1, 8, 8, 8])
qconv_5 = conv_gemm.qconv(view_default, <const>, <const>, <const>, None, 0, -inf, inf, 1, 0, 0, 255, True, 'none', (1, 1), (1, 1), (0, 0), (1, 1), 0)
kernel_chain_0 = kernel_chain(quantize_per_tensor_default_1, getitem) of 13 steps -> (qconv_5)
getitem_4 = _operator.getitem(kernel_chain_0, 0)
return (getitem_4)""")


@pytest.mark.parametrize("case", ["three groups", "the shuffled tensor returned"])
def test_shuffles_the_kernel_cannot_serve_stay(case, monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(1, 3, 12, 12)
    block = ShuffleBlock(channels=12, units=1, groups=3) if case == "three groups" else ShuffleBlock(return_shuffled=True)
    model = quantize(block.eval(), (x,))
    captured = compile_and_run(model, (x,))[2]
    targets = [n.target for n in captured.lowered.graph.nodes]
    if case == "three groups":
        assert shuffle_pair not in targets and shuffle_halves not in targets
        assert "transpose" in targets  # (a Tensor method call: cleanup.views_as_tensor_methods)
    else:  # (the first unit's shuffle is rewritten; the last one's contiguous result is the output)
        graph = short_graph(captured.lowered)  # (with its chain's steps)
        assert graph.count("channel_shuffle.shuffle_halves(") == 1 and "aten.contiguous(" in graph, graph
    assert_matches_reference(model, (x,))


def test_a_stage_start_reads_the_uint8_cat_and_its_shuffles_run_in_one_chain():
    """The stride-2 unit's branches end in uint8 (the cat shares their scale): the shuffle
    reads them as the reference's dequantize gives them, with no cat, dequantize or slices
    between; every shuffle is a step of the one chain; the reference's values."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 12)
    model = quantize(DownsamplingStage().eval(), (x,))
    graph = short_graph(compile_and_run(model, (x,))[2].lowered)
    first = next(line for line in graph.splitlines() if "channel_shuffle.shuffle_halves(" in line)
    assert first.split("(", 1)[1].split(", ")[2].startswith("("), graph  # (its dequantize's scale and zero point)
    assert "aten.cat" not in graph and "dequantize_per_tensor" not in graph and "slice" not in graph, graph
    assert graph.count("kernel_chain(") == 1 and "channel_shuffle.shuffle_pair(" in graph, graph
    assert_matches_reference(model, (x,))
