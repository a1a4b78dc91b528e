"""Weight-only linears for XPU, checked at graph level on this CPU-only machine: a registry
simulating an XPU build says which ops have XPU kernels; the packing runs on CPU tensors."""
import expecttest
import pytest
import torch

import qbackend
from qbackend.weight_only.weight_quant import unpack_int4

from tests.helpers import lower_without_running, short_graph
from tests.xpu_builds import SimulatedXpuBuild, requires_xpu


def lowered_for_xpu(model, x, **options):
    return lower_without_running(model, (x,), SimulatedXpuBuild(), device="xpu", **options)


class TestXpuWeightOnlyGraphs(expecttest.TestCase):
    def test_int4_runs_the_scales_and_zeros_kernel_in_bf16(self):
        torch.manual_seed(0)
        model = qbackend.quantize_weights(torch.nn.Linear(256, 64), bits=4, group_size=128)
        lowered, report = lowered_for_xpu(model, torch.randn(4, 256))
        self.assertExpectedInline(short_graph(lowered), """\
l_args_0_ = input
_to_copy_default = aten._to_copy(l_args_0_, dtype=bfloat16, memory_format=torch.contiguous_format)
_weight_int4pack_mm_with_scales_and_zeros_default = aten._weight_int4pack_mm_with_scales_and_zeros(_to_copy_default, <const>, 128, <const>, <const>)
_to_copy_default_1 = aten._to_copy(_weight_int4pack_mm_with_scales_and_zeros_default, dtype=float32)
add_tensor = aten.add.Tensor(_to_copy_default_1, <const>)
return (add_tensor)""")
        assert report.decisions[0].op == "aten::_weight_int4pack_mm_with_scales_and_zeros.default"
        mm = next(n for n in lowered.graph.nodes if "scales_and_zeros" in str(n.target))
        packed, scale, zeros = (getattr(lowered, a.target) for a in (mm.args[1], mm.args[3], mm.args[4]))
        weight = model.weight
        # XPU reads u = q + 8 from int32 [N, K/8] (even column low), w = (u - zero) * scale
        assert packed.dtype == torch.int32 and packed.shape == (64, 256 // 8)
        assert torch.equal(unpack_int4(packed.view(torch.uint8)), unpack_int4(weight.qdata))
        assert torch.equal(zeros, (weight.zero.to(torch.int16) + 8).to(torch.int8).t())
        assert scale.dtype == torch.bfloat16 and scale.shape == (2, 64)

    def test_int8_fp16_model_keeps_fp16(self):
        model = qbackend.quantize_weights(torch.nn.Linear(64, 32, bias=False).half(), bits=8)
        lowered, _ = lowered_for_xpu(model, torch.randn(2, 64, dtype=torch.float16))
        self.assertExpectedInline(short_graph(lowered), """\
l_args_0_ = input
contiguous_default = aten.contiguous(l_args_0_)
_weight_int8pack_mm_default = aten._weight_int8pack_mm(contiguous_default, <const>, <const>)
return (_weight_int8pack_mm_default)""")


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, None)], ids=["int4", "int8"])
def test_cpu_build_has_no_xpu_weight_only_kernels(bits, group_size):
    """On this CPU-only torch the XPU rows resolve to nothing: the linear stays float with why."""
    model = qbackend.quantize_weights(torch.nn.Linear(64, 32), bits=bits, group_size=group_size)
    _, report = lower_without_running(model, (torch.randn(2, 64),), device="xpu")
    assert not report.lowered and "has no xpu kernel" in report.kept[0].reason, str(report)


def test_float_offsets_are_refused_on_xpu():
    from qbackend.quantized_tensor import from_old_cpu_int4

    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (32, 64), dtype=torch.int32), 8)
    linear = torch.nn.Linear(64, 32, bias=False)
    linear.weight = torch.nn.Parameter(from_old_cpu_int4(packed, torch.rand(2, 32, 2), 32), requires_grad=False)
    _, report = lowered_for_xpu(linear, torch.randn(2, 64))
    assert "takes integer zero points" in report.kept[0].reason, str(report)


@requires_xpu
@pytest.mark.parametrize("bits", [4, 8])
def test_xpu_end_to_end_matches_the_dequantized_linear(bits):
    from tests.tolerances import assert_weight_only_close

    torch.manual_seed(0)
    model = qbackend.quantize_weights(torch.nn.Linear(256, 64), bits=bits, group_size=128 if bits == 4 else None).to("xpu")
    dense = torch.nn.Linear(256, 64).to("xpu")
    dense.load_state_dict(model.state_dict())
    x = torch.randn(4, 256, device="xpu")
    with torch.no_grad():
        actual = torch.compile(model, backend="qbackend")(x)
        assert_weight_only_close(actual.cpu(), dense(x).cpu(), "xpu")
