"""Freezing: weights are quantized and prepacked once, at compile time, never per call."""
import copy

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from qbackend.kernels import registry
from qbackend.pipeline import static_module
from qbackend.lowering import depthwise, gemm, stem
from qbackend.models import tiny_resnet

from tests.helpers import assert_outputs_close, compile_and_run, quantize

PER_CALL_WEIGHT_WORK = ("qconv_prepack", "qlinear_prepack", "quantize_per_channel", "dequantize_per_channel")


def _compiled_tiny_resnet():
    inputs = (torch.randn(2, 3, 32, 32),)
    converted = quantize(tiny_resnet(), inputs)
    torch._dynamo.reset()
    return converted, torch.compile(converted, backend="qbackend"), inputs


def test_second_call_runs_no_weight_quantization_or_prepack(monkeypatch):
    """On oneDNN (qbackend's own kernels off: the profiler sees oneDNN's ops, not theirs)."""
    monkeypatch.setattr(registry, "available", lambda: "qbackend's own kernels are unavailable: switched off by the test")
    _, compiled, inputs = _compiled_tiny_resnet()
    with torch.no_grad():
        compiled(*inputs)
        with profile(activities=[ProfilerActivity.CPU]) as trace:
            compiled(*inputs)
    names = {event.name for event in trace.events()}
    assert any("qconv" in n for n in names), sorted(names)  # the profiler did see the kernels
    offenders = sorted(n for n in names if any(word in n for word in PER_CALL_WEIGHT_WORK))
    assert not offenders, offenders


def test_second_call_packs_no_weights_for_own_kernels(monkeypatch):
    """The own kernels' weights are packed while lowering, never on a call."""
    if registry.available() is not None:
        pytest.skip(registry.available())
    packs = []
    for module in (gemm, depthwise, stem):
        original = module.pack
        monkeypatch.setattr(module, "pack", lambda *a, original=original, **k: packs.append(1) or original(*a, **k))
    _, compiled, inputs = _compiled_tiny_resnet()
    with torch.no_grad():
        compiled(*inputs)
        lowered = len(packs)
        compiled(*inputs)
    assert lowered > 0 and len(packs) == lowered, (lowered, len(packs))


def test_weights_are_snapshotted_at_compile_time():
    """Like Inductor's freezing: later edits of the module's weights do not reach the compiled model."""
    converted, compiled, inputs = _compiled_tiny_resnet()
    with torch.no_grad():
        before = compiled(*inputs)
        for name, buffer in converted.named_buffers():
            if buffer.dtype == torch.int8:
                buffer.zero_()
        after = compiled(*inputs)
    assert torch.equal(before, after)


def _placeholders(gm) -> int:
    return sum(node.op == "placeholder" for node in gm.graph.nodes)


def test_a_converted_model_passes_dynamo_no_weights_per_call():
    """quantize_x86's result is one Dynamo specializes on (qbackend/pipeline/static_module.py): its
    tensors reach the backend as graph attributes, not as inputs gathered and checked on every
    call; a deepcopy keeps that, and the numerics are the reference's. Unmarked, every tensor is
    an input, and the report says so and what to call."""
    inputs = (torch.randn(2, 3, 32, 32),)
    converted = quantize(tiny_resnet(), inputs)
    assert static_module.is_static(converted) and all(map(static_module.is_static, converted.modules()))
    for model in (converted, copy.deepcopy(converted)):
        actual, expected, captured = compile_and_run(model, inputs)
        assert _placeholders(captured.graphs[0][0]) == 1
        assert_outputs_close(actual, expected, "tiny_resnet")
        assert not any("mark_static" in note for note in captured.report.notes), captured.report.notes
    plain = copy.deepcopy(converted)
    for module in plain.modules():
        del module.torchdynamo_force_dynamic
    tensors = len({node.target for node in plain.graph.nodes if node.op == "get_attr"})
    _, _, captured = compile_and_run(plain, inputs)
    assert _placeholders(captured.graphs[0][0]) == 1 + tensors  # (the default: every tensor an input)
    assert tensors >= static_module.LIFTED_WEIGHTS_NOTED
    assert static_module.lifted_weights_note(tensors) in captured.report.notes, captured.report.notes
    assert static_module.lifted_weights_note(static_module.LIFTED_WEIGHTS_NOTED - 1) is None


