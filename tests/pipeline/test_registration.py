"""backend="qbackend" works without importing qbackend, and nothing global changes."""
import subprocess
import sys
import textwrap

QUANTIZE = textwrap.dedent("""
    import torch, torch.nn as nn
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e, convert_pt2e
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.Linear(8 * 8 * 8, 10)).eval()
    example_inputs = (torch.randn(2, 3, 12, 12),)
    m = torch.export.export(model, example_inputs, strict=True).module()
    m = prepare_pt2e(m, xiq.X86InductorQuantizer().set_global(xiq.get_default_x86_inductor_quantization_config(reduce_range=True)))
    m(*example_inputs)
    m = convert_pt2e(m)
""")


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_backend_found_by_name_in_a_fresh_process():
    out = _run(QUANTIZE + textwrap.dedent("""
        import sys
        assert "qbackend" not in sys.modules
        with torch.no_grad():
            expected = m(*example_inputs)
            actual = torch.compile(m, backend="qbackend")(*example_inputs)
        cos = torch.nn.functional.cosine_similarity(actual.flatten(), expected.flatten(), dim=0).item()
        print("imported-by-dynamo", "qbackend.pipeline.backend" in sys.modules, "cosine-ok", cos > 0.9999)
    """))
    assert "imported-by-dynamo True cosine-ok True" in out, out


def test_importing_and_using_qbackend_changes_no_global_state():
    out = _run(QUANTIZE + textwrap.dedent("""
        import torch._inductor.config as inductor_config, torch._dynamo.config as dynamo_config

        def snapshot():
            return {
                # the live values (get_config_copy would deep-copy objects and break identity)
                "inductor": {k: getattr(inductor_config, k) for k in inductor_config.get_config_copy()},
                "dynamo": {k: getattr(dynamo_config, k) for k in dynamo_config.get_config_copy()},
                # qbackend's own kernels register in its own namespace when first used (no other
                # code can reach them): every other op name must stay as it was
                "ops": sorted(op for op in torch._C._dispatch_get_all_op_names() if not op.startswith("qbackend::")),
                "qbackend_ops": sorted(op for op in torch._C._dispatch_get_all_op_names() if op.startswith("qbackend::")),
                "threads": torch.get_num_threads(),
                "mkldnn": torch.backends.mkldnn.enabled,
                "default_dtype": torch.get_default_dtype(),
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                # qbackend adds its own weight class (torch.load(weights_only=True) of its state
                # dicts): nothing else
                "safe_globals": sorted(map(str, (g for g in torch.serialization.get_safe_globals()
                                                 if getattr(g, "__module__", None) != "qbackend.quantized_tensor"))),
            }

        before = snapshot()
        import qbackend, qbackend.pipeline.backend, qbackend.lowering, qbackend.patterns
        after_import = snapshot()
        with torch.no_grad():
            torch.compile(m, backend="qbackend")(*example_inputs)
            report = qbackend.explain(m, *example_inputs)
            fused = []
            qbackend.compile(m, {"remainder": "inductor", "report_sink": fused.append})(*example_inputs)
            weight_only = qbackend.quantize_weights(nn.Sequential(nn.Linear(64, 32)).eval(), bits=4, group_size=32)
            weight_only(torch.randn(2, 64))
            torch.compile(weight_only, backend="qbackend")(torch.randn(2, 64))
        after_use = snapshot()
        print("new ops", after_use.pop("qbackend_ops"), before.pop("qbackend_ops"), after_import.pop("qbackend_ops"))
        print("remainder", fused[0].notes[-1])
        for stage, snap in (("import", after_import), ("use", after_use)):
            for key in before:
                if before[key] != snap[key]:
                    diff = before[key] if not isinstance(before[key], dict) else {k: (v, snap[key].get(k)) for k, v in before[key].items() if snap[key].get(k) != v}
                    print("CHANGED", stage, key, str(diff)[:500])
        print("lowered", len(report.lowered), "of", len(report.decisions))
        print("safe", [g.__name__ for g in torch.serialization.get_safe_globals() if getattr(g, "__module__", None) == "qbackend.quantized_tensor"])
        print("done")
    """))
    assert "CHANGED" not in out, out
    assert "safe ['QuantizedLinearWeight']" in out, out
    from qbackend.kernels import registry  # importing it registers nothing

    registered = sorted(f"{registry.NAMESPACE}::{name}" for name in registry.OPS) if registry.available() is None else []
    assert f"new ops {registered} [] []" in out, out
    assert "lowered 3 of 3" in out and "done" in out, out
    assert "remainder (the ops around the lowered kernels) compiled by Inductor" in out, out
