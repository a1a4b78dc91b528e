"""Runs of qbackend's own kernels as one C call (qbackend/kernels/kernel_chain.py): the same bytes as
the separate calls, on every call; nothing the caller holds is reused; arena placement."""
import expecttest
import pytest
import torch
import torch.nn as nn

from qbackend import models
from qbackend.kernels import add_quantize, conv_gemm, registry
from qbackend.kernels.kernel_chain import KernelChain, Ref, _plan, _runs

from tests.helpers import (assert_one_chain_of_c_steps, compile_and_run, needs_own_kernels, quantize, short_graph,
                           with_and_without_chains)
from tests.kernels.test_own_conv_kernels import InvertedResidual, SqueezeExcitationBlock

pytestmark = needs_own_kernels


class ProjectAndPool(nn.Module):
    """An inverted residual block whose depthwise output is also max-pooled (on int8, after the
    project conv, by torch's kernel: ceil mode): a value that both leaves the chain and feeds a
    later step in it."""

    def __init__(self):
        super().__init__()
        self.block = InvertedResidual(channels=16, expanded=64)

    def forward(self, x):
        b = self.block
        d = b.depthwise(b.expand(x))
        return b.project(d), nn.functional.max_pool2d(d, 2, ceil_mode=True)


def _compiled(model, x, monkeypatch) -> tuple:
    """(captured graphs with kernel chains, without)."""
    return with_and_without_chains(lambda: compile_and_run(model, (x,))[2], monkeypatch)


@pytest.mark.parametrize("model_kind", ["residual block", "value leaving mid-chain"])
def test_chain_gives_the_bytes_of_the_separate_calls_on_every_call(model_kind, monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(2, 16, 12, 12)
    block = InvertedResidual(channels=16, expanded=64, residual=True) if model_kind == "residual block" else ProjectAndPool()
    model = quantize(block.eval(), (x,))
    chained, separate = _compiled(model, x, monkeypatch)
    assert any(isinstance(n.target, KernelChain) for n in chained.lowered.graph.nodes)
    assert not any(isinstance(n.target, KernelChain) for n in separate.lowered.graph.nodes)
    inputs = [torch.randn(2, 16, 12, 12) for _ in range(3)]
    with torch.no_grad():
        for i in inputs:  # the first call runs the steps one by one; later ones, the prepared program
            a, b = chained.lowered(i), separate.lowered(i)
            assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_a_squeeze_excitation_block_runs_as_one_chain_of_c_steps(monkeypatch):
    """EfficientNet's block: the pool of the depthwise conv's quantized float output, the gate's
    sigmoid and the scale-and-quantize are steps too: one chain, prepared as a C program, the
    bytes of the separate calls."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 14, 14)
    model = quantize(SqueezeExcitationBlock(nn.SiLU).eval(), (x,))
    chained, separate = _compiled(model, x, monkeypatch)
    assert_one_chain_of_c_steps(chained, separate, [
        "qconv", "qconv_depthwise", "global_avg_pool_quantize", "qconv", "qconv", "scale_quantize", "qconv"],
        [torch.randn(2, 8, 14, 14) for _ in range(3)])


def test_a_transformer_encoder_runs_as_one_chain_of_c_steps(monkeypatch):
    """Every layer's LayerNorms (with the float rows the residual reads), its merged q / k / v
    projection, attention read inside it, the out-projection with its residual and the FFN: one
    chain, prepared as one C program, the bytes of the separate calls."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64)
    model = quantize(models.bert_encoder_like(num_layers=2, hidden=64, heads=4, ffn=128), (x,))
    chained, separate = _compiled(model, x, monkeypatch)
    layer = ["qconv", "attention_from_projection", "qconv", "layer_norm_and_quantize", "qconv", "qconv"]
    assert_one_chain_of_c_steps(chained, separate, ["quantize_per_tensor", *layer, "layer_norm_and_quantize", *layer],
                                [torch.randn(2, 16, 64) for _ in range(3)])


def test_a_layer_norm_row_past_the_kernels_range_runs_the_chains_nodes(monkeypatch):
    """A row whose statistics overflow float32 is ATen's to decide (layer_norm_quantize.c): its
    chain step refuses the call, and that call runs the nodes, as the separate calls do; the
    next call runs the program again."""
    torch.manual_seed(0)
    x = torch.randn(4, 32)
    model = quantize(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.Linear(32, 32)).eval(), (x,))
    chained, separate = _compiled(model, x, monkeypatch)
    (node,) = [n for n in chained.lowered.graph.nodes if isinstance(n.target, KernelChain)]
    assert [kernel for _, kernel, _ in node.target.listing()] == ["layer_norm_quantize", "qconv", "qconv"]
    huge = torch.randn(4, 32)
    huge[1] *= 1e20
    with torch.no_grad():
        chained.lowered(x)  # (prepares the program)
        (program,) = node.target._programs.values()
        for i in (huge, x):
            torch.testing.assert_close(chained.lowered(i)[0], separate.lowered(i)[0], rtol=0, atol=0, equal_nan=True)
        assert program.run([huge]) is None
        assert torch.equal(program.run([x])[0].view(4, 32), separate.lowered(x)[0])
    assert list(node.target._programs.values()) == [program]


