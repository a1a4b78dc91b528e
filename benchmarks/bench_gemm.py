"""qbackend's own int8 kernels against torch's, per layer: the GEMM (``qbackend::qconv``), the
depthwise conv and the stem conv against oneDNN's int8 conv / linear, the pools and input quantize against
torch's quantized-tensor pools and quantize.

    python benchmarks/bench_gemm.py [--out docs/benchmarks_gemm.md]

The convs and linears of the three benchmark models (ResNet-18 at batch 1 and 8, MobileNetV2's
1x1 and depthwise convs, the BERT-base encoder's linears at 128 and 1024 rows), each timed
interleaved as the lowered graph calls it: torch's op, and qbackend's kernel in each build this
CPU runs (AVX2 always; AVX512-VNNI where the CPU has it). The ratio column is what
``lowering/gemm.py``'s LIMITS and input zero point conditions are set from.
"""
import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))

from qbackend.kernels import conv_gemm, pools  # noqa: E402
from qbackend.kernels import depthwise as depthwise_kernel
from qbackend.kernels import isa as kernel_isa
from qbackend.kernels import quantize as quantize_kernel
from qbackend.kernels import stem as stem_kernel
from qbackend.kernels import library  # noqa: E402
from qbackend.lowering import depthwise, gemm, stem  # noqa: E402
from qbackend.lowering.own_conv import scale_and_offset  # noqa: E402
from qbackend.ops import resolve  # noqa: E402

from common import NUM_THREADS, Settings, cpu_key, interleaved_samples, machine_description, write_section  # noqa: E402

# (name, batch, Cin, H, W, Cout, kernel, stride, input zero point): H x W is the input
CONVS = [
    *[(f"ResNet {name}", batch, cin, size, size, cout, k, s, zp)
      for batch in (1, 8)
      for name, cin, size, cout, k, s, zp in [
          ("layer1 3x3", 64, 56, 64, 3, 1, 0), ("layer2 3x3 s2", 64, 56, 128, 3, 2, 0),
          ("layer2 3x3", 128, 28, 128, 3, 1, 0), ("layer2 1x1 s2 (downsample)", 64, 56, 128, 1, 2, 0),
          ("layer3 3x3", 256, 14, 256, 3, 1, 0), ("layer3 1x1 s2 (downsample)", 128, 28, 256, 1, 2, 0),
          ("layer4 3x3", 512, 7, 512, 3, 1, 0), ("layer4 3x3, input zero point 60", 512, 7, 512, 3, 1, 60),
          ("layer4 1x1 s2 (downsample)", 256, 14, 512, 1, 2, 0)]],
    ("MobileNetV2 1x1 expand", 1, 24, 56, 56, 144, 1, 1, 64),
    ("MobileNetV2 1x1 project", 1, 144, 56, 56, 24, 1, 1, 0),
    ("MobileNetV2 1x1 expand", 1, 96, 14, 14, 576, 1, 1, 64),
    ("MobileNetV2 1x1 last", 1, 320, 7, 7, 1280, 1, 1, 64),
]
# MobileNetV2's depthwise 3x3 layers at batch 1: (channels, input size, stride)
DEPTHWISE = [(32, 112, 1), (96, 112, 2), (144, 56, 1), (144, 56, 2), (192, 28, 1), (384, 14, 1), (576, 14, 2), (960, 7, 1)]
# (name, rows, in, out)
LINEARS = [
    *[(f"encoder {name}", rows, cin, cout) for rows in (128, 1024)
      for name, cin, cout in [("Q/K/V merged", 768, 2304), ("attention out", 768, 768), ("FFN in", 768, 3072),
                              ("FFN out", 3072, 768)]],
    ("ResNet fc", 1, 512, 1000), ("MobileNetV2 classifier", 1, 1280, 1000),
    *[("FFN in, rows sweep", rows, 768, 3072) for rows in (8, 32, 64)],
]


def builds():
    """The GEMM builds this CPU runs (kernel_isa.gemm_build's values; the depthwise kernel has the
    first two only)."""
    vnni = kernel_isa._vnni_library()[0] is not None
    return [build for build, (isa, _) in library.GEMM_BUILDS.items()
            if (isa == "avx2" or vnni) and (build != "avx512_amx" or kernel_isa.amx_ready())]


