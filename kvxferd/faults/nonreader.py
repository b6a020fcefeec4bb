"""A receiver whose control plane never reads: ``python -m kvxferd.faults.nonreader``.

A real :class:`~kvxferd.transfer.receiver.Receiver` (real NIXL, so the sender's writes land)
that tells the sender to send its Results and CancelAcks to ``BLACKHOLE``, a TCP
port that accepts connections and never reads. It fetches ``COUNT`` requests
``PREFIX-i`` from ``SENDER`` and then waits, at most ``LIFETIME`` seconds, to be
killed. One JSON line on stdout says it is ready.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np


def main(argv: list[str]) -> int:
    sender, blackhole, prefix, count, lifetime, ucx_tls = argv
    from kvxferd.config import load_receiver_settings
    from kvxferd.faults.harness import FAULT_DEADLINES, FAULT_POOL
    from kvxferd.transfer.receiver import Receiver

    settings = load_receiver_settings(
        name="faults-nonreader",
        result_endpoint="tcp://127.0.0.1:0",
        pool={**FAULT_POOL, "num_blocks": 256},
        deadlines=FAULT_DEADLINES,
        dataplane={"ucx_tls": ucx_tls} if ucx_tls != "-" else {},
        security={"mode": "off"},  # loopback only, as the fault suite's daemons
    )
    rx = Receiver(settings).start()
    rx.result_endpoint = blackhole  # what Register will tell the sender
    handles = [
        rx.fetch(f"{prefix}-{i}", sender, np.arange(4 * i, 4 * i + 4) % 256)
        for i in range(int(count))
    ]
    print(json.dumps({"event": "ready", "fetches": len(handles)}), flush=True)
    time.sleep(float(lifetime))  # killed by the suite long before
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
