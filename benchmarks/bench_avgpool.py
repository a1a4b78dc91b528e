"""Int8 average pooling paths, interleaved (a few seconds; numbers in docs/design-notes.md).

    python benchmarks/bench_avgpool.py

For each shape: dequantize + float pool + quantize (qbackend's fast exact q/dq, what runs
without the qavgpool rule), the ATen pool on a quantized-tensor copy (what qavgpool emits) and,
for global pools, an int32 sum; with each one's distance in quantization steps to the
reference (quantized_decomposed q/dq around the float pool).
"""
import statistics
import time
import warnings

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  registers quantized_decomposed

from qbackend.kernels import fast_qdq

SCALE, ZERO_POINT = 0.0123, 7
aten, qd = torch.ops.aten, torch.ops.quantized_decomposed


def reference(x, pool):
    dq = qd.dequantize_per_tensor(x, SCALE, ZERO_POINT, 0, 255, torch.uint8)
    return qd.quantize_per_tensor(pool(dq), SCALE, ZERO_POINT, 0, 255, torch.uint8)


def float_pool(x, pool):
    dq = fast_qdq.dequantize_per_tensor(x, SCALE, ZERO_POINT, 0, 255, torch.uint8)
    return fast_qdq.quantize_per_tensor(pool(dq), SCALE, ZERO_POINT, 0, 255, torch.uint8)


def quantized_tensor_pool(x, pool):
    return pool(torch._make_per_tensor_quantized_tensor(x, SCALE, ZERO_POINT)).int_repr()


def int32_sum(x, pool):
    """Global average only: exact integer sum, one rounding."""
    n = x.shape[2] * x.shape[3]
    total = x.sum((2, 3), keepdim=True, dtype=torch.int32)
    return ((total - n * ZERO_POINT).to(torch.float32) / n).round_().add_(ZERO_POINT).to(torch.uint8)


CASES = [
    ("avg_pool2d 2x2/2, 1x256x56x56", (1, 256, 56, 56), lambda t: aten.avg_pool2d(t, [2, 2], [2, 2]), False),
    ("avg_pool2d 2x2/2, 8x128x28x28", (8, 128, 28, 28), lambda t: aten.avg_pool2d(t, [2, 2], [2, 2]), False),
    ("avg_pool2d 3x3/1 pad 1, 1x192x28x28", (1, 192, 28, 28), lambda t: aten.avg_pool2d(t, [3, 3], [1, 1], [1, 1]), False),
    ("adaptive 1x1, 1x512x7x7", (1, 512, 7, 7), lambda t: aten.adaptive_avg_pool2d(t, [1, 1]), True),
    ("adaptive 1x1, 8x512x7x7", (8, 512, 7, 7), lambda t: aten.adaptive_avg_pool2d(t, [1, 1]), True),
    ("adaptive 1x1, 1x1280x7x7", (1, 1280, 7, 7), lambda t: aten.adaptive_avg_pool2d(t, [1, 1]), True),
    ("adaptive 7x7, 1x256x14x14", (1, 256, 14, 14), lambda t: aten.adaptive_avg_pool2d(t, [7, 7]), False),
]


def steps(got, expected) -> str:
    d = (got.reshape(expected.shape).int() - expected.int()).abs()
    return f"max {d.max().item()}, {(d == 0).double().mean().item():.1%} equal"


def main(iters=60):
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore")  # quantized tensors are deprecated (see lowering/capabilities.py)
    print("| shape (uint8, channels-last) | dq + float pool + q | quantized-tensor pool | int32 sum | vs reference: quantized-tensor / int32 sum |")
    print("|---|---|---|---|---|")
    for name, shape, pool, is_global in CASES:
        torch.manual_seed(0)
        x = torch.randint(0, 256, shape, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
        paths = {"float": float_pool, "quantized": quantized_tensor_pool, **({"sum": int32_sum} if is_global else {})}
        expected = reference(x, pool)
        times = {key: [] for key in paths}
        for i in range(iters + 5):
            for key, path in paths.items():  # interleaved: machine noise hits every path alike
                start = time.perf_counter()
                path(x, pool)
                if i >= 5:
                    times[key].append(time.perf_counter() - start)
        us = {key: f"{statistics.median(t) * 1e6:.0f} us" for key, t in times.items()}
        accuracy = steps(quantized_tensor_pool(x, pool), expected) + (f" / {steps(int32_sum(x, pool), expected)}" if is_global else "")
        print(f"| {name} | {us['float']} | {us['quantized']} | {us.get('sum', '-')} | {accuracy} |")


if __name__ == "__main__":
    main()
