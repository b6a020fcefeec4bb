"""The ``kvxferd faults`` command: run the scenarios, print one line each, write the report."""

from __future__ import annotations

import argparse
import sys

from kvxferd.faults.report import line, write_report
from kvxferd.faults.scenarios import NAMES, Result, Timing, run_one


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="shorter holds and soak (about 2 minutes)")
    p.add_argument(
        "--only", action="append", choices=NAMES, default=[], help="run this scenario (repeat)"
    )
    p.add_argument(
        "--report", help="write the figures into this markdown file (docs/reliability.md)"
    )
    p.add_argument(
        "--ucx-tls",
        dest="ucx_tls",
        default="tcp",
        help="UCX_TLS of the daemons (default tcp: a stopped peer stalls writes, as across hosts)",
    )
    p.add_argument("--seed", type=int, default=11)


def main_faults(args: argparse.Namespace) -> int:
    timing = Timing.quick() if args.quick else Timing()
    names = args.only or list(NAMES)
    tls = None if args.ucx_tls in ("", "default") else args.ucx_tls
    results: list[Result] = []
    for k, name in enumerate(names):
        res = run_one(name, timing, args.seed + 100 * k, tls)
        results.append(res)
        print(line(res), flush=True)
    if args.report:
        write_report(args.report, results, quick=args.quick, ucx_tls=tls)
        print(f"faults: figures written to {args.report}")
    broken = [r.name for r in results if r.broken]
    skipped = [r.name for r in results if r.skipped]
    print(
        f"faults: {len(results) - len(broken) - len(skipped)} passed, {len(broken)} broke a bound"
        + (f" ({', '.join(broken)})" if broken else "")
        + (f", {len(skipped)} skipped ({', '.join(skipped)})" if skipped else ""),
        file=sys.stderr,
    )
    return 1 if broken else 0
