"""A Llama decode step's own-kernel calls (weight-only matmuls, RMSNorm, rotary, SiLU-multiply)
and the views between them as kernel chains (qbackend/kernels/kernel_chain.py): the bytes of the
separate calls on every step, C programs where the operands stay in place, the nodes one by one
where a view copies, views that leave a chain."""
import operator
import threading

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qbackend
from qbackend.pipeline import cleanup
from qbackend.kernels import kv_append, rms_norm
from qbackend.kernels import attention
from qbackend.kernels.kernel_chain import KernelChain, chain_own_kernels

from tests.helpers import Captured, in_threads, needs_own_kernels, short_graph
from tests.tolerances import assert_weight_only_close

pytestmark = needs_own_kernels


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm, op for op."""

    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + 1e-6))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Layer(nn.Module):
    """A Llama decoder layer as transformers writes it: grouped-query attention over a KV cache
    that grows by torch.cat, a SiLU-gated MLP, residual adds."""

    def __init__(self, hidden, heads, kv_heads, intermediate):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.input_norm, self.post_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.gate, self.up = nn.Linear(hidden, intermediate, bias=False), nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x, cos, sin, cache):
        b, length, _ = x.shape
        h = self.input_norm(x)
        q = self.q(h).view(b, length, -1, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, length, -1, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, length, -1, self.head_dim).transpose(1, 2)
        q = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
        k = k * cos.unsqueeze(1) + rotate_half(k) * sin.unsqueeze(1)
        cache["k"] = torch.cat([cache["k"], k], dim=-2)
        cache["v"] = torch.cat([cache["v"], v], dim=-2)
        a = F.scaled_dot_product_attention(q, cache["k"], cache["v"], is_causal=length > 1, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, length, -1))
        h = self.post_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    def __init__(self, hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2, vocab=96):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden, heads, kv_heads, intermediate) for _ in range(layers))
        self.norm, self.head = RMSNorm(hidden), nn.Linear(hidden, vocab, bias=False)
        head_dim = hidden // heads
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))

    def forward(self, tokens, start, caches):
        position_ids = (torch.arange(tokens.shape[1]) + start).unsqueeze(0)  # (transformers' spelling)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.embed(tokens)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cos, sin, cache)
        return self.head(self.norm(x)[:, -1:, :])


def _decode(model, backend, steps=6):
    """The logits of a 5-token prompt and ``steps`` greedy decode steps, and the caches
    (``backend`` None: the model run eagerly)."""
    torch._dynamo.reset()
    run = model if backend is None else torch.compile(model, backend=backend)
    caches = [{"k": torch.zeros(1, 2, 0, 32), "v": torch.zeros(1, 2, 0, 32)} for _ in model.layers]
    tokens, start, logits = torch.arange(5)[None] * 7 % 96, 0, []
    with torch.no_grad():
        for _ in range(steps + 1):
            logits.append(run(tokens, start, caches))
            start += tokens.shape[1]
            tokens = logits[-1].argmax(-1)
    return logits, caches


def _model(bits):
    torch.manual_seed(0)
    return qbackend.quantize_weights(TinyLlama().eval(), bits=bits, group_size=64 if bits == 4 else None)


def _chains(graph) -> list:
    return [node.target for node in graph.graph.nodes if isinstance(node.target, KernelChain)]


def _compiled(chains) -> list:
    """Per chain, whether its calls run as one C program (a view that copies makes them run the nodes)."""
    return [program is not None for chain in chains for program in chain._programs.values()]


@pytest.mark.parametrize("bits", [4, 8])
def test_decode_steps_give_the_bytes_of_the_separate_calls(bits, monkeypatch):
    model = _model(bits)
    chained = Captured()
    logits, caches = _decode(model, chained)
    with monkeypatch.context() as patch:
        patch.setattr(cleanup, "chain_own_kernels", lambda gm, **_: None)
        separate = Captured()
        expected, expected_caches = _decode(model, separate)
    assert all(torch.equal(a, b) for a, b in zip(logits, expected))
    assert all(torch.equal(a[key], b[key]) for a, b in zip(caches, expected_caches) for key in "kv")
    for step, (a, reference) in enumerate(zip(logits, _decode(model, None)[0])):
        assert_weight_only_close(a, reference, f"step {step}", "weight_only_int16")
    (prompt, _, prompt_chained, _), (_, _, decode, _) = chained.graphs
    assert not any(_chains(graph[2]) for graph in separate.graphs)
    # a step is one chain, KV cache appends and attention inside; the prompt's fills its caches
    # for the first time (new buffers: no program for that signature), every decode step runs
    # the one program prepared at the first (the caches' lengths are given per call)
    assert [_compiled(_chains(graph)) for graph in (prompt_chained, decode)] == [[], [True]]


class TestDecodeGraph(expecttest.TestCase):
    def test_a_decode_step_is_one_chain_with_its_cache_appends_and_attention(self):
        captured = Captured()
        _decode(_model(4), captured, steps=2)
        decode = captured.graphs[-1][2]
        lines = [line for line in short_graph(decode).splitlines()
                 if "kernel_chain(" in line or "append(" in line or "attention" in line]
        self.assertExpectedInline("\n".join(lines), """\
