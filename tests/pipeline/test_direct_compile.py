"""``qbackend.compile``: a converted PT2E module lowered without Dynamo gives what the
torch.compile path gives (outputs bit for bit, the same report, prepacks tuned for the input
shapes), lowers each new input signature once, and leaves the user's module as it was."""
import pytest
import torch
import torch.nn as nn

import qbackend
from qbackend.kernels import fast_qdq
from qbackend.pipeline.backend import Options, compile_graph
from qbackend.pipeline.direct import CompiledGraphModule, InputBinding, _with_shapes
from qbackend.lowering.common import static_shape
from qbackend.models import bert_encoder_like, tiny_resnet

from tests.helpers import lowering_keys, quantize


def _resnet():
    inputs = (torch.randn(2, 3, 32, 32),)
    return quantize(tiny_resnet(), inputs), inputs


def _lines(report) -> list[str]:
    return str(report).splitlines()


def test_same_outputs_and_report_as_torch_compile_without_dynamo():
    model, inputs = _resnet()
    reports = []
    torch._dynamo.reset()
    with torch.no_grad():
        through_dynamo = torch.compile(model, backend="qbackend", options={"report_sink": reports.append})(*inputs)
        frames = torch._dynamo.utils.counters["frames"]["total"]
        compiled = qbackend.compile(model, options={"report_sink": reports.append})
        direct = compiled(*inputs)
    assert isinstance(compiled, CompiledGraphModule)
    assert torch._dynamo.utils.counters["frames"]["total"] == frames  # Dynamo traced nothing more
    assert torch.equal(direct, through_dynamo)
    assert len(reports) == 2 and _lines(reports[0]) == _lines(reports[1]) and not reports[1].kept, str(reports[1])


def test_prepacks_see_the_shapes_convert_pt2e_left_unrecorded():
    model, inputs = _resnet()
    assert any("val" not in n.meta for n in model.graph.nodes if n.op == "call_function")  # (why the fake pass exists)
    _, report, lowered_graph = compile_graph(_with_shapes(model, list(inputs)), list(inputs), Options())
    lowered = [n for n in lowered_graph.graph.nodes if n.meta.get("qbackend_rule") in ("qconv", "qconv_add", "qlinear")]
    kernels = [n.args[0] if n.target is fast_qdq.clamp_to_range_ else n for n in lowered]  # 7-bit outputs: kernel, clamp
    assert sum(d.lowered for d in report.decisions if d.kind in ("conv", "linear")) == 11  # 10 convs and the fc
    assert kernels and all(static_shape(n.args[0]) is not None for n in kernels)


def _metadata(gm) -> list:
    return [(n.name, tuple(v.shape), v.stride(), v.dtype) if isinstance(v := n.meta.get("val"), torch.Tensor) else (n.name, None)
            for n in gm.graph.nodes if n.op != "output"]


