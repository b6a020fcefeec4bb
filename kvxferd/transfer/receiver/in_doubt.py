"""The receiver's in-doubt table: fetches whose blocks a write may still reach.

A fetch completes only on its sender's word that NIXL reported its WRITEs complete. On
cancel or timeout the blocks stay fenced until the sender acknowledges that no write is
in flight, or until ``cancel_fence_ms`` passes; then the outcome is in doubt and the
blocks (and aux slot) must not be reused. A fetch's fence, from the fetch table on::

    fence        in                         out
    -----------  -------------------------  -----------------------------------------------
    FENCED       fetches.py's ``by_id``     CancelAck(in_doubt=false) / final Result:
                                            forgotten (aux slot back); cancel_fence_ms:
                                            IN_DOUBT, moved here (``fetches_in_doubt``)
    IN_DOUBT     ``by_id`` here (bounded by  a late CancelAck(in_doubt=false), done/failed
                 max_fetches_in_flight; the  Result, a new sender incarnation, or its link's
                 oldest is dropped unasked:  NIXL agent torn down (revocable transports,
                 ``in_doubt_untracked``)     ``fences_released_teardown``): resolved
                                            (``in_doubt_resolved``, aux slot back)

While in doubt its Cancel is re-sent with a bounded backoff (``in_doubt_retry_ms`` ..
``in_doubt_retry_max_ms``), at once when its sender answers a Register again.
``unresolved`` counts every fetch ended in doubt and not resolved yet (untracked ones
too), ``aux_quarantined`` the aux slots they hold. The table has no lock of its own:
the caller holds the receiver's ``_lock``, except where a method says it takes it;
``settled`` (a condition on that lock) is notified when a doubt resolves.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from kvxferd.errors import Reason
from kvxferd.transfer.session import Fence, RxSession

if TYPE_CHECKING:
    from kvxferd.transfer.receiver.core import Receiver

log = logging.getLogger("kvxferd.receiver")


class InDoubt:
    """Fetches ended in doubt, still asked about (the receiver's ``_lock``)."""

    def __init__(self, rx: Receiver) -> None:
        self.rx = rx
        self.by_id: dict[int, RxSession] = {}  # ended in doubt, still asked about (bounded)
        self.unresolved = 0  # fetches ended in doubt and not resolved yet
        self.aux_quarantined = 0  # aux slots held by those fetches
        self.settled = threading.Condition(rx._lock)  # notified when a doubt resolves

    def maybe_forget(self, f: RxSession) -> None:
        """Drop a fetch once no write toward its blocks can come, or keep asking while in doubt."""
        rx = self.rx
        if not f.ended or f.fence is Fence.FENCED:
            return
        rx.fetches.reregistered.discard(f.fetch_id)
        in_doubt = f.fence is Fence.IN_DOUBT
        untracked: RxSession | None = None
        with rx._lock:
            if rx.fetches.by_id.pop(f.fetch_id, None) is None:
                return
            if in_doubt:
                self.unresolved += 1
                self.by_id[f.fetch_id] = f
                if f.aux_slot >= 0:
                    self.aux_quarantined += 1
                if len(self.by_id) > rx.settings.limits.max_fetches_in_flight:
                    # Bounded: the oldest stays in doubt (its blocks and slot kept) unasked.
                    untracked = self.by_id.pop(next(iter(self.by_id)))
        if in_doubt:
            rx.stats.add("fetches_in_doubt")
            if f.aux_slot >= 0:
                rx.stats.add("aux_slots_quarantined")
            f.retry_every = rx.settings.deadlines.in_doubt_retry_ms / 1000
            f.retry_at = 0.0 if rx._draining.is_set() else time.monotonic() + f.retry_every
            if untracked is not None:
                rx.stats.add("in_doubt_untracked")
        elif f.aux_slot >= 0:
            rx.aux_slots.give_back([f.aux_slot])

    def settle(self, f: RxSession) -> None:
        """After a fence moved: forget an open-table fetch, or resolve one that was in doubt."""
        rx = self.rx
        self.maybe_forget(f)
        if not f.blocks_reusable:
            return
        with rx._lock:
            if self.by_id.pop(f.fetch_id, None) is None:
                return
            self.unresolved -= 1
            if f.aux_slot >= 0:
                self.aux_quarantined -= 1
            self.settled.notify_all()
        if f.aux_slot >= 0:
            rx.aux_slots.give_back([f.aux_slot])
            rx.stats.add("aux_slots_released")
        rx.stats.add("in_doubt_resolved")
        log.info("fetch %d of %s: outcome no longer in doubt", f.fetch_id, f.request_id)

    def ask_again_now(self, endpoint: str) -> None:
        """The sender at ``endpoint`` answered a Register: ask about its fetches in doubt now.

        Their re-asks backed off while it was away (up to ``in_doubt_retry_max_ms``); waiting
        that out after a heal kept blocks fenced for tens of seconds with the link back.
        """
        with self.rx._lock:
            doubtful = [f for f in self.by_id.values() if f.sender_endpoint == endpoint]
        for f in doubtful:
            f.retry_at = 0.0
            f.retry_every = self.rx.settings.deadlines.in_doubt_retry_ms / 1000

    def ask_all_now(self) -> None:
        """Shutdown: ask about every fetch in doubt now."""
        with self.rx._lock:
            doubtful = list(self.by_id.values())
        for d in doubtful:
            d.retry_at = 0.0

    def retry(self, now: float) -> None:
        """Ask again about fetches in doubt, backing off to ``in_doubt_retry_max_ms``."""
        rx = self.rx
        with rx._lock:
            due = [f for f in self.by_id.values() if now >= f.retry_at]
        cap = rx.settings.deadlines.in_doubt_retry_max_ms / 1000
        for f in due:
            f.retry_at = now + f.retry_every
            f.retry_every = min(f.retry_every * 2, cap)
            rx.stats.add("in_doubt_retries")
            rx.links.send_cancel(f)

    def agent_torn(self, gen: int) -> None:
        """A link's NIXL agent is destroyed: no write sent through it can land any more.

        With revocable transports (``LinkAgents.proves``) that is proof: every fetch sent
        through it ends (``peer_lost``, if still open) and its fence is released
        (``fences_released_teardown``). Otherwise its fetches stay in doubt.
        """
        rx = self.rx
        if not rx.agents.proves:
            return
        with rx._lock:
            through = [
                f
                for f in (*rx.fetches.by_id.values(), *self.by_id.values())
                if f.sent and f.agent_gen == gen
            ]
        for f in through:
            if not f.ended and f.abandon(
                Reason.PEER_LOST, "the link's data plane was torn down (link down)"
            ):
                rx.stats.add("fetches_failed")
                rx.stats.add(f"failed_{Reason.PEER_LOST}")
            if f.release():
                rx.stats.add("fences_released_teardown")
                self.settle(f)

    def release_all_by_teardown(self, also: list[RxSession]) -> None:
        """Shutdown, every link's NIXL agent closed: nothing sent through them can land now;
        every fence (tracked here, in the fetch table, or in ``also``) is released."""
        rx = self.rx
        released = 0
        with rx._lock:
            doubtful = [*self.by_id.values(), *rx.fetches.by_id.values(), *also]
        for f in doubtful:
            if f.release():
                released += 1
        rx.stats.add("fences_released_teardown", released)
        with rx._lock:  # those no longer tracked (over the table's bound) too
            self.by_id.clear()
            self.unresolved = 0
