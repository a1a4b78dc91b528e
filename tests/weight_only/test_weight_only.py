"""Weight-only int4 / int8: the quantized-weight tensor behaves like a plain tensor, lowers to
the packed kernels, and matches the float linear on the dequantized weight."""
import io

import expecttest
import pytest
import torch
import torch.nn as nn

import qbackend
from qbackend.kernels import isa, registry, weight_only_mm
from qbackend.quantized_tensor import QuantizedLinearWeight
from qbackend.weight_only.weight_quant import pack_int4, unpack_int4

from tests.helpers import compile_and_run, needs_own_kernels, short_graph
from tests.tolerances import assert_weight_only_close


class MLP(nn.Module):
    """A gated MLP written three ways: F.linear, matmul(x, w.t()) and x @ w.T."""

    def __init__(self, hidden=256, inner=512):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(hidden, inner), nn.Linear(hidden, inner, bias=False), nn.Linear(inner, hidden)

    def forward(self, x):
        h = nn.functional.silu(self.gate(x)) * torch.matmul(x, self.up.weight.t())
        return h @ self.down.weight.T + self.down.bias


def quantized_and_reference(bits, group_size, dtype=torch.float32, seed=0, compute="auto"):
    """(weight-only model, float model with the dequantized weights)."""
    torch.manual_seed(seed)
    model = MLP().to(dtype).eval()
    qbackend.quantize_weights(model, bits=bits, group_size=group_size, compute=compute)
    reference = MLP().to(dtype).eval()
    reference.load_state_dict(model.state_dict())  # a float model gets the dequantized values
    return model, reference


KERNELS = {  # (compute choice, bits) -> the op the report names
    ("int16", 4): "qbackend::int4_mm_int16.default", ("int16", 8): "qbackend::int8_mm_int16.default",
    ("bf16", 4): "aten::_weight_int4pack_mm_for_cpu.default", ("bf16", 8): "aten::_weight_int8pack_mm.default",
}


@pytest.mark.parametrize("compute", ["auto", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (4, 128), (4, 256), (8, None)],
                         ids=["int4-g32", "int4-g64", "int4-g128", "int4-g256", "int8"])
def test_compiled_and_eager_match_the_dequantized_float_model(bits, group_size, dtype, compute):
    model, reference = quantized_and_reference(bits, group_size, dtype, compute=compute)
    x = torch.randn(2, 3, 256, dtype=dtype)
    actual, _, captured = compile_and_run(model, (x,), weight_only_compute=compute)
    with torch.no_grad():
        expected = reference.float()(x.float()).to(dtype)  # exact up to fp32 rounding
        eager = model(x)
    # "auto" is qbackend's int16 kernel wherever it builds (this suite's machines: AVX2 + cc)
    kernel = "int16" if compute == "auto" and registry.available() is None else "bf16"
    tolerance = "weight_only_int16" if kernel == "int16" and dtype == torch.float32 else "weight_only"
    assert_weight_only_close(actual, expected, "compiled", tolerance)
    assert_weight_only_close(eager, expected, "eager", tolerance)
    report = captured.report
    assert [d.rule for d in report.decisions] == [f"int{bits}_weight_linear"] * 3, str(report)
    assert {d.op for d in report.decisions} == {KERNELS[kernel, bits]}


def test_auto_without_the_int16_kernels_runs_torchs_with_the_reason(monkeypatch):
    monkeypatch.setattr(registry, "available", lambda: "qbackend's own kernels are unavailable: no C compiler found")
    model, reference = quantized_and_reference(4, 64)
    x = torch.randn(3, 256)
    actual, _, captured = compile_and_run(model, (x,))
    with torch.no_grad():
        assert_weight_only_close(actual, reference(x), "fallback")
    decision = captured.report.decisions[0]
    assert decision.op == KERNELS["bf16", 4]
    assert "torch's kernel: qbackend's own kernels are unavailable: no C compiler found" in decision.reason


