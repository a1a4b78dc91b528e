"""Freezing: weights are quantized and prepacked once, at compile time, never per call."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from qbackend import native
from qbackend.lowering import depthwise, gemm, stem
from qbackend.models import tiny_resnet

from .helpers import quantize

PER_CALL_WEIGHT_WORK = ("qconv_prepack", "qlinear_prepack", "quantize_per_channel", "dequantize_per_channel")


def _compiled_tiny_resnet():
    inputs = (torch.randn(2, 3, 32, 32),)
    converted = quantize(tiny_resnet(), inputs)
    torch._dynamo.reset()
    return converted, torch.compile(converted, backend="qbackend"), inputs


def test_second_call_runs_no_weight_quantization_or_prepack(monkeypatch):
    """On oneDNN (qbackend's own kernels off: the profiler sees oneDNN's ops, not theirs)."""
    monkeypatch.setattr(native, "available", lambda: "qbackend's own kernels are unavailable: switched off by the test")
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
    if native.available() is not None:
        pytest.skip(native.available())
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