@pytest.mark.parametrize("movable, kernels, moves", [(True, 2, True), (False, 2, False), (True, 1, False)],
                         ids=["moves", "writes", "no run"])
def test_a_call_between_a_runs_kernels_moves_before_the_run_unless_it_writes(movable, kernels, moves):
    """A transformer's mask, made from an input between its first LayerNorm and first linear, had
    split the encoder's chain: a call reading none of the run's values moves before it, unless
    ``movable`` refuses it (a write may be what the run's kernels read) or no chain forms."""
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    first = graph.call_function(conv_gemm.qconv, (x,))
    between = graph.call_function(torch.ops.aten.add.Tensor, (y, 1))
    last = graph.call_function(conv_gemm.qconv, (first,)) if kernels == 2 else graph.call_function(torch.relu, (first,))
    graph.output((last, between))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    runs = _runs(gm, {conv_gemm.qconv: "qconv"}, lambda node: movable)
    assert runs == ([[first, last]] if movable and kernels == 2 else [])
    assert [n.name for n in gm.graph.nodes][2:4] == ([between.name, first.name] if moves else [first.name, between.name])


@pytest.mark.parametrize("target", ["a step's value", "the chain's input"])
def test_an_in_place_sum_joins_only_where_it_writes_a_steps_value(target):
    """A write into the chain's input would be read written by a call that runs the nodes again
    (a refused step's fallback): such a sum ends the run instead."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    first = graph.call_function(conv_gemm.qconv, (x,))
    written = graph.call_method("permute", (first if target == "a step's value" else x, [0, 1]))
    total = graph.call_function(add_quantize.add_quantize_, (written, first, 0.1, 128, 0, 255))
    last = graph.call_function(conv_gemm.qconv, (total,))
    graph.output((last,))
    runs = _runs(torch.fx.GraphModule(nn.Module(), graph), {conv_gemm.qconv: "qconv", add_quantize.add_quantize_: "add_quantize_"},
                 lambda node: False)
    assert runs == ([[first, written, total, last]] if target == "a step's value" else [])


class TestChainGraph(expecttest.TestCase):
    def test_block_becomes_one_chain_call(self):
        torch.manual_seed(0)
        x = torch.randn(2, 16, 12, 12)
        model = quantize(InvertedResidual(channels=16, expanded=64, residual=True).eval(), (x,))
        _, _, captured = compile_and_run(model, (x,))
        self.assertExpectedInline(short_graph(captured.lowered), """\
