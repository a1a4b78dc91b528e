"""A KV cache's cat as an append into room after the cached rows (qbackend/llm/kv_append.py): the
values are always the cat's, a view that does not end where its buffer is filled gets a new
buffer (also when two threads extend one cache state at once), and only a cat of a graph input
that fused attention and the graph's output read is rewritten."""
import functools
import threading

import expecttest
import pytest
import torch
import torch.nn.functional as F

from qbackend.kernels import kv_append

from tests.helpers import Captured, in_threads, needs_own_kernels, short_graph
from tests.tolerances import TOLERANCE


def _rows(n, seed, heads=2, head_dim=16):
    return torch.randn(1, heads, n, head_dim, generator=torch.Generator().manual_seed(seed))


def test_appends_equal_cat_and_reuse_one_buffer():
    past, reference, buffers = torch.tensor([]), torch.tensor([]), set()
    for step in range(300):
        new = _rows(5 if step == 0 else 1, step)
        past, reference = kv_append.append(past, new, -2), torch.cat([reference, new], dim=-2)
        assert torch.equal(past, reference) and past.shape == reference.shape
        buffers.add(past._base.data_ptr())
    assert len(buffers) == 2, "5 rows and room for 256; the 262nd row reallocates"
    assert past._base.size(2) == 262 + kv_append.room_after(262)


def test_a_cropped_cache_and_a_second_branch_get_buffers_of_their_own():
    cache = kv_append.append(torch.tensor([]), _rows(8, 0), -2)
    longer = kv_append.append(cache, _rows(1, 1), -2)
    kept = longer.clone()
    cropped = longer[..., :-3, :]  # DynamicCache.crop: a view that ends before the buffer's rows
    branch = kv_append.append(cropped, _rows(1, 2), -2)
    assert torch.equal(longer, kept), "rows the longer view shows were written"
    assert branch._base.data_ptr() != longer._base.data_ptr()
    assert torch.equal(branch, torch.cat([kept[..., :-3, :], _rows(1, 2)], dim=-2))
    again = kv_append.append(cache, _rows(1, 3), -2)  # the state before `longer`: its room is taken
    assert torch.equal(longer, kept) and torch.equal(again, torch.cat([cache, _rows(1, 3)], dim=-2))
    assert again._base.data_ptr() != longer._base.data_ptr()


def test_a_sliding_window_view_keeps_appending_in_place():
    cache = kv_append.append(torch.tensor([]), _rows(8, 0), -2)
    window = kv_append.append(cache, _rows(1, 1), -2)[..., -4:, :]  # DynamicSlidingWindowLayer's last rows
    grown = kv_append.append(window, _rows(1, 2), -2)
    assert grown._base is window._base and torch.equal(grown, torch.cat([window, _rows(1, 2)], dim=-2))


@pytest.mark.parametrize("dim", [0, 1, 3, -1])
def test_any_dim(dim):
    first, new = _rows(3, 0), _rows(3, 1)
    grown = kv_append.append(kv_append.append(torch.tensor([]), first, dim), new, dim)
    assert grown._base is not None and torch.equal(grown, torch.cat([first, new], dim))


@pytest.mark.parametrize("past, new", [
    (_rows(3, 0), _rows(1, 1).double()),  # dtypes differ: cat promotes
    (_rows(3, 0), _rows(1, 1, heads=3)),  # sizes differ: cat raises
    (_rows(3, 0).requires_grad_(), _rows(1, 1)),  # autograd: a copy into room would record a write
], ids=["dtypes", "sizes", "grad"])
def test_what_append_does_not_take_runs_as_cat(past, new):
    try:
        expected = torch.cat([past, new], -2)
    except RuntimeError as error:
        with pytest.raises(RuntimeError, match=str(error)[:40]):
            kv_append.append(past, new, -2)
        return
    actual = kv_append.append(past, new, -2)
    assert torch.equal(actual, expected) and actual.dtype == expected.dtype and actual._base is None


class DecodeStep(torch.nn.Module):
    """transformers' DynamicCache update and grouped-query attention over it, one step;
    ``reader`` also reads the grown keys with an op that is not attention."""

    def __init__(self, reader=None):
        super().__init__()
        self.reader = reader

    def forward(self, q, k, v, cache: dict):
        cache["k"] = torch.cat([cache["k"], k], dim=-2)
        cache["v"] = torch.cat([cache["v"], v], dim=-2)
        out = F.scaled_dot_product_attention(q, cache["k"], cache["v"], scale=0.25, enable_gqa=True)
        return out if self.reader is None else (out, self.reader(cache["k"]))


def _decode(module, steps, compiled):
    cache, outputs = {"k": torch.tensor([]), "v": torch.tensor([])}, []
    run = torch.compile(module, backend=compiled) if compiled else module
    with torch.no_grad():
        for step in range(steps):
            rows = 6 if step == 0 else 1
            q, k, v = _rows(rows, 3 * step, heads=8), _rows(rows, 3 * step + 1), _rows(rows, 3 * step + 2)
            outputs.append(run(q, k, v, cache))
    return outputs, cache


def test_decode_steps_append_with_the_reference_values_and_compile_no_more():
    torch._dynamo.reset()
    captured = Captured()
    actual, cache = _decode(DecodeStep(), 300, captured)
    expected, reference = _decode(DecodeStep(), 300, None)
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, **TOLERANCE["attention_f32"])
    assert torch.equal(cache["k"], reference["k"]) and torch.equal(cache["v"], reference["v"])
    assert cache["k"]._base is not None and cache["k"]._base.size(2) > cache["k"].size(2)
    assert len(captured.graphs) == 2, "the first call, then one graph of symbolic sizes and strides for every later step"
    notes = [note for graph in captured.graphs for note in graph[3].notes if "KV cache" in note]
    assert notes == ["2 KV cache cat(s) append into room kept after the cache's rows"] * 2


