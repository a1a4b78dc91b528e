"""The README's quickstart and every recipe in examples/ run as a user runs them (a fresh
process each), on small configurations, and say what they should."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=900,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def numbers(pattern: str, text: str) -> list[float]:
    found = [float(value) for value in re.findall(pattern, text)]
    assert found, (pattern, text)
    return found


def test_the_readme_quickstart_is_the_example_and_runs():
    readme = (ROOT / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert quickstart == (EXAMPLES / "quickstart.py").read_text()
    assert len(quickstart.splitlines()) <= 15
    assert readme.index("## Quickstart") < 40 * 80  # (on the first screen: before anything else of length)
    out = run("quickstart.py")
    assert re.search(r"qbackend \[cpu\]: (\d+) of \1 conv / linear / pool / attention ops lowered", out), out
    (cosine,) = numbers(r"tensor\(([0-9.]+)\)", out)
    assert cosine > 0.99


def test_cnn_recipe_at_two_batch_sizes():
    out = run("cnn.py", "--model", "resnet18_like", "--image", "32", "--calibration", "2", "--batches", "1", "3")
    assert re.search(r"batch 1: .*\nbatch 3: ", out), out
    assert min(numbers(r"vs the reference ([0-9.]+)", out)) > 0.999
    assert min(numbers(r"cosine vs float ([0-9.]+)", out)) > 0.99
    assert re.search(r"qbackend \[cpu\]: (\d+) of \1 conv", out), out  # every conv and the linear lowered
    assert "ms per call at batch 3: float eager" in out


def test_hugging_face_classifier_recipe_at_three_shapes():
    out = run("hf_classifier.py", "--small")
    shapes = re.findall(r"batch (\d+), (\d+) tokens", out)
    assert [batch for batch, _ in shapes] == ["1", "3", "9"] and len({tokens for _, tokens in shapes}) == 3, out
    assert min(numbers(r"cosine vs float ([0-9.]+)", out)) > 0.99
    assert re.search(r"qbackend \[cpu\]: (\d+) of \1 conv", out), out


def test_save_load_recipe_gives_the_same_bits_in_a_fresh_process():
    out = run("save_load.py")
    assert "loaded in a fresh process; torchao imported: False" in out, out
    assert "the same bits as the in-process compile; report: the same" in out, out


def test_llm_recipe_decodes_the_eager_tokens():
    out = run("llm_decode.py", "--small", "--tokens", "6")
    rows = re.findall(r"int4, (eager|qbackend.*?)\s+([0-9.]+) tokens/s .* (the eager tokens|OTHER TOKENS than eager)", out)
    assert len(rows) == 3 and all(same == "the eager tokens" for *_, same in rows), out
    assert "text: " in out
