"""Weight-only weights moved onto 2 MB pages in place (qbackend/llm/huge_pages.py over
qbackend/kernels/huge_pages.py): the bytes and addresses stay, exactly the whole 2 MB pages inside a tensor move, and what Linux refuses
changes nothing."""
import platform

import torch

from qbackend.kernels import huge_pages
from qbackend.quantized_tensor import QuantizedLinearWeight
from qbackend import quantize_weights

from tests.helpers import Captured, needs_own_kernels


def _linux_collapses() -> bool:
    """madvise(MADV_COLLAPSE) is in Linux 6.1+, unless transparent huge pages are off."""
    if platform.system() != "Linux":
        return False
    major, minor = (int(p) for p in platform.release().split(".")[:2])
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            enabled = "[never]" not in f.read()
    except OSError:
        enabled = False
    return enabled and (major, minor) >= (6, 1)


def _interior(tensor: torch.Tensor) -> int:
    begin, page = tensor.data_ptr(), huge_pages.HUGE_PAGE
    return max(0, (begin + tensor.numel() * tensor.element_size()) // page * page - (begin + page - 1) // page * page)


def test_the_whole_pages_inside_move_and_the_bytes_stay():
    tensor = torch.randint(0, 256, (9 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    before, address = tensor.clone(), tensor.data_ptr()
    moved = huge_pages.collapse([tensor, tensor[: 1 << 20]])  # (a tensor inside another's pages counts once)
    assert moved == (_interior(tensor) if _linux_collapses() else 0) and moved % huge_pages.HUGE_PAGE == 0
    assert tensor.data_ptr() == address and torch.equal(tensor, before)


def test_tensors_it_cannot_move_are_left_as_they_are():
    small = torch.zeros(1 << 20, dtype=torch.uint8)  # (no whole 2 MB page inside)
    strided = torch.zeros(4096, 2048)[:, ::2]
    assert huge_pages.collapse([small, strided, torch.zeros(8 << 20, dtype=torch.uint8, device="meta")]) == 0


@needs_own_kernels
def test_a_weight_only_linears_weights_move_with_its_values_unchanged():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096, bias=False))
    quantize_weights(model, bits=4, group_size=128)
    weight = model[0].weight
    assert isinstance(weight, QuantizedLinearWeight)
    x = torch.randn(1, 2048)
    torch._dynamo.reset()
    captured = Captured()
    with torch.no_grad():
        expected = model(x)
        actual = torch.compile(model, backend=captured)(x)
    assert torch.equal(actual, expected)
    notes = [note for note in captured.report.notes if "2 MB pages" in note]
    assert len(notes) == (1 if _linux_collapses() else 0), captured.report.notes


class Siblings(torch.nn.Module):
    """Two linears reading one input: their weights run merged (lowering/sibling_linears.py)."""

    def __init__(self):
        super().__init__()
        self.q, self.k = torch.nn.Linear(2048, 2048, bias=False), torch.nn.Linear(2048, 1024, bias=False)

    def forward(self, x):
        return self.q(x).relu(), self.k(x).relu()  # (an output the graph returns is not merged)


@needs_own_kernels
def test_merged_weights_move_whole_onto_aligned_pages():
    torch.manual_seed(0)
    model = quantize_weights(Siblings().eval(), bits=4, group_size=128)
    x = torch.randn(1, 1, 2048)  # (a decode step's rows)
    torch._dynamo.reset()
    captured = Captured()
    with torch.no_grad():
        expected = model(x)
        actual = torch.compile(model, backend=captured)(x)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))
    lowered = captured.lowered
    merged = [getattr(lowered, n.target) for n in lowered.graph.nodes if n.op == "get_attr" and "_merged_" in n.target]
    big = [t for t in merged if t.numel() * t.element_size() >= huge_pages.HUGE_PAGE // 2]
    assert big and all(t.data_ptr() % huge_pages.HUGE_PAGE == 0 for t in big), [t.data_ptr() % huge_pages.HUGE_PAGE for t in big]
