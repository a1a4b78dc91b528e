"""The alias table against simulated torch generations: the right op per version and device,
and a missing op disables its rules with a reason instead of failing."""
from qbackend.ops import ALIASES, TorchRegistry, resolve
from qbackend.patterns.examples import residual_block

from .helpers import assert_matches_reference, quantize
from .xpu_builds import Generation as FakeRegistry


OLD_TORCH = FakeRegistry({"onednn::qconv2d_pointwise.default": {"MkldnnCPU", "Meta"}})
NEW_TORCH = FakeRegistry({"onednn::qconv_pointwise.default": {"CPU", "MkldnnCPU", "Meta"}})
BOTH = FakeRegistry({**OLD_TORCH.kernels, **NEW_TORCH.kernels})


def test_older_torch_resolves_the_2d_name():
    assert resolve("qconv", "cpu", OLD_TORCH).qualname == "onednn::qconv2d_pointwise.default"


def test_newer_torch_resolves_the_new_name():
    assert resolve("qconv", "cpu", NEW_TORCH).qualname == "onednn::qconv_pointwise.default"


def test_newest_name_wins_when_both_exist():
    assert resolve("qconv", "cpu", BOTH).qualname == "onednn::qconv_pointwise.default"


def test_op_without_kernel_for_the_device_is_skipped():
    resolved = resolve("qconv", "xpu", BOTH)
    assert not resolved
    assert "onednn::qconv_pointwise.default has no xpu kernel" in resolved.reason
    assert "onednn::qconv2d_pointwise.default has no xpu kernel" in resolved.reason


def test_meta_requirement_skips_legacy_names_without_meta():
    legacy = FakeRegistry({"onednn::qconv_pointwise.tensor": {"CPU"}, "onednn::qconv2d_pointwise.tensor": {"MkldnnCPU"}})
    assert not resolve("qconv_tensor", "cpu", legacy, need_meta=True)
    assert resolve("qconv_tensor", "cpu", legacy).qualname == "onednn::qconv_pointwise.tensor"


def test_live_torch_resolves_every_cpu_int8_op():
    for logical in ("qconv", "qconv_binary", "qconv_prepack", "qlinear", "qlinear_prepack"):
        assert resolve(logical, "cpu"), resolve(logical, "cpu").reason


def test_int4_cpu_uses_the_for_cpu_variant_on_this_torch():
    assert resolve("int4_mm", "cpu").qualname == "aten::_weight_int4pack_mm_for_cpu.default"


def test_missing_op_disables_its_rules_with_a_reason():
    """A torch with no binary conv: the residual conv is still lowered by the plain rule, the
    numerics hold, and the report says why the binary rule was not used."""
    module, inputs = residual_block()
    live = ("qconv_pointwise", "qconv_prepack", "qlinear_pointwise", "qlinear_prepack")
    registry = _LiveOps({f"onednn::{name}.default": {"CPU", "MkldnnCPU"} for name in live})
    report = assert_matches_reference(quantize(module, inputs), inputs, registry).report
    assert any(note.startswith("rule qconv_add disabled on cpu: no qconv_binary op for cpu") for note in report.notes), report.notes
    assert [d.rule for d in report.decisions] == ["qconv", "qconv", "qconv"], str(report)
    residual = report.decisions[-1]
    assert residual.tried[0].reason.startswith("qconv_add matched but cpu cannot run it: no qconv_binary op for cpu")


class _LiveOps(FakeRegistry):
    """A fake registry whose listed ops are the real ones (so emitted graphs still run)."""

    def lookup(self, qualname):
        return TorchRegistry().lookup(qualname) if qualname in self.kernels else None


def test_every_alias_candidate_is_spelled_namespace_colon_name():
    for logical, candidates in ALIASES.items():
        for candidate in candidates:
            assert "::" in candidate, (logical, candidate)


def test_older_torch_lowers_through_the_2d_name_end_to_end():
    """Only the pre-rename qconv2d_pointwise exists: the emitted graph calls it, and it runs."""
    module, inputs = residual_block()
    old = ("qconv2d_pointwise", "qconv2d_pointwise.binary", "qconv_prepack")
    registry = _LiveOps({f"onednn::{name}" + ("" if "." in name else ".default"): {"MkldnnCPU", "CPU"} for name in old})
    report = assert_matches_reference(quantize(module, inputs), inputs, registry).report
    assert [d.op for d in report.decisions] == ["onednn::qconv2d_pointwise", "onednn::qconv2d_pointwise", "onednn::qconv2d_pointwise.binary"]
