"""``options={"remainder": "inductor"}``: Inductor compiles the float ops around the lowered
oneDNN calls. The kernels still run, the float ops no longer run as ATen calls, the numerics
are the reference's, no input is written, and a failing Inductor leaves the eager lowered graph."""
import pytest
import torch
import torch.nn as nn
from torch.profiler import profile

import qbackend
from qbackend.models import bert_encoder_like, tiny_resnet

from tests.helpers import dense_convs_on_onednn, needs_own_kernels, quantize
from tests.tolerances import assert_outputs_close, assert_weight_only_close

INDUCTOR = {"remainder": "inductor"}
COMPILED_NOTE = "remainder (the ops around the lowered kernels) compiled by Inductor"


def _encoder():
    inputs = (torch.randn(1, 16, 64),)  # 16 rows: within every GEMM build's max_rows
    return quantize(bert_encoder_like(num_layers=1, hidden=64, heads=4, ffn=128), inputs), inputs


def _ops_run(compiled, inputs) -> set:
    with profile() as trace:
        compiled(*inputs)
    return {event.name for event in trace.events()}


@needs_own_kernels
def test_encoder_kernels_stay_and_float_ops_fuse():
    model, inputs = _encoder()
    reports = []
    eager = qbackend.compile(model)
    fused = qbackend.compile(model, {**INDUCTOR, "report_sink": reports.append})
    given = inputs[0].clone()
    with torch.no_grad():
        expected = model(*inputs)
        assert_outputs_close(fused(*inputs), expected, "remainder by Inductor")
    assert_outputs_close(fused(*inputs), expected, "called with grad enabled")
    assert torch.equal(inputs[0], given)  # (Inductor's own int8 lowering writes into its input here)
    report, = reports
    assert COMPILED_NOTE in report.notes and report.lowered and not report.kept, str(report)
    eager_ops, fused_ops = _ops_run(eager, inputs), _ops_run(fused, inputs)
    assert "qbackend::qconv" in fused_ops  # (the encoder's linears: qbackend's own GEMM kernel)
    assert "aten::native_layer_norm" in eager_ops and "aten::native_layer_norm" not in fused_ops


def test_conv_residual_in_place_sum_through_dynamo(monkeypatch):
    """The in-place conv sum declares its write (``Tensor(a!)``): traced and lowered by Inductor."""
    dense_convs_on_onednn(monkeypatch)
    inputs = (torch.randn(2, 3, 32, 32),)
    model = quantize(tiny_resnet(), inputs)
    given = inputs[0].clone()
    reports = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="qbackend", options={**INDUCTOR, "report_sink": reports.append})
    with torch.no_grad():
        assert_outputs_close(compiled(*inputs), model(*inputs), "tiny_resnet, remainder by Inductor")
    assert torch.equal(inputs[0], given)
    assert COMPILED_NOTE in reports[0].notes, str(reports[0])
    assert "onednn::qconv2d_pointwise" in _ops_run(compiled, inputs)


def test_inductor_failure_runs_the_lowered_graph_eagerly(monkeypatch):
    import torch._inductor.compile_fx as compile_fx

    def fail(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(compile_fx, "compile_fx", fail)
    model, inputs = _encoder()
    reports = []
    with torch.no_grad():
        result = qbackend.compile(model, {**INDUCTOR, "report_sink": reports.append})(*inputs)
        assert torch.equal(result, qbackend.compile(model)(*inputs))
    assert "remainder runs eagerly: Inductor failed (RuntimeError: no C++ compiler found)" in reports[0].notes


def test_unknown_remainder_is_refused():
    with pytest.raises(ValueError, match="remainder='tvm'; valid: 'eager', 'inductor'"):
        qbackend.compile(_encoder()[0], {"remainder": "tvm"})(torch.randn(1, 16, 64))


def test_softmax_over_queries_stays_correct():
    """Inductor 2.13's attention pass rewrites matmul -> scale -> + mask -> softmax(dim=-2) ->
    matmul into SDPA, which takes the softmax over -1: 0.13 off on this model (plain
    ``torch.compile`` too). qbackend's sdpa rule rejects it, and Inductor runs without its passes."""
    from tests.kernels.test_attention import MaskedAttention, inputs

    model = quantize(MaskedAttention(dim=-2), inputs())
    reports = []
    with torch.no_grad():
        result = qbackend.compile(model, {**INDUCTOR, "report_sink": reports.append})(*inputs())
        torch.testing.assert_close(result, model(*inputs()), rtol=0, atol=1e-5)
    assert COMPILED_NOTE in reports[0].notes
    assert "softmax is not over the last dim" in reports[0].kept[0].reason, str(reports[0])


def test_symbolic_sizes_keep_the_eager_remainder():
    """Dynamo's dynamic graph takes any size; Inductor would be handed the example's."""
    from qbackend.patterns.examples import HandQuantized

    module, reports = HandQuantized(rank=2), []
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="qbackend", dynamic=True, options={**INDUCTOR, "report_sink": reports.append})
    with torch.no_grad():
        for batch, size in ((2, 12), (3, 9)):
            x = torch.randn(batch, 8, size, size)
            assert (compiled(x) - module(x)).abs().max() <= 0.03 * 1.0001, (batch, size)  # within one output step
    assert len(reports) == 1 and reports[0].lowered
    assert "remainder runs eagerly: the graph has symbolic sizes (Inductor is handed static ones here)" in reports[0].notes


@needs_own_kernels
def test_weight_only_int16_kernel_stays_an_extern_call_under_inductor():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.SiLU(), nn.Linear(512, 256)).eval()
    reference = nn.Sequential(nn.Linear(256, 512), nn.SiLU(), nn.Linear(512, 256)).eval()
    qbackend.quantize_weights(model, bits=4, group_size=64)
    reference.load_state_dict(model.state_dict())
    x, reports = torch.randn(3, 256), []
    compiled = qbackend.compile(model, {**INDUCTOR, "report_sink": reports.append})
    with torch.no_grad():
        compiled(x)  # compiles
        with profile() as trace:
            actual = compiled(x)
    assert_weight_only_close(actual, reference(x).detach(), "int16 under Inductor", "weight_only_int16")
    assert COMPILED_NOTE in reports[0].notes
    assert sum(e.name == "qbackend::int4_mm_int16" for e in trace.events()) == 2
