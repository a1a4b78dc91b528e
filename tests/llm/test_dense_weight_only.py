"""Weight-only linears over many rows run as dense matmuls on slices of the weight written out
(qbackend/llm/dense_weight_only.py): the written-out weights, the numerics, where the measured
crossover puts the switch, and when the graph keeps the int16 kernels."""
import expecttest
import pytest
import torch

from qbackend.llm import dense_weight_only
from qbackend.kernels import dense_weight_only as dense_kernels  # (the kernels: dense slices, bf16 matmul)
from qbackend.kernels import registry, weight_only_mm
from qbackend.kernels import weight_only_linear
from qbackend.weight_only.weight_quant import quantize

from tests.helpers import compile_and_run, needs_own_kernels, short_graph
from tests.weight_only.test_weight_only import quantized_and_reference
from tests.tolerances import assert_weight_only_close

pytestmark = needs_own_kernels
needs_bf16_kernel = pytest.mark.skipif(dense_kernels._bf16_kernel() is None, reason="needs a CPU with AVX512-BF16")


def packed(bits, n=96, k=256, group=64, seed=0):
    torch.manual_seed(seed)
    weight = quantize(torch.randn(n, k), bits, group if bits == 4 else None)
    return weight, weight_only_linear.pack(weight, "cpu", torch.float32, "int16").args


@pytest.mark.parametrize("bits, group", [(4, 32), (4, 64), (4, 128), (8, None)], ids=["int4 g32", "int4 g64", "int4 g128", "int8"])
def test_written_out_rows_are_the_dequantized_weight(bits, group):
    weight, args = packed(bits, group=group)
    expected = weight.dequantize(torch.float32)
    for start, rows in ((0, 96), (16, 32), (95, 1)):
        f32 = dense_kernels.written_out(bits, args, start, torch.empty(rows, 256))
        bf16 = dense_kernels.written_out(bits, args, start, torch.empty(rows, 256, dtype=torch.bfloat16))
        # int4: u * scale + (offset - 8 scale) in one multiply-add, so an ulp from (q * scale + offset)
        torch.testing.assert_close(f32, expected[start:start + rows], rtol=1e-6, atol=1e-6)
        assert (bf16.float() - f32).abs().max() <= f32.abs().max() * 2 ** -8  # (nearest even: half a bf16 ulp)
        # the float32 value rounded to nearest even, the same bits (int4 bf16 by a per-group table)
        assert torch.equal(bf16, f32.to(torch.bfloat16))


def test_a_nan_weight_stays_nan_in_bf16():
    weight, (storage, scale, codes, group) = packed(4)
    assert codes.dtype == weight_only_mm.INT4_OFFSET_CODES  # (integer zero points: offsets as int8 codes)
    nan_scale, nan_offset = scale.clone(), codes.float() * scale  # (the float offsets of the same weight)
    nan_scale[3, 0] = nan_offset[3, 0] = float("nan")
    for scale_, offset in ((nan_scale, codes), (scale, nan_offset)):
        out = dense_kernels.written_out(4, (storage, scale_, offset, group), 0, torch.empty(96, 256, dtype=torch.bfloat16))
        assert out[3, :group].isnan().all() and not out[3, group:].isnan().any() and not out[4].isnan().any()


