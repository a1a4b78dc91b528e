"""Variable shapes on real architectures, written to docs/dynamic_shapes.md: torchvision's
ResNet-50 quantized once with ``dynamic_batch=True`` and a Hugging Face ``BertModel`` (from a
config, dict inputs) with a symbolic batch and sequence length, each run at 5 shapes through
``torch.compile(..., dynamic=True)`` and ``qbackend.compile``: cosine vs the reference (the
converted module run eagerly) beside a lowering for that fixed shape's, and how many graphs /
lowerings served them. The bar: the tests' (cosine >= 0.9999), or where a fixed-shape lowering
misses it too (ResNet-50's 53 requantized layers land at ~0.998 on a CPU without VNNI, for
Inductor as well: docs/benchmarks_zoo.md), an error (1 - cosine) at most 10% above the fixed
shape's: a symbolic size costs no accuracy. Exits non-zero if a shape misses the bar or a path
made more than two graphs / lowerings (Dynamo: one for a size of 1, one for the rest;
``qbackend.compile``: one for the first shape, one for export's symbolic sizes).

    python benchmarks/check_dynamic_shapes.py [--docs docs]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import qbackend
from qbackend.pt2e_flow import quantize_x86

import zoo_models
from common import NUM_THREADS, cosine, cpu_key, machine_description, write_section

PROJECT_ROOT = Path(__file__).resolve().parents[1]
MIN_COSINE = 0.9999  # tests/tolerances.py TOLERANCE["float"]["min_cosine"]
ERROR_MARGIN = 1.1  # vs the fixed-shape lowering's 1 - cosine, where that misses MIN_COSINE


def resnet50():
    zoo = zoo_models.build("resnet50", 1, 4)
    model = quantize_x86(zoo.model, zoo.inputs, zoo.calibration, dynamic_batch=True)
    return "resnet50 (torchvision), dynamic_batch=True", model, [(f"batch {b}", ((torch.randn(b, 3, 224, 224),), {}))
                                                                for b in (1, 2, 3, 5, 8)]


def bert():
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, attn_implementation="sdpa")
    model = BertModel(config, add_pooling_layer=False).eval()

    def batch(b, s, seed):
        g = torch.Generator().manual_seed(seed)
        mask = torch.ones(b, s, dtype=torch.long)
        mask[:, s - s // 4:] = torch.randint(0, 2, (b, s // 4), generator=g)  # some padding, as a tokenizer gives
        return {"input_ids": torch.randint(0, config.vocab_size, (b, s), generator=g), "attention_mask": mask}

    dims = {0: torch.export.Dim("batch", min=1, max=64), 1: torch.export.Dim("seq", min=2, max=512)}
    model = quantize_x86(model, batch(2, 32, 0), [batch(2, 32, i) for i in range(1, 5)],
                         dynamic_shapes={"input_ids": dims, "attention_mask": dims})
    shapes = [(1, 16), (2, 32), (3, 8), (4, 64), (8, 128)]
    return ("BertModel (transformers, from a config: 4 layers, hidden 256), dict inputs, symbolic batch and sequence",
            model, [(f"batch {b}, sequence {s}", ((), batch(b, s, 100 + i))) for i, (b, s) in enumerate(shapes)])


def first_tensor(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def check(title, model, shapes) -> tuple[list[str], bool]:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    paths = {"torch.compile(dynamic=True)": torch.compile(model, backend="qbackend", dynamic=True),
             "qbackend.compile": qbackend.compile(model)}
    fixed = qbackend.compile(model)
    fixed.symbolic = None  # (one lowering per input shape)
    lines = [f"### {title}", "", "| shape | cosine vs reference: fixed-shape lowering | " +
             " | ".join(paths) + " |", "|---|---|" + "---|" * len(paths)]
    ok = True
    with torch.no_grad():
        for label, (args, kwargs) in shapes:
            expected = first_tensor(model(*args, **kwargs))
            fixed_cosine = cosine(first_tensor(fixed(*args, **kwargs)), expected)
            cosines = [cosine(first_tensor(run(*args, **kwargs)), expected) for run in paths.values()]
            bar = min(MIN_COSINE, 1 - ERROR_MARGIN * (1 - fixed_cosine))
            ok &= min(cosines) >= bar
            lines.append(f"| {label} | {fixed_cosine:.7f} | " + " | ".join(f"{c:.7f}" for c in cosines) + " |")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    symbolic = paths["qbackend.compile"].SYMBOLIC
    lowerings = [key if key == symbolic else "first shape " + " ".join(str(list(s[1])) for s in key)
                 for key in paths["qbackend.compile"].lowered]
    ok &= graphs == 1 + ("batch 1" in "".join(label for label, _ in shapes))  # (Dynamo: size 1 and the rest)
    ok &= len(lowerings) == 2 and symbolic in lowerings  # (the first shape's, then the symbolic sizes')
    lines += ["", f"Graphs Dynamo compiled for the {len(shapes)} shapes: {graphs}; lowerings `qbackend.compile` made:"
              f" {len(lowerings)} ({', '.join(lowerings)})."]
    return lines, ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=Path, default=PROJECT_ROOT / "docs")
    args = parser.parse_args(argv)
    torch.set_num_threads(NUM_THREADS)
    sections, all_ok = [f"- Machine: {machine_description()}", "- Command: `python benchmarks/check_dynamic_shapes.py`;"
                        f" bar: cosine >= {MIN_COSINE} vs the reference at every shape, at most two graphs / lowerings per path.", ""], True
    for build in (resnet50, bert):
        lines, ok = check(*build())
        sections += lines + [""]
        all_ok &= ok
    sections.append(f"**All shapes within the bar, at most two lowerings each: {all_ok}.**")
    write_section(args.docs / "dynamic_shapes.md", "Variable shapes on real architectures", cpu_key(), "\n".join(sections))
    print("\n".join(sections))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
