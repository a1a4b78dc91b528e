"""The GEMM's exact int16 build (csrc/conv_gemm_int8_exact16.c): 8-bit activations x 8-bit
weights, whose int16 pair sums saturate the AVX2 build's vpmaddubsw, give the reference's
integers on any AVX2 CPU; the lowering packs such weights for it instead of keeping the layer
float."""
import math

import pytest
import torch
import torch.nn as nn

from qbackend.kernels import registry
from qbackend.lowering import gemm
from qbackend.lowering.own_conv import scale_and_offset

from tests.helpers import compile_and_run, kernel_calls, needs_own_kernels, quantize, simulate_cpu
from tests.kernels.test_own_conv_kernels import reference
from tests.tolerances import assert_int8_close, assert_outputs_close


@needs_own_kernels
def test_sums_past_int16_are_exact():
    """255 x (127 + 127) per pair overflows vpmaddubsw's int16; vpmaddwd of int16 pairs adds in int32."""
    x = torch.full((1, 64, 2, 2), 255, dtype=torch.uint8)
    w = torch.full((8, 64, 1, 1), 127, dtype=torch.int8)
    mult, add = (t.float() for t in scale_and_offset(w, torch.ones(8), 1.0, 0))
    out = registry.op("qconv")(x, gemm.pack(w, exact16=True), mult, add, None, 0.0, -math.inf, math.inf, 1.0, 0, 0, 255, True)
    assert torch.equal(out, torch.full((1, 8, 2, 2), 255.0 * 127 * 64))


@needs_own_kernels
@pytest.mark.parametrize("kernel,stride,padding", [((1, 1), 1, 0), ((3, 3), 1, 1), ((3, 3), 2, 1), ((1, 3), 1, (0, 1))],
                         ids=["1x1", "3x3", "3x3 stride 2", "1x3"])
@pytest.mark.parametrize("cin,cout", [(36, 40), (3, 116), (58, 58)], ids=["36 -> 40", "3 -> 116", "58 -> 58"])
@pytest.mark.parametrize("residual", [None, "uint8", "float"])
def test_full_range_weights_give_the_reference_integers(kernel, stride, padding, cin, cout, residual):
    """Full 8-bit activations and weights; channel counts the packing pads (3, 58), tails of
    8-wide output blocks (116), windows leaving the image (the input's zero point, 7, there)."""
    torch.manual_seed(0)
    x_scale, x_zp, out_scale, out_zp, r_scale, r_zp = 0.03, 7, 0.2, 60, 0.04, 11
    padding = padding if isinstance(padding, tuple) else (padding, padding)
    x = torch.randint(0, 256, (2, cin, 7, 9), dtype=torch.uint8)
    w = torch.randint(-128, 128, (cout, cin, *kernel), dtype=torch.int8)
    w_scale, bias = torch.rand(cout) * 0.01 + 0.001, torch.randn(cout)
    out_shape = (2, cout, *(nn.functional.conv2d(torch.zeros(1, 1, 7, 9), torch.zeros(1, 1, *kernel), None, stride,
                                                 padding).shape[2:]))
    r = {None: None, "uint8": torch.randint(0, 256, out_shape, dtype=torch.uint8), "float": torch.randn(out_shape)}[residual]
    shift = -r_zp * r_scale if residual == "uint8" else 0.0
    mult, add = (t.float() for t in scale_and_offset(w, w_scale, x_scale, x_zp, bias, shift))
    scale = {None: 0.0, "uint8": r_scale, "float": 1.0}[residual]
    actual = registry.op("qconv")(x, gemm.pack(w, exact16=True), mult, add, r, scale, 0.0, math.inf, out_scale, out_zp,
                                  0, 255, False, "none", kernel, (stride, stride), padding, (1, 1), x_zp)
    expected = reference(x, x_scale, x_zp, w, w_scale, bias, stride, padding, 0.0, math.inf, out_scale, out_zp, 0, 255,
                         r, *((r_scale, r_zp) if residual == "uint8" else (1.0, 0)))  # (a float residual: scale 1, zero point 0)
    assert actual.is_contiguous(memory_format=torch.channels_last)
    assert_int8_close(actual, expected, f"{cin} -> {cout} {kernel} stride {stride} residual={residual}")


@needs_own_kernels
def test_8bit_weights_lower_onto_it_where_the_avx2_build_would_saturate(monkeypatch):
    """A model with X86InductorQuantizer's own 8-bit weights on a CPU without VNNI: every conv and
    linear runs on the GEMM, the same integers as the reference, its weights int16."""
    simulate_cpu(monkeypatch, saturates=True)
    monkeypatch.setattr("qbackend.kernels.isa.int8_build", lambda: "avx2")
    monkeypatch.setattr("qbackend.kernels.isa.gemm_build", lambda: "avx2")
    x = torch.randn(2, 8, 6, 6)
    model = quantize(nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 1), nn.Flatten(),
                                   nn.Linear(8 * 6 * 6, 10)).eval(), (x,), reduce_range=False)
    actual, expected, captured = compile_and_run(model, (x,))
    assert_outputs_close(actual, expected, "8-bit weights")
    report = captured.report
    assert [(d.node, d.op) for d in report.decisions] == [
        ("conv2d", "qbackend::qconv.default"), ("conv2d_1", "qbackend::qconv.default"), ("linear", "qbackend::qconv.default")
    ], str(report)
    assert all("not oneDNN: this CPU's oneDNN int8 kernel adds pairs of products in int16" in d.reason
               and "its exact int16 build, not vpmaddubsw" in d.reason for d in report.decisions), str(report)
    weights = [args[1] for args in kernel_calls(captured.lowered, "qconv")]
    assert [getattr(captured.lowered, w.target).dtype if isinstance(w, torch.fx.Node) else w.dtype
            for w in weights] == [torch.int16] * 3
