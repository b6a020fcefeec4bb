"""The cut experiments of docs/hosts.md: many engine loops on one pair, a cut, the recovery.

As root, from the repository root::

    python -m tests.support.hosts_experiment                       # kernel TCP, 15 s cut both ways
    python -m tests.support.hosts_experiment --rto-max-ms 1000 --retries2 5 --one-way --cut-s 8

Four hosts as tests/test_hosts.py builds them; ``--loops`` engine loops on p0->d0 (so that
KV writes are in flight when the link goes) and 2 on p0->d1 (the same sender's other pair).
Prints one JSON line: writes stalled in the cut, how the failures ended, how long after the
heal p0->d0 carried a good transfer, whether the data plane reconnected, p0->d1's slowest.
"""

from __future__ import annotations

import argparse
import json
import time

from tests.support.hosts import HostNet, why_no_hosts
from tests.test_hosts import PORT, stalled

RECOVER_WAIT_S = 30.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rto-max-ms", type=int, default=None, help="net.ipv4.tcp_rto_max_ms")
    ap.add_argument("--retries2", type=int, default=None, help="net.ipv4.tcp_retries2")
    ap.add_argument("--cut-s", type=float, default=15.0)
    ap.add_argument("--one-way", action="store_true", help="drop only p0 -> d0")
    ap.add_argument("--at", choices=["switch", "hosts"], default="switch")
    ap.add_argument("--loops", type=int, default=8)
    a = ap.parse_args()
    why = why_no_hosts()
    if why is not None:
        print(why)
        return 77
    with HostNet(4, tcp_rto_max_ms=a.rto_max_ms, tcp_retries2=a.retries2) as net:
        h = net.hosts
        p0, p1 = net.sender(h[0], "p0", PORT), net.sender(h[1], "p1", PORT)
        d0, d1 = net.receiver(h[2], "d0"), net.receiver(h[3], "d1")
        net.wait_ready()
        e = {d.name: net.engine(d, seed=i) for i, d in enumerate([p0, p1, d0, d1])}
        ep = f"tcp://{h[0].ip}:{PORT}"
        cut = net.pair("xp0d0", e["p0"], e["d0"], ep, threads=a.loops, seed=1)
        other = net.pair("xp0d1", e["p0"], e["d1"], ep, threads=2, seed=2)
        time.sleep(3.0)  # traffic before the cut
        s0 = stalled(p0.metrics())
        t_cut = net.cut(h[0], h[2], at=a.at, both=not a.one_way)
        time.sleep(a.cut_s)
        s1 = stalled(p0.metrics())
        t_heal = net.heal(h[0], h[2])
        by = time.monotonic() + RECOVER_WAIT_S
        while time.monotonic() < by and not any(
            f.ok and f.started > t_heal for f in cut.snapshot()
        ):
            time.sleep(0.05)
        for t in (cut, other):
            t.finish(15.0)
        ff = cut.snapshot()
        first = min((f.ended for f in ff if f.ok and f.ended and f.ended > t_heal), default=None)
        od = [f for f in other.snapshot() if t_cut <= f.started < t_heal]
        log = p0.stderr_path.read_text(errors="replace")
        print(json.dumps({
            **vars(a),
            "stalled_in_cut": s1 - s0,
            "failed": sorted({f"{f.state}:{f.reason}" for f in ff if not f.ok}),
            "failed_after_heal": sum(not f.ok for f in ff if f.started > t_heal),
            "recover_s": round(first - t_heal, 2) if first else None,
            "reconnected": "reconnected" in log,
            "dataplane_lines": [ln[:40] + ln[-70:] for ln in log.splitlines() if "kvxferd.dataplane" in ln][-6:],
            "heal_wall": time.strftime("%H:%M:%S", time.gmtime(time.time() - (time.monotonic() - t_heal))),
            "other_max_s": round(max((f.seconds for f in od), default=0.0), 2),
            "other_failed": sum(not f.ok for f in od),
        }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
