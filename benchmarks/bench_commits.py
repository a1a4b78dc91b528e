"""Two commits of qbackend on the same zoo models, each alone in a fresh process, alternated:
does a change (a refactoring, say) leave the latency, the compile time and the numerics as they
were? Writes a section of docs/benchmarks_commits.md for this CPU.

    python benchmarks/bench_commits.py --old 94bfde2 [--new HEAD] [--models ...] [--reps 3]

Each commit is checked out in a worktree of its own (under the work directory); the models are
prepared once (benchmarks/zoo_engines.py prepare: the same saved converted model for both) and
every run is zoo_engines.py's ``run`` of the old or the new tree's engine (``qbackend.compile``
by default). A worktree gets the links an install would make (qbackend/patterns, /lowering)
and, for ``torch.compile``, a ``sitecustomize`` that registers its own backend: the installed
entry point names one layout's module."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import cpu_key, machine_description, write_section
from zoo_engines import DIRECT, PROJECT_ROOT

WORK = Path.home() / ".cache" / "qbackend-bench-commits"


def _tree(rev: str) -> Path:
    """A worktree of ``rev`` (the checkout itself for the working tree: ``--new .``)."""
    if rev == ".":
        return PROJECT_ROOT
    sha = subprocess.run(["git", "rev-parse", rev], cwd=PROJECT_ROOT, check=True, capture_output=True, text=True).stdout.strip()
    tree = WORK / "trees" / sha[:12]
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=PROJECT_ROOT, check=True, capture_output=True)
    for part in ("patterns", "lowering"):  # (installed, they live inside the package)
        link = tree / "qbackend" / part
        if not link.exists():
            link.symlink_to(Path("..") / part)
    (tree / "benchmarks" / "sitecustomize.py").write_text(SHIM)
    return tree


SHIM = """# (bench_commits.py) torch.compile's "qbackend" is this tree's backend, wherever its layout keeps it
import importlib.util
import torch._dynamo.backends.registry as registry
module = "qbackend.pipeline.backend" if importlib.util.find_spec("qbackend.pipeline") else "qbackend.backend"
registry._COMPILER_FNS["qbackend"] = importlib.import_module(module).qbackend
registry._BACKENDS["qbackend"] = None
"""


def _run(tree: Path, args: list, out: Path) -> dict:
    shim = [str(tree / "benchmarks")] if tree != PROJECT_ROOT else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), *shim]))
    subprocess.run([sys.executable, str(tree / "benchmarks" / "zoo_engines.py"), *args, "--out", str(out)], cwd=tree, env=env,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="a git revision")
    parser.add_argument("--new", default=".", help="a git revision, or . for the working tree (default)")
    parser.add_argument("--models", nargs="+", default=["mobilenet_v3_large", "distilbert", "resnet50"])
    parser.add_argument("--engine", default=DIRECT)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--docs", type=Path, default=PROJECT_ROOT / "docs")
    args = parser.parse_args()
    trees = {"old": _tree(args.old), "new": _tree(args.new)}
    for tree in trees.values():  # (each tree's kernels built before anything is timed)
        _run(tree, ["run", "--engine", args.engine, "--work", str(_prepared(args.models[0], trees["new"]))],
             WORK / "warm.json")
    results: dict = {}
    for model in args.models:
        work = _prepared(model, trees["new"])
        for rep in range(args.reps):
            for name in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                result = _run(trees[name], ["run", "--engine", args.engine, "--work", str(work)], WORK / "run.json")
                if "median_ms" not in result:
                    raise SystemExit(f"{model} on {name}: {result.get('error')}")
                results.setdefault((model, name), []).append(result)
                print(model, name, rep, f"{result['median_ms']:.2f} ms", flush=True)
    lines = [f"- old: `{args.old}`, new: `{args.new}`; engine {args.engine}, batch 1, {args.reps} processes of each, "
             "alternated; ms are per-process medians (best / median of them); cosines vs fp32 of every process", "",
             "| model | old ms | new ms | new / old (medians) | old compile s | new compile s | cosines old | cosines new |",
             "|---|---|---|---|---|---|---|---|"]
    for model in args.models:
        old, new = results[(model, "old")], results[(model, "new")]
        ms = [[r["median_ms"] for r in runs] for runs in (old, new)]
        compile_s = [statistics.median(r["compile_s"] for r in runs) for runs in (old, new)]
        cosines = [sorted({round(r["cos_fp32"], 5) for r in runs}) for runs in (old, new)]
        lines.append(f"| {model} | {min(ms[0]):.2f} / {statistics.median(ms[0]):.2f} | {min(ms[1]):.2f} / "
                     f"{statistics.median(ms[1]):.2f} | {statistics.median(ms[1]) / statistics.median(ms[0]):.2f} | "
                     f"{compile_s[0]:.1f} | {compile_s[1]:.1f} | {cosines[0]} | {cosines[1]} |")
    text = "\n".join(lines)
    print(text)
    write_section(args.docs / "benchmarks_commits.md", "Two commits on the same models, each alone in its process", cpu_key(),
                  f"- Machine: {machine_description()}\n{text}\n")


def _prepared(model: str, tree: Path) -> Path:
    work = WORK / f"{model}_b1"
    if not (work / "manifest.json").exists():
        work.mkdir(parents=True, exist_ok=True)
        _run(tree, ["prepare", "--model", model, "--batch", "1", "--work", str(work)], work / "manifest.json")
    return work


if __name__ == "__main__":
    main()