def test_bad_arguments_are_refused_before_the_kernel():
    _, (storage, scale, offset, group) = packed(4)
    written_out = dense_kernels.written_out
    with pytest.raises(ValueError, match=r"rows \[90, 100\) of 96"):
        written_out(4, (storage, scale, offset, group), 90, torch.empty(10, 256))
    with pytest.raises(ValueError, match="contiguous bf16 / float32 buffer"):
        written_out(4, (storage, scale, offset, group), 0, torch.empty(8, 256, dtype=torch.float16))
    with pytest.raises(ValueError, match="the scales must be a contiguous CPU torch.float32"):
        written_out(4, (storage, scale.double(), offset, group), 0, torch.empty(8, 256))
    with pytest.raises(ValueError, match="the int4 storage must be"):
        written_out(4, (storage[:, :64], scale, offset, group), 0, torch.empty(8, 256))
    with pytest.raises(ValueError, match="multiples of 16"):
        written_out(4, (storage, scale, offset, 24), 0, torch.empty(8, 256))
    _, (int8, int8_scale) = packed(8)
    with pytest.raises(ValueError, match="the int8 weight must be"):
        written_out(8, (int8.t(), int8_scale), 0, torch.empty(8, 96))
    with pytest.raises(ValueError, match=r"float32 activations \[M, 256\]"):
        dense_weight_only.dense_slices(torch.randn(4, 128), 4, torch.float32, storage, scale, offset, group)


@pytest.mark.parametrize("rows", [20, 300], ids=["32-row slices", "64-row slices"])  # (more rows: larger slices)
@pytest.mark.parametrize("bits", [4, 8])
def test_dense_slices_match_the_float_linear_on_the_dequantized_weight(bits, rows, monkeypatch):
    monkeypatch.setattr(dense_weight_only, "CHUNK_BYTES", 40 * 256 * 4)  # 32-row slices: 96 rows in three
    monkeypatch.setattr(dense_weight_only, "CHUNK_GROWTH_ROWS", 150)  # 300 rows: 64-row slices, 96 rows in two
    weight, args = packed(bits)
    x = torch.randn(rows, 256)
    expected = x @ weight.dequantize(torch.float32).t()
    kernel = registry.PLAIN[f"int{bits}_mm_int16"]
    assert_weight_only_close(dense_weight_only.dense_slices(x, bits, torch.float32, *args), expected, "fp32", "weight_only_int16")
    assert_weight_only_close(dense_weight_only.dense_slices(x, bits, torch.bfloat16, *args), expected, "bf16")
    assert torch.equal(dense_weight_only.kernel_or_dense(x, rows + 1, rows + 1, torch.bfloat16, bits, *args), kernel(x, *args))
    assert torch.equal(dense_weight_only.kernel_or_dense(x, rows, rows, torch.bfloat16, bits, *args),
                       dense_weight_only.dense_slices(x, bits, torch.bfloat16, *args))



def simulated(record):
    """A machine where the dense matmul wins from ``record``'s row count on (None: never)."""
    calls = []
    return calls, lambda bits, kernel, args: calls.append(args[0].shape) or dict(record)


