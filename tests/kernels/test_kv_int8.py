"""The int8 KV cache option (qbackend/llm/kv_int8.py): each append also keeps its buffer's rows as
int8 with a scale per row, attention reads those, and its result is attention's on the
dequantized keys and values, bit for bit; the float cache stays exact; anything the int8 rows
do not cover runs float attention."""
import expecttest
import pytest
import torch

from qbackend.kernels import kv_int8
from qbackend.kernels import attention
from qbackend.pipeline.backend import Options

from tests.helpers import Captured, needs_own_kernels, short_graph
from tests.kernels.test_kv_append import DecodeStep, _decode, _rows, in_place, racing


def _grown(seed, rows=40, scale=3.0):
    """A cache grown by appends: a prompt (one row of zeros: scale 1, not 0 / 0), then two single rows."""
    prompt = _rows(rows, seed) * scale
    prompt[0, 1, 5] = 0.0
    cache = kv_int8.append_int8(torch.tensor([]), prompt, -2)
    for step in range(2):
        cache = kv_int8.append_int8(cache, _rows(1, seed + 10 + step) * scale, -2)
    return cache


@needs_own_kernels
def test_rows_are_symmetric_int8_with_a_scale_per_row():
    keys = _grown(0)
    values, scales = kv_int8._int8_view(keys)
    assert values.dtype == torch.int8 and values.shape == keys.shape and scales.shape == keys.shape[:3]
    expected_scales = keys.abs().amax(-1) / 127
    assert scales[0, 1, 5] == 1.0
    expected_scales[0, 1, 5] = 1.0
    assert torch.equal(scales, expected_scales)
    assert torch.equal(values, torch.round(keys / scales[..., None]).to(torch.int8))
    assert values.abs().max() == 127


@needs_own_kernels
@pytest.mark.parametrize("query_rows, is_causal, masked", [(1, False, False), (1, False, True), (7, True, False)],
                         ids=["decode", "decode with a padding mask", "causal prompt rows"])
def test_attention_on_int8_rows_is_attention_on_their_dequantized_values(query_rows, is_causal, masked):
    keys, values = _grown(1), _grown(2, scale=1.0)
    q = _rows(query_rows, 3, heads=8)  # (grouped: 4 query heads per key / value head)
    mask = None
    if masked:
        mask = torch.zeros(1, 1, 1, keys.size(2))
        mask[..., :3] = float("-inf")
    (k8, k_scales), (v8, v_scales) = kv_int8._int8_view(keys), kv_int8._int8_view(values)
    dequantized = (k8.float() * k_scales[..., None], v8.float() * v_scales[..., None])
    actual = kv_int8.attention_kv_int8(q, keys, values, mask, 0.25, is_causal)
    assert torch.equal(actual, attention.attention_f32(q, *dequantized, mask, 0.25, is_causal))
    exact = attention.attention_f32(q, keys, values, mask, 0.25, is_causal)
    assert torch.nn.functional.cosine_similarity(actual.flatten(), exact.flatten(), 0) > 0.999


@needs_own_kernels
def test_views_the_int8_rows_do_not_cover_run_float_attention():
    q = _rows(1, 3, heads=8)
    keys, values = _grown(1), _grown(2)
    cropped = keys[:, :, :10]  # (a crop shows the buffer's rows, but with another length: still covered)
    assert kv_int8._int8_view(cropped) is not None
    plain = keys.clone()  # (not an append buffer's view)
    assert kv_int8._int8_view(plain) is None
    assert torch.equal(kv_int8.attention_kv_int8(q, plain, values, None, 0.25), attention.attention_f32(q, plain, values, None, 0.25))
    keys._base.__dict__.pop(kv_int8._INT8_ROWS)  # (rows appended before the option was on)
    assert torch.equal(kv_int8.attention_kv_int8(q, keys, values, None, 0.25), attention.attention_f32(q, keys, values, None, 0.25))


@needs_own_kernels
def test_two_threads_extending_one_cache_state_get_their_own_int8_rows(monkeypatch):
    """Each thread's result and its int8 rows are those of its own cat (the room's loser
    quantizes its new buffer), as if the threads had appended one after the other."""
    cache = _grown(4)
    new = [_rows(1, seed) * 3.0 for seed in (5, 6)]
    grown = racing(monkeypatch, [lambda rows=rows: kv_int8.append_int8(cache, rows, -2) for rows in new])
    assert sorted(in_place(result, cache) for result in grown) == [False, True]
    for result, rows in zip(grown, new):
        alone = kv_int8.append_int8(_grown(4), rows, -2)
        assert torch.equal(result, alone)
        assert all(map(torch.equal, kv_int8._int8_view(result), kv_int8._int8_view(alone)))


def test_the_option_takes_float_or_int8():
    with pytest.raises(ValueError, match="kv_cache='int4'; valid: 'float', 'int8'"):
        Options.parse({"kv_cache": "int4"})


@needs_own_kernels
class TestInt8Graph(expecttest.TestCase):
    def test_attention_over_appends_reads_the_int8_rows_and_the_float_cache_stays_exact(self):
        torch._dynamo.reset()
        captured = Captured(kv_cache="int8")
        actual, cache = _decode(DecodeStep(), 20, captured)
        expected, reference = _decode(DecodeStep(), 20, None)
        assert torch.equal(cache["k"], reference["k"]) and torch.equal(cache["v"], reference["v"])
        for got, want in zip(actual, expected):
            assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), 0) > 0.999
        notes = [note for graph in captured.graphs for note in graph[3].notes if "int8" in note]
        assert notes == ["1 attention call(s) read an int8 copy of their KV cache (option kv_cache='int8')"] * 2
        lines = [line for line in short_graph(captured.graphs[0][2]).splitlines() if "append" in line or "attention" in line]
        self.assertExpectedInline("\n".join(lines), """\
cat = kv_int8.append_int8(l_cache_k_, l_k_, -2)
cat_1 = kv_int8.append_int8(l_cache_v_, l_v_, -2)
attention_f32 = kv_int8.attention_kv_int8(l_q_, cat, cat_1, None, 0.25)
return (attention_f32, cat, cat_1)""")
