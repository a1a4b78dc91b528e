"""Variable batch and sequence length: ``quantize_x86(dynamic_batch=True)`` /
``dynamic_shapes=`` export symbolic sizes; ``qbackend.compile`` lowers the first input's shapes
for themselves and, from a second shape on, once for every size export's ranges admit (a
specialised lowering, at most ``SPECIALISED_LIMIT`` of them, for any other input), as Dynamo
recompiles; ``torch.compile(dynamic=True)`` runs them in one graph; every size gives the
reference's numerics."""
import collections
import copy
import functools
import threading

import pytest
import torch

import qbackend
from qbackend.pipeline import direct
from qbackend.pipeline.direct import CompiledGraphModule
from qbackend.models import bert_encoder_like, tiny_resnet

from tests.helpers import in_threads, lowering_keys, quantize
from tests.tolerances import assert_float_close

SYMBOLIC = CompiledGraphModule.SYMBOLIC


@pytest.fixture(scope="module")
def resnet():
    """Calibrated at batch 1 (exported at 2: export fixes a size it sees as 1)."""
    return quantize(tiny_resnet(), (torch.randn(1, 3, 32, 32),), dynamic_batch=True)


def _images(batch: int) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(batch))


def test_the_first_batch_is_lowered_for_itself_then_one_lowering_runs_every_batch(resnet):
    compiled = qbackend.compile(resnet)
    with torch.no_grad():
        for batch in (2, 3, 5, 8, 3):
            assert_float_close(compiled(_images(batch)), resnet(_images(batch)), f"batch {batch}")
    assert lowering_keys(compiled) == [(2, 3, 32, 32), SYMBOLIC]


def test_batch_one_shares_the_symbolic_lowering(resnet):
    """dynamic_batch's range starts at 1 (export's default Dim starts at 2: it specialises 0 and 1)."""
    compiled = qbackend.compile(resnet)
    with torch.no_grad():
        for batch in (4, 1, 6):
            assert_float_close(compiled(_images(batch)), resnet(_images(batch)), f"batch {batch}")
    assert lowering_keys(compiled) == [(4, 3, 32, 32), SYMBOLIC]


def test_without_exports_ranges_batch_one_has_its_own_lowering():
    """A module converted by hand (torchao's convert drops export's ``range_constraints``) has
    only the shape environment's range, from 2: batch 1 is lowered for its shape, beside the
    first batch's and the symbolic lowering, as Dynamo recompiles for a size of 1."""
    model = quantize(tiny_resnet(), (torch.randn(2, 3, 32, 32),), dynamic_shapes=({0: torch.export.Dim("batch")},))
    del model.range_constraints
    compiled = qbackend.compile(model)
    with torch.no_grad():
        for batch in (4, 1, 6, 1):
            assert_float_close(compiled(_images(batch)), model(_images(batch)), f"batch {batch}")
    assert lowering_keys(compiled) == [(4, 3, 32, 32), SYMBOLIC, (1, 3, 32, 32)]


def test_specialised_lowerings_are_bounded_least_recently_used_first(resnet, monkeypatch):
    monkeypatch.setattr(direct, "SPECIALISED_LIMIT", 2)
    compiled = qbackend.compile(resnet)
    compiled.symbolic = None  # (as when export's sizes admit no shared lowering)
    with torch.no_grad():
        for batch in (2, 3, 2, 4):
            assert_float_close(compiled(_images(batch)), resnet(_images(batch)), f"batch {batch}")
    assert [key[0][1][0] for key in compiled.lowered] == [2, 4]


def test_a_thread_whose_lowering_another_evicts_meanwhile_still_runs_it(resnet, monkeypatch):
    """Two threads calling one compiled module: one finds batch 2's lowering and is held there
    until the other has lowered batch 3 and evicted batch 2's (one kept); both get their
    outputs (marking the evicted lowering as used had raised a KeyError)."""
    monkeypatch.setattr(direct, "SPECIALISED_LIMIT", 1)
    compiled = qbackend.compile(resnet)
    compiled.symbolic = None  # (every batch a lowering of its own)
    with torch.no_grad():
        compiled(_images(2))
    found, evicted = threading.Event(), threading.Event()

    class Table(collections.OrderedDict):
        def get(self, key, default=None):
            value = super().get(key, default)
            if value is not None and key[0][1][0] == 2 and not found.is_set():
                found.set()
                evicted.wait(30)
            return value

        def __delitem__(self, key):
            super().__delitem__(key)
            evicted.set()

    compiled.lowered = Table(compiled.lowered)

    def run(batch):
        if batch == 3:
            found.wait(30)
        return compiled(_images(batch))

    outputs = dict(zip((2, 3), in_threads([functools.partial(run, batch) for batch in (2, 3)], evicted.set)))
    assert evicted.is_set() and lowering_keys(compiled) == [(3, 3, 32, 32)]
    with torch.no_grad():
        for batch, output in outputs.items():
            assert_float_close(output, resnet(_images(batch)), f"batch {batch}")


def test_a_copy_runs_the_lowerings_it_copied(resnet):
    compiled = qbackend.compile(resnet)
    with torch.no_grad():
        compiled(_images(2))
        copied = copy.deepcopy(compiled)
        assert_float_close(copied(_images(2)), resnet(_images(2)), "batch 2")
    assert lowering_keys(copied) == [(2, 3, 32, 32)] and copied._table is not compiled._table


def test_torch_compile_dynamic_runs_every_batch_in_one_graph(resnet):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(resnet, backend="qbackend", dynamic=True)
    with torch.no_grad():
        for batch in (2, 3, 7):
            assert_float_close(compiled(_images(batch)), resnet(_images(batch)), f"batch {batch}")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_batch_and_sequence_length_vary_together():
    model = bert_encoder_like(num_layers=1, hidden=64, heads=4, ffn=128)
    sizes = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=256)}
    example = torch.randn(2, 16, 64)
    quantized = quantize(model, {"x": example}, dynamic_shapes={"x": sizes})
    compiled = qbackend.compile(quantized)
    with torch.no_grad():
        for batch, seq in ((2, 16), (3, 7), (2, 40), (4, 128)):
            x = torch.randn(batch, seq, 64, generator=torch.Generator().manual_seed(seq))
            assert_float_close(compiled(x=x), quantized(x=x), f"batch {batch}, sequence {seq}")
    assert lowering_keys(compiled) == [(2, 16, 64), SYMBOLIC]
    report = qbackend.explain(quantized, example)
    assert not report.kept, str(report)


@pytest.mark.parametrize("flags, message", [
    ({"dynamic_batch": True, "dynamic_shapes": ({0: torch.export.Dim("b")},)}, "not both"),
    ({"dynamic_batch": True, "num_batches": 0}, "num_batches must be at least 1"),
])
def test_conflicting_flow_options_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        quantize(torch.nn.Linear(4, 4), (torch.randn(2, 4),), **flags)