class TestDenseSlicesInTheGraph(expecttest.TestCase):
    @pytest.fixture(autouse=True)
    def _cache(self, cache_dir, monkeypatch):
        self.monkeypatch = monkeypatch

    def compiled(self, module, x, **options):
        actual, _, captured = compile_and_run(module, (x,), kernel_choice="measure", **options)
        return actual, short_graph(captured.lowered), str(captured.report)

    def test_from_the_measured_row_count_on_the_linear_runs_dense(self):
        calls, measured = simulated({"dtype": "bf16", "from": 24, "ms": {}})
        self.monkeypatch.setattr(dense_weight_only, "_measured", measured)
        model, reference = quantized_and_reference(4, 128)
        x = torch.randn(1, 32, 256)
        actual, graph, report = self.compiled(model.gate, x)
        self.assertExpectedInline(graph, """\
l_args_0_ = input
reshape_default = l_args_0_.reshape([-1, 256])
int4_mm_int16 = dense_weight_only.kernel_or_dense(reshape_default, 24, 24, bfloat16, 4, <const>, <const>, <const>, 128)
unflatten_rows = weight_only_linear.unflatten_rows(int4_mm_int16, l_args_0_)
add_tensor = aten.add.Tensor(unflatten_rows, <const>)
return (add_tensor)""")
        assert "weight-only dense int4 512x256 g128: dense bf16 from 24 rows" in report
        with torch.no_grad():
            assert_weight_only_close(actual, reference.gate(x), "32 rows, dense bf16")
        assert calls == [(512, 128)]
        # the next compile reads the machine's record: nothing timed again
        model.gate(torch.randn(1, 8, 256))
        self.compiled(model.gate, torch.randn(1, 16, 256))
        assert calls == [(512, 128)]

    @needs_bf16_kernel
    def test_where_only_the_bf16_kernel_wins_it_runs_from_its_row_count_on(self):
        self.monkeypatch.setattr(dense_weight_only, "_measured", simulated({"bf16_from": 9, "dtype": None, "from": None, "ms": {}})[1])
        model, reference = quantized_and_reference(4, 128)
        x = torch.randn(1, 32, 256)
        actual, graph, report = self.compiled(model.gate, x)
        # (the graph as above, the dense slices never: from inf rows)
        assert "kernel_or_dense(reshape_default, 9, inf, bfloat16, 4, <const>, <const>, <const>, 128)" in graph
        assert "weight-only dense int4 512x256 g128: the bf16 kernel from 9 rows" in report
        with torch.no_grad():
            assert_weight_only_close(actual, reference.gate(x), "32 rows, the bf16 kernel")

    def test_kept_on_the_kernel_for_few_rows_without_measuring_and_where_dense_never_wins(self):
        calls, measured = simulated({"dtype": None, "from": None, "ms": {}})
        self.monkeypatch.setattr(dense_weight_only, "_measured", measured)
        model, reference = quantized_and_reference(8, None)
        _, graph, report = self.compiled(model.up, torch.randn(1, 4, 256))  # (decode-like: 4 rows)
        assert calls == [] and "kernel_or_dense" not in graph and "dense matmuls" not in report
        actual, graph, _ = self.compiled(model.up, torch.randn(1, 64, 256))
        assert calls == [(512, 256)] and "int8_mm_int16(" in graph and "kernel_or_dense" not in graph

    def test_prior_and_int16_compute_keep_the_int16_kernels(self):
        calls, measured = simulated({"dtype": "fp32", "from": 2, "ms": {}})
        self.monkeypatch.setattr(dense_weight_only, "_measured", measured)
        model, _ = quantized_and_reference(4, 128)
        x = torch.randn(1, 32, 256)
        for options in ({"kernel_choice": "prior"}, {"kernel_choice": "measure", "weight_only_compute": "int16"}):
            _, _, captured = compile_and_run(model.gate, (x,), **options)
            assert "kernel_or_dense" not in short_graph(captured.lowered)
        assert calls == []


def timings(by_rows, part=None):
    """``_timed`` on a simulated machine: the times (ms) at each probe's row count; ``part``: those
    of the many-rows probes on part of the weight (two candidates)."""
    return lambda candidates, rows, k: {name: (part if part and len(candidates) == 2 else by_rows)[rows][name]
                                        for name in candidates}


def test_the_measured_record_names_a_dtype_only_where_its_line_beats_the_kernels(monkeypatch):
    monkeypatch.setattr(dense_weight_only, "bf16_kernel_takes", lambda bits, args: False)
    weight, args = packed(4)
    kernel = registry.PLAIN["int4_mm_int16"]
    # int16 0.2 ms a row; bf16 3 ms + 0.05 a row (crossing at 20 rows); fp32 slower than bf16
    monkeypatch.setattr(dense_weight_only, "_timed", timings({32: {"int16": 6.4, "bf16": 4.6, "fp32": 9.0},
                                                             128: {"int16": 25.6, "bf16": 9.4, "fp32": 20.0}}))
    record = dense_weight_only._measured(4, kernel, args)
    assert (record["bf16_from"], record["dtype"], record["from"]) == (None, "bf16", 21)
    monkeypatch.setattr(dense_weight_only, "_timed", timings({32: {"int16": 1.0, "bf16": 4.6, "fp32": 9.0},
                                                             128: {"int16": 4.0, "bf16": 9.4, "fp32": 20.0}}))
    assert dense_weight_only._measured(4, kernel, args)["dtype"] is None


