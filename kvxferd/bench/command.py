"""``kvxferd bench`` on the command line: its flags, the options they make, the run, its output."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pydantic import ValidationError

from kvxferd.bench.curves import CurveOptions, format_curves, run_curves
from kvxferd.bench.plot import plot_available, write_curves_plot, write_plot
from kvxferd.bench.report import dataplane_description, format_report
from kvxferd.bench.runner import run_bench
from kvxferd.bench.workload import FULL, PRESETS, QUICK, BenchError, Options, Workload
from kvxferd.config import DataPlaneSettings


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``kvxferd bench`` (and of ``python -m kvxferd.bench``)."""
    p.add_argument(
        "--quick", action="store_true", help="the quick preset (about a minute on 2 cores)"
    )
    p.add_argument(
        "--json", dest="json_path", metavar="PATH", help="write every figure as JSON here"
    )
    p.add_argument(
        "--plot", dest="plot_path", metavar="PATH", help="write a PNG chart here (needs matplotlib)"
    )
    p.add_argument(
        "--reps", type=int, help="repetitions per path and workload (default: the preset's)"
    )
    p.add_argument(
        "--only", metavar="NAMES", help="comma-separated workload names of the preset to run"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ucx-tls", dest="ucx_tls", help="UCX_TLS for every agent, e.g. 'shm'")
    p.add_argument(
        "--ucx-error-handling-mode", dest="ucx_error_handling_mode", choices=["peer", "none"]
    )
    p.add_argument("--ucx-num-workers", dest="ucx_num_workers", type=int)
    p.add_argument("--sync-mode", dest="sync_mode", choices=["strict", "rw", "none", "default"])
    p.add_argument(
        "--timeout", dest="timeout_s", type=float, default=3600.0, help="bound on the whole run (s)"
    )
    p.add_argument(
        "--curves",
        action="store_true",
        help="cost-growth curves instead of the preset: in flight, workers, blocks per request, "
        "peers, each against raw NIXL; --json / --plot write their data and chart (2-3 min)",
    )
    p.add_argument(
        "--scale",
        action="store_true",
        help="1..64 receivers attached to one sender daemon: set-up time, the sender's memory, "
        "fds and threads per peer, throughput against 1 peer; --json writes the figures (~2 min)",
    )
    p.add_argument(
        "--curve-cost",
        dest="curve_cost",
        action="store_true",
        help="a small request's control round trip (REQUEST_DATA -> Result) with CURVE on and "
        "off in the same run, and curve/plain; --reps sets the repetitions (~10 s)",
    )
    p.add_argument(
        "--hetero",
        action="store_true",
        help="heterogeneous TP (1P2D, 2P1D) next to equal TP (1P1D) on real daemons over NIXL, "
        "same bytes per request, alternating repetitions, ratios to 1P1D; --reps, --json (~15 s)",
    )
    p.add_argument(
        "--digest",
        action="store_true",
        help="the per-request digest's cost: its GB/s for 1-64 MiB, and the kvxferd path with "
        "and without it next to raw NIXL, repetitions alternating; --reps, --json (~2 min)",
    )
    p.add_argument(
        "--engine-path",
        dest="engine_path",
        action="store_true",
        help="issue 22's engine-path figures (p50 at 1 in flight, req/s at 16, daemon CPU per "
        "request) on real daemons, CURVE off and on, for this tree and --before/--before-rev, "
        "repetitions alternating; --reps, --requests, --only, --security, --json (~4 min)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="the engine path's floor: the same processes and hops in plain Python with no "
        "kvxferd logic, p50 and daemon CPU at 1 in flight; --reps, --requests, --security (~1 min)",
    )
    p.add_argument(
        "--before",
        metavar="PATH",
        help="--engine-path: the checkout to compare against (its daemons and engines run its code)",
    )
    p.add_argument(
        "--before-rev",
        dest="before_rev",
        metavar="REV",
        help="--engine-path: a git revision to compare against, checked out with 'git worktree "
        "add' into a temporary directory and removed afterwards",
    )
    p.add_argument(
        "--requests",
        type=int,
        metavar="N",
        help="--engine-path: requests per repetition of every workload (default 1000 at 1 in "
        "flight, 2000 at 16)",
    )
    p.add_argument(
        "--security",
        choices=["off", "curve", "both"],
        default="both",
        help="--engine-path: security off, CURVE on, or both (default)",
    )
    p.add_argument(
        "--scale-peers",
        dest="scale_peers",
        default="1,8,32,64",
        metavar="N,N,...",
        help="--scale: the peer counts, attached in steps (default 1,8,32,64)",
    )


def options_from_args(args: argparse.Namespace, child_module: str = "kvxferd") -> Options:
    preset = "quick" if args.quick else "full"
    base: dict[str, Any] = dict(PRESETS[preset])
    workloads: tuple[Workload, ...] = base.pop("workloads")
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        known = {w.name: w for w in (*FULL, *QUICK)}
        missing = [n for n in names if n not in known]
        if missing:
            raise BenchError(f"unknown workload(s) {missing}; known: {sorted(known)}")
        workloads = tuple(known[n] for n in names)
    dp_fields = ("ucx_tls", "ucx_error_handling_mode", "ucx_num_workers", "sync_mode")
    try:
        dp = DataPlaneSettings(
            **{f: getattr(args, f) for f in dp_fields if getattr(args, f, None) is not None}
        )
    except ValidationError as e:
        raise BenchError(f"invalid data-plane setting: {e.errors()[0]['msg']}") from None
    if args.reps is not None:
        if args.reps < 1:
            raise BenchError("--reps must be >= 1")
        base["reps"] = args.reps
    return Options(
        preset=preset,
        workloads=workloads,
        dataplane=dp,
        seed=args.seed,
        child_module=child_module,
        timeout_s=args.timeout_s,
        **base,
    )


def main_bench(args: argparse.Namespace, child_module: str = "kvxferd") -> int:
    """``kvxferd bench``: run, print the tables, write --json / --plot. 0 ok, 1 failed, 2 bad usage."""
    if getattr(args, "engine_path", False):
        from kvxferd.bench.engine_ab import main_engine_ab

        return main_engine_ab(args)
    if getattr(args, "floor", False):
        from kvxferd.bench.floor import main_floor

        return main_floor(args)
    if args.plot_path and not plot_available():
        print(
            "kvxferd bench: --plot needs matplotlib; install it with pip install 'kvxferd[bench]'",
            file=sys.stderr,
        )
        return 2
    if getattr(args, "curve_cost", False):
        return main_curve_cost(args)
    if getattr(args, "hetero", False):
        return main_hetero(args)
    if getattr(args, "digest", False):
        return main_digest(args, child_module)
    if getattr(args, "curves", False):
        return main_curves(args, child_module)
    if getattr(args, "scale", False):
        from kvxferd.bench.scale import main_scale

        return main_scale(args)
    try:
        opts = options_from_args(args, child_module)
        print(f"kvxferd bench: {dataplane_description(opts.dataplane)}", file=sys.stderr)
        report = run_bench(opts)
    except BenchError as e:
        print(f"kvxferd bench: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(format_report(report))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot_path:
        write_plot(report, args.plot_path)
    ok = all(
        p["verified"] and not p["failures"]
        for w in report["workloads"]
        for p in w["paths"].values()
    )
    return 0 if ok else 1


def main_curves(args: argparse.Namespace, child_module: str = "kvxferd") -> int:
    """``kvxferd bench --curves``: the sweep, its tables, --json and --plot. 0 ok, 1 failed."""
    if args.quick or args.only:
        print("kvxferd bench: --curves takes neither --quick nor --only", file=sys.stderr)
        return 2
    try:
        dp_fields = ("ucx_tls", "ucx_error_handling_mode", "ucx_num_workers", "sync_mode")
        dp = DataPlaneSettings(
            **{f: getattr(args, f) for f in dp_fields if getattr(args, f, None) is not None}
        )
    except ValidationError as e:
        print(f"kvxferd bench: invalid data-plane setting: {e.errors()[0]['msg']}", file=sys.stderr)
        return 2
    extra: dict[str, Any] = {} if args.reps is None else {"reps": max(1, args.reps)}
    opts = CurveOptions(
        dataplane=dp,
        seed=args.seed,
        child_module=child_module,
        timeout_s=args.timeout_s,
        **extra,
    )
    try:
        print(f"kvxferd bench --curves: {dataplane_description(dp)}", file=sys.stderr)
        doc = run_curves(opts)
    except BenchError as e:
        print(f"kvxferd bench: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(format_curves(doc))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot_path:
        write_curves_plot(doc, args.plot_path)
    ok = all(
        p["verified"] and not p["failures"]
        for ax in doc["axes"].values()
        for pt in ax["points"]
        if not pt["skipped"]
        for p in pt["paths"].values()
    )
    return 0 if ok else 1


def main_curve_cost(args: argparse.Namespace) -> int:
    """``kvxferd bench --curve-cost``: CURVE on vs off, its table, --json. 0 ok, 1 failed, 2 bad usage."""
    from kvxferd.bench.curve_cost import CurveCostOptions, format_curve_cost, run_curve_cost

    if args.quick or args.only or args.plot_path or args.curves or args.scale:
        print(
            "kvxferd bench: --curve-cost takes none of --quick, --only, --plot, --curves, --scale",
            file=sys.stderr,
        )
        return 2
    extra: dict[str, Any] = {} if args.reps is None else {"reps": args.reps}
    try:
        doc = run_curve_cost(CurveCostOptions(timeout_s=args.timeout_s, **extra))
    except BenchError as e:
        print(f"kvxferd bench: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(format_curve_cost(doc))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


def main_hetero(args: argparse.Namespace) -> int:
    """``kvxferd bench --hetero``: 1P2D and 2P1D next to 1P1D, its table, --json. 0 ok, 1 failed, 2 bad usage."""
    from kvxferd.bench.hetero import HeteroOptions, format_hetero, run_hetero

    if args.quick or args.only or args.plot_path or args.curves or args.scale:
        print(
            "kvxferd bench: --hetero takes none of --quick, --only, --plot, --curves, --scale",
            file=sys.stderr,
        )
        return 2
    extra: dict[str, Any] = {} if args.reps is None else {"reps": args.reps}
    try:
        doc = run_hetero(HeteroOptions(seed=args.seed, timeout_s=args.timeout_s, **extra))
    except BenchError as e:
        print(f"kvxferd bench: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(format_hetero(doc))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


def main_digest(args: argparse.Namespace, child_module: str = "kvxferd") -> int:
    """``kvxferd bench --digest``: the digest's cost, its tables, --json. 0 ok, 1 failed, 2 bad usage."""
    from kvxferd.bench.digest_cost import format_digest_cost, run_digest_cost

    if args.quick or args.only or args.plot_path or args.curves or args.scale:
        print(
            "kvxferd bench: --digest takes none of --quick, --only, --plot, --curves, --scale",
            file=sys.stderr,
        )
        return 2
    try:
        args.quick = True  # the quick preset's repetition sizes: the run stays near 2 minutes
        doc = run_digest_cost(options_from_args(args, child_module))
    except BenchError as e:
        print(f"kvxferd bench: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(format_digest_cost(doc))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=1)
    ok = all(
        p["verified"] and not p["failures"] for w in doc["workloads"] for p in w["paths"].values()
    )
    return 0 if ok else 1
