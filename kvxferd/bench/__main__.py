"""``python -m kvxferd.bench [flags]``, and the child roles ``_bench-tx|_bench-rx SPEC``."""

from __future__ import annotations

import argparse
import sys

import kvxferd.bench
from kvxferd.bench import add_arguments, main_bench, run_child


def _main(argv: list[str] | None = None) -> int:
    """The command line, or a child role when the first argument names one; the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("_bench-tx", "_bench-rx"):
        return run_child(argv[0], argv[1])
    p = argparse.ArgumentParser(
        prog="python -m kvxferd.bench", description=(kvxferd.bench.__doc__ or "").partition("\n")[0]
    )
    add_arguments(p)
    return main_bench(p.parse_args(argv), child_module="kvxferd.bench")


if __name__ == "__main__":
    raise SystemExit(_main())