def test_the_bf16_kernel_takes_the_rows_between_the_int16_kernel_and_the_dense_slices(monkeypatch):
    monkeypatch.setattr(dense_weight_only, "bf16_kernel_takes", lambda bits, args: True)
    weight, args = packed(4)
    kernel = registry.PLAIN["int4_mm_int16"]
    # bf16 kernel 1 ms + 0.08 a row: past int16's 0.2 a row at 8.3 rows; at 128 rows before the dense slices
    probes = {32: {"int16": 6.4, "bf16": 4.6, "fp32": 9.0, "bf16 kernel": 3.56},
              128: {"int16": 25.6, "bf16": 12.0, "fp32": 20.0, "bf16 kernel": 11.24}}
    # on part of the weight at 128 and 512 rows the dense slices' line crosses the kernel's at 224 rows
    monkeypatch.setattr(dense_weight_only, "_timed", timings(probes, {128: {"bf16": 12.0, "bf16 kernel": 11.0},
                                                                      512: {"bf16": 30.0, "bf16 kernel": 33.0}}))
    record = dense_weight_only._measured(4, kernel, args)
    assert (record["bf16_from"], record["dtype"], record["from"]) == (9, "bf16", 225)
    # the kernel still faster at 512 rows: no dense slices
    monkeypatch.setattr(dense_weight_only, "_timed", timings(probes, {128: {"bf16": 12.0, "bf16 kernel": 11.0},
                                                                      512: {"bf16": 34.0, "bf16 kernel": 33.0}}))
    record = dense_weight_only._measured(4, kernel, args)
    assert (record["bf16_from"], record["dtype"], record["from"]) == (9, None, None)


@needs_bf16_kernel
@pytest.mark.parametrize("bits, offsets", [(4, "codes"), (4, "float"), (8, None)],
                         ids=["int4, int8 offset codes", "int4, float offsets", "int8"])
def test_the_bf16_kernel_multiplies_the_written_out_bf16_weight(bits, offsets):
    weight, args = packed(bits, n=100)
    if offsets == "float":  # (the same weights with float32 offsets)
        args = (args[0], args[1], args[2].float() * args[1], args[3])
    bf16_weight = dense_kernels.written_out(bits, args, 0, torch.empty(100, 256, dtype=torch.bfloat16))
    for rows in (1, 5, 6, 13, 40):  # (tiles of 6 rows and of 4 weight rows, with their remainders: 100 = 25 x 4)
        x = torch.randn(rows, 256)
        expected = x.bfloat16().double() @ bf16_weight.double().t()  # (exact products; float32 sums in the kernel)
        actual = dense_kernels.bf16_mm(x, bits, *args)
        assert actual.dtype == torch.float32 and actual.shape == (rows, 100)
        torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert_weight_only_close(dense_weight_only.kernel_or_dense(x, 8, 64, torch.bfloat16, bits, *args),
                             x @ weight.dequantize(torch.float32).t(), "bf16")


@needs_bf16_kernel
def test_the_bf16_kernel_checks_its_arguments():
    _, (storage, scale, offset, group) = packed(4)
    mm = dense_kernels.bf16_mm
    with pytest.raises(ValueError, match=r"float32 or bf16 CPU activations \[M, 256\]"):
        mm(torch.randn(4, 128), 4, storage, scale, offset, group)
    with pytest.raises(ValueError, match="the int4 storage must be"):
        mm(torch.randn(4, 256), 4, storage.t().contiguous().t(), scale, offset, group)
    with pytest.raises(ValueError, match="multiples of 32"):
        mm(torch.randn(4, 256), 4, storage, scale, offset, 16)
    with pytest.raises(ValueError, match="the scales must be"):
        mm(torch.randn(4, 256), 4, storage, scale[:, :2], offset, group)
    _, (int8, int8_scale) = packed(8)
    with pytest.raises(ValueError, match="the int8 weight must be"):
        mm(torch.randn(4, 256), 8, int8.t().contiguous().t(), int8_scale)
