"""What users and their files name stays where it was when the package is rearranged: the
top-level names, the flow's module, the backend's entry point, the command-line modules, the
``qbackend::`` ops, the environment variables and the class pickled checkpoints name."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import pickle
import re
from pathlib import Path

import torch

import qbackend

ROOT = Path(__file__).resolve().parents[1]

PUBLIC = ["quantize_x86", "quantize_xpu", "QuantizeConfig", "compile", "explain", "save", "load", "inspect", "ArchiveError", "accuracy_report", "AccuracyReport", "Report", "smooth_quant",
          "SmoothReport", "QuantizedLinearWeight", "quantize_weights", "from_old_cpu_int4"]
COMMANDS = ["qbackend.__main__", "qbackend.demo", "qbackend.docs", "qbackend.patterns.__main__", "qbackend.lowering.__main__", "qbackend.archive_operators"]
OWN_OPS = ["add_quantize", "add_quantize_", "attention_f32", "attention_quantize", "avg_pool_u8", "global_avg_pool_quantize",
           "global_avg_pool_u8", "int4_mm_int16",
           "int8_mm_int16", "layer_norm_and_quantize", "layer_norm_quantize", "max_pool_u8", "qconv", "qconv_depthwise",
           "qconv_depthwise_layer_norm", "qconv_grouped", "qconv_stem", "scale_quantize"]
VARIABLES = {"QBACKEND_CACHE_DIR", "QBACKEND_KERNELS", "QBACKEND_KERNEL_CHOICE", "QBACKEND_REPORT", "QBACKEND_STRICT"}


def test_every_public_name_imports_from_the_package():
    assert sorted(qbackend.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(qbackend, name) is not None, name
    assert callable(qbackend.compile) and callable(qbackend.explain) and isinstance(qbackend.__version__, str)


def test_the_flow_keeps_its_module():
    flow = importlib.import_module("qbackend.pt2e_flow")
    assert {"quantize_x86", "quantize_xpu", "cpu_needs_reduce_range"} <= set(flow.__all__)
    assert callable(flow.quantize_x86) and callable(flow.quantize_xpu)


def test_torch_compile_finds_the_backend_by_its_entry_point():
    (entry,) = [e for e in importlib.metadata.entry_points(group="torch_dynamo_backends") if e.name == "qbackend"]
    assert entry.load() is importlib.import_module("qbackend.pipeline.backend").qbackend
    assert "qbackend" in torch._dynamo.list_backends()


def test_command_line_modules_exist():
    for name in COMMANDS:
        assert importlib.util.find_spec(name) is not None, name


def test_own_op_names_are_unchanged():
    from qbackend.kernels import registry

    assert sorted(registry.OPS) == OWN_OPS
    assert registry.NAMESPACE == "qbackend"


def test_environment_variables_are_the_documented_ones():
    source = "".join(p.read_text() for part in ("qbackend", "patterns", "lowering") for p in (ROOT / part).rglob("*.py"))
    assert set(re.findall(r"QBACKEND_[A-Z_0-9]+", source)) == VARIABLES
    readme = (ROOT / "README.md").read_text()
    assert all(name in readme for name in VARIABLES), [name for name in VARIABLES if name not in readme]


def test_a_checkpoint_names_the_weight_class_where_it_always_was():
    weight = qbackend.QuantizedLinearWeight.from_float(torch.randn(16, 64), bits=4, group_size=32)
    assert type(weight).__module__ == "qbackend.quantized_tensor"
    assert b"qbackend.quantized_tensor" in pickle.dumps(type(weight))