class TestWeightOnlyGraphs(expecttest.TestCase):
    def lowered(self, model, x, **options):
        _, _, captured = compile_and_run(model, (x,), **options)
        return short_graph(captured.lowered), str(captured.report)

    @needs_own_kernels
    def test_int4_fp32_model_runs_qbackends_int16_kernel(self):
        model, _ = quantized_and_reference(4, 128)
        graph, report = self.lowered(model.gate, torch.randn(4, 256), weight_only_compute="int16")
        self.assertExpectedInline(graph, """\
l_args_0_ = input
int4_mm_int16 = weight_only_mm.int4_mm_int16(l_args_0_, <const>, <const>, <const>, 128)
add_tensor = aten.add.Tensor(int4_mm_int16, <const>)
return (add_tensor)""")
        assert "float32 activations quantized per group to int16 for qbackend's kernel" in report

    def test_int4_fp32_model_runs_torchs_kernel_in_bf16(self):
        model, _ = quantized_and_reference(4, 128)
        graph, report = self.lowered(model.gate, torch.randn(4, 256), weight_only_compute="bf16")
        self.assertExpectedInline(graph, """\
l_args_0_ = input
_to_copy_default = aten._to_copy(l_args_0_, dtype=bfloat16, memory_format=torch.contiguous_format)
_weight_int4pack_mm_for_cpu_default = aten._weight_int4pack_mm_for_cpu(_to_copy_default, <const>, 128, <const>)
_to_copy_default_1 = aten._to_copy(_weight_int4pack_mm_for_cpu_default, dtype=float32)
add_tensor = aten.add.Tensor(_to_copy_default_1, <const>)
return (add_tensor)""")
        assert "float32 activations computed in torch.bfloat16" in report

    def test_compute_in_the_activation_dtype_when_asked(self):
        model, reference = quantized_and_reference(8, None)
        x = torch.randn(2, 5, 256)
        graph, report = self.lowered(model.up, x, weight_only_compute="activation")
        self.assertExpectedInline(graph, """\
l_args_0_ = input
reshape_default = l_args_0_.reshape([-1, 256])
contiguous_default = aten.contiguous(reshape_default)
_weight_int8pack_mm_default = aten._weight_int8pack_mm(contiguous_default, <const>, <const>)
unflatten_rows = weight_only_linear.unflatten_rows(_weight_int8pack_mm_default, l_args_0_)
return (unflatten_rows)""")
        assert "computed in" not in report
        actual, _, _ = compile_and_run(model.up, (x,), weight_only_compute="activation")
        with torch.no_grad():
            assert_weight_only_close(actual, reference.up(x), "fp32 compute")


def test_plain_tensor_semantics():
    model, reference = quantized_and_reference(4, 64)
    w, dense = model.up.weight, reference.up.weight.detach()
    x = torch.randn(3, 256)
    with torch.no_grad():
        for name, got, want in [
            ("F.linear", nn.functional.linear(x, w), x @ dense.t()),
            ("matmul(x, w.t())", torch.matmul(x, w.t()), x @ dense.t()),
            ("x @ w.T", x @ w.T, x @ dense.t()),
        ]:
            assert_weight_only_close(got, want, name)
    assert isinstance(w.t().t(), QuantizedLinearWeight) and not w.t().t().transposed
    assert w.t().shape == (256, 512) and w.T.shape == (256, 512)
    assert torch.equal(w.t().t(), dense)  # any other op sees the dequantized values
    assert torch.equal(w + 0, dense)
    assert isinstance(w.detach(), QuantizedLinearWeight)
    moved = w.to("meta")
    assert isinstance(moved, QuantizedLinearWeight) and moved.device.type == "meta" and moved.qdata.device.type == "meta"
    assert w.to(torch.bfloat16).dtype == torch.bfloat16 and w.to(torch.bfloat16).qdata is not None


