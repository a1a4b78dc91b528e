"""Every unary post-op on conv1d/2d/3d and linear, int8 and float output: folded where the
kernel accepts it (asked of the kernel) or one of qbackend's own kernels fuses it, left in the
graph with the kernel's reason where not (a relu / hardtanh before an int8 output: a clamp of
it), and numerics equal to the reference either way."""
import pytest
import torch

from qbackend.kernels import registry
from qbackend.lowering import own_conv
from qbackend.lowering.capabilities import conv_post_op_refusal, linear_post_op_refusal
from qbackend.patterns.examples import POST_OP_CALLS, HandQuantized, post_op_of

from tests.helpers import assert_matches_reference

SPATIAL = {0: (5, 8), 1: (8, 20), 2: (8, 12, 12), 3: (8, 6, 6, 6)}  # per rank, after the batch dim
CASES = [pytest.param(rank, name, quantized, id=f"{'linear' if rank == 0 else f'conv{rank}d'}-{name}-{'int8' if quantized else 'float'}")
         for rank in (0, 1, 2, 3) for name in POST_OP_CALLS for quantized in (True, False)]


def _refusal(rank, name):
    post = post_op_of(name)
    if rank == 0:
        return post.name, linear_post_op_refusal("cpu", post.name, post.scalars, post.algorithm)
    return post.name, conv_post_op_refusal("cpu", rank, post.name, post.scalars, post.algorithm)


@pytest.mark.parametrize("rank,name,quantized", CASES)
def test_post_op(rank, name, quantized):
    module = HandQuantized(rank, post_op=name, quantize_output=quantized)
    inputs = (torch.randn(2, *SPATIAL[rank]),)
    (decision,) = assert_matches_reference(module, inputs).report.decisions
    assert decision.lowered and decision.rule == ("qlinear" if rank == 0 else "qconv"), decision
    attr, refusal = _refusal(rank, name)
    out = "quantize(torch.uint8)" if quantized else "torch.float32 out"
    if refusal is None:
        assert decision.post_ops == [attr, out]
    elif rank == 2 and attr in own_conv.ACTIVATIONS and registry.available() is None:  # (GELU: MaxViT's convs)
        assert decision.post_ops == [attr, out]
        assert decision.reason.startswith(f"qbackend's conv kernel, not oneDNN: oneDNN refuses the post-op: {refusal};"), decision.reason
    elif quantized and attr in ("relu", "hardtanh"):  # (conv3d): the kernel's int8 output clamped
        assert decision.post_ops == [attr, out]
        assert f"{attr} as a clamp of the int8 output to [" in decision.reason, decision.reason
    else:
        assert decision.post_ops == ["torch.float32 out"]
        assert decision.reason.startswith(f"{attr}{', ' + out if quantized else ''} not fused: {refusal}"), decision.reason


def test_linear_accepts_every_post_op_in_the_table():
    """Linear fuses all of them on torch 2.13 (Inductor 2.13 fuses only relu and gelu)."""
    assert all(_refusal(0, name)[1] is None for name in POST_OP_CALLS)
