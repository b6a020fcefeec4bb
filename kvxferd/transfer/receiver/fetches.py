"""The receiver's fetch table: admission, RequestData out, cancel, fail, deadlines.

``by_id`` maps a fetch id to its RxSession from admission until no write toward its
blocks can come: open, or ended with its fence up. Then it leaves (in_doubt.py's
``maybe_forget``): forgotten, or moved to the in-doubt table. Engine threads admit
into it and everyone reads it under the receiver's ``_lock`` (the caller holds it);
the io thread alone takes fetches out. Fetch ids are a process-wide counter from a
random start, never reused (nor, in practice, reused by the next incarnation), so a
late result can never land on a newer fetch.

One fetch (session.py has its states)::

    admitted (fetch, engine thread) --StartFetch--> start (io thread): its link
       ready         -> RequestData batched on the link (sent at the turn's end)
       registering   -> waits on the link (sent once the RegisterReply comes)
       down          -> fails peer_lost (``fetches_refused_link_down``): nothing is sent
       not dialable  -> fails not_authorized / bad_endpoint
    cancel / deadline -> ended locally, fenced; its Cancel goes out if it was sent
"""

from __future__ import annotations

import itertools
import os
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvxferd.errors import Reason, RejectedError
from kvxferd.transfer import commands as cmd
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.journal import Ending
from kvxferd.transfer.layout import check_blocks, check_layers
from kvxferd.transfer.receiver.handle import RxHandle
from kvxferd.transfer.session import Fence, RxSession, RxState

if TYPE_CHECKING:
    from kvxferd.transfer.receiver.core import Receiver
    from kvxferd.transfer.receiver.links import Link

# From a random point: a restarted receiver never reuses its last incarnation's fetch ids,
# so a Result a sender still had queued for the old process can never match a new fetch.
_fetch_ids = itertools.count((int.from_bytes(os.urandom(6), "little") << 8) + 1)
_REQUEST_ID = re.compile(wire.REQUEST_ID_PATTERN)