cat_3 = kv_append.append(l_caches_0_k_, rotary_1, -2)
cat_4 = kv_append.append(l_caches_0_v_, v, -2)
attention_f32 = attention.attention_f32(rotary, cat_3, cat_4, None, 0.177)
transpose_3 = attention_f32.transpose(1, 2)
cat_7 = kv_append.append(l_caches_1_k_, rotary_3, -2)
cat_8 = kv_append.append(l_caches_1_v_, v_1, -2)
attention_f32_1 = attention.attention_f32(rotary_2, cat_7, cat_8, None, 0.177)
transpose_7 = attention_f32_1.transpose(1, 2)
kernel_chain_0 = kernel_chain(x, getitem_10, getitem_11, l_caches_0_k_, l_caches_0_v_, l_caches_1_k_, l_caches_1_v_) of 91 steps -> (cat_3, cat_4, cat_7, cat_8, getitem_9, int4_mm_int16_14)""")


def _graph(build) -> torch.fx.GraphModule:
    """A graph of own-kernel calls and views: ``build(graph, x, constant)`` returns its outputs."""
    root, graph = nn.Module(), torch.fx.Graph()
    x = graph.placeholder("x")

    def constant(name, tensor):
        root.register_buffer(name, tensor)
        return graph.get_attr(name)

    graph.output(build(graph, x, constant))
    return torch.fx.GraphModule(root, graph)


def _chained_and_separate(build, x):
    """(the chained graph's outputs, the graph's own, the chain)."""
    gm = _graph(build)
    expected = gm(x)
    assert chain_own_kernels(gm) is not None
    gm.recompile()
    (chain,) = [node.target for node in gm.graph.nodes if isinstance(node.target, KernelChain)]
    first, again = gm(x), gm(x)  # (the first call runs the nodes and prepares the program)
    for actual in (first, again):
        assert all(torch.equal(a, e) and a.shape == e.shape and a.stride() == e.stride() for a, e in zip(actual, expected))
    return chain


def test_a_view_between_steps_is_an_offset_and_a_leaving_view_is_made_again():
    def build(graph, x, constant):
        normed = graph.call_function(rms_norm.rms_norm, (x, constant("w1", torch.randn(32)), 1e-6))
        rows = graph.call_method("view", (normed, 3, 64))
        total, out = (graph.call_function(operator.getitem, (graph.call_function(
            rms_norm.add_rms_norm, (rows, rows, constant("w2", torch.randn(64)), 1e-6)), k)) for k in range(2))
        return (graph.call_method("transpose", (out, 0, 1)), graph.call_method("view", (normed, 2, 96)))

    chain = _chained_and_separate(build, torch.randn(6, 32))
    assert list(chain._programs.values())[0] is not None


def test_a_view_that_copies_runs_the_nodes_one_by_one():
    def build(graph, x, constant):
        normed = graph.call_function(rms_norm.rms_norm, (x, constant("w1", torch.randn(32)), 1e-6))
        copied = graph.call_method("reshape", (graph.call_method("transpose", (normed, 0, 1)), 16, 12))
        return (graph.call_function(rms_norm.rms_norm, (copied, constant("w2", torch.randn(12)), 1e-6)),)

    chain = _chained_and_separate(build, torch.randn(6, 32))
    assert list(chain._programs.values()) == [None]


def test_a_strided_input_the_kernel_copies_runs_the_nodes_one_by_one():
    def build(graph, x, constant):
        normed = graph.call_function(rms_norm.rms_norm, (x, constant("w1", torch.randn(6)), 1e-6))
        return (graph.call_function(rms_norm.rms_norm, (normed, constant("w2", torch.randn(6)), 1e-6)),)

    chain = _chained_and_separate(build, torch.randn(6, 32).t())
    assert list(chain._programs.values()) == [None]


def test_a_size_among_the_inputs_prepares_a_program_per_value():
    """Dynamo passes a prompt's symbolic length as a graph input (a SymInt placeholder), which a
    view inside a run may read: the chain's key holds its value."""
    root, graph = nn.Module(), torch.fx.Graph()
    x, rows = graph.placeholder("x"), graph.placeholder("rows")
    root.register_buffer("w", torch.randn(32))
    normed = graph.call_function(rms_norm.rms_norm, (x, graph.get_attr("w"), 1e-6))
    viewed = graph.call_method("view", (normed, rows, -1, 32))
    graph.output((graph.call_function(rms_norm.rms_norm, (viewed, graph.get_attr("w"), 1e-6)),))
    gm = torch.fx.GraphModule(root, graph)
    x = torch.randn(6, 32)
    expected = {n: gm(x, n)[0] for n in (2, 3)}
    assert chain_own_kernels(gm) is not None
    gm.recompile()
    (chain,) = [node.target for node in gm.graph.nodes if isinstance(node.target, KernelChain)]
    for n in (2, 3, 2, 3):
        actual = gm(x, n)[0]
        assert torch.equal(actual, expected[n]) and actual.shape == expected[n].shape
    assert len(chain._programs) == 2 and all(program is not None for program in chain._programs.values())


