"""The package's layers (pyproject.toml's import-linter contracts) and no import loop anywhere,
imports inside functions counted, checked on the installed layout."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed_layout(tmp_path_factory) -> Path:
    """qbackend as installed (patterns/ and lowering/ inside it), sources only: grimp reads
    the package from the files under the directory it is found in."""
    site = tmp_path_factory.mktemp("site")
    skip = shutil.ignore_patterns("__pycache__", "csrc", "prebuilt")
    shutil.copytree(ROOT / "qbackend", site / "qbackend", ignore=skip)
    for part in ("patterns", "lowering"):
        shutil.copytree(ROOT / part, site / "qbackend" / part, ignore=skip)
    return site


def _run(site: Path, code: str) -> subprocess.CompletedProcess:
    # (a process of its own: here qbackend is already imported from the checkout)
    return subprocess.run([sys.executable, "-c", code], cwd=site, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)


def test_import_linter_contracts_hold(installed_layout):
    result = _run(installed_layout, "import sys; from importlinter.cli import lint_imports; "
                                    f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True))")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout, result.stdout


LOOPS = """
import grimp, json
graph = grimp.build_graph("qbackend", cache_dir=None)
modules = sorted(graph.modules)
index, low, stack, on, loops, counter = {}, {}, [], set(), [], [0]

def visit(v):  # Tarjan's strongly connected components
    index[v] = low[v] = counter[0]; counter[0] += 1; stack.append(v); on.add(v)
    for w in sorted(graph.find_modules_directly_imported_by(v)):
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        component = []
        while True:
            w = stack.pop(); on.discard(w); component.append(w)
            if w == v:
                break
        if len(component) > 1:
            loops.append(sorted(component))

import sys; sys.setrecursionlimit(10000)
for m in modules:
    if m not in index:
        visit(m)
print(json.dumps({"modules": len(modules), "loops": loops}))
"""


def test_no_import_loop_among_modules(installed_layout):
    result = _run(installed_layout, LOOPS)
    assert result.returncode == 0, result.stderr
    import json

    found = json.loads(result.stdout)
    assert found["modules"] > 100, found
    assert found["loops"] == [], "\n".join(" <-> ".join(loop) for loop in found["loops"])


def test_a_broken_layer_is_reported(installed_layout, tmp_path):
    """The contract can fail: ops (the bottom layer) importing the lowering breaks it."""
    site = tmp_path / "site"
    shutil.copytree(installed_layout, site)
    ops = site / "qbackend" / "ops.py"
    ops.write_text(ops.read_text() + "\n\ndef _upward():\n    from qbackend.lowering import TABLES  # noqa: F401\n")
    result = _run(site, "import sys; from importlinter.cli import lint_imports; "
                        f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True))")
    assert result.returncode != 0 and "qbackend.ops -> qbackend.lowering" in result.stdout, result.stdout
