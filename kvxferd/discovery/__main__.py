"""``python -m kvxferd.discovery``: which peers a daemon with this configuration would see.

    python -m kvxferd.discovery --config /etc/kvxferd/receiver.toml --peers sender --once
    python -m kvxferd.discovery --config receiver.toml --peers sender     # events until Ctrl-C

Prints one JSON object per line: each event (``added``/``changed``/``removed``),
or with ``--once`` the peers after the first read of the source. Reads the
``[discovery]`` section the daemons read (file, then ``KVXFERD_DISCOVERY__*``).
Exit 2 on a configuration error, 1 when ``--once`` could not read the source in time.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import msgspec

from kvxferd.config import load_receiver_settings
from kvxferd.discovery import PeerAdded, PeerChanged, PeerEvent, make_watcher
from kvxferd.errors import ConfigError


def _line(obj: object) -> None:
    sys.stdout.write(json.dumps(obj, default=msgspec.to_builtins) + "\n")
    sys.stdout.flush()


def _event(ev: PeerEvent) -> None:
    if isinstance(ev, PeerAdded):
        _line({"event": "added", "peer": msgspec.to_builtins(ev.peer)})
    elif isinstance(ev, PeerChanged):
        _line(
            {
                "event": "changed",
                "old": msgspec.to_builtins(ev.old),
                "peer": msgspec.to_builtins(ev.new),
            }
        )
    else:
        _line({"event": "removed", "peer": msgspec.to_builtins(ev.peer), "reason": ev.reason})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvxferd.discovery", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--config", help="a daemon's TOML file (its [discovery] section is used)")
    ap.add_argument(
        "--peers", choices=("sender", "receiver"), default="sender", help="role to list"
    )
    ap.add_argument("--once", action="store_true", help="print the peers after one read and exit")
    ap.add_argument(
        "--timeout", type=float, default=10.0, help="--once: seconds to wait for a read"
    )
    args = ap.parse_args(argv)
    try:
        settings = load_receiver_settings(args.config).discovery
    except ConfigError as e:
        print(f"kvxferd.discovery: {e}", file=sys.stderr)
        return 2
    watcher = make_watcher(settings, args.peers, None if args.once else _event)
    if watcher is None:
        print("kvxferd.discovery: [discovery] backend is 'none': no peers to list", file=sys.stderr)
        return 2
    watcher.start()
    try:
        if args.once:
            deadline = time.monotonic() + args.timeout
            while watcher.count("reads") == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            state = watcher.state()
            _line(state)
            return 0 if state["counts"]["reads"] else 1
        threading.Event().wait()
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        watcher.stop()


if __name__ == "__main__":
    sys.exit(main())
