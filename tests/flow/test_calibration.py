"""Calibration takes what users have: tuples, dicts of keyword inputs (a tokenizer's batch),
single tensors, a DataLoader; ``num_batches`` runs only that many; the progress bar shows
only when asked or on a terminal. Each form calibrates exactly as the tuples it stands for."""
import pytest
import torch
import torch.nn as nn

from tests.helpers import quantize


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)

    def forward(self, x, mask):
        return self.fc(x) * mask


def _batches(n: int) -> list:
    return [(torch.randn(2, 8, generator=torch.Generator().manual_seed(i)), torch.ones(2, 8)) for i in range(n)]


def _scales(converted) -> list:
    return [n.args[1] for n in converted.graph.nodes if n.op == "call_function" and "quantize_per_tensor" in str(n.target)]


def _reference():
    return _scales(quantize(Masked(), _batches(1)[0], calibration=_batches(3)))


def test_keyword_batches_calibrate_as_positional_ones():
    keyword = [{"x": x, "mask": mask} for x, mask in _batches(3)]
    converted = quantize(Masked(), keyword[0], calibration=keyword)
    assert _scales(converted) == _reference()
    x, mask = _batches(1)[0]
    torch.testing.assert_close(converted(x=x, mask=mask), Masked()(x, mask), atol=0.05, rtol=0.05)


def test_a_data_loader_calibrates_as_its_batches():
    xs, masks = (torch.cat(parts) for parts in zip(*_batches(3)))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, masks), batch_size=2)
    assert _scales(quantize(Masked(), _batches(1)[0], calibration=loader)) == _reference()


def test_single_tensor_batches():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    tensors = [x for x, _ in _batches(3)]
    assert _scales(quantize(module, (tensors[0],), calibration=tensors)) == _scales(
        quantize(module, (tensors[0],), calibration=[(t,) for t in tensors]))


def test_num_batches_stops_the_calibration_there():
    taken = []

    def endless():
        index = 0
        while True:
            taken.append(index)
            yield _batches(index + 1)[index]
            index += 1

    converted = quantize(Masked(), _batches(1)[0], calibration=endless(), num_batches=3)
    assert taken == [0, 1, 2] and _scales(converted) == _reference()


@pytest.mark.parametrize("progress, shown", [(True, True), (False, False), (None, False)])
def test_the_progress_bar_shows_when_asked_or_on_a_terminal(progress, shown, capsys):
    quantize(Masked(), _batches(1)[0], calibration=_batches(3), progress=progress)
    assert ("calibrating: 100%" in capsys.readouterr().err) == shown  # (pytest's stderr is no terminal)
