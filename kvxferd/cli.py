"""Command line: ``kvxferd sender | receiver | keygen | demo | bench | faults | print-config``.

``sender`` and ``receiver`` run until SIGINT/SIGTERM, then shut down within
their configured bound; the exit code says whether the drain was complete
(0) or not (3). A configuration error exits 2 with a message naming the setting,
the source its value came from and the limit it broke (precedence: kvxferd.config);
a bad flag too. Either is one line on stderr, never a traceback or a usage dump.

SIGHUP never ends ``sender`` or ``receiver`` (a closing terminal or a careless
``kill -HUP`` must not end a daemon that holds transfers): it re-reads the
allow-list directory (``security.allowed_keys_dir``) and nothing else; the
daemon's own key and the log level change by restart, which drains.

``keygen --dir D --name N`` writes a CURVE key pair in the ``zmq.auth`` format,
``D/N.key`` (public: copy it into the peers' allow-list directories) and
``D/N.key_secret`` (mode 0600: this daemon's ``security.key_file``); it never
overwrites a file (exit 1).

``--version`` prints the version and the protocol versions this release speaks
(``kvxferd 0.2.0 (wire protocol 4, 3; engine protocol 5, 4)``: the newest first). The ``_bench-*`` commands are private children
of ``bench`` and are left out of ``--help``. Output cut short by a closed pipe
(``kvxferd print-config | head -1``) ends quietly, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import typing
from typing import Any, Literal

from kvxferd import __version__
from kvxferd.config import (
    ReceiverSettings,
    SenderSettings,
    load_receiver_settings,
    load_sender_settings,
    settings_sources,
)
from kvxferd.errors import ConfigError

EXIT_CONFIG = 2
EXIT_NOT_DRAINED = 3


def version_line() -> str:
    """What ``--version`` prints: the release and every protocol version it speaks."""
    from kvxferd.engine import engine_protocol as ep
    from kvxferd.transfer import protocol as wire

    def spoken(versions: frozenset[int]) -> str:
        return ", ".join(str(v) for v in sorted(versions, reverse=True))

    return (
        f"kvxferd {__version__} (wire protocol {spoken(wire.SUPPORTED_VERSIONS)}; "
        f"engine protocol {spoken(ep.ENGINE_VERSIONS)})"
    )


class _Version(argparse.Action):
    """``--version``: the line of :func:`version_line`, built only when asked (the protocol
    modules import numpy; a refusal or ``keygen`` imports neither torch nor NIXL)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        sys.stdout.write(version_line() + "\n")
        parser.exit(0)


