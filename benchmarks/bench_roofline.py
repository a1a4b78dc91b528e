"""How close the int8 conv kernels run to this CPU's instruction bound, written to
docs/roofline_int8.md (one section per CPU).

    python benchmarks/bench_roofline.py

The bound: ``peak_int8.c``, nothing but the int8 multiply-add instructions on registers (AVX2:
vpmaddubsw / vpmaddwd / vpaddd; AVX512-VNNI: vpdpbusd on ymm, where the CPU has it), on 1
thread and on 2 (whether the second thread adds a core's worth or shares one). Against it:
ResNet-50's convs at batch 8, the compute-bound case, on oneDNN (what Inductor calls) and on
qbackend's GEMM, in multiply-adds per second. A kernel at the bound can only be beaten by
doing fewer multiply-adds; the ratio says how much any engine has left on this CPU.
"""
from __future__ import annotations

import ctypes
import datetime
import subprocess
import tempfile
from pathlib import Path

import torch

import bench_gemm
from common import NUM_THREADS, cpu_key, machine_description, write_section

PROJECT_ROOT = Path(__file__).resolve().parents[1]
VNNI_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
# ResNet-50 at batch 8: (name, Cin, input size, Cout, kernel, stride)
LAYERS = [("layer1 3x3", 64, 56, 64, 3, 1), ("layer1 1x1 expand", 64, 56, 256, 1, 1), ("layer2 3x3", 128, 28, 128, 3, 1),
          ("layer3 3x3", 256, 14, 256, 3, 1), ("layer3 1x1 reduce", 1024, 14, 256, 1, 1), ("layer4 3x3", 512, 7, 512, 3, 1)]
BATCH = 8


def _has_vnni() -> bool:
    return "avx512_vnni" in Path("/proc/cpuinfo").read_text()


def _peak_library(directory: str) -> ctypes.CDLL:
    """peak_int8.c built into ``directory`` (this process's own temporary directory)."""
    library = Path(directory) / "peak_int8.so"
    flags = ["-O2", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", *(VNNI_FLAGS if _has_vnni() else [])]
    subprocess.run(["cc", *flags, str(Path(__file__).with_name("peak_int8.c")), "-o", str(library)], check=True)
    return ctypes.CDLL(str(library))


def peak(function, threads: int, seconds: float = 0.3) -> float:
    """Best of 5 runs of ``function`` (multiply-adds per second), each about ``seconds`` long."""
    function.restype, function.argtypes = ctypes.c_double, [ctypes.c_int, ctypes.c_long, ctypes.POINTER(ctypes.c_int)]
    sink = ctypes.c_int()
    steps = max(1, int(function(threads, 1 << 16, ctypes.byref(sink)) * seconds / (8 * 32 * threads)))
    return max(function(threads, steps, ctypes.byref(sink)) for _ in range(5))


def achieved_rows(bound: float) -> list:
    rows = []
    for name, cin, size, cout, k, s in LAYERS:
        out = (size + 2 * (k // 2) - k) // s + 1
        macs = BATCH * out * out * cout * cin * k * k
        onednn, own = bench_gemm.conv_runners(BATCH, cin, size, size, cout, k, s, 0)
        times = bench_gemm.median_us({"onednn": onednn, "own": own})
        rates = [macs / (times[path] * 1e-6) for path in ("onednn", "own")]
        rows.append(f"| {name}: {cin}->{cout}, {BATCH * out * out} pixels | "
                    + " | ".join(f"{r / 1e9:.0f} ({r / bound:.0%})" for r in rates) + " |")
        print(rows[-1], flush=True)
    return rows


def main():
    torch.set_num_threads(NUM_THREADS)
    with tempfile.TemporaryDirectory(prefix="qbackend_peak_") as directory:
        library = _peak_library(directory)
        peaks = {(isa, threads): peak(getattr(library, function), threads)
                 for isa, function in (("AVX2", "qb_peak_avx2"), ("AVX512-VNNI ymm", "qb_peak_vnni"))
                 if isa == "AVX2" or _has_vnni() for threads in (1, NUM_THREADS)}
    build = "AVX512-VNNI ymm" if bench_gemm.native.int8_build() == "avx512_vnni" else "AVX2"
    bound = peaks[(build, NUM_THREADS)]
    lines = [f"- Machine: {machine_description()}",
             f"- Date: {datetime.date.today().isoformat()}; command: `python benchmarks/bench_roofline.py`", "",
             "| instructions | 1 thread, GMAC/s | 2 threads, GMAC/s | 2 threads / 1 |", "|---|---|---|---|"]
    for isa in dict.fromkeys(isa for isa, _ in peaks):
        one, two = peaks[(isa, 1)], peaks[(isa, NUM_THREADS)]
        lines.append(f"| {isa} | {one / 1e9:.0f} | {two / 1e9:.0f} | {two / one:.2f} |")
    lines += ["", f"ResNet-50's convs at batch {BATCH} (uint8 in and out, ReLU), median of interleaved calls: GMAC/s and"
              f" the share of the {build} bound on {NUM_THREADS} threads ({bound / 1e9:.0f} GMAC/s).", "",
              "| layer | oneDNN | qbackend GEMM |", "|---|---|---|", *achieved_rows(bound)]
    write_section(PROJECT_ROOT / "docs" / "roofline_int8.md", "int8 convs against this CPU's instruction bound", cpu_key(),
                  "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