def test_signatures_past_the_prepared_ones_run_the_nodes(monkeypatch):
    """A chain keeps at most MAX_PROGRAMS signatures, and past them prepares once every
    PREPARE_EVERY calls: one new at every call would otherwise pay the preparing (a first run
    and a layout) each time."""
    from qbackend.kernels import kernel_chain

    monkeypatch.setattr(kernel_chain, "MAX_PROGRAMS", 3)

    def build(graph, x, constant):
        normed = graph.call_function(rms_norm.rms_norm, (x, constant("w1", torch.randn(32)), 1e-6))
        return (graph.call_function(rms_norm.rms_norm, (normed, constant("w2", torch.randn(32)), 1e-6)),)

    gm = _graph(build)
    inputs = [torch.randn(rows, 32) for rows in range(1, 7)]
    expected = [gm(x)[0] for x in inputs]
    chain_own_kernels(gm)
    gm.recompile()
    (chain,) = [node.target for node in gm.graph.nodes if isinstance(node.target, KernelChain)]
    for _ in range(2):
        assert all(torch.equal(gm(x)[0], e) for x, e in zip(inputs, expected))
    assert len(chain._programs) == 3 and all(program is not None for program in chain._programs.values())


def _attention_over_appends():
    """cache_k / cache_v grown by the new rows, then grouped-query attention over them: the graph
    kv_cache_appends leaves of a decode step's attention (8 query heads, 2 key / value heads)."""
    root, graph = nn.Module(), torch.fx.Graph()
    q, k, v, cache_k, cache_v = (graph.placeholder(name) for name in ("q", "k", "v", "cache_k", "cache_v"))
    keys = graph.call_function(kv_append.append, (cache_k, k, -2))
    values = graph.call_function(kv_append.append, (cache_v, v, -2))
    graph.output((graph.call_function(attention.attention_f32, (q, keys, values, None, 0.25)), keys, values))
    return torch.fx.GraphModule(root, graph)


def _decoded(gm, caches, steps, seed=0):
    """Per step of one new key / value row: the graph's outputs (the attention, the longer caches)."""
    generator, results = torch.Generator().manual_seed(seed), []
    for _ in range(steps):
        q, k, v = (torch.randn(1, heads, 1, 16, generator=generator) for heads in (8, 2, 2))
        results.append(gm(q, k, v, *caches))
        caches = results[-1][1:]
    return results