def conv_runners(batch, cin, h, w, cout, k, s, zp):
    torch.manual_seed(0)
    x = torch.randint(0, 256, (batch, cin, h, w), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    weight = torch.randint(-64, 64, (cout, cin, k, k), dtype=torch.int8)  # 7-bit: every build takes it
    w_scale, pad = torch.full((cout,), 0.002), k // 2
    prepack, qconv = resolve("qconv_prepack", "cpu").op, resolve("qconv", "cpu").op
    packed = prepack(weight, w_scale, 0.02, zp, [s, s], [pad, pad], [1, 1], 1, x.shape)
    w_zp = torch.zeros(cout, dtype=torch.int64)

    def onednn():
        return qconv(x, 0.02, zp, packed, w_scale, w_zp, None, [s, s], [pad, pad], [1, 1], 1, 0.05, 3, None, "relu", [], "")

    mult, add = (t.float() for t in scale_and_offset(weight, w_scale, 0.02, zp))
    packed_weight = packing(weight)

    def own():
        return conv_gemm.qconv(x, packed_weight(), mult, add, None, 0.0, 0.0, float("inf"), 0.05, 3, 0, 255, False, "none",
                            (k, k), (s, s), (pad, pad), (1, 1), zp)
    return onednn, own


def linear_runners(rows, cin, cout):
    torch.manual_seed(0)
    x = torch.randint(0, 256, (rows, cin), dtype=torch.uint8)
    weight = torch.randint(-64, 64, (cout, cin), dtype=torch.int8)
    w_scale = torch.full((cout,), 0.002)
    packed = resolve("qlinear_prepack", "cpu").op(weight, [rows, cin])
    qlinear, w_zp = resolve("qlinear", "cpu").op, torch.zeros(cout, dtype=torch.int64)

    def onednn():
        return qlinear(x, 0.02, 64, packed, w_scale, w_zp, None, 0.05, 3, None, "none", [], "")

    mult, add = (t.float() for t in scale_and_offset(weight, w_scale, 0.02, 64))
    x4, packed_weight = x.reshape(rows, cin, 1, 1), packing(weight)

    def own():
        return conv_gemm.qconv(x4, packed_weight(), mult, add, None, 0.0, -float("inf"), float("inf"), 0.05, 3, 0, 255)
    return onednn, own


def packing(weight, pack=gemm.pack):
    """A function giving pack(weight) for the build being timed, packed once per build."""
    packed = {}

    def for_build():
        build = kernel_isa.int8_build()
        if build not in packed:
            packed[build] = pack(weight)
        return packed[build]
    return for_build


def depthwise_runners(channels, size, stride):
    torch.manual_seed(0)
    x = torch.randint(0, 256, (1, channels, size, size), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    weight = torch.randint(-128, 128, (channels, 1, 3, 3), dtype=torch.int8)
    w_scale = torch.full((channels,), 0.002)
    prepack, qconv = resolve("qconv_prepack", "cpu").op, resolve("qconv", "cpu").op
    packed = prepack(weight, w_scale, 0.02, 0, [stride] * 2, [1, 1], [1, 1], channels, x.shape)
    w_zp = torch.zeros(channels, dtype=torch.int64)

    def onednn():
        return qconv(x, 0.02, 0, packed, w_scale, w_zp, None, [stride] * 2, [1, 1], [1, 1], channels, 0.05, 0,
                     None, "hardtanh", [0.0, 6.0], "")

    mult_add = scale_and_offset(weight, w_scale, 0.02, 0)
    constants = packing(weight, lambda w: depthwise.pack(w, *mult_add, depthwise.vnni_built()))

    def own():
        return depthwise_kernel.qconv_depthwise(x, 0, *constants(), (stride, stride), (1, 1), 0.0, 6.0, 0.05, 0, 0, 255)
    return onednn, own


# network stems (3 input channels): (name, out channels, kernel, stride, padding, post-op), at batch 1 and 8
STEMS = [("ResNet stem 7x7 s2 + relu", 64, 7, 2, 3, "relu"), ("RegNet stem 3x3 s2 + relu", 32, 3, 2, 1, "relu"),
         ("EfficientNet stem 3x3 s2 + silu", 32, 3, 2, 1, "swish"),
         ("MobileNetV3 stem 3x3 s2 + hardswish", 16, 3, 2, 1, "hardswish")]


def stem_rows() -> list:
    """The stem conv kernel (the build that runs here) against oneDNN's conv, on 224x224 images
    (7-bit weights: exact in oneDNN's int16 pair sums without VNNI too)."""
    build = kernel_isa.int8_build()
    prepack, qconv, rows, fused = resolve("qconv_prepack", "cpu").op, resolve("qconv", "cpu").op, [], []
    for name, cout, k, s, pad, post in STEMS:
        for batch in (1, 8):
            torch.manual_seed(0)
            x = torch.randint(0, 256, (batch, 3, 224, 224), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
            weight = torch.randint(-64, 64, (cout, 3, k, k), dtype=torch.int8)
            w_scale, w_zp = torch.full((cout,), 0.002), torch.zeros(cout, dtype=torch.int64)
            packed = prepack(weight, w_scale, 0.02, 3, [s, s], [pad, pad], [1, 1], 1, x.shape)
            mult, add = (t.float() for t in scale_and_offset(weight, w_scale, 0.02, 3))
            constants = (stem.pack(weight, build), mult, add)
            low = 0.0 if post == "relu" else -float("inf")
            activation = () if post == "relu" else (*stem_kernel.NO_POOL, post)
            args = (x, 3, *constants, (k, k), (s, s), (pad, pad), low, float("inf"), 0.05, 0, 0, 255)
            rows.append(torch_vs_own_row(
                f"{name}, batch {batch}: 3->{cout}",
                lambda x=x, packed=packed, w_scale=w_scale, w_zp=w_zp, s=s, pad=pad, post=post: qconv(
                    x, 0.02, 3, packed, w_scale, w_zp, None, [s, s], [pad, pad], [1, 1], 1, 0.05, 0, None, post, [], ""),
                lambda args=args, activation=activation: stem_kernel.qconv_stem(*args, *activation)))
            print(rows[-1], flush=True)
            if name.startswith("ResNet"):  # (its 3x3 stride-2 max pool: fused, lowering/stem.py fuse_max_pool)
                pool = ((3, 3), (2, 2), (1, 1))
                fused.append(torch_vs_own_row(
                    f"{name} + max pool 3x3 s2, batch {batch}",
                    lambda args=args: pools.max_pool_u8(stem_kernel.qconv_stem(*args), *pool, (1, 1)),
                    lambda args=args: stem_kernel.qconv_stem(*args, *pool)))
                print(fused[-1], flush=True)
    return rows + ["", "| stem conv and its max pool | two calls: stem kernel, max pool kernel (us) | one call, pool fused (us) | "
                   "fused / two calls |", "|---|---|---|---|", *fused]


def torch_vs_own_row(label, peer, own):
    us = median_us({"torch": peer, "own": own})
    return f"| {label} | {us['torch']:.0f} | {us['own']:.0f} | {us['own'] / us['torch']:.2f} |"


def other_kernel_rows() -> list:
    """The pools and the input quantize, against the ops they replace (one build: AVX2)."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401  registers the reference's quantize

    quantize, rows = torch.ops.quantized_decomposed.quantize_per_tensor, []
    for batch in (1, 8):
        x = torch.randint(0, 256, (batch, 64, 112, 112), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
        rows.append(torch_vs_own_row(f"ResNet max pool 3x3 s2, batch {batch}: quantized::max_pool2d",
                                     lambda x=x: torch.ops.quantized.max_pool2d(x, [3, 3], [2, 2], [1, 1], [1, 1], False),
                                     lambda x=x: pools.max_pool_u8(x, (3, 3), (2, 2), (1, 1), (1, 1))))
        head = torch.randint(0, 256, (batch, 1280, 7, 7), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
        rows.append(torch_vs_own_row(
            f"MobileNetV2 head global average pool, batch {batch}: quantized-tensor copy, its pool, int_repr",
            lambda h=head: torch.nn.functional.adaptive_avg_pool2d(torch._make_per_tensor_quantized_tensor(h, 0.05, 3), 1).int_repr(),
            lambda h=head: pools.global_avg_pool_u8(h, 3, 0, 255)))
        image = torch.randn(batch, 3, 224, 224)
        rows.append(torch_vs_own_row(
            f"input quantize {batch}x3x224x224 to channels-last uint8: the reference's quantize + to channels-last",
            lambda i=image: quantize(i, 0.03, 127, 0, 255, torch.uint8).contiguous(memory_format=torch.channels_last),
            lambda i=image: quantize_kernel.quantize_channels_last(i, 0.03, 127, 0, 255)))
    return rows


def median_us(runners: dict, seconds: float = 0.6) -> dict:
    """Interleaved medians (common.interleaved_samples: each round calls every runner once),
    about ``seconds`` of rounds."""
    settings = Settings(calibration_batches=0, warmup_calls=2, target_seconds=seconds / len(runners), min_iters=10, max_iters=400)
    return {name: statistics.median(times) * 1e6 for name, times in interleaved_samples(runners, (), settings).items()}


def timed_row(label, onednn, own, columns, builds=None):
    """The row's cells for each build in ``columns``; those not in ``builds`` (default: all) blank."""
    builds = [b for b in columns if builds is None or b in builds]
    runners = {"oneDNN": onednn}
    for build in builds:
        runners[build] = (lambda b: lambda: _with_build(b, own))(build)
    us = median_us(runners)
    best = min(builds, key=us.get)
    cells = " | ".join(f"{us[b]:.0f}" if b in us else "" for b in columns)
    return f"| {label} | {us['oneDNN']:.0f} | {cells} | {us[best] / us['oneDNN']:.2f} |"


def _with_build(build, own):
    saved = kernel_isa.int8_build, kernel_isa.gemm_build
    kernel_isa.int8_build = lambda: library.GEMM_BUILDS[build][0]
    kernel_isa.gemm_build = lambda: build
    try:
        return own()
    finally:
        kernel_isa.int8_build, kernel_isa.gemm_build = saved


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "docs" / "benchmarks_gemm.md")
    args = parser.parse_args()
    torch.set_num_threads(NUM_THREADS)
    machine, builds_here = machine_description(), builds()
    header = (f"| layer | oneDNN (us) | {' | '.join(f'qbackend {b} (us)' for b in builds_here)} | best qbackend / oneDNN |\n"
              f"|---|---|{'---|' * len(builds_here)}---|")
    lines = [header]
    for name, batch, cin, h, w, cout, k, s, zp in CONVS:
        out = (h + 2 * (k // 2) - k) // s + 1
        label = f"{name}, batch {batch}: {cin}->{cout}, {batch * out * out} output pixels"
        lines.append(timed_row(label, *conv_runners(batch, cin, h, w, cout, k, s, zp), builds_here))
        print(lines[-1], flush=True)
    for name, rows, cin, cout in LINEARS:
        lines.append(timed_row(f"{name}: {rows} rows, {cin}->{cout}", *linear_runners(rows, cin, cout), builds_here))
        print(lines[-1], flush=True)
    for channels, size, stride in DEPTHWISE:
        label = f"MobileNetV2 depthwise 3x3 s{stride} + relu6, batch 1: {channels} channels, {size}x{size} input"
        lines.append(timed_row(label, *depthwise_runners(channels, size, stride), builds_here, ("avx2", "avx512_vnni")))
        print(lines[-1], flush=True)
    stems = [f"| layer | oneDNN (us) | qbackend {kernel_isa.int8_build()} (us) | qbackend / oneDNN |", "|---|---|---|---|",
             *stem_rows()]
    others = ["| op | torch (us) | qbackend (us) | qbackend / torch |", "|---|---|---|---|", *other_kernel_rows()]
    print("\n".join(others[2:]), flush=True)
    body = (f"- Machine: {machine}\n"
            f"- Date: {datetime.date.today()}; command: `python benchmarks/bench_gemm.py`\n"
            "- Interleaved medians of the call as a lowered graph makes it (oneDNN: the prepacked op with a relu / "
            "requantize epilogue; qbackend: the plain function, uint8 out)\n"
            f"- GEMM builds: avx512_vnni on ymm registers, avx512_vnni_zmm on zmm; this CPU's probe "
            f"(kernel_isa.zmm_speedup: zmm / ymm products per second) {kernel_isa.zmm_speedup():.2f}, so it runs "
            f"{kernel_isa.gemm_build()}\n\n### GEMM and depthwise vs oneDNN\n\n"
            + "\n".join(lines) + "\n\n### Stem conv (3 input channels) vs oneDNN\n\n" + "\n".join(stems)
            + "\n\n### Pools and input quantize\n\n" + "\n".join(others) + "\n")
    write_section(args.out, "qbackend's own int8 kernels vs torch's, per layer", cpu_key(), body)


if __name__ == "__main__":
    main()