class Fetches:
    """Open fetches (and those ended with their fence up) by fetch id."""

    def __init__(self, rx: Receiver) -> None:
        self.rx = rx
        self.by_id: dict[int, RxSession] = {}  # the receiver's _lock
        self.reregistered: set[int] = set()  # io thread only: retried after UNKNOWN_PEER

    def open_toward(self, endpoint: str) -> list[RxSession]:
        """The fetches toward ``endpoint`` not ended yet (takes the receiver's ``_lock``)."""
        with self.rx._lock:  # engine threads add to the table under this lock
            return [f for f in self.by_id.values() if f.sender_endpoint == endpoint and not f.ended]

    # -- admission (engine threads) --------------------------------------------------------
    def check_dialable(self, endpoint: str) -> None:
        """Refuse a sender endpoint from request data before anything dials it: one libzmq
        would read otherwise (``bad_endpoint``), or one ``access.dial_allow`` does not admit
        (``not_authorized``, counted ``endpoints_refused``)."""
        verdict = self.rx.dial_allow.verdict(endpoint)
        if verdict is None:
            return
        by_policy, why = verdict
        if by_policy:
            self.rx.stats.add("endpoints_refused")
            raise RejectedError(Reason.NOT_AUTHORIZED, why)
        raise RejectedError(Reason.BAD_ENDPOINT, why)

    def admit(
        self,
        request_id: str,
        sender_endpoint: str,
        block_ids: Sequence[int] | np.ndarray,
        layers: tuple[int, int] | None,
        want_aux: bool,
        timeout_ms: int | None,
        token: str = "",
        sender_key: str = "",
        digest: bool = False,
    ) -> RxHandle:
        """One fetch from one sender: checked, its aux slot taken, queued for the io thread."""
        rx = self.rx
        if rx._draining.is_set():
            raise RejectedError(Reason.DRAINING, "receiver is draining")
        if not _REQUEST_ID.match(request_id):
            raise RejectedError(Reason.MALFORMED, "request id must be 1-256 printable ASCII chars")
        self.check_dialable(sender_endpoint)
        moved_to = rx.moved.target(sender_endpoint, request_id)
        if moved_to is not None:  # its sender drained and handed it over (moved.py)
            self.check_dialable(moved_to)
            sender_endpoint, sender_key = moved_to, rx.transport.server_key_for(moved_to, "")
            rx.stats.add("moved_followed")
        blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if blocks.size > rx.settings.limits.max_blocks_per_request:
            raise RejectedError(Reason.TOO_LARGE, f"{blocks.size} blocks > max_blocks_per_request")
        check_blocks(rx.pool.layout, blocks, "destination blocks")
        lb, le = layers or (0, rx.pool.layout.num_layers)
        check_layers(rx.pool.layout, lb, le)
        aux_slot = -1
        if want_aux:
            try:
                aux_slot = int(rx.aux_slots.take(1)[0])
            except RejectedError:
                raise RejectedError(
                    Reason.BUSY,
                    f"no free aux slot ({rx.doubts.aux_quarantined} quarantined by outcomes "
                    "in doubt)",
                ) from None
        timeout_ms = timeout_ms or rx.settings.deadlines.kv_transfer_timeout_ms
        f = RxSession(
            fetch_id=next(_fetch_ids),
            request_id=request_id,
            sender_endpoint=sender_endpoint,
            dst_blocks=blocks,
            layer_begin=lb,
            layer_end=le,
            aux_slot=aux_slot,
            deadline=time.monotonic() + timeout_ms / 1000,
            token=token,
            sender_key=sender_key,
            on_end=self.journal,
            digest=digest,
        )
        # Admission is atomic with the start of a drain: shutdown sets _draining under this
        # lock and then takes its list of open fetches, so a fetch is refused or on that list.
        with rx._lock:
            if rx._draining.is_set():
                refusal = RejectedError(Reason.DRAINING, "receiver is draining")
            elif len(self.by_id) >= rx.settings.limits.max_fetches_in_flight:
                refusal = RejectedError(Reason.BUSY, "max_fetches_in_flight reached")
            else:
                self.by_id[f.fetch_id] = f
                rx.enqueue_locked(cmd.StartFetch(f))
                return RxHandle(rx, f)
        if aux_slot >= 0:
            rx.aux_slots.give_back([aux_slot])
        raise refusal

    def journal(self, f: RxSession) -> None:
        """Record how a fetch ended (its one log line; see journal.py)."""
        outcome = f.outcome
        if outcome is None:  # pragma: no cover - called only after the commit
            return
        self.rx.journal.record(
            Ending(
                role="receiver",
                kind="fetch",
                request_id=f.request_id,
                outcome=outcome.state.value,
                reason=outcome.reason.value if outcome.reason else None,
                detail=outcome.detail,
                peer=f.sender_endpoint,
                fetch_id=f.fetch_id,
                duration_s=time.monotonic() - f.started,
                nbytes=outcome.nbytes,
                blocks=int(f.dst_blocks.size),
            )
        )

    # -- the io thread ---------------------------------------------------------------------
    def start(self, f: RxSession) -> None:
        if f.ended:
            return
        links = self.rx.links
        links.removed.discard(f.sender_endpoint)  # a fetch brings a removed sender back
        link = links.open(f.sender_endpoint)
        if isinstance(link, str):
            denied = link.startswith(Reason.NOT_AUTHORIZED)  # no allowed key for the sender
            self.fail(f, Reason.NOT_AUTHORIZED if denied else Reason.BAD_ENDPOINT, link)
        elif link.down:  # nothing is sent that could put its blocks in doubt
            self.rx.stats.add("fetches_refused_link_down")
            self.fail(f, Reason.PEER_LOST, f"link to {link.endpoint} is down")
        elif link.ready and link.lost_since is None:
            self.send_request(link, f)
        elif links.get(f.sender_endpoint) is link:
            link.waiting.append(f)
        else:
            self.fail(f, Reason.PEER_LOST, "sender unreachable")

    def send_request(self, link: Link, f: RxSession) -> None:
        rx = self.rx
        if f.prefill_rank >= 0:  # a piece: its sender must be the rank it was planned for
            rec = rx.groups.records.get(link.endpoint)
            if rec is None or (rec.rank, rec.compat) != (f.prefill_rank, f.prefill_compat):
                what = "declared no topology" if rec is None else f"is prefill rank {rec.rank}"
                rx.stats.add("topology_refused")
                self.fail(
                    f,
                    Reason.INCOMPATIBLE,
                    f"sender at {link.endpoint} {what}; the fetch lists it as rank "
                    f"{f.prefill_rank} of the instance",
                )
                return
        left_s = f.deadline - time.monotonic()
        msg = wire.RequestData(
            request_id=f.request_id,
            fetch_id=f.fetch_id,
            dst_blocks=f.dst_blocks.tolist(),
            layer_begin=f.layer_begin,
            layer_end=f.layer_end,
            aux_slot=f.aux_slot,
            timeout_ms=min(max(1, int(left_s * 1000)), 3_600_000),
            deadline_unix_ms=max(1, int((time.time() + left_s) * 1000)),
            token=f.token,
            # A fetch that checks a digest learns it from its done Result (no notification).
            notify=f.nonce if rx.settings.dataplane.notifications and not f.digest else b"",
            digest=f.digest,
        )
        was_sent = f.sent
        # Marked sent now: a Cancel of this fetch goes on the same link after the batch
        # (``Links.send_cancel`` flushes it first), so the sender always sees them in order.
        f.mark_sent(link.sender_id)
        f.agent_gen = link.agent.gen if link.agent is not None else -1
        rx.links.batch(link, f, wire.encode(msg, link.version), was_sent)

    def cancel(self, f: RxSession, state: RxState, reason: Reason, detail: str) -> bool:
        rx = self.rx
        fence_s = rx.settings.deadlines.cancel_fence_ms / 1000
        if not f.end_locally(state, reason, detail, fence_s):
            return False
        rx.stats.add(f"fetches_{state}")
        link = rx.links.get(f.sender_endpoint)
        if link is not None and f in link.waiting:
            link.waiting.remove(f)
        if f.sent:
            rx.links.send_cancel(f)
        rx.doubts.maybe_forget(f)
        return True

    def fail(self, f: RxSession, reason: Reason, detail: str) -> None:
        if f.fail(reason, detail):
            self.rx.stats.add("fetches_failed")
            self.rx.stats.add(f"failed_{reason}")
        self.rx.doubts.maybe_forget(f)

    def drain_end(self, f: RxSession, detail: str) -> None:
        """End an open fetch for the drain (failed/shutting_down, fenced if sent); count it."""
        if self.cancel(f, RxState.FAILED, Reason.SHUTTING_DOWN, detail):
            self.rx.stats.add("drain_dropped_cut")

    def check_deadlines(self, now: float) -> None:
        """Groups never planned and fetches past their deadline, fences past theirs."""
        rx = self.rx
        with rx._lock:
            fetches = list(self.by_id.values())
            late = [g for g in rx.groups.unplanned.values() if now >= g.deadline]
        for g in late:
            rx.groups.end(g, RxState.TIMED_OUT, Reason.TIMEOUT, "the instance's record never came")
        for f in fetches:
            if not f.ended and now >= f.deadline:
                self.cancel(f, RxState.TIMED_OUT, Reason.TIMEOUT, "kv_transfer_timeout passed")
            elif f.fence is Fence.FENCED and f.fence_expired(now):
                rx.stats.add("fences_in_doubt")
                rx.doubts.maybe_forget(f)
