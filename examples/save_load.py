"""Save a quantized model once, load it in a fresh process: no torchao, no calibration there.

    python examples/save_load.py [--path model.pt2]

It quantizes the bundled ResNet-18-shaped CNN with a free batch size, saves it with
``qbackend.save``, then runs ``python examples/save_load.py --load model.pt2`` in a new process,
which loads it (``qbackend.load``: read as data, checked, lowered on the first call) and writes
its outputs. This process checks that they are the in-process compile's, bit for bit, and
that both reports are the same.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import qbackend
from qbackend import models

BATCHES = (1, 3)


def inputs(batch: int) -> torch.Tensor:
    return torch.randn(batch, 3, 64, 64, generator=torch.Generator().manual_seed(batch))


def run(compile_with) -> tuple[dict, str]:
    """The outputs at every batch of BATCHES and the first call's report, as the saving and the
    loading process see them; ``compile_with(options)`` gives the model compiled."""
    reports = []
    fast = compile_with({"report_sink": reports.append})
    with torch.no_grad():
        outputs = {batch: fast(inputs(batch)) for batch in BATCHES}
    return outputs, str(reports[0])


def load(path: Path) -> None:
    outputs, report = run(lambda options: qbackend.load(path, options))
    torch.save({"outputs": outputs, "report": report}, path.with_suffix(".loaded"))
    print(f"loaded in a fresh process; torchao imported: {'torchao' in sys.modules}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path)
    parser.add_argument("--load", type=Path, help="(the fresh process's part)")
    args = parser.parse_args(argv)
    if args.load:
        return load(args.load)

    model = models.resnet18_like(num_classes=10).eval()
    calibration = [(inputs(2),) for _ in range(4)]
    m = qbackend.quantize_x86(model, (inputs(2),), calibration, dynamic_batch=True)
    with tempfile.TemporaryDirectory() as directory:
        path = args.path or Path(directory) / "model.pt2"
        qbackend.save(m, path)
        print(f"saved {path.stat().st_size / 1e6:.1f} MB; recipe: {qbackend.inspect(path)['recipe']['flow']}")
        subprocess.run([sys.executable, __file__, "--load", str(path)], check=True)
        loaded = torch.load(path.with_suffix(".loaded"))
    outputs, report = run(lambda options: qbackend.compile(m, options))
    same = all(torch.equal(outputs[batch], loaded["outputs"][batch]) for batch in BATCHES)
    print(f"outputs at batch {', '.join(map(str, BATCHES))}: {'the same bits' if same else 'DIFFERENT'} as the in-process "
          f"compile; report: {'the same' if report == loaded['report'] else 'DIFFERENT'}")
    print(report.splitlines()[0])


if __name__ == "__main__":
    main()