def test_state_dict_is_device_neutral_and_round_trips():
    model, _ = quantized_and_reference(4, 64)
    x = torch.randn(2, 256)
    with torch.no_grad():
        before = model(x)  # eager use packs and caches: the cache must not leak into the state
        torch.compile(model, backend="qbackend")(x)
    state = model.state_dict()
    weight = state["up.weight"]
    n, k = weight.weight_shape
    assert (weight.qdata.dtype, tuple(weight.qdata.shape)) == (torch.uint8, (n, k // 2))  # two int4 per byte
    assert torch.equal(pack_int4(unpack_int4(weight.qdata)), weight.qdata)
    assert sorted(weight.__tensor_flatten__()[0]) == ["qdata", "scale", "zero"]

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)  # (qbackend registers the class as safe)
    fresh = qbackend.quantize_weights(MLP().eval(), bits=4, group_size=64)
    fresh.load_state_dict(loaded)
    with torch.no_grad():
        assert torch.equal(fresh(x), before)


def test_kernel_limits_leave_the_linear_unlowered_with_the_reason():
    torch.manual_seed(0)
    odd = nn.Sequential(nn.Linear(128, 40), nn.ReLU(), nn.Linear(40, 16))  # 40 outputs: int4 needs N % 16
    qbackend.quantize_weights(odd, bits=4, group_size=32, filter_fn=lambda m, name: m.in_features == 128)
    x = torch.randn(3, 128)
    actual, expected, captured = compile_and_run(odd, (x,), weight_only_compute="bf16")
    assert_weight_only_close(actual, expected, "unlowered")
    kept = captured.report.kept
    assert any("divisible by 16, got 40" in d.reason for d in kept), str(captured.report)

    int8 = qbackend.quantize_weights(nn.Linear(40, 16), bits=8)  # K = 40: the bf16 int8 kernel is wrong there
    x = torch.randn(3, 40)
    actual, expected, captured = compile_and_run(int8, (x,))  # and the int16 one takes K % 64 == 0 only
    assert_weight_only_close(actual, expected, "int8 K=40")
    assert "in_features 40 is not a multiple of 16" in captured.report.kept[0].reason


def test_int16_limits_fall_back_to_torchs_kernel_with_the_reason():
    torch.manual_seed(0)
    model = qbackend.quantize_weights(nn.Linear(96, 32), bits=4, group_size=32)  # K = 96: not whole 64-blocks
    x = torch.randn(3, 96)
    actual, expected, captured = compile_and_run(model, (x,))
    assert_weight_only_close(actual, expected, "K=96")
    decision = captured.report.decisions[0]
    assert decision.op == KERNELS["bf16", 4]
    assert "torch's kernel: in_features 96 is not a multiple of 64" in decision.reason
    with pytest.raises(ValueError, match="in_features 96 is not a multiple of 64"):
        qbackend.kernels.weight_only_linear.pack(model.weight.group_quantized(), "cpu", torch.float32, "int16")


@needs_own_kernels
def test_int16_kernel_takes_40_outputs_torchs_int4_kernel_refuses():
    torch.manual_seed(0)
    model = qbackend.quantize_weights(nn.Linear(128, 40), bits=4, group_size=32, compute="int16")
    x = torch.randn(5, 128)
    actual, expected, captured = compile_and_run(model, (x,), weight_only_compute="int16")
    assert_weight_only_close(actual, expected, "N=40", "weight_only_int16")
    assert captured.report.decisions[0].op == KERNELS["int16", 4]
    with torch.no_grad():
        assert_weight_only_close(model(x), expected, "eager N=40", "weight_only_int16")


def test_in_features_not_a_multiple_of_the_group_stay_float():
    model = qbackend.quantize_weights(nn.Sequential(nn.Linear(96, 32)), bits=4, group_size=64)
    assert not isinstance(model[0].weight, QuantizedLinearWeight)


@pytest.mark.parametrize("compute,bits,op", [("bf16", 4, KERNELS["bf16", 4]), ("bf16", 8, KERNELS["bf16", 8]),
                                             ("activation", 8, KERNELS["bf16", 8])])  # (fp32 rows, no copy)
def test_torchs_kernels_take_a_transposed_input(compute, bits, op):
    """torch's packed kernels raise on strided rows ("expect A to be contiguous"): the lowering
    hands them contiguous ones (found by the fuzzer with the own kernels switched off)."""
    model, reference = quantized_and_reference(bits, 32 if bits == 4 else None)
    x = torch.randn(256, 3).t()
    actual, _, captured = compile_and_run(model, (x,), weight_only_compute=compute)
    assert {d.op for d in captured.report.decisions} == {op}
    assert_weight_only_close(actual, reference(x), compute)


def test_other_compilers_see_through_the_tensor():
    model, reference = quantized_and_reference(4, 32)
    x = torch.randn(2, 256)
    torch._dynamo.reset()
    with torch.no_grad():
        actual = torch.compile(model, backend="aot_eager")(x)
        assert_weight_only_close(actual, reference(x), "aot_eager")


@needs_own_kernels
@pytest.mark.parametrize("compute", ["bf16", "int16"])
def test_int4_packing_in_row_chunks_gives_the_one_shot_bytes(compute):
    from qbackend.kernels.weight_only_linear import PACK_ROWS, pack
    from qbackend.weight_only.weight_quant import quantize

    n = PACK_ROWS + 48  # a second chunk that ends in a short block
    weight = quantize(torch.randn(n, 128), 4, 32)
    whole = {"bf16": lambda: torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.rows().to(torch.int32) + 8, 8),
             "int16": lambda: pack_int4(weight.rows())}[compute]()
    assert torch.equal(pack(weight, "cpu", torch.float32, compute).args[0], whole)