def _overrides(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value


class _Parser(argparse.ArgumentParser):
    """Refuses a bad command line in one line (as a configuration error, exit 2), not a
    usage dump; ``--help`` still prints the usage."""

    def error(self, message: str) -> typing.NoReturn:
        command = self.prog.removeprefix("kvxferd").strip()
        where = f"{command}: " if command else ""
        self.exit(EXIT_CONFIG, f"kvxferd: {where}{message}; see `{self.prog} --help`\n")


def _parser(tool: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; ``tool`` ("bench", "faults") adds that tool's options."""
    p = _Parser(prog="kvxferd", description=__doc__.splitlines()[0])
    p.add_argument("--version", action=_Version, nargs=0, help="show the version and exit")
    sub = p.add_subparsers(
        dest="cmd",
        required=True,
        metavar="{sender,receiver,keygen,print-config,demo,bench,faults}",
    )

    s = sub.add_parser("sender", help="run the context-side sender until SIGTERM")
    s.add_argument("--config", help="TOML file (sections [pool], [deadlines], ...)")
    s.add_argument(
        "--listen",
        help="ROUTER endpoint, e.g. tcp://10.0.0.5:5555 (0.0.0.0 needs an advertise host)",
    )
    s.add_argument("--num-threads", type=int, dest="num_threads", help="worker threads (>= 1)")
    s.add_argument("--name")
    s.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"])

    r = sub.add_parser("receiver", help="run the generation-side receiver until SIGTERM")
    r.add_argument("--config")
    r.add_argument("--result-endpoint", dest="result_endpoint")
    r.add_argument("--name")
    r.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"])

    k = sub.add_parser("keygen", help="write a CURVE key pair (NAME.key, NAME.key_secret)")
    k.add_argument("--dir", required=True, dest="key_dir", help="directory (made 0700 if new)")
    k.add_argument("--name", required=True, help="file name stem, e.g. the host or daemon name")

    c = sub.add_parser("print-config", help="print the effective configuration as JSON")
    c.add_argument("--role", choices=["sender", "receiver"], required=True)
    c.add_argument("--config")
    c.add_argument(
        "--sources",
        action="store_true",
        help="print each setting's value and where it came from (default, file, env, flag)",
    )
    c.add_argument("--listen", help="as for sender")
    c.add_argument("--num-threads", type=int, dest="num_threads", help="as for sender")
    c.add_argument("--result-endpoint", dest="result_endpoint", help="as for receiver")
    c.add_argument("--name")
    c.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"])

    d = sub.add_parser(
        "demo",
        help="sender + receiver daemons on loopback, engines via kvxferd.engine.client, verified",
    )
    d.add_argument("--requests", type=_positive, default=300)
    d.add_argument("--receivers", type=int, default=1, choices=range(1, 9), metavar="1..8")
    d.add_argument("--inflight", type=_positive, default=8, help="fetches in flight per receiver")
    d.add_argument("--seed", type=int, default=1)
    d.add_argument("--json", dest="json_path", help="also write the summary as JSON here")

    # The tools' options are added only when the command line names the tool: their modules
    # import torch and NIXL (seconds), which a daemon's refusal or `keygen` must not wait for.
    bench = sub.add_parser(
        "bench", help="kvxferd vs raw NIXL vs a plain ZMQ copy on KV-shaped workloads"
    )
    faults = sub.add_parser(
        "faults",
        help="real daemons through kills, stops, a partition, SIGTERM and a soak; figures",
    )
    if tool == "bench":
        from kvxferd.bench import add_arguments as add_bench_arguments

        add_bench_arguments(bench)
    elif tool == "faults":
        from kvxferd.faults import add_arguments as add_faults_arguments

        add_faults_arguments(faults)
    for hidden_bench in ("_bench-tx", "_bench-rx"):
        sub.add_parser(hidden_bench).add_argument("spec")

    return p


def _serve(role: Literal["sender", "receiver"], settings: Any) -> int:
    from kvxferd.service.daemon import serve

    # Ignored until the daemon's loop handles it (re-reads the allow-list); see above.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return serve(role, settings)


SENDER_FLAGS = ("listen", "num_threads", "name", "log_level")
RECEIVER_FLAGS = ("result_endpoint", "name", "log_level")


def _print_config(args: argparse.Namespace) -> None:
    role, config, sources = args.role, args.config, args.sources
    load = load_sender_settings if role == "sender" else load_receiver_settings
    flags = _overrides(args, SENDER_FLAGS if role == "sender" else RECEIVER_FLAGS)
    settings = load(config, **flags)
    if not sources:
        print(settings.model_dump_json(indent=2))
        return
    cls = SenderSettings if role == "sender" else ReceiverSettings
    values = settings.model_dump(mode="json")
    for name, source in settings_sources(cls, config, flags).items():
        value: object = values
        for part in name.split("."):
            value = value[part]  # type: ignore[index]
        print(f"{name} = {json.dumps(value)}  # {source}")


def _keygen(directory: str, name: str) -> int:
    from kvxferd.auth import keygen

    try:
        public, secret = keygen(directory, name)
    except (FileExistsError, ValueError) as e:
        print(f"kvxferd keygen: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"public": str(public), "secret": str(secret)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (``| head``); silence the flush at exit too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _main(argv: list[str] | None) -> int:
    words = sys.argv[1:] if argv is None else argv
    tool = next((w for w in words if not w.startswith("-")), None)
    args = _parser(tool if tool in ("bench", "faults") else None).parse_args(argv)
    try:
        if args.cmd == "sender":
            return _serve(
                "sender",
                load_sender_settings(args.config, **_overrides(args, SENDER_FLAGS)),
            )
        if args.cmd == "receiver":
            return _serve(
                "receiver",
                load_receiver_settings(args.config, **_overrides(args, RECEIVER_FLAGS)),
            )
        if args.cmd == "keygen":
            return _keygen(args.key_dir, args.name)
        if args.cmd == "print-config":
            _print_config(args)
            sys.stdout.flush()
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
        from kvxferd import demo

        assert args.cmd == "demo", args.cmd
        spec = demo.Spec(
            requests=args.requests,
            receivers=args.receivers,
            inflight=args.inflight,
            seed=args.seed,
        )
        return demo.run_demo(spec, args.json_path)
    except ConfigError as e:
        print(f"kvxferd: configuration error: {e}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    raise SystemExit(main())
