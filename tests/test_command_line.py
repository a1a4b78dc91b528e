"""``python -m qbackend``: ``warm`` builds the kernels a first compile would (and says where),
``inspect`` prints what an archive says of itself, and a bad file is one line, not a traceback."""
import json
import subprocess
import sys

import torch

import qbackend
from qbackend.kernels import registry
from qbackend.models import tiny_resnet

from tests.helpers import quantize


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qbackend", *args], capture_output=True, text=True, timeout=600, env=env)


def test_warm_makes_the_kernels_ready_or_says_why_not():
    done = run("warm")
    if registry.available() is None:
        assert done.returncode == 0 and done.stdout.startswith("qbackend kernels: ready in "), done.stdout + done.stderr
    else:  # (no compiler, no AVX2, or QBACKEND_KERNELS=off: the reason, and a failing status for a container build)
        assert done.returncode == 1 and registry.available() in done.stdout, done.stdout


def test_inspect_prints_the_recipe_and_refuses_a_bad_file_in_one_line(tmp_path):
    model = quantize(tiny_resnet(), (torch.randn(2, 3, 32, 32),))
    qbackend.save(model, tmp_path / "model.pt2")
    done = run("inspect", str(tmp_path / "model.pt2"))
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["recipe"]["flow"] == "quantize_x86" and shown["recipe"]["options"]["reduce_range"] is True, shown
    assert shown["versions"]["torch"] == torch.__version__, shown
    (tmp_path / "bad.pt2").write_bytes(b"not an archive")
    done = run("inspect", str(tmp_path / "bad.pt2"))
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.startswith("qbackend inspect: ") and "not a qbackend archive" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