@needs_own_kernels
def test_int16_kernel_reads_the_stored_nibbles_without_a_copy():
    from qbackend.kernels.weight_only_linear import pack

    model, _ = quantized_and_reference(4, 32)
    weight = model.up.weight.group_quantized()
    assert weight.nibbles
    assert pack(weight, "cpu", torch.float32, "int16").args[0].data_ptr() == weight.stored.data_ptr()


def test_dense_from_a_row_count_when_asked(monkeypatch):
    from qbackend.kernels import weight_only_linear

    model, reference = quantized_and_reference(4, 128)
    calls = []
    original = weight_only_linear.packed_or_dense
    monkeypatch.setattr(weight_only_linear, "packed_or_dense", lambda rows, dense, *a: calls.append((rows.shape[0], dense.dtype))
                        or original(rows, dense, *a))
    for tokens in (1, 32):
        x = torch.randn(1, tokens, 256)
        actual, _, captured = compile_and_run(model.gate, (x,), weight_only_dense_rows=16, weight_only_compute="bf16")
        with torch.no_grad():
            assert_weight_only_close(actual, reference.gate.float()(x), f"{tokens} tokens")
        assert "dense torch.bfloat16 matmul from 16 rows on" in captured.report.decisions[0].reason
    assert calls == [(1, torch.bfloat16), (32, torch.bfloat16)]


@needs_own_kernels
def test_weight_only_kernels_refuse_bad_inputs_with_a_clear_error():
    from qbackend.weight_only.weight_quant import quantize

    weight = quantize(torch.randn(32, 128), 4, 64)
    int4 = registry.op("int4_mm_int16")
    scale, offset = weight.scale.float().contiguous(), weight.float_offset().contiguous()
    nibbles = weight.nibble_storage()
    assert int4(torch.randn(2, 128), nibbles, scale, offset, 64).shape == (2, 32)
    with pytest.raises(ValueError, match="takes float32 CPU activations"):
        int4(torch.randn(2, 128).double(), nibbles, scale, offset, 64)
    with pytest.raises(ValueError, match="expected a contiguous CPU torch.float32 constant of 64 elements"):
        int4(torch.randn(2, 128), nibbles, scale[:, :1].contiguous(), offset, 64)
    with pytest.raises(ValueError, match="group size 48 is neither 32 nor a multiple of 64"):
        int4(torch.randn(2, 128), nibbles, scale, offset, 48)
    with pytest.raises(ValueError, match="in_features 40 is not a multiple of 64"):
        registry.op("int8_mm_int16")(torch.randn(2, 40), torch.zeros(8, 40, dtype=torch.int8), torch.ones(8))


@needs_own_kernels
@pytest.mark.parametrize("bits,group_size,codes", [(4, 32, False), (4, 128, False), (4, 128, True), (8, None, False)],
                         ids=["int4-g32", "int4-g128", "int4-g128-codes", "int8"])
def test_nan_and_infinity_come_out_as_the_float_linear_gives_them(bits, group_size, codes):
    from qbackend.weight_only.weight_quant import quantize

    torch.manual_seed(0)
    weight = quantize(torch.randn(16, 256), bits, group_size or 256)
    x = torch.randn(5, 256)
    # infinities where no weight is near 0 (inf * 0 is NaN, and the kernel's u * scale + offset
    # form of a weight that dequantizes to exactly 0 may round to +-1e-9 instead)
    a, b = (weight.dequantize().abs().amin(0) > 1e-3).nonzero().flatten()[[0, -1]].tolist()
    assert a != b
    x[1, 7] = float("nan")
    x[2, a] = float("inf")
    x[3, a], x[3, b] = float("inf"), -float("inf")
    expected = x @ weight.dequantize().T  # NaN rows, and +-inf / NaN where the weights' signs say
    if bits == 4:
        scale = weight.scale.float().contiguous()  # (the kernel's offset is for u = q + 8: qbackend/kernels/weight_only_linear.py)
        offset = (-8 - weight.zero_point).to(torch.int8) if codes else (weight.float_offset() - 8 * scale).contiguous()
        args = (weight.nibble_storage(), scale, offset, group_size)
        kernel = registry.op("int4_mm_int16")
    else:
        args = (weight.stored, weight.scale.float().flatten().contiguous())
        kernel = registry.op("int8_mm_int16")
    actual = kernel(x, *args)
    for row in (1, 2, 3):  # exactly IEEE's NaN / inf pattern, row by row
        assert torch.equal(actual[row].isnan(), expected[row].isnan()), row
        assert torch.equal(actual[row].isinf() & (actual[row] > 0), expected[row].isinf() & (expected[row] > 0)), row
        finite = expected[row].isfinite()
        torch.testing.assert_close(actual[row][finite], expected[row][finite], rtol=1e-4, atol=1e-3)
    assert expected[1].isnan().all() and expected[2].isinf().all() and expected[3].isnan().any()
    assert actual[[0, 4]].isfinite().all()
    assert_weight_only_close(actual[[0, 4]], expected[[0, 4]], "finite rows", "weight_only_int16")


