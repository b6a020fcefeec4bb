"""Command line: ``kvxferd sender | receiver | demo | bench | faults | print-config``.

``sender`` and ``receiver`` run until SIGINT/SIGTERM, then shut down within
their configured bound; the exit code says whether the drain was complete
(0) or not (3). A configuration error exits 2 with a message naming the setting.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Literal

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.errors import ConfigError

EXIT_CONFIG = 2
EXIT_NOT_DRAINED = 3


def _overrides(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvxferd", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("sender", help="run the context-side sender until SIGTERM")
    s.add_argument("--config", help="TOML file (sections [pool], [deadlines], ...)")
    s.add_argument("--listen", help="ROUTER endpoint, e.g. tcp://0.0.0.0:5555")
    s.add_argument("--num-threads", type=int, dest="num_threads", help="worker threads (>= 1)")
    s.add_argument("--name")
    s.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"])

    r = sub.add_parser("receiver", help="run the generation-side receiver until SIGTERM")
    r.add_argument("--config")
    r.add_argument("--result-endpoint", dest="result_endpoint")
    r.add_argument("--name")
    r.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"])

    c = sub.add_parser("print-config", help="print the effective configuration as JSON")
    c.add_argument("--role", choices=["sender", "receiver"], required=True)
    c.add_argument("--config")

    d = sub.add_parser(
        "demo", help="sender + receiver daemons on loopback, engines via kvxferd.client, verified"
    )
    d.add_argument("--requests", type=_positive, default=300)
    d.add_argument("--receivers", type=int, default=1, choices=range(1, 9), metavar="1..8")
    d.add_argument("--inflight", type=_positive, default=8, help="fetches in flight per receiver")
    d.add_argument("--seed", type=int, default=1)
    d.add_argument("--json", dest="json_path", help="also write the summary as JSON here")

    from kvxferd.bench import add_arguments as add_bench_arguments

    bench = sub.add_parser(
        "bench", help="kvxferd vs raw NIXL vs a plain ZMQ copy on KV-shaped workloads"
    )
    add_bench_arguments(bench)
    from kvxferd.faults import add_arguments as add_faults_arguments

    add_faults_arguments(
        sub.add_parser(
            "faults",
            help="real daemons through kills, stops, a partition, SIGTERM and a soak; figures",
        )
    )
    for hidden_bench in ("_bench-tx", "_bench-rx"):
        sub.add_parser(hidden_bench).add_argument("spec")

    return p


def _serve(role: Literal["sender", "receiver"], settings: Any) -> int:
    from kvxferd.daemon import serve

    return serve(role, settings)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "sender":
            return _serve(
                "sender",
                load_sender_settings(
                    args.config, **_overrides(args, ("listen", "num_threads", "name", "log_level"))
                ),
            )
        if args.cmd == "receiver":
            return _serve(
                "receiver",
                load_receiver_settings(
                    args.config, **_overrides(args, ("result_endpoint", "name", "log_level"))
                ),
            )
        if args.cmd == "print-config":
            load = load_sender_settings if args.role == "sender" else load_receiver_settings
            print(load(args.config).model_dump_json(indent=2))
            return 0
        if args.cmd == "bench":
            from kvxferd.bench import main_bench

            return main_bench(args)
        if args.cmd == "faults":
            from kvxferd.faults import main_faults

            return main_faults(args)
        if args.cmd in ("_bench-tx", "_bench-rx"):
            from kvxferd.bench import run_child

            return run_child(args.cmd, args.spec)
        from kvxferd import workload

        assert args.cmd == "demo", args.cmd
        spec = workload.Spec(
            requests=args.requests,
            receivers=args.receivers,
            inflight=args.inflight,
            seed=args.seed,
        )
        return workload.run_demo(spec, args.json_path)
    except ConfigError as e:
        print(f"kvxferd: configuration error: {e}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    raise SystemExit(main())
