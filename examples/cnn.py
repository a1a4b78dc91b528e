"""A torchvision (or timm, or your own) CNN: int8 with any batch size, checked and timed.

    python examples/cnn.py --model resnet50            # torchvision's definition (pip install --no-deps torchvision)
    python examples/cnn.py --model timm:mobilenetv3_large_100   # timm's (pip install --no-deps timm)
    python examples/cnn.py --model resnet18_like       # bundled with qbackend: needs nothing more

Random weights unless ``--weights DEFAULT`` (downloads torchvision's). Calibration runs on random
images here: use a few hundred real ones. It prints the report's first line, the output cosine
against the float model and against the converted module run eagerly (the reference), at two
batch sizes, and the latency of the float model and of qbackend.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import qbackend
from qbackend import models


def build(name: str, weights) -> torch.nn.Module:
    if name in models.MODEL_BUILDERS:
        return models.build_model(name)
    if name.startswith("timm:"):
        import timm

        return timm.create_model(name[5:], pretrained=weights is not None)
    import torchvision

    return torchvision.models.get_model(name, weights=weights)


def median_ms(function, x, calls: int = 20) -> float:
    times = []
    for _ in range(calls + 3):
        start = time.perf_counter()
        function(x)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[3:])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18_like")
    parser.add_argument("--weights", default=None, help="torchvision's weights name (DEFAULT downloads them)")
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--batches", type=int, nargs=2, default=(1, 4), help="the two batch sizes called")
    parser.add_argument("--calibration", type=int, default=8)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = build(args.model, args.weights).eval()
    images = lambda batch: torch.randn(batch, 3, args.image, args.image)  # noqa: E731
    calibration = [(images(2),) for _ in range(args.calibration)]
    m = qbackend.quantize_x86(model, (images(2),), calibration, dynamic_batch=True)
    fast = qbackend.compile(m)  # one lowering for every batch size (torch.compile(m, backend="qbackend") works too)

    with torch.no_grad():
        for batch in args.batches:
            x = images(batch)
            out = fast(x)
            print(f"batch {batch}: cosine vs float {cosine(out, model(x)):.4f}, vs the reference {cosine(out, m(x)):.6f}")
        print(qbackend.explain(m, x).summary())
        print(f"ms per call at batch {batch}: float eager {median_ms(model, x):.2f}, qbackend int8 {median_ms(fast, x):.2f}")


if __name__ == "__main__":
    main()