class TestDecodeGraph(expecttest.TestCase):
    def test_the_caches_cats_become_appends(self):
        torch._dynamo.reset()
        captured = Captured()
        _decode(DecodeStep(), 1, captured)
        lines = [line for line in short_graph(captured.lowered).splitlines() if "append" in line or "cat" in line]
        self.assertExpectedInline("\n".join(lines), """\
cat = kv_append.append(l_cache_k_, l_k_, -2)
cat_1 = kv_append.append(l_cache_v_, l_v_, -2)
attention_f32 = attention.attention_f32(l_q_, cat, cat_1, None, 0.25)
kernel_chain_0 = kernel_chain(l_cache_k_, l_k_, l_cache_v_, l_v_, l_q_) of 3 steps -> (cat, cat_1, attention_f32)""")

    def test_a_cat_read_by_another_op_stays_a_cat(self):
        torch._dynamo.reset()
        captured = Captured()
        reader = DecodeStep(reader=lambda keys: keys.view(-1) * 2)
        [(out, doubled)], _ = _decode(reader, 1, captured)
        [(_, expected)], _ = _decode(reader, 1, None)
        assert torch.equal(doubled, expected)
        lines = [line for line in short_graph(captured.lowered).splitlines() if "append" in line or "cat" in line]
        self.assertExpectedInline("\n".join(lines), """\
cat = torch.cat([l_cache_k_, l_k_], dim=-2)
cat_1 = kv_append.append(l_cache_v_, l_v_, -2)
attention_f32 = attention.attention_f32(l_q_, cat, cat_1, None, 0.25)
kernel_chain_0 = kernel_chain(l_cache_v_, l_v_, l_q_, cat) of 2 steps -> (cat_1, attention_f32)
view = cat.view(-1)
return (getitem_1, mul, cat, getitem)""")


def racing(monkeypatch, calls: list, checks: int = 1) -> list:
    """``calls`` run in threads of their own, each held after its ``checks``-th ``kv_append.room``
    until every thread got there: all of them saw the same room free before any took it (the
    interleaving that gave two threads views of the same rows), forced rather than hoped for.
    ``kv_append.room`` is itself again on return."""
    barrier, seen, original = threading.Barrier(len(calls), timeout=30), threading.local(), kv_append.room

    def room(*args):
        found = original(*args)
        seen.count = getattr(seen, "count", 0) + 1
        if seen.count == checks:
            barrier.wait()
        return found

    def run(call):
        with torch.no_grad():  # (grad mode is per thread)
            return call()

    with monkeypatch.context() as patched:
        patched.setattr(kv_append, "room", room)
        return in_threads([functools.partial(run, call) for call in calls], barrier.abort)


def in_place(grown: torch.Tensor, past: torch.Tensor) -> bool:
    return grown.untyped_storage().data_ptr() == past.untyped_storage().data_ptr()


def test_two_threads_extending_one_cache_state_get_their_own_rows(monkeypatch):
    """Beam branches or a shared prefix: each thread's result is its own cat; one took the room,
    the other a new buffer (both had been given views of the same row: one thread's values)."""
    cache = kv_append.append(torch.tensor([]), _rows(8, 0), -2)
    kept, new = cache.clone(), [_rows(1, seed) for seed in (1, 2)]
    grown = racing(monkeypatch, [lambda rows=rows: kv_append.append(cache, rows, -2) for rows in new])
    for result, rows in zip(grown, new):
        assert torch.equal(result, torch.cat([kept, rows], dim=-2))
    assert torch.equal(cache, kept)
    assert sorted(in_place(result, cache) for result in grown) == [False, True]


@needs_own_kernels
def test_two_threads_decoding_from_one_compiled_cache_state_get_their_own_rows(monkeypatch):
    """The same through torch.compile: the kernel chain's program claims both caches' room
    before its C call (each thread held after checking both); the loser runs the nodes."""
    from qbackend.kernels.kernel_chain import _Program

    torch._dynamo.reset()
    run, cache = torch.compile(DecodeStep(), backend="qbackend"), {"k": torch.tensor([]), "v": torch.tensor([])}
    with torch.no_grad():
        for step in range(3):  # (an empty cache, then the symbolic graph's first call prepares the program)
            run(_rows(6 if step == 0 else 1, 3 * step, heads=8), _rows(6 if step == 0 else 1, 3 * step + 1),
                _rows(6 if step == 0 else 1, 3 * step + 2), cache)
    kept = {name: value.clone() for name, value in cache.items()}
    steps = [(_rows(1, 10 + 3 * k, heads=8), _rows(1, 11 + 3 * k), _rows(1, 12 + 3 * k), dict(cache)) for k in range(2)]
    programs, original = [], _Program.run
    monkeypatch.setattr(_Program, "run", lambda self, inputs: programs.append(self) or original(self, inputs))
    outputs = racing(monkeypatch, [lambda step=step: run(*step) for step in steps], checks=2)
    assert len(programs) == 2, "both calls ran the chain's program"
    for (q, k, v, grown), out in zip(steps, outputs):
        keys, values = torch.cat([kept["k"], k], dim=-2), torch.cat([kept["v"], v], dim=-2)
        assert torch.equal(grown["k"], keys) and torch.equal(grown["v"], values)
        expected = F.scaled_dot_product_attention(q, keys, values, scale=0.25, enable_gqa=True)
        torch.testing.assert_close(out, expected, **TOLERANCE["attention_f32"])
    assert sorted(in_place(grown["k"], cache["k"]) for *_, grown in steps) == [False, True]