l_x_ = input
quantize_per_tensor_default = fast_qdq.quantize_per_tensor(l_x_, 0.0645, 63, 0, 127, uint8)
dequantize_per_tensor_default_3 = fast_qdq.dequantize_per_tensor(quantize_per_tensor_default, 0.0645, 63, 0, 127, uint8)
qconv = conv_gemm.qconv(quantize_per_tensor_default, <const>, <const>, <const>, None, 0, 0, 6, 0.0175, 0, 0, 127, False, 'none', (1, 1), (1, 1), (0, 0), (1, 1), 63)
qconv_depthwise = depthwise.qconv_depthwise(qconv, 0, <const>, <const>, <const>, (1, 1), (1, 1), 0, 6, 0.0104, 0, 0, 127)
qconv_1 = conv_gemm.qconv(qconv_depthwise, <const>, <const>, <const>, dequantize_per_tensor_default_3, 1, -inf, inf, 1, 0, 0, 255, True, 'none', (1, 1), (1, 1), (0, 0), (1, 1), 0)
kernel_chain_0 = kernel_chain(quantize_per_tensor_default, dequantize_per_tensor_default_3) of 3 steps -> (qconv_1)
getitem = _operator.getitem(kernel_chain_0, 0)
return (getitem)""")
        assert "note: 3 own-kernel calls run as 1 chain (one C call each)" in str(captured.report)
        assert captured.report.chains == 1 and captured.report.merge(captured.report).chains == 2


def test_outputs_are_fresh_and_inputs_untouched():
    torch.manual_seed(0)
    x = torch.randn(1, 16, 10, 10)
    model = quantize(ProjectAndPool().eval(), (x,))
    _, _, captured = compile_and_run(model, (x,))
    with torch.no_grad():
        first = captured.lowered(x)
        kept = [t.clone() for t in first]
        x_before = x.clone()
        for _ in range(2):
            captured.lowered(torch.randn(1, 16, 10, 10))
    assert all(torch.equal(a, b) for a, b in zip(first, kept)), "a later call wrote into an earlier call's output"
    assert torch.equal(x, x_before)


def test_a_new_input_shape_is_prepared_again():
    """The chain keeps one program per input signature (its kernels take any batch)."""
    torch.manual_seed(0)
    x = torch.randn(1, 16, 10, 10)
    model = quantize(InvertedResidual(channels=16, expanded=64).eval(), (x,))
    _, _, captured = compile_and_run(model, (x,))
    chain = next(n.target for n in captured.lowered.graph.nodes if isinstance(n.target, KernelChain))
    for batch in (1, 3, 3):
        x8 = torch.randint(0, 128, (batch, 16, 10, 10), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
        step_values = []
        for _, kernel, args in chain.listing():  # the same steps, one by one
            values = {"input": [x8], "step": step_values}
            args = [values[a.source][a.index] if isinstance(a, Ref) else a for a in args]
            step_values.append(registry.own_kernel(kernel, traced=False)(*args))
        (actual,) = chain(x8)
        assert torch.equal(actual, step_values[-1])
    assert len(chain._programs) == 2


def test_a_program_keeps_its_arena_between_calls():
    """A fresh arena at every call was a fresh mapping past glibc's mmap threshold, each page
    faulted in again (regnet_y_400mf at batch 8: ~1100 faults a call)."""
    torch.manual_seed(0)
    x = torch.randn(1, 16, 10, 10)
    model = quantize(InvertedResidual(channels=16, expanded=64).eval(), (x,))
    _, _, captured = compile_and_run(model, (x,))
    chain = next(n.target for n in captured.lowered.graph.nodes if isinstance(n.target, KernelChain))
    with torch.no_grad():
        captured.lowered(x)  # (the first call of a signature runs the steps one by one, then prepares)
        (program,) = chain._programs.values()
        addresses = []
        for _ in range(3):
            captured.lowered(torch.randn(1, 16, 10, 10))
            addresses.append([arena.data_ptr() for arena in program.spare_arenas])
    assert len(addresses[0]) == 1 and addresses == [addresses[0]] * 3


def test_arena_plan_shares_memory_only_between_values_not_alive_together():
    # a step's output (lifetime starting at the step) never meets its input (ending there)
    offsets, total = _plan([100, 100, 100, 10], [(0, 1), (1, 2), (2, 3), (0, 3)])
    assert offsets == [0, 128, 0, 256] and total == 320
    spans = [(o, o + s) for o, s in zip(offsets, [128, 128, 128, 64])]
    lifetimes = [(0, 1), (1, 2), (2, 3), (0, 3)]
    for i in range(4):
        for j in range(i):
            alive_together = lifetimes[i][0] <= lifetimes[j][1] and lifetimes[j][0] <= lifetimes[i][1]
            overlap = spans[i][0] < spans[j][1] and spans[j][0] < spans[i][1]
            assert not (alive_together and overlap), (i, j)


def test_concurrent_calls_from_two_threads_get_their_own_results():
    """ctypes lets go of the GIL during the chain's C call: each call has its own addresses."""
    import threading

    torch.manual_seed(0)
    x = torch.randn(2, 16, 12, 12)
    model = quantize(InvertedResidual(channels=16, expanded=64, residual=True).eval(), (x,))
    _, _, captured = compile_and_run(model, (x,))
    inputs = [torch.randn(2, 16, 12, 12) for _ in range(2)]
    with torch.no_grad():
        expected = [captured.lowered(i)[0] for i in inputs]
    results, errors = [[], []], []

    def work(k):
        try:
            with torch.no_grad():
                for _ in range(200):
                    results[k].append(captured.lowered(inputs[k])[0])
        except Exception as error:  # (reported below: an assertion in a thread would be lost)
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(torch.equal(r, expected[k]) for k in range(2) for r in results[k])


def test_a_graph_without_own_kernels_is_left_alone_without_loading_them(monkeypatch):
    """The pass runs on every lowered graph (XPU ones too): it must not build the C kernels to
    find there is nothing to chain."""
    from qbackend.kernels.kernel_chain import chain_own_kernels

    def no_loading():
        raise AssertionError("the kernels were loaded")

    monkeypatch.setattr(registry, "available", no_loading)
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()))
    before = str(gm.graph)
    assert chain_own_kernels(gm) is None and str(gm.graph) == before