def test_values_reused_from_export_are_what_a_fake_tensor_pass_gives():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from qbackend.pipeline.direct import _frozen_copy, _reuse_export_values

    model, inputs = _resnet()
    reused, propagated = _frozen_copy(model), _frozen_copy(model)
    assert _reuse_export_values(reused, list(inputs))
    FakeTensorProp(propagated, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    assert _metadata(reused) == _metadata(propagated)
    assert all(v[1] is not None for v in _metadata(reused))
    # an input in another layout than export's gives other strides downstream: the full pass runs
    channels_last = [inputs[0].contiguous(memory_format=torch.channels_last)]
    assert not _reuse_export_values(_frozen_copy(model), channels_last)
    x = next(n for n in _with_shapes(model, channels_last).graph.nodes if n.op == "placeholder")
    assert x.meta["val"].stride() == channels_last[0].stride()


@pytest.mark.parametrize("name", ["resnet, symbolic batch", "encoder, symbolic batch and sequence"])
def test_meta_and_archive_values_are_what_a_fake_tensor_pass_gives(name, tmp_path):
    """The values a first call lowers from without a fake-tensor mode (whose import brings
    Dynamo's): ATen's meta kernels, and a loaded archive's records for the call's sizes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from qbackend.pipeline.direct import _archive_values, _frozen_copy, _meta_values

    if name.startswith("resnet"):
        model, inputs = quantize(tiny_resnet(), (torch.randn(2, 3, 32, 32),), dynamic_batch=True), [torch.randn(3, 3, 32, 32)]
    else:
        sizes = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=64)}
        model = quantize(bert_encoder_like(num_layers=1, hidden=32, heads=2, ffn=64), {"x": torch.randn(2, 8, 32)},
                         dynamic_shapes={"x": sizes})
        inputs = [torch.randn(3, 13, 32)]
    qbackend.save(model, tmp_path / "model.pt2")
    propagated, meta, archived = _frozen_copy(model), _frozen_copy(model), _frozen_copy(qbackend.load(tmp_path / "model.pt2").module)
    FakeTensorProp(propagated, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    assert _meta_values(meta, inputs) and _archive_values(archived, inputs)
    assert _metadata(meta) == _metadata(propagated) == _metadata(archived)
    assert sum(v[1] is not None for v in _metadata(archived)) > 20
    # another layout than the recorded one: the records do not say its strides
    assert not _archive_values(_frozen_copy(archived), [inputs[0].transpose(0, 1).contiguous().transpose(0, 1)])


def test_an_export_with_a_symbolic_batch_is_lowered_for_its_first_batch_then_once_for_every_batch():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    model = quantize(module, (torch.randn(4, 16),), dynamic_batch=True)
    compiled = qbackend.compile(model)
    with torch.no_grad():
        for rows in (4, 9, 4, 7):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(compiled(x), model(x), atol=0.05, rtol=0.05)
    # (the first rows lowered for themselves, as Dynamo's first graph)
    assert lowering_keys(compiled) == [(4, 16), CompiledGraphModule.SYMBOLIC]


def _outcome(fn, args):
    try:
        return tuple(fn(*args).shape)
    except Exception as error:
        return type(error), str(error).splitlines()[0]


def test_inputs_the_export_does_not_take_behave_as_in_eager():
    """Wrong arguments, another dtype, another fixed size, another structure: the module
    itself runs them (here: raises), nothing is lowered for them."""
    model, (x,) = _resnet()
    compiled = qbackend.compile(model)
    with torch.no_grad():
        compiled(x)
        for args in [(), (x, x), (x.to(torch.int64),), (torch.randn(3, 3, 32, 32),), ([x],)]:
            assert _outcome(compiled, args) == _outcome(model, args)
    assert len(compiled.lowered) == 1


def test_the_users_module_is_left_as_it_was():
    model, inputs = _resnet()
    code, state = model.code, {k: v.clone() for k, v in model.state_dict().items()}
    metas = [dict(n.meta) for n in model.graph.nodes]
    with torch.no_grad():
        qbackend.compile(model)(*inputs)
    assert model.code == code and [dict(n.meta) for n in model.graph.nodes] == metas
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_a_module_that_is_no_exported_graph_goes_through_torch_compile():
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    compiled = qbackend.compile(module)
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), module(x))


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, mask):
        return self.fc(x) * mask


def test_inputs_passed_by_name_as_to_the_module():
    inputs = (torch.randn(2, 8), torch.ones(2, 8))
    model = quantize(Masked(), inputs)
    with torch.no_grad():
        expected = model(inputs[0], mask=inputs[1])
        torch.testing.assert_close(qbackend.compile(model)(inputs[0], mask=inputs[1]), expected, atol=0.05, rtol=0.05)


def test_positional_tensors_as_export_took_them_skip_the_binding_and_give_what_it_gives():
    """Tensors passed positionally, as many as export took and no keywords, are the placeholders
    as they come (``InputBinding.plain``: no signature binding, no pytree); every other call
    binds, and both give the same placeholders, or None."""
    inputs = (torch.randn(2, 8), torch.ones(2, 8))
    model = quantize(Masked(), inputs)
    fast, bound = InputBinding(model), InputBinding(model)
    bound.plain = False
    assert fast.plain
    calls = [(inputs, {}), (inputs[:1], {"mask": inputs[1]}), ((inputs[0], nn.Parameter(inputs[1])), {}),
             (inputs[:1], {}), (inputs * 2, {})]
    for args, kwargs in calls:
        got, expected = fast.placeholders(args, kwargs), bound.placeholders(args, kwargs)
        assert (got is None) == (expected is None)
        assert got is None or [id(t) for t in got] == [id(t) for t in expected]
    assert [fast.placeholders(args, kwargs) is None for args, kwargs in calls] == [False, False, False, True, True]
