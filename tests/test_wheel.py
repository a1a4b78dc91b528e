"""A built wheel carries the C kernels: installed where no C compiler runs (``CC`` pointing
nowhere) and with an empty kernel cache, a model runs on qbackend's own kernels, loaded from
the wheel's prebuilt libraries, and nothing is compiled."""
import json
import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest
import torch

import qbackend
from qbackend.kernels import registry
from qbackend.models import tiny_resnet

from tests.helpers import quantize

ROOT = Path(__file__).resolve().parents[1]


def _run(*command, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, **kwargs)
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-3000:])
    return done


def _setuptools_builds_wheels() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return tuple(int(part) for part in setuptools.__version__.split(".")[:2]) >= (70, 1)


@pytest.mark.skipif(registry.available() is not None, reason="the own kernels do not run on this machine")
def test_an_installed_wheel_runs_the_own_kernels_without_a_compiler(tmp_path):
    # this environment's setuptools when it builds wheels itself (70.1+), else pip's isolated build
    isolation = ("--no-build-isolation",) if _setuptools_builds_wheels() else ()
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(tmp_path / "dist"), str(ROOT))
    (wheel,) = (tmp_path / "dist").glob("qbackend-*.whl")

    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    site = Path(_run(str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip())
    (site / "torch_here.pth").write_text(str(Path(torch.__file__).parents[1]) + "\n")  # (torch as installed here)
    _run(str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel))
    assert (site / "qbackend" / "py.typed").is_file()  # (PEP 561: type checkers read the package's annotations)

    model = quantize(tiny_resnet(), (torch.randn(2, 3, 32, 32),))
    qbackend.save(model, tmp_path / "model.pt2")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.save({"x": x, "expected": model(x)}, tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import json, torch, qbackend
        from qbackend.kernels import kernel_build, registry
        assert qbackend.__file__.startswith({str(tmp_path / "venv")!r}), qbackend.__file__
        reports = []
        loaded = qbackend.load({str(tmp_path / "model.pt2")!r}, options={{"report_sink": reports.append}})
        io = torch.load({str(tmp_path / "io.pt")!r})
        with torch.no_grad():
            y = loaded(io["x"])
        assert registry.available() is None, registry.available()
        own = [d for d in reports[0].decisions if d.lowered and "qbackend::" in str(d)]
        cosine = torch.nn.functional.cosine_similarity(y.flatten(), io["expected"].flatten(), dim=0).item()
        print(json.dumps({{"own_kernels": len(own), "cosine": cosine,
                          "prebuilt": sorted(p.name for p in kernel_build.PREBUILT.iterdir())}}))
    """)
    environment = {**os.environ, "CC": str(tmp_path / "no-compiler"), "QBACKEND_CACHE_DIR": str(tmp_path / "cache")}
    done = _run(str(python), "-c", script, cwd=tmp_path, env=environment)
    result = json.loads(done.stdout)
    assert result["own_kernels"] > 0 and result["cosine"] > 0.9999, result
    assert "qbackend_kernels.so" in result["prebuilt"], result
    # nothing compiled (the kernel choice cache may hold the zmm probe of a VNNI CPU)
    assert not [p for p in (tmp_path / "cache").glob("*") if p.name != "choices"]
