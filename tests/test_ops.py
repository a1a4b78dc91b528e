"""The alias table against simulated torch generations: the right op per version and device,
and a missing op disables its rules with a reason instead of failing."""
from qbackend.ops import ALIASES, TorchRegistry, resolve
from qbackend.patterns.examples import residual_block

from tests.helpers import assert_matches_reference, onednn_only, quantize
from tests.xpu_builds import Generation as FakeRegistry


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


def test_older_torch_lowers_through_the_2d_name_end_to_end(monkeypatch):
    """Only the pre-rename qconv2d_pointwise exists: the emitted graph calls it, and it runs."""
    onednn_only(monkeypatch)
    module, inputs = residual_block()
    old = ("qconv2d_pointwise", "qconv2d_pointwise.binary", "qconv_prepack")
    registry = _LiveOps({f"onednn::{name}" + ("" if "." in name else ".default"): {"MkldnnCPU", "CPU"} for name in old})
    report = assert_matches_reference(quantize(module, inputs), inputs, registry).report
    assert [d.op for d in report.decisions] == ["onednn::qconv2d_pointwise", "onednn::qconv2d_pointwise", "onednn::qconv2d_pointwise.binary"]


# --- simulated torch generations: which op each device resolves to -------------------------

from tests.xpu_builds import CURRENT_XPU, PER_RANK_NAMES, RENAMED_CPU_ONLY, Generation, SimulatedXpuBuild  # noqa: E402

GENERATIONS = {"2.1-2.7": Generation(PER_RANK_NAMES), "2.8+": Generation(RENAMED_CPU_ONLY), "current": SimulatedXpuBuild()}
CONVS = ("qconv1d", "qconv", "qconv3d", "qconv_binary", "qlinear", "qlinear_binary")


def _resolved(generation, device, need_meta=False):
    return {logical: resolve(logical, device, GENERATIONS[generation], need_meta=need_meta).qualname for logical in CONVS}


def test_per_rank_names_only():
    assert _resolved("2.1-2.7", "cpu") == {
        "qconv1d": "onednn::qconv1d_pointwise.default", "qconv": "onednn::qconv2d_pointwise.default",
        "qconv3d": "onednn::qconv3d_pointwise.default", "qconv_binary": "onednn::qconv2d_pointwise.binary",
        "qlinear": "onednn::qlinear_pointwise.default", "qlinear_binary": "onednn::qlinear_pointwise.binary"}
    assert _resolved("2.1-2.7", "xpu") == {
        "qconv1d": "onednn::qconv1d_pointwise.default", "qconv": "onednn::qconv2d_pointwise.default",
        "qconv3d": "onednn::qconv3d_pointwise.default", "qconv_binary": None,
        "qlinear": "onednn::qlinear_pointwise.default", "qlinear_binary": None}


def test_renamed_on_cpu_only_keeps_xpu_on_the_per_rank_names():
    """The case that broke XPU lowering: qconv_pointwise exists (CPU) but XPU still registers
    only the per-rank names; each device resolves to the name it has a kernel for."""
    assert set(_resolved("2.8+", "cpu")[c] for c in ("qconv1d", "qconv", "qconv3d")) == {"onednn::qconv_pointwise.default"}
    xpu = _resolved("2.8+", "xpu")
    assert (xpu["qconv1d"], xpu["qconv"], xpu["qconv3d"]) == (
        "onednn::qconv1d_pointwise.default", "onednn::qconv2d_pointwise.default", "onednn::qconv3d_pointwise.default")


def test_legacy_names_without_meta_never_reach_a_traced_graph():
    """Graphs traced with fake tensors (need_meta): XPU conv1d / conv3d on the 2.8+ build
    resolve to nothing, with the reason, rather than to qconv1d/3d_pointwise (no Meta)."""
    xpu = _resolved("2.8+", "xpu", need_meta=True)
    assert xpu["qconv1d"] is None and xpu["qconv3d"] is None and xpu["qconv"] == "onednn::qconv2d_pointwise.default"
    reason = resolve("qconv1d", "xpu", GENERATIONS["2.8+"], need_meta=True).reason
    assert "onednn::qconv1d_pointwise.default has no Meta kernel" in reason
    assert resolve("qconv_prepack", "xpu", GENERATIONS["2.8+"], need_meta=True)  # compile-time only: exempt


def test_current_build_resolves_every_device_to_the_canonical_name():
    for device in ("cpu", "xpu"):
        ops = _resolved("current", device, need_meta=True)
        assert ops["qconv1d"] == ops["qconv"] == ops["qconv3d"] == "onednn::qconv_pointwise.default", (device, ops)
        assert ops["qconv_binary"] == "onednn::qconv2d_pointwise.binary" and ops["qlinear_binary"], (device, ops)


def test_no_device_ever_resolves_to_an_op_without_a_kernel_for_it():
    from qbackend.ops import COMPILE_TIME, COMPOSITE_KEYS, DEVICE_DISPATCH_KEYS

    for name, registry in GENERATIONS.items():
        for device, keys in DEVICE_DISPATCH_KEYS.items():
            for need_meta in (False, True):
                for logical in ALIASES:
                    resolved = resolve(logical, device, registry, need_meta=need_meta)
                    if resolved:
                        composite = any(registry.has_kernel(resolved.qualname, key) for key in COMPOSITE_KEYS)
                        assert composite or any(registry.has_kernel(resolved.qualname, key) for key in keys), \
                            (name, device, logical)
                        assert not need_meta or logical in COMPILE_TIME or \
                            composite or registry.has_kernel(resolved.qualname, "Meta"), (name, device, logical)


def test_every_current_xpu_op_is_an_alias_candidate():
    candidates = {f"{c}.default" if "." not in c.split("::")[1] else c for cs in ALIASES.values() for c in cs}
    assert CURRENT_XPU - {"aten::cat.default"} <= candidates