@pytest.mark.skipif(isa._vnni_library()[0] is None, reason=f"no AVX512-VNNI build here: {isa._vnni_library()[1]}")
@pytest.mark.parametrize("rows", [1, 3, 6], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("outputs,inputs,group_size", [(37, 512, 64), (40, 384, 128), (16, 512, 256), (24, 256, 32)], ids=str)
def test_the_vnni_and_avx2_int4_kernels_give_the_same_bits(outputs, inputs, group_size, rows, monkeypatch):
    """vpdpbusd pairs (groups of 64 or more; one row as two halves of each thread's weight rows,
    an odd count leaving one) and vpmaddwd sums are the same integers; a NaN row is redone. The
    offsets as int8 codes give the bits of the float offsets code * scale, in both builds."""
    from qbackend.kernels import weight_only_linear
    from qbackend.weight_only.weight_quant import quantize

    torch.manual_seed(outputs)
    weight = quantize(torch.randn(outputs, inputs), 4, group_size)
    args = weight_only_linear.pack(weight, "cpu", torch.float32, "int16").args
    x = torch.randn(rows, inputs) * torch.logspace(-3, 3, inputs)  # (groups of very different ranges)
    x[-1, 5] = float("nan") if rows > 1 else x[-1, 5]
    assert args[2].dtype == weight_only_mm.INT4_OFFSET_CODES  # (integer zero points)
    float_offsets = (*args[:2], args[2].float() * args[1], args[3])
    results = []
    for build in (isa._vnni_library()[0], isa._load()[0]):
        monkeypatch.setattr(weight_only_mm, "_weight_only_library", lambda: weight_only_mm._declare(build))
        results += [weight_only_mm.int4_mm_int16(x, *args), weight_only_mm.int4_mm_int16(x, *float_offsets)]
    for other in results[1:]:
        assert torch.equal(results[0].isnan(), other.isnan())
        assert torch.equal(results[0].nan_to_num(), other.nan_to_num())
    finite = x.isfinite().all(1)
    assert_weight_only_close(results[0][finite], x[finite] @ weight.dequantize().T, "VNNI build", "weight_only_int16")


def test_a_quantized_weight_must_hold_its_declared_shape():
    good = QuantizedLinearWeight.from_float(torch.randn(64, 256), bits=4, group_size=128)
    parts = dict(qdata=good.qdata, scale=good.scale, zero=good.zero, bits=4, group_size=128, shape=(64, 256),
                 dtype=torch.float32)
    assert QuantizedLinearWeight(**parts).shape == (64, 256)
    for change, message in [(dict(shape=(128, 256)), r"qdata of a 4-bit \[128, 256\] weight \(group 128\) must be"),  # (#20)
                            (dict(qdata=good.qdata.view(torch.int8)), "must be torch.uint8"),
                            (dict(group_size=96), "group size 96 does not divide in_features 256"),
                            (dict(scale=good.scale[:, :1]), r"scale of a 4-bit \[64, 256\] weight"),
                            (dict(bits=3), "expected 4 or 8 bits"),
                            (dict(dtype=torch.int32), "a float model dtype")]:
        with pytest.raises(ValueError, match=message):
            QuantizedLinearWeight(**{**parts, **change})


def test_quantize_weights_takes_torchaos_filter_order_and_refuses_meaningless_options():
    model = nn.Sequential(nn.Linear(128, 32), nn.Linear(32, 16))
    seen = []
    qbackend.quantize_weights(model, filter_fn=lambda module, name: seen.append((type(module).__name__, name)) or name == "0")
    assert seen == [("Linear", "0"), ("Linear", "1")]
    assert isinstance(model[0].weight, qbackend.QuantizedLinearWeight) and model[0].weight.group_size == 128
    assert not isinstance(model[1].weight, qbackend.QuantizedLinearWeight)
    with pytest.warns(DeprecationWarning, match="use filter_fn"):
        qbackend.quantize_weights(nn.Linear(64, 16), group_size=32, include=lambda name, module: True)
    with pytest.raises(ValueError, match="per output channel; group_size=128 has no meaning"):
        qbackend.quantize_weights(nn.Linear(64, 16), bits=8, group_size=128)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        qbackend.quantize_weights(nn.Linear(64, 16), bits=3)
