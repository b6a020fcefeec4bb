"""Command line: ``kvxferd sender | receiver | demo | print-config``.

``sender`` and ``receiver`` run until SIGINT/SIGTERM, then shut down within
their configured bound; the exit code says whether the drain was complete
(0) or not (3). A configuration error exits 2 with a message naming the setting.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from typing import Any

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.errors import ConfigError

EXIT_CONFIG = 2
EXIT_NOT_DRAINED = 3


def _overrides(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


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

    d = sub.add_parser("demo", help="sender + receiver processes on loopback, verified bytes")
    d.add_argument("--requests", type=int, default=300)
    d.add_argument("--receivers", type=int, default=1, choices=range(1, 9), metavar="1..8")
    d.add_argument("--inflight", type=int, default=8, help="fetches in flight per receiver")
    d.add_argument("--seed", type=int, default=1)
    d.add_argument("--json", dest="json_path", help="also write the summary as JSON here")

    for hidden in ("_demo-sender", "_demo-receiver"):
        h = sub.add_parser(hidden)
        h.add_argument("spec")
        h.add_argument("rest", nargs="*")
    return p


def _serve(role: str, settings: Any) -> int:
    from kvxferd.receiver import Receiver
    from kvxferd.sender import Sender

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if role == "sender":
        svc = Sender(settings).start()
        print(json.dumps({"event": "ready", "role": role, "endpoint": svc.endpoint}), flush=True)
        while not stop.wait(1.0):
            pass
        report = svc.shutdown()
        return 0 if report.drained and report.threads_joined else EXIT_NOT_DRAINED
    rsvc = Receiver(settings).start()
    print(
        json.dumps({"event": "ready", "role": role, "endpoint": rsvc.result_endpoint}), flush=True
    )
    while not stop.wait(1.0):
        pass
    return 0 if rsvc.shutdown() else EXIT_NOT_DRAINED


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
        from kvxferd import workload

        if args.cmd == "demo":
            spec = workload.Spec(
                requests=args.requests,
                receivers=args.receivers,
                inflight=args.inflight,
                seed=args.seed,
            )
            return workload.run_demo(spec, args.json_path)
        spec = workload.Spec(**json.loads(args.spec))
        if args.cmd == "_demo-sender":
            return workload.run_sender(spec)
        return workload.run_receiver(spec, args.rest[0], int(args.rest[1]))
    except ConfigError as e:
        print(f"kvxferd: configuration error: {e}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    raise SystemExit(main())
