"""An archive is data: ``qbackend.load`` runs no code a file brings and refuses, with an
ArchiveError naming the record, every archive it cannot read as a converted graph.

Each case edits a real saved archive as an attacker would: the injected code would create a
canary file, which must never exist, whether at load or at the first call."""
import copy
import json
import signal
import sys
import zipfile

import pytest
import torch

import qbackend
from qbackend.archive.operator_allowlist import ALLOWED, FLOWS, resolve, side_effect
from qbackend.models import bert_encoder_like, tiny_resnet

from tests.helpers import quantize
from tests.tolerances import assert_float_close

IMAGE = (2, 3, 32, 32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: (records, example inputs, expected output)} of a CNN and of an encoder taking
    keyword inputs, both with a dynamic batch."""
    directory, archives = tmp_path_factory.mktemp("archives"), {}
    cnn = quantize(tiny_resnet(), (torch.randn(IMAGE),), dynamic_batch=True)
    encoder = quantize(bert_encoder_like(num_layers=1, hidden=32, heads=2, ffn=64), {"x": torch.randn(2, 8, 32)},
                       dynamic_batch=True)
    for name, model, args, kwargs in (("cnn", cnn, (torch.randn(IMAGE),), {}),
                                      ("encoder", encoder, (), {"x": torch.randn(2, 8, 32)})):
        qbackend.save(model, directory / f"{name}.pt2")
        with torch.no_grad():
            expected = model(*args, **kwargs)
        archives[name] = (torch.load(directory / f"{name}.pt2", weights_only=True), args, kwargs, expected)
    return archives


def _node(records, op):
    return next(index for index, node in enumerate(records["nodes"]) if node[1] == op)


def _replace(records, index, **fields):
    name, op, target, args, kwargs, value = records["nodes"][index]
    fields = {"name": name, "op": op, "target": target, "args": args, "kwargs": kwargs, "value": value, **fields}
    records["nodes"][index] = tuple(fields.values())


def _code(canary) -> str:
    """Python that creates the canary file, written without dots (FX splits attribute paths at them)."""
    return f"getattr(getattr(__import__('pathlib'), 'Path')({str(canary)!r}), 'touch')()"


def _placeholder_target(records, canary):
    """(without the pytree record, the target is the function's parameter: ``x=code`` its default)"""
    records["pytree"] = None
    _replace(records, _node(records, "placeholder"), target=f"x={_code(canary)}")


def _placeholder_name(records, canary):
    _replace(records, _node(records, "placeholder"), name=f"x; {_code(canary)}")


def _attribute_target(records, canary):
    index = _node(records, "get_attr")
    evil = f'a", None) or {_code(canary)} or getattr(self, "b'
    records["constants"][evil] = records["constants"].pop(records["nodes"][index][2])
    _replace(records, index, target=evil)


def _keyword_key(records, canary):
    index = next(i for i, n in enumerate(records["nodes"]) if n[1] == "call_function" and n[2].startswith("quantized_decomposed"))
    _replace(records, index, kwargs={"dict": [(f"out_dtype={_code(canary)}, x", None)]})


def _argument_name(records, canary):
    orig_args, in_spec, out_spec = records["pytree"]
    records["pytree"] = ([f"{orig_args[0]}={_code(canary)}", *orig_args[1:]], in_spec, out_spec)


def _keyword_input_key(records, canary):
    orig_args, in_spec, out_spec = records["pytree"]
    records["pytree"] = (orig_args, in_spec.replace('[\\"x\\"]', json.dumps(json.dumps([f"x':{_code(canary)},'y"]))[1:-1]),
                         out_spec)


def _enum_import(records, canary):
    """pytree's own loader imports the module an enum record names: here one that touches the
    canary (a module any installed package could provide)."""
    module = canary.parent / "canary_module.py"
    module.write_text(f"{_code(canary)}\nimport enum\nclass E(enum.Enum):\n    A = 1\n")
    sys.path.insert(0, str(canary.parent))
    orig_args, in_spec, out_spec = records["pytree"]
    enum = json.dumps([{"__enum__": True, "fqn": "canary_module:E", "name": "A"}])
    records["pytree"] = (orig_args, in_spec.replace('[\\"x\\"]', json.dumps(enum)[1:-1]), out_spec)


def _file_operator(records, canary):
    """``aten::from_file(..., shared=True)`` writes a file: an ATen operator, not one a
    converted graph calls."""
    index = _node(records, "call_function")
    _replace(records, index, target="aten::from_file.default", args=(str(canary), True, 16), kwargs={"dict": []})


INJECTIONS = [_placeholder_target, _placeholder_name, _attribute_target, _keyword_key, _argument_name, _file_operator]
ENCODER_INJECTIONS = [_keyword_input_key, _enum_import]


def _tampered(saved, name, tmp_path, edit, canary):
    records = copy.deepcopy(saved[name][0])
    edit(records, canary)
    torch.save(records, tmp_path / "tampered.pt2")
    return tmp_path / "tampered.pt2"


def _load_and_call(path, args, kwargs):
    """Load, call, and call the loaded graph as it is (the lowering re-emits what it keeps)."""
    loaded = qbackend.load(path)
    with torch.no_grad():
        loaded.module(*args, **kwargs)
        return loaded(*args, **kwargs)


@pytest.mark.parametrize("edit", [pytest.param(e, id=e.__name__.strip("_")) for e in INJECTIONS])
def test_a_name_or_operator_that_would_run_code_is_refused(saved, tmp_path, edit):
    canary = tmp_path / "canary"
    path = _tampered(saved, "cnn", tmp_path, edit, canary)
    with pytest.raises(qbackend.ArchiveError):
        _load_and_call(path, *saved["cnn"][1:3])
    assert not canary.exists()


@pytest.mark.parametrize("edit", [pytest.param(e, id=e.__name__.strip("_")) for e in ENCODER_INJECTIONS])
def test_an_input_structure_that_would_run_code_is_refused(saved, tmp_path, edit):
    canary = tmp_path / "canary"
    path = _tampered(saved, "encoder", tmp_path, edit, canary)
    try:
        with pytest.raises(qbackend.ArchiveError, match="pytree"):
            _load_and_call(path, *saved["encoder"][1:3])
    finally:
        sys.modules.pop("canary_module", None)
        if str(tmp_path) in sys.path:
            sys.path.remove(str(tmp_path))
    assert not canary.exists()


@pytest.mark.parametrize("name", ["cnn", "encoder"])
def test_an_untouched_archive_loads_and_runs_as_saved(saved, tmp_path, name):
    records, args, kwargs, expected = saved[name]
    torch.save(records, tmp_path / "same.pt2")
    assert_float_close(_load_and_call(tmp_path / "same.pt2", args, kwargs), expected, name)


class _Alarm:
    """Fails the test instead of hanging it: a refusal must come at once."""

    def __enter__(self):
        signal.signal(signal.SIGALRM, self._raise)
        signal.alarm(30)

    def __exit__(self, *exc):
        signal.alarm(0)

    @staticmethod
    def _raise(*_):
        raise TimeoutError("still evaluating after 30 s")


@pytest.mark.parametrize("size", ["10**10**10", "s0**(2**40)", "-" * 5000 + "s0", "(" * 300 + "s0" + ")" * 300,
                                  "s0.__class__", "__import__('os')", "s0**-1", "s0//0", "2**70", "Max(s0)", 10**30, -3])
def test_a_size_record_out_of_bounds_is_refused_at_once(saved, tmp_path, size):
    records = copy.deepcopy(saved["cnn"][0])
    index = next(i for i, n in enumerate(records["nodes"]) if isinstance(n[5], dict) and "sizes" in n[5])
    value = dict(records["nodes"][index][5])
    value["sizes"] = [size, *value["sizes"][1:]]
    _replace(records, index, value=value)
    torch.save(records, tmp_path / "sizes.pt2")
    with _Alarm(), pytest.raises(qbackend.ArchiveError, match=f"node {records['nodes'][index][0]}"):
        qbackend.load(tmp_path / "sizes.pt2")


def _constant(records, edit):
    name = next(iter(records["constants"]))
    records["constants"][name] = edit(records["constants"][name])


@pytest.mark.parametrize("edit,reason", [
    (lambda t: t.reshape(-1)[:1].expand(t.numel()), "overlap"),
    (lambda t: torch.quantize_per_tensor(t.float(), 0.1, 0, torch.qint8), "cannot be a constant"),
    (lambda t: "a string", "not a tensor"),
    (lambda t: t.to(torch.complex64), "cannot be a constant"),
], ids=["overlapping", "quantized", "string", "complex"])
def test_a_constant_that_is_not_plain_numbers_in_its_storage_is_refused(saved, tmp_path, edit, reason):
    records = copy.deepcopy(saved["cnn"][0])
    _constant(records, edit)
    torch.save(records, tmp_path / "constant.pt2")
    with pytest.raises(qbackend.ArchiveError, match=reason):
        qbackend.load(tmp_path / "constant.pt2")


def _node_edit(field, value):
    def edit(records):
        index = next(i for i, n in enumerate(records["nodes"]) if n[1] == "call_function" and n[3])
        _replace(records, index, **{field: value(records["nodes"][index])})
    return edit


@pytest.mark.parametrize("edit,reason", [
    (_node_edit("args", lambda n: (10**30, *n[3][1:])), "integer"),
    (_node_edit("args", lambda n: ({"node": "not_a_node"}, *n[3][1:])), "not an earlier node"),
    (_node_edit("args", lambda n: ({"node": n[0]}, *n[3][1:])), "not an earlier node"),
    (_node_edit("args", lambda n: (torch.ones(2), *n[3][1:])), "an argument of type Tensor"),
    (_node_edit("kwargs", lambda n: {"dict": [("no_such_argument", 1)]}), "takes no keyword"),
    (_node_edit("op", lambda n: "call_module"), "a node of kind"),
    (_node_edit("args", lambda n: ({"dtype": "_dynamo"}, *n[3][1:])), "unknown value"),
    (_node_edit("args", lambda n: ({"device": "file:/etc/passwd"}, *n[3][1:])), "unknown device"),
    (lambda records: records["nodes"].pop(), "no output"),
    (lambda records: records["inputs"].pop(), "placeholders"),
    (lambda records: records.update(symbols={"s0": (5, 2, 3)}), "range"),
    (lambda records: records.update(nodes="nodes"), "expected a list"),
], ids=["huge_int", "unknown_node", "self_reference", "tensor_argument", "unknown_keyword", "module_call",
        "torch_attribute_as_dtype", "device", "no_output", "inputs", "symbol_range", "not_a_list"])
def test_a_malformed_record_is_refused_naming_it(saved, tmp_path, edit, reason):
    records = copy.deepcopy(saved["cnn"][0])
    edit(records)
    torch.save(records, tmp_path / "malformed.pt2")
    with pytest.raises(qbackend.ArchiveError, match=reason):
        qbackend.load(tmp_path / "malformed.pt2")


def test_a_truncated_archive_is_refused(tmp_path):
    model = quantize(tiny_resnet(), (torch.randn(IMAGE),))
    qbackend.save(model, tmp_path / "model.pt2")
    data = (tmp_path / "model.pt2").read_bytes()
    for length in (0, 100, len(data) // 2, len(data) - 30):
        (tmp_path / "cut.pt2").write_bytes(data[:length])
        with pytest.raises(qbackend.ArchiveError, match="not a"):
            qbackend.load(tmp_path / "cut.pt2")


def test_the_earlier_format_loads_only_when_trusted(tmp_path):
    """torch.export's archive is deserialized by code that builds Python source from its names."""
    with zipfile.ZipFile(tmp_path / "old.pt2", "w") as archive:
        archive.writestr("model/archive_format", "pt2")
    with pytest.raises(qbackend.ArchiveError, match="trusted=True"):
        qbackend.load(tmp_path / "old.pt2")


def test_every_allowed_operator_touches_only_its_tensors():
    """The list names overloads this torch has, none reaching a file, storage or generator;
    the check itself finds the operator the review used to write a file."""
    assert len(ALLOWED) > 50
    assert {name for name in ALLOWED if resolve(name) is None} == set()
    assert {name: side_effect(resolve(name)) for name in ALLOWED if side_effect(resolve(name))} == {}
    assert side_effect(torch.ops.aten.from_file.default) == "takes a file name (filename)"
    assert "aten::from_file.default" not in ALLOWED and "aten::set_.source_Storage" not in ALLOWED
    assert side_effect(torch.ops.aten.set_.source_Storage) is not None
    assert {"quantized_decomposed::quantize_per_tensor.default", "aten::conv2d.default"} <= FLOWS


def test_the_command_prints_every_allowed_operator(capsys):
    from qbackend.archive_operators import main

    assert main([]) == 0
    printed = {line.strip() for line in capsys.readouterr().out.splitlines() if line.startswith("    ")}
    assert printed == ALLOWED


def test_a_slice_of_the_archive_fuzzer(capsys):
    """Mutants of the four seed archives (tests/fuzz/archive.py): each refused at load, or run
    as its own graph runs eagerly; no code run, no crash, no hang. ``python -m
    tests.fuzz.archive --cases 20000`` runs more."""
    from tests.fuzz.archive import main

    failed = main(["--cases", "60"])
    assert not failed, capsys.readouterr().out


@pytest.mark.parametrize("name,edit", [
    ("cnn", lambda c: c.update({"fc__bias": c["fc__bias"][:0]})),  # (the converted module reads fc.bias as fc__bias)
    ("encoder", lambda c: c.update({k: v[:0] for k, v in c.items() if k.endswith("out__bias")})),
], ids=["conv_net_linear", "attention_output"])
def test_a_bias_that_does_not_fit_its_weight_raises_as_eagerly(saved, tmp_path, name, edit):
    """(found by the archive fuzzer: a size-0 bias went into oneDNN's qlinear and MKL's packed
    sgemm, which read past it: a segfault) The rules and the float linear pass now take only
    one float per output channel; the graph then runs as it is and raises as eagerly."""
    records, args, kwargs, _ = saved[name]
    records = copy.deepcopy(records)
    edit(records["constants"])
    torch.save(records, tmp_path / "bias.pt2")
    loaded = qbackend.load(tmp_path / "bias.pt2")
    with torch.no_grad():
        with pytest.raises(RuntimeError) as eager:
            loaded.module(*args, **kwargs)
        with pytest.raises(RuntimeError) as compiled:
            loaded(*args, **kwargs)
    assert str(compiled.value) == str(eager.value)