def _get_attr_targets(gm) -> list:
    return [node.target for node in gm.graph.nodes if node.op == "get_attr"]


def test_a_marked_model_reads_its_tensors_from_the_root_with_its_state_dict_keys():
    """A converted model saved with torch.export and loaded again reads its weights from
    submodules and keeps a get_attr node per float weight convert_pt2e replaced, nothing reading
    it: each a chain of guards Dynamo checks per call. Marked, every tensor the graph reads is
    the root's and the unread nodes are gone; ``state_dict`` keeps its keys and their order (a
    copy too, and inside a parent module), ``load_state_dict`` takes them, outputs are the same."""
    inputs = (torch.randn(2, 3, 32, 32),)
    loaded = torch.export.export(quantize(tiny_resnet(), inputs), inputs).module()
    assert any("." in target for target in _get_attr_targets(loaded))
    unread = sum(not node.users for node in loaded.graph.nodes if node.op == "get_attr")
    assert unread > 0
    state = {key: value.clone() for key, value in loaded.state_dict().items()}
    reads = len(_get_attr_targets(loaded)) - unread
    with torch.no_grad():
        expected = loaded(*inputs)
        marked = static_module.mark_static(loaded)
        assert len(_get_attr_targets(marked)) == reads and not any("." in t for t in _get_attr_targets(marked))
        assert list(marked.state_dict()) == list(state)
        assert not marked.load_state_dict(state).missing_keys
        for model in (marked, copy.deepcopy(marked)):
            assert list(model.state_dict()) == list(state) and torch.equal(model(*inputs), expected)
        parent = torch.nn.Sequential(torch.nn.Identity(), marked)
        assert list(parent.state_dict()) == [f"1.{key}" for key in state]
        parent.load_state_dict({f"1.{key}": torch.zeros_like(value) for key, value in state.items()})
        assert not torch.equal(marked(*inputs), expected)  # (the loaded zeros are what the graph reads)
        marked.load_state_dict(state)
        actual, reference, captured = compile_and_run(marked, inputs)
    assert _placeholders(captured.graphs[0][0]) == 1
    assert torch.equal(reference, expected)
    assert_outputs_close(actual, expected, "tiny_resnet loaded")


def test_flat_names_are_identifiers():
    """A Sequential's ``0.bias`` is read as ``_0__bias``: a get_attr target an archive takes."""
    inputs = (torch.randn(2, 8, 6, 6),)
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 1))
    loaded = torch.export.export(quantize(model.eval(), inputs), inputs).module()
    targets = _get_attr_targets(static_module.mark_static(loaded))
    assert "_0__bias" in targets and all(t.isidentifier() for t in targets), targets


def test_replacing_a_weight_of_a_static_model_recompiles():
    """Specialized means guarded by identity: a tensor swapped for another is seen (an in-place
    edit is not, as with any frozen weights: test_weights_are_snapshotted_at_compile_time)."""
    inputs = (torch.randn(2, 3, 32, 32),)
    converted = quantize(tiny_resnet(), inputs)
    torch._dynamo.reset()
    compiled = torch.compile(converted, backend="qbackend")
    with torch.no_grad():
        before = compiled(*inputs)
        name, weight = next((n, b) for n, b in converted.named_buffers() if b.dtype == torch.int8)
        owner, _, attribute = name.rpartition(".")
        setattr(converted.get_submodule(owner), attribute, torch.zeros_like(weight))
        expected, after = converted(*inputs), compiled(*inputs)
    assert not torch.equal(before, after)
    assert_outputs_close(after, expected, "tiny_resnet")


def test_a_graph_that_updates_its_own_buffer_stays_dynamic():
    """Its buffer's values change from call to call: it must stay a graph input."""
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("total", torch.zeros(3))

        def forward(self, x):
            self.total.add_(x)
            return self.total * 2

    traced = torch.fx.symbolic_trace(Counter())  # (add_ as a method call: freeze.is_written reads both forms)
    assert not static_module.is_static(static_module.mark_static(traced))
    plain = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    assert static_module.is_static(static_module.mark_static(plain))