def test_a_cache_reallocated_mid_decode_runs_the_nodes_once_then_a_new_program(monkeypatch):
    """The caches' lengths are no part of a signature: one program runs every step while their
    buffers have room. A full buffer makes that call run the nodes (which reallocate it); the
    next call's caches have other strides, so a new program, kept next to the old one."""
    monkeypatch.setattr(kv_append, "room_after", lambda rows: 3)
    prompt = [torch.randn(1, 2, 5, 16) for _ in "kv"]

    def first_caches():  # (each run its own buffers: 5 rows and room for 3)
        return [kv_append.append(torch.tensor([]), rows, -2) for rows in prompt]

    expected = _decoded(_attention_over_appends(), first_caches(), 10)
    chained = _attention_over_appends()
    assert chain_own_kernels(chained) == "3 own-kernel calls run as 1 chain (one C call each)"
    chained.recompile()
    (chain,) = _chains(chained)
    for step, (actual, wanted) in enumerate(zip(_decoded(chained, first_caches(), 10), expected)):
        assert all(torch.equal(a, w) and a.shape == w.shape for a, w in zip(actual, wanted)), f"step {step}"
    # buffers of 5 + 3 rows, 9 + 3, 13 + 3: a program each (made at its first call), and the call
    # that found it full ran the nodes
    assert chain._calls == 10 and _compiled([chain]) == [True, True, True]


def test_two_caches_in_one_buffer_run_the_nodes():
    """Two inputs ending where one buffer is filled (a cache passed as both keys and values):
    the program would write both appends into the same room; the nodes reallocate the second."""
    cache = kv_append.append(torch.tensor([]), torch.randn(1, 2, 5, 16), -2)
    expected = _decoded(_attention_over_appends(), [cache.clone(), cache.clone()], 3)
    chained = _attention_over_appends()
    chain_own_kernels(chained)
    chained.recompile()
    separate = [kv_append.append(torch.tensor([]), cache.clone(), -2) for _ in "kv"]
    _decoded(chained, separate, 2)  # (a program for these caches' signature)
    assert _compiled(_chains(chained)) == [True]
    shared = kv_append.append(torch.tensor([]), cache.clone(), -2)
    for actual, wanted in zip(_decoded(chained, [shared, shared], 3), expected):
        assert all(torch.equal(a, w) for a, w in zip(actual, wanted))


def _two_norms():
    """A chain of two RMSNorms; inputs of 1-4 rows of 32 and the graph's own outputs for them."""
    def build(graph, x, constant):
        normed = graph.call_function(rms_norm.rms_norm, (x, constant("w1", torch.randn(32)), 1e-6))
        return (graph.call_function(rms_norm.rms_norm, (normed, constant("w2", torch.randn(32)), 1e-6)),)

    gm = _graph(build)
    inputs = {rows: torch.randn(rows, 32) for rows in range(1, 5)}
    expected = {rows: gm(x)[0] for rows, x in inputs.items()}
    chain_own_kernels(gm)
    gm.recompile()
    (chain,) = _chains(gm)
    return gm, chain, inputs, expected


def test_past_the_kept_programs_the_oldest_goes_every_prepare_every_calls(monkeypatch):
    from qbackend.kernels import kernel_chain

    monkeypatch.setattr(kernel_chain, "MAX_PROGRAMS", 2)
    monkeypatch.setattr(kernel_chain, "PREPARE_EVERY", 3)
    gm, chain, inputs, expected = _two_norms()
    kept = []
    for rows in (1, 2, 3, 3, 3, 4, 1):  # 1, 2 prepared; 3 waits three calls after 2's, then takes 1's place
        assert torch.equal(gm(inputs[rows])[0], expected[rows])
        kept.append(sorted(key[0][0][0] for key in chain._programs))
    assert kept == [[1], [1, 2], [1, 2], [1, 2], [2, 3], [2, 3], [2, 3]]


def test_two_threads_preparing_past_the_kept_programs_both_get_their_outputs(monkeypatch):
    """Both threads new signatures with the table full, each held where it evicts the oldest
    program until the other got there too (the same program: the second deletion had raised a
    KeyError out of the model's call)."""
    from qbackend.kernels import kernel_chain

    monkeypatch.setattr(kernel_chain, "MAX_PROGRAMS", 2)
    monkeypatch.setattr(kernel_chain, "PREPARE_EVERY", 0)
    gm, chain, inputs, expected = _two_norms()
    for rows in (1, 2):
        gm(inputs[rows])
    barrier = threading.Barrier(2, timeout=30)

    class Evicting(dict):  # (the table as it was: an eviction from it waits for the other thread's)
        def __delitem__(self, key):
            barrier.wait()
            super().__delitem__(key)

    chain._programs = Evicting(chain._programs)
    results = dict(zip((3, 4), in_threads([lambda rows=rows: gm(inputs[rows])[0] for rows in (3, 4)], barrier.abort)))
    assert all(torch.equal(results[rows], expected[rows]) for rows in (3, 4))
    assert len(chain._programs) == 2 and all(torch.equal(gm(x)[0], expected[rows]) for rows, x in inputs.items())
