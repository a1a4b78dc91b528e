"""``python -m tests.fuzz --seeds FIRST:END [--verbose]``: run the seeds, print each failure
with the command that reruns it alone, and a summary (counts, time)."""
import argparse
import sys
import time
import traceback

from .check import InvalidCase, run_case


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz")
    parser.add_argument("--seeds", default="0:100", help="FIRST:END (END excluded)")
    parser.add_argument("--verbose", action="store_true", help="print every case, not only failures")
    args = parser.parse_args(argv)
    first, end = map(int, args.seeds.split(":"))
    start, failed, invalid = time.time(), [], []
    for seed in range(first, end):
        if (seed - first) % 250 == 0 and seed > first:
            print(f"... {seed - first} seeds in {time.time() - start:.0f} s, {len(failed)} failed", file=sys.stderr, flush=True)
        try:
            what, problems = run_case(seed)
        except InvalidCase as error:
            invalid.append(seed)
            print(f"INVALID {error}", flush=True)
            continue
        except Exception as error:  # a crash: the reproducer says where
            what, problems = f"seed {seed}", [f"raised {type(error).__name__}: {error}\n{traceback.format_exc()}"]
        if problems:
            failed.append(seed)
            print(f"FAIL {what}\n  " + "\n  ".join(problems) + f"\n  rerun: python -m tests.fuzz --seeds {seed}:{seed + 1} --verbose", flush=True)
        elif args.verbose:
            print(f"ok {what}", flush=True)
    ran = end - first - len(invalid)
    print(f"{ran} graphs in {time.time() - start:.0f} s: {len(failed)} failed {failed[:50]}, "
          f"{len(invalid)} invalid {invalid[:50]}")
    return 1 if failed or invalid else 0


if __name__ == "__main__":
    sys.exit(main())
