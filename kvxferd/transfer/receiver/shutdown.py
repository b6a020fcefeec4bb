"""The receiver's shutdown: drain, cut what is left, ask about the doubt, then let go.

Shutdown admits no fetch once draining (admission checks under ``_lock``), waits up to
``drain_timeout_ms`` for the open ones, ends the rest ``failed``/``shutting_down`` (so
does an engine's cancel or close during the drain; each counted as
``drain_dropped_cut``), asks once more about fetches in doubt, and deregisters memory
(data plane, pool) only when no outcome is in doubt (else ``drain_dropped_in_doubt``).
With revocable transports, closing every link's NIXL agent is the proof that ends
what is still in doubt (``fences_released_teardown``). Runs on the caller's thread;
the io thread does the cutting (commands.py's DrainEnd, RetryInDoubt).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from kvxferd.errors import Reason
from kvxferd.transfer import commands as cmd
from kvxferd.transfer.drain import DROPPED_CUT, RxShutdownReport

if TYPE_CHECKING:
    from kvxferd.transfer.receiver.core import Receiver

log = logging.getLogger("kvxferd.receiver")


def shut_down(rx: Receiver, t0: float, total: float) -> RxShutdownReport:
    """Drain, then end what is left, wait for fences, stop; what it dropped."""
    d = rx.settings.deadlines
    deadline = t0 + total
    drain_deadline = min(t0 + d.drain_timeout_ms / 1000, deadline - 0.2 * total)
    settle_deadline = deadline - 0.1 * total
    with rx._lock:  # fetch() admits under this lock: no fetch slips past this list
        rx._draining.set()
        open_fetches = list(rx.fetches.by_id.values())
        unplanned = list(rx.groups.unplanned.values())
    for g in unplanned:  # no piece started: nothing can land
        rx.groups.fail(g, Reason.SHUTTING_DOWN, "receiver shut down before it was planned")
    waiting = sum(1 for f in open_fetches if not f.ended)
    if waiting:
        log.info(
            "draining: %d fetch%s open; waiting up to %.1f s",
            waiting,
            "" if waiting == 1 else "es",
            max(0.0, drain_deadline - time.monotonic()),
        )
    for f in open_fetches:
        if rx._started:
            f.completion.wait(max(0.0, drain_deadline - time.monotonic()))
    rx.drain_complete = all(f.ended for f in open_fetches)
    for f in open_fetches:
        if not f.ended:
            rx._command(cmd.DrainEnd(f))
    rx._command(cmd.RetryInDoubt())
    for f in open_fetches:
        if rx._started:
            f.fence_done.wait(max(0.0, settle_deadline - time.monotonic()))
    in_doubt = rx.doubts
    if rx._started:
        with in_doubt.settled:  # late answers about fetches in doubt, until the bound
            in_doubt.settled.wait_for(
                lambda: in_doubt.unresolved == 0,
                max(0.0, settle_deadline - time.monotonic()),
            )
    with rx._lock:  # _command writes the eventfd under this lock
        rx._stopping.set()
    if rx._started:
        rx._io.join(max(0.0, deadline - time.monotonic()))
    else:
        rx._router.close(linger=0)
    joined = not rx._io.is_alive()
    if joined:
        os.close(rx._wake)
        rx.io.close()
    abandoned = 0
    for f in open_fetches:  # nobody will answer for these any more
        if f.abandon(Reason.SHUTTING_DOWN, "receiver shut down before the fetch ended"):
            abandoned += 1
            rx.stats.add("drain_dropped_cut")
    with rx._lock:
        doubtful = in_doubt.unresolved
        doubtful += sum(1 for f in rx.fetches.by_id.values() if not f.blocks_reusable)
    doubtful = max(doubtful, sum(1 for f in open_fetches if not f.blocks_reusable))
    safe = doubtful == 0
    if not safe and joined and rx.agents.proves:
        # Our side of every link torn down: nothing sent through them can land now.
        rx.agents.close()
        in_doubt.release_all_by_teardown(open_fetches)
        log.info("receiver shutdown: %d outcome(s) in doubt ended by tearing down", doubtful)
        doubtful, safe = 0, True
    elif doubtful:
        rx.stats.add("drain_dropped_in_doubt", doubtful)
    if safe and joined:
        rx.agents.close()
        if rx._owns_pool:
            rx.pool.close()
    else:
        # A write may still land: deregistering now would let it hit freed memory.
        log.warning(
            "receiver shutdown: %d outcome(s) in doubt; memory stays registered until exit",
            doubtful,
        )
    report = RxShutdownReport(
        fetches_cut=rx.stats.get(DROPPED_CUT),
        in_doubt=doubtful,
        blocks_safe=safe,
        threads_joined=joined,
        elapsed_s=time.monotonic() - t0,
    )
    log.info("receiver shutdown: %s (abandoned: %d)", report, abandoned)
    return report
