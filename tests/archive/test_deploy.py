"""``qbackend.save`` / ``qbackend.load``: a converted model saved once runs in a fresh process
without torchao, calibration or Dynamo (until a second shape asks for the symbolic lowering),
with the reference's numerics and the symbolic sizes it was exported with; the archive is data
that names operators only."""
import functools
import json
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import qbackend
from qbackend.pipeline.direct import CompiledGraphModule
from qbackend.models import bert_encoder_like, tiny_resnet

from tests.helpers import lowering_keys, quantize
from tests.tolerances import assert_float_close


def test_a_fresh_process_runs_the_saved_model_without_torchao(tmp_path):
    model = quantize(tiny_resnet(), (torch.randn(2, 3, 32, 32),), dynamic_batch=True)
    inputs = [torch.randn(batch, 3, 32, 32) for batch in (1, 3, 5)]
    with torch.no_grad():
        torch.save({"inputs": inputs, "expected": [model(x) for x in inputs]}, tmp_path / "io.pt")
    qbackend.save(model, tmp_path / "model.pt2")
    script = textwrap.dedent(f"""
        import sys, torch, qbackend
        from tests.helpers import lowering_keys
        from tests.tolerances import assert_float_close
        loaded = qbackend.load({str(tmp_path / "model.pt2")!r})
        io = torch.load({str(tmp_path / "io.pt")!r})
        with torch.no_grad():
            for x, expected in zip(io["inputs"], io["expected"]):
                assert_float_close(loaded(x), expected, f"batch {{len(x)}}")
                if len(x) == 1:  # (the first call lowers from the archive's values: no fake tensors, no Dynamo)
                    assert "torch._dynamo" not in sys.modules
        assert lowering_keys(loaded) == [(1, 3, 32, 32), {CompiledGraphModule.SYMBOLIC!r}], list(loaded.lowered)
        assert "torchao" not in sys.modules
        print("ran", len(io["inputs"]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ran 3", done.stderr[-3000:]


def test_the_archive_holds_only_what_the_graph_reads(tmp_path):
    """A converted module keeps the float weights its int8 copies replaced; they are not saved."""
    model = quantize(tiny_resnet(), (torch.randn(2, 3, 32, 32),))
    read = {n.target for n in model.graph.nodes if n.op == "get_attr"}
    unread = {name for name, _ in model.named_parameters()} - read
    assert "conv1.weight" in unread  # (the premise: convert_pt2e left it behind)
    qbackend.save(model, tmp_path / "model.pt2")
    assert set(torch.load(tmp_path / "model.pt2", weights_only=True)["constants"]) == read


def test_keyword_inputs_and_a_symbolic_sequence_length_survive_the_round_trip(tmp_path):
    sizes = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=256)}
    model = quantize(bert_encoder_like(num_layers=1, hidden=64, heads=4, ffn=128), {"x": torch.randn(2, 16, 64)},
                     dynamic_shapes={"x": sizes})
    qbackend.save(model, tmp_path / "encoder.pt2")
    loaded = qbackend.load(tmp_path / "encoder.pt2")
    with torch.no_grad():
        for batch, seq in ((2, 16), (3, 40)):
            x = torch.randn(batch, seq, 64)
            assert_float_close(loaded(x=x), model(x=x), f"batch {batch}, sequence {seq}")
    assert lowering_keys(loaded) == [(2, 16, 64), CompiledGraphModule.SYMBOLIC]


class MaskedByIntegers(torch.nn.Module):
    """A tokenizer-style integer mask cast to float: export records an assert of its dtype,
    which a loaded archive carries without a value."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x, mask):
        return self.fc(x) * mask.to(torch.float32)


def test_a_loaded_graph_with_dtype_asserts_is_lowered_once_for_every_batch(tmp_path):
    torch.manual_seed(0)
    model = quantize(MaskedByIntegers(), (torch.randn(2, 8), torch.ones(2, 8, dtype=torch.int64)), dynamic_batch=True)
    qbackend.save(model, tmp_path / "masked.pt2")
    loaded = qbackend.load(tmp_path / "masked.pt2")
    assert any(n.target is torch.ops.aten._assert_tensor_metadata.default for n in loaded.module.graph.nodes)
    with torch.no_grad():
        for batch in (2, 5):
            x, mask = torch.randn(batch, 8), torch.randint(0, 2, (batch, 8))
            assert_float_close(loaded(x, mask), model(x, mask), f"batch {batch}")
    assert lowering_keys(loaded) == [(2, 8), CompiledGraphModule.SYMBOLIC]


def test_only_a_converted_graph_can_be_saved(tmp_path):
    with pytest.raises(TypeError, match="takes a converted PT2E module"):
        qbackend.save(torch.nn.Linear(2, 2), tmp_path / "linear.pt2")


def test_an_archive_of_the_earlier_format_loads_when_trusted(tmp_path):
    """(``torch.export.save`` of the converted module: what ``save`` wrote before its own records;
    its loader builds code from the file, so only by an explicit ``trusted=True``)"""
    model = quantize(tiny_resnet(), (torch.randn(2, 3, 32, 32),))
    torch.export.save(torch.export.export(model, (torch.randn(2, 3, 32, 32),), strict=False), tmp_path / "old.pt2")
    loaded = qbackend.load(tmp_path / "old.pt2", trusted=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_float_close(loaded(x), model(x), "earlier format")


class CallsPython(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.relu(x) + 1


def test_the_archive_names_operators_only(tmp_path):
    """A graph calling a Python function cannot be saved; an archive naming anything but an
    operator (here: ``builtins.eval`` written in by hand) is refused before any node is made."""
    model = quantize(tiny_resnet(), (torch.randn(2, 3, 32, 32),))
    traced = torch.fx.symbolic_trace(CallsPython())
    traced.graph.find_nodes(op="placeholder")[0].meta["val"] = torch.empty(2, 3)  # (as export records)
    with pytest.raises(ValueError, match="does not allow"):
        qbackend.save(traced, tmp_path / "python.pt2")
    qbackend.save(model, tmp_path / "model.pt2")
    saved = torch.load(tmp_path / "model.pt2", weights_only=True)
    name, op, _, args, kwargs, value = saved["nodes"][-2]
    saved["nodes"][-2] = (name, op, "builtins::eval.default", args, kwargs, value)
    torch.save(saved, tmp_path / "tampered.pt2")
    with pytest.raises(qbackend.ArchiveError, match="not an operator a saved graph may call"):
        qbackend.load(tmp_path / "tampered.pt2")


def test_an_archive_says_how_its_model_was_made_and_a_loaded_model_reports_as_compiled(tmp_path):
    import importlib.metadata

    from qbackend.version import VERSION

    inputs = (torch.randn(2, 3, 32, 32),)
    model = quantize(tiny_resnet(), inputs, [inputs, (torch.randn(2, 3, 32, 32),)], keep_float=["fc"])
    qbackend.save(model, tmp_path / "model.pt2")
    about = qbackend.inspect(tmp_path / "model.pt2")
    assert about["versions"] == {"qbackend": VERSION, "torch": torch.__version__, "torchao": importlib.metadata.version("torchao")}
    assert about["recipe"]["flow"] == "quantize_x86" and about["recipe"]["options"]["keep_float"] == ["fc"], about["recipe"]
    assert about["recipe"]["options"]["reduce_range"] is True and about["inputs"] == [["float32", "cpu", [2, 3, 32, 32]]]
    assert about["recipe"]["chosen"]["activation_ranges"][0] in ("histogram", "min_max"), about["recipe"]
    in_process, loaded = [], []
    with torch.no_grad():
        qbackend.compile(model, options={"report_sink": in_process.append})(*inputs)
        qbackend.load(tmp_path / "model.pt2", options={"report_sink": loaded.append})(*inputs)
    lines = [[d.line() for d in reports[0].decisions] for reports in (in_process, loaded)]
    assert lines[0] == lines[1] and any("(stages.0.0.conv1)" in line for line in lines[1]), lines


def _saved_with(tmp_path, **changes):
    inputs = (torch.randn(2, 3, 32, 32),)
    qbackend.save(quantize(tiny_resnet(), inputs), tmp_path / "model.pt2")
    saved = torch.load(tmp_path / "model.pt2", weights_only=True)
    saved.update(changes)
    torch.save(saved, tmp_path / "changed.pt2")
    return tmp_path / "changed.pt2"


@pytest.mark.parametrize("changes, message", [
    ({"about": {"recipe": {"options": torch.ones(2)}}}, r"about: tensor\(\[1., 1.\]\) is not plain data"),
    ({"about": {"recipe": functools.reduce(lambda inner, _: [inner], range(20), 1)}}, "about: a description nested too deep or too long"),
    ({"about": "recipe"}, "about: expected a dict, got str"),
])
def test_what_an_archive_says_of_itself_is_checked_as_data(tmp_path, changes, message):
    path = _saved_with(tmp_path, **changes)
    with pytest.raises(qbackend.ArchiveError, match=message):
        qbackend.inspect(path)


def test_a_node_source_must_name_a_node_with_a_plain_path(tmp_path):
    with pytest.raises(qbackend.ArchiveError, match=r"source of 'nowhere': not a node's module path"):
        qbackend.load(_saved_with(tmp_path, sources={"nowhere": "layer1"}))
    with pytest.raises(qbackend.ArchiveError, match=r"source of 'x': not a node's module path"):
        qbackend.load(_saved_with(tmp_path, sources={"x": "layer1\n__import__('os')"}))


def test_an_output_type_this_process_has_not_registered_names_its_import(tmp_path):
    inputs = (torch.randn(2, 3, 32, 32),)
    qbackend.save(quantize(tiny_resnet(), inputs), tmp_path / "model.pt2")
    saved = torch.load(tmp_path / "model.pt2", weights_only=True)
    names, in_spec, out_spec = saved["pytree"]
    protocol, output = json.loads(out_spec)  # (one tensor: a leaf; wrapped as a library's output type would be)
    wrapped = {"type": "some_library.outputs.Output", "context": "null", "children_spec": [output]}
    saved["pytree"] = (names, in_spec, json.dumps([protocol, wrapped]))
    torch.save(saved, tmp_path / "changed.pt2")
    with pytest.raises(qbackend.ArchiveError, match=r"which this process has not registered: import some_library.outputs "
                                                    r"first \(load imports nothing an archive names beyond "
                                                    r"\['transformers.modeling_outputs'\]\)"):
        qbackend.load(tmp_path / "changed.pt2")
    assert "some_library" not in sys.modules


def test_the_slice_to_end_sentinel_is_taken_as_a_slices_end_only(tmp_path):
    """2**63 - 1, torch's "to the end", is what export writes for a slice over a dynamic size's
    whole length; anywhere else an integer beyond 2**62 is refused, as before."""
    inputs = (torch.randn(2, 3, 32, 32),)
    qbackend.save(quantize(tiny_resnet(), inputs), tmp_path / "model.pt2")
    saved = torch.load(tmp_path / "model.pt2", weights_only=True)
    index, entry = next((i, e) for i, e in enumerate(saved["nodes"]) if "dequantize_per_tensor" in str(e[2]))
    name, op, target, args, kwargs, value = entry
    saved["nodes"][index] = (name, op, target, [*args[:2], 2**63 - 1, *args[3:]], kwargs, value)  # (its zero point)
    torch.save(saved, tmp_path / "changed.pt2")
    with pytest.raises(qbackend.ArchiveError, match=rf"node {name} zero_point: 9223372036854775807 is not an integer within"):
        qbackend.load(tmp_path / "changed.pt2")


def test_a_hugging_face_classifier_loads_in_a_fresh_process_with_no_import(tmp_path):
    """transformers' output types register when transformers.modeling_outputs is imported: load
    imports that module (a fixed list), so the saved classifier, exported with a free batch and
    sequence length, needs no import from its user, and lowers and reports as the in-process
    compile does at both shapes (the first call's, then the symbolic lowering's)."""
    # (transformers imports torchvision where installed; PyPI's is built for CUDA torch, whose C
    # ops fail to register against the CPU wheel: the benchmark environment has it. Not needed here.)
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    import transformers

    config = transformers.DistilBertConfig(vocab_size=64, dim=32, hidden_dim=64, n_layers=1, n_heads=2, num_labels=3)
    torch.manual_seed(0)
    model = transformers.DistilBertForSequenceClassification(config).eval()
    batches = [{"input_ids": torch.randint(0, 64, (b, s)), "attention_mask": torch.ones(b, s, dtype=torch.int64)}
               for b, s in ((2, 7), (3, 11))]
    sizes = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=64)}
    converted = qbackend.quantize_x86(model, batches[0], batches, dynamic_shapes={"input_ids": sizes, "attention_mask": sizes})
    reports = []
    compiled = qbackend.compile(converted, {"report_sink": reports.append})
    with torch.no_grad():
        expected = [compiled(**batch).logits for batch in batches]
    qbackend.save(converted, tmp_path / "model.pt2")
    torch.save({"batches": batches, "logits": expected, "reports": list(map(str, reports))}, tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import sys, torch, qbackend
        io = torch.load({str(tmp_path / "io.pt")!r})
        reports = []
        loaded = qbackend.load({str(tmp_path / "model.pt2")!r}, {{"report_sink": reports.append}})
        with torch.no_grad():
            outputs = [loaded(**batch) for batch in io["batches"]]
        assert type(outputs[0]).__name__ == "SequenceClassifierOutput", type(outputs[0])
        assert all(torch.equal(out.logits, logits) for out, logits in zip(outputs, io["logits"]))
        assert list(map(str, reports)) == io["reports"], (list(map(str, reports)), io["reports"])
        print("ok", len(reports))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith(f"ok {len(reports)}"), done.stderr[-3000:]
    assert len(reports) == 2  # (the first shape's lowering, then the one for every size)
