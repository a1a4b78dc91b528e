"""Rotary position embedding as one call (qbackend/llm/rotary.py): the graph's values bit for bit,
the calls it rewrites, and the results it leaves alone."""
import expecttest
import pytest
import torch
import torch.nn.functional as F

from qbackend.kernels import rotary

from tests.helpers import lowered_lines, needs_own_kernels
from tests.tolerances import TOLERANCE


def rotate_half(x):
    """transformers' rotate_half."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _reference(q, cos, sin):
    return (q * cos) + (rotate_half(q) * sin)


def _geometry(batch, heads, length, head_dim, seed=0):
    """q as a projection's heads (a transposed view), cos and sin for the positions."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads * head_dim, generator=generator).view(batch, length, heads, head_dim).transpose(1, 2)
    angles = torch.randn(batch, length, head_dim, generator=generator)
    return q, angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


@needs_own_kernels
@pytest.mark.parametrize("batch, heads, length, head_dim", [(1, 32, 1, 64), (2, 4, 9, 16), (1, 3, 300, 20)],
                         ids=["decode", "prefill", "a tail, rows in parallel"])
def test_kernel_equals_the_graphs_ops(batch, heads, length, head_dim):
    q, cos, sin = _geometry(batch, heads, length, head_dim)
    actual = rotary.rotary(q, cos, sin)
    assert torch.equal(actual, _reference(q, cos, sin)) and actual.is_contiguous()
    shared = (cos[:1], sin[:1])  # (positions shared by the batch: broadcast over it too)
    assert torch.equal(rotary.rotary(q, *shared), _reference(q, *shared))


@needs_own_kernels
def test_a_nan_or_signed_zero_comes_out_as_in_the_graph():
    q, cos, sin = _geometry(1, 2, 3, 16)
    q[0, 0, 0, 3], q[0, 1, 2, 9], sin[0, 0, 1, :] = float("nan"), -0.0, float("inf")
    actual, expected = rotary.rotary(q, cos, sin), _reference(q, cos, sin)
    assert torch.equal(actual.isnan(), expected.isnan())
    assert torch.equal(actual.nan_to_num(), expected.nan_to_num()) and torch.equal(actual.signbit(), expected.signbit())


@pytest.mark.parametrize("q, cos", [
    (torch.randn(1, 2, 3, 15), torch.randn(1, 1, 3, 15)),  # odd head dim
    (torch.randn(1, 2, 3, 16, dtype=torch.float64), torch.randn(1, 1, 3, 16, dtype=torch.float64)),
    (torch.randn(2, 3, 16), torch.randn(3, 16)),  # 3-D
    (torch.randn(1, 2, 3, 16), torch.randn(1, 1, 3, 1)),  # cos broadcast along the head dim
], ids=["odd", "float64", "3-D", "broadcast head dim"])
def test_what_the_kernel_does_not_take_runs_the_graphs_ops(q, cos):
    sin = cos.flip(-1) * 0.5
    assert torch.equal(rotary.rotary(q, cos, sin), _reference(q, cos, sin))


class RotaryAttention(torch.nn.Module):
    """Queries and keys rotated as transformers' apply_rotary_pos_emb does, then attention;
    ``returned``: the rotated keys also leave the graph."""

    def __init__(self, returned=False):
        super().__init__()
        self.returned = returned

    def forward(self, q, k, v, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_embed = (q * cos) + (rotate_half(q) * sin)
        k_embed = (k * cos) + (rotate_half(k) * sin)
        out = F.scaled_dot_product_attention(q_embed, k_embed, v, scale=0.25)
        return (out, k_embed) if self.returned else out


class StaticCacheAttention(RotaryAttention):
    """A StaticCache's update: the rotated keys copied into a cache buffer at their positions
    (``index_copy_``, which reads only their values), attention over the buffer."""

    def forward(self, q, k, v, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_embed = (q * cos) + (rotate_half(q) * sin)
        k_embed = (k * cos) + (rotate_half(k) * sin)
        keys = torch.zeros(k.shape[0], k.shape[1], 8, k.shape[3]).index_copy_(2, torch.arange(k.shape[2]), k_embed)
        return F.scaled_dot_product_attention(q_embed, keys[:, :, :k.shape[2]], v, scale=0.25)


def _run(module):
    q, cos, sin = _geometry(1, 2, 5, 16)
    k, v = _geometry(1, 2, 5, 16, seed=1)[0], _geometry(1, 2, 5, 16, seed=2)[0]
    return lowered_lines(module, (q, k, v, cos[:, 0], sin[:, 0]), "rotary", "cat", "attention")


@needs_own_kernels
class TestRotaryGraph(expecttest.TestCase):
    def test_queries_and_keys_become_calls(self):
        actual, expected, captured, lines = _run(RotaryAttention())
        torch.testing.assert_close(actual, expected, **TOLERANCE["attention_f32"])
        self.assertExpectedInline(lines, """\
rotary = rotary.rotary(l_q_, cos, sin)
rotary_1 = rotary.rotary(l_k_, cos, sin)
attention_f32 = attention.attention_f32(rotary, rotary_1, l_v_, None, 0.25)
kernel_chain_0 = kernel_chain(l_cos_, l_sin_, l_q_, l_k_, l_v_) of 5 steps -> (attention_f32)""")
        assert "2 rotary embedding(s) in one pass" in captured.report.notes

    def test_a_returned_result_keeps_the_graphs_layout(self):
        (out, keys), (expected_out, expected_keys), captured, lines = _run(RotaryAttention(returned=True))
        assert torch.equal(keys, expected_keys) and keys.stride() == expected_keys.stride()
        self.assertExpectedInline(lines, """\
rotary = rotary.rotary(l_q_, cos, sin)
cat_1 = torch.cat((neg_1, x1_1), dim=-1)
mul_3 = _operator.mul(cat_1, sin)
attention_f32 = attention.attention_f32(rotary, k_embed, l_v_, None, 0.25)
return (attention_f32, k_embed)""")

    def test_keys_a_static_cache_copies_in_become_a_call(self):
        actual, expected, captured, lines = _run(StaticCacheAttention())
        torch.testing.assert_close(actual, expected, **TOLERANCE["attention_f32"])
        assert "2 rotary embedding(s) in one pass" in captured.report.notes
