"""The sender's bounded drain: ``shutdown`` in five steps, each within what is left of its bound.

Publish is refused with ``draining`` from the moment it starts, and so is a RequestData
for a request not published here (parked ones get it at once); Registers are still taken
and a fetch of a request published before the drain is attached and served::

    0. requests another sender is handing over here published (adopt.py), then draining
       set (under the registry lock: publish and parking check it there)
    1. parked fetches refused ``draining`` (the SharedDealerPool, bounded by the deadline);
       then the handover: requests no fetch touched offered to ``[handover] targets``
       (handover.py), which fetch them from here
    2. wait, up to ``drain_timeout_ms``, until every published request ended (fetched, or
       expired by its TTL, or moved) and no slice is queued or writing; the moved requests'
       receivers are told (``Moved``) and redirects answered up to ``redirect_window_ms``
    3. what is still open ends ``failed``/``shutting_down``; workers refuse its queued writes
    4. threads stopped, each join bounded by what is left
    5. memory deregistered only when no write is in flight

A request its engine closes or cancels while the drain runs ends the same way (the
engine lets go because it is stopping too). Each one is counted
(``drain_dropped_never_fetched`` / ``drain_dropped_cut``, and at the end
``drain_dropped_in_doubt``: requests with a write still in flight) in ``stats`` and in
the :class:`~kvxferd.transfer.drain.ShutdownReport` (the counters and reports both
services share live in kvxferd/transfer/drain.py). ``shutdown`` runs once
(``waiters.Once``); a later call waits within its own bound for the first.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import zmq

from kvxferd.errors import Reason, SendTimeout
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.drain import DROPPED_CUT, DROPPED_NEVER_FETCHED, ShutdownReport
from kvxferd.transfer.session import SliceState, TxSession
from kvxferd.transfer.waiters import Once
from kvxferd.transfer.worker import STOP, Peer

if TYPE_CHECKING:
    from kvxferd.transfer.sender.api import Sender

log = logging.getLogger("kvxferd.sender")


class Drain:
    """The bounded shutdown of ``sender`` and what its drain dropped."""

    def __init__(self, sender: Sender) -> None:
        self._s = sender
        self.stats = sender.stats
        self._once: Once[ShutdownReport] = Once()

    def shutdown(self, timeout: float | None = None) -> ShutdownReport:
        """Drain up to drain_timeout, end what is left, join, deregister; bounded.

        Safe to call again and from several threads: a later call waits (within its own
        bound) for the first and returns the same report, or an incomplete one if the
        first has not finished by then.
        """
        s = self._s
        total = s.settings.deadlines.shutdown_timeout_ms / 1000 if timeout is None else timeout
        t0 = time.monotonic()
        report = self._once.run(lambda: self._shutdown(t0, total), total)
        if report is None:  # another call's shutdown is still running (or failed)
            never, cut, doubt = self.counts_now()
            return ShutdownReport(
                drain_complete=False,
                drained=False,
                writes_in_doubt=s.writes_in_flight(),
                threads_joined=False,
                elapsed_s=time.monotonic() - t0,
                never_fetched=never,
                transfers_cut=cut,
                requests_in_doubt=doubt,
            )
        return report

    def end_by_engine(self, session: TxSession, what: str) -> bool:
        """The engine cancels or closes ``session``: cancelled, or during a drain, dropped by it."""
        if self._s._draining.is_set():
            # An engine lets go of a request during a drain because the daemon (or the engine
            # with it) is stopping: the drain dropped it, and the outcome and count say so.
            return self._drain_end(session, f"{what} by the engine during the drain")
        return session.cancel(Reason.CANCELLED, f"{what} by the engine")

    def _drain_end(self, session: TxSession, detail: str) -> bool:
        """End an open request for the drain (failed/shutting_down) and count it."""
        if not session.fail(Reason.SHUTTING_DOWN, detail):
            return False  # it had ended by itself
        # No fetch can attach once the outcome is committed: the slices are final here.
        if session.slices():
            self.stats.add("drain_dropped_cut")
        else:
            self.stats.add("drain_dropped_never_fetched")
        return True

    def open_requests(self) -> tuple[int, int]:
        """Open requests: (published and not fetched yet, with a fetch attached)."""
        s = self._s
        with s._lock:
            sessions = [x for x in s.published.sessions.values() if not x.ended]
        unfetched = sum(1 for x in sessions if not x.slices())
        return unfetched, len(sessions) - unfetched

    def counts_now(self) -> tuple[int, int, int]:
        """(never fetched, transfers cut, in doubt) if the process ended now: dropped so far
        plus what is still open, and the requests with a write in flight."""
        s = self._s
        unfetched, attached = self.open_requests()
        with s._lock:
            doubt = sum(1 for x in s.published.sessions.values() if x.writes_in_flight > 0)
        return (
            self.stats.get(DROPPED_NEVER_FETCHED) + unfetched,
            self.stats.get(DROPPED_CUT) + attached,
            doubt,
        )

    def reply_shared(self, peer: Peer, msg: wire._Msg) -> None:
        try:
            self._s._shared.send(
                peer.result_endpoint, wire.encode(msg, peer.version), peer.identity
            )
        except SendTimeout:
            self.stats.add("send_timeouts")
        except zmq.ZMQError as e:
            self.stats.add("send_errors")
            log.warning("message to %s dropped: %s", peer.receiver_id, e)

    def _shutdown(self, t0: float, total: float) -> ShutdownReport:
        s = self._s
        d = s.settings.deadlines
        deadline = t0 + total
        join_reserve = min(1.0, 0.2 * total)  # the drain must leave time to join the threads
        drain_deadline = min(t0 + d.drain_timeout_ms / 1000, deadline - join_reserve)
        if s.adopt is not None:  # requests moving here publish before publishing is refused
            s.adopt.finish_moves(drain_deadline)
        with s._lock:  # publish and parking check the flag under this lock: none slips past
            s._draining.set()
            parked = s.parked.clear()
        # 1. fetches parked for a request never published: nothing can publish it any more
        for p in parked:
            if time.monotonic() >= deadline - join_reserve:
                self.stats.add("shutdown_refusals_skipped")
                continue
            self.stats.add(f"rejected_{Reason.DRAINING}")
            self.reply_shared(
                p.peer,
                wire.Result(
                    request_id=p.msg.request_id,
                    fetch_id=p.msg.fetch_id,
                    status="failed",
                    reason=Reason.DRAINING,
                    detail="sender is draining: request not published here",
                ),
            )
        # 1b. hand what no fetch touched yet to another sender (handover.py)
        handover = s.handover
        handover.offer(drain_deadline)
        unfetched, attached = self.open_requests()
        if unfetched or attached:
            log.info(
                "draining: %d published request%s not fetched yet, %d transfer%s open; "
                "waiting up to %.1f s",
                unfetched,
                "" if unfetched == 1 else "s",
                attached,
                "" if attached == 1 else "s",
                max(0.0, drain_deadline - time.monotonic()),
            )

        # 2. wait for published requests to be fetched and attached fetches to finish
        def open_work() -> bool:
            with s._lock:
                return any(
                    not x.ended
                    or any(sl.state in (SliceState.QUEUED, SliceState.WRITING) for sl in x.slices())
                    for x in s.published.sessions.values()
                )

        busy = open_work()  # checked once even when drain_timeout_ms is 0
        while busy and time.monotonic() < drain_deadline:
            time.sleep(0.01)  # poll: no event covers "every slice of every session"
            handover.settle()
            busy = open_work()
        handover.settle()
        handover.give_up()
        # 2b. moved requests: tell the receivers, answer redirects for a short window
        handover.tell_and_wait(deadline - join_reserve)
        # 3. the drain deadline: end what is still open; workers refuse its queued writes
        with s._lock:
            sessions = list(s.published.sessions.values())
        for x in sessions:
            if not x.ended:
                self._drain_end(x, "still open at the drain deadline (drain_timeout_ms)")
        # 4. stop threads, each join bounded by what is left
        if s.adopt is not None:  # requests adopted from another sender: its own receiver
            s.adopt.close(max(0.0, deadline - time.monotonic() - join_reserve / 2))
        for w in s._workers:
            w.queue.put(STOP)
        s._stopping.set()
        joined = True
        for t in [s.listener.thread, *(w.thread for w in s._workers)]:
            if t.is_alive() or not s._started:
                if s._started:
                    t.join(max(0.0, deadline - time.monotonic()))
                joined = joined and not t.is_alive()
        if not s._started:
            s.listener.close_unstarted()
        elif joined:
            s.io.close()
        s._shared.close_all()
        # 5. deregister only when no write can touch the memory
        # Workers still inside a bounded send cannot post: every session refuses admission now.
        s.probes.close(max(0.0, deadline - time.monotonic()))
        in_flight = sum(x.writes_in_flight for x in sessions)
        in_doubt = sum(1 for x in sessions if x.writes_in_flight > 0)
        if in_doubt:
            self.stats.add("drain_dropped_in_doubt", in_doubt)
        if in_flight == 0 and s.probes.in_flight() == 0:
            s.dataplane.close()
            if s._owns_pool:
                s.pool.close()
        never, cut = self.stats.get(DROPPED_NEVER_FETCHED), self.stats.get(DROPPED_CUT)
        report = ShutdownReport(
            drain_complete=never == 0 and cut == 0,
            drained=in_flight == 0,
            writes_in_doubt=in_flight,
            threads_joined=joined,
            elapsed_s=time.monotonic() - t0,
            never_fetched=never,
            transfers_cut=cut,
            requests_in_doubt=in_doubt,
            moved=handover.moved,
        )
        log.info("sender shutdown: %s", report)
        return report
