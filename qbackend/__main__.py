"""qbackend's command line: what users do from a shell rather than in their own code.

    python -m qbackend warm            build this machine's C kernels now (a container image, CI)
    python -m qbackend inspect PATH    what a saved archive says of itself: recipe, versions, inputs

Quantizing needs the user's model, and so their code: ``qbackend.quantize_x86`` (README).
"""
from __future__ import annotations

import argparse
import json
import sys


def warm() -> int:
    """Build (or find built) the kernel libraries this CPU runs and measure its once-per-machine
    probe, so a first compile elsewhere in the image pays neither. 0 when the kernels run here."""
    from qbackend.kernels import isa, kernel_build, registry

    reason = registry.available()
    if reason is not None:
        print(f"qbackend kernels: not available here: {reason}")
        return 1
    print(f"qbackend kernels: ready in {kernel_build.kernel_dir(kernel_build.cache_dir())} "
          f"(int8 build {isa.int8_build()}, GEMM {isa.gemm_build()}; AVX512-VNNI: {isa.vnni_unavailable() or 'yes'})")
    return 0


def inspect(path: str) -> int:
    import qbackend

    print(json.dumps(qbackend.inspect(path), indent=2, default=str))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qbackend", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("warm", help="build this machine's C kernels now (once per machine and user)")
    shown = commands.add_parser("inspect", help="a saved archive's recipe, versions and inputs, read as data")
    shown.add_argument("path")
    args = parser.parse_args(argv)
    if args.command == "warm":
        return warm()
    try:
        return inspect(args.path)
    except Exception as error:  # (ArchiveError, OSError: one line, not a traceback, for a file given on a shell)
        print(f"qbackend inspect: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
