"""The requests an engine published on a sender: by request id, session id and fetch key.

One published request's entries (its session's own states are in session.py)::

    (none)   --add (publish)----------------------------------> live: in ``live`` (by request
                                                                id), ``sessions`` (by session
                                                                id), the TTL heap; ``grants``
                                                                if its publisher named who may
                                                                fetch it
    live     --attach (a RequestData of it; refusals stay out)-> each fetch in ``fetches``
                                                                by (receiver_id, fetch_id)
    live     --unlive (the engine closed it)-------------------> closed: out of ``live``
    closed   --remove (drained and closed, whichever last)-----> gone: out of ``sessions``,
                                                                ``grants`` and ``fetches``

A request id is live at most once; a session stays in ``sessions`` until it is both
drained and closed (``Sender.session_drained``). The TTL heap holds (ttl deadline,
session id) of every published session, earliest first, with lazy deletion: an entry
whose session is gone or fetched is dropped when it comes due (``due``), so housekeeping
costs what expires, not what is live; it is compacted when it outgrows the sessions.

The table keeps each identity's fetch count in
:class:`~kvxferd.transfer.ownership.Ownership` in step (``max_fetches``): +1 at attach,
-1 when the fetch leaves with its session. It has no lock of its own: the caller holds
the sender's registry lock.
"""

from __future__ import annotations

import heapq
import hmac
import itertools
from dataclasses import dataclass

import numpy as np

from kvxferd.auth import ANONYMOUS, Transport
from kvxferd.errors import Reason, RejectedError
from kvxferd.stats import Stats
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.ownership import Ownership
from kvxferd.transfer.session import Slice, SliceState, TxSession
from kvxferd.transfer.worker import Peer, WriteTask

Key = tuple[str, int]  # (receiver_id, fetch_id)


@dataclass(frozen=True, slots=True)
class Grant:
    """Who may fetch one published request, when its publisher said (Publish's options)."""

    token: bytes | None  # the fetch token issued at publish, or None
    allowed: frozenset[str]  # identities or receiver ids; empty: any registered receiver


class Published:
    """Published requests and their fetches; the caller holds the sender's registry lock."""

    def __init__(
        self, ownership: Ownership, transport: Transport, stats: Stats, max_live_sessions: int
    ) -> None:
        self._ownership = ownership
        self._transport = transport
        self.stats = stats
        self._max_live = max_live_sessions
        self.live: dict[str, TxSession] = {}  # request id -> open session (at most one)
        self.sessions: dict[int, TxSession] = {}  # session id -> every session not yet removed
        self.fetches: dict[Key, TxSession] = {}  # (peer, fetch id) -> session
        self.grants: dict[int, Grant] = {}  # session id -> who may fetch it
        self._ttl_heap: list[tuple[float, int]] = []
        self._session_ids = itertools.count(1)

    def next_id(self) -> int:
        """A new session id (any thread: ``itertools.count`` needs no lock)."""
        return next(self._session_ids)

    def add(self, session: TxSession, grant: Grant | None, draining: bool) -> RejectedError | None:
        """Publish ``session``, or the refusal (draining, a duplicate, max_live_sessions)."""
        request_id = session.request_id
        if draining:
            return RejectedError(Reason.DRAINING, "sender is draining")
        if request_id in self.live:
            return RejectedError(Reason.DUPLICATE, f"request {request_id} is already published")
        if len(self.sessions) >= self._max_live:
            return RejectedError(Reason.BUSY, "max_live_sessions reached")
        self.live[request_id] = session
        self.sessions[session.session_id] = session
        if grant is not None:
            self.grants[session.session_id] = grant
        heapq.heappush(self._ttl_heap, (session.ttl_deadline, session.session_id))
        if len(self._ttl_heap) > 2 * len(self.sessions) + 1024:
            self._compact_ttl_heap()
        return None

    def unlive(self, session: TxSession) -> None:
        """The engine closed ``session``: its request id is free again."""
        if self.live.get(session.request_id) is session:
            del self.live[session.request_id]

    def remove(self, session: TxSession, remove: bool) -> bool:
        """Forget ``session`` once drained, if the engine closed it (or ``remove``); True if it
        was removed now."""
        closed = self.live.get(session.request_id) is not session
        if not (remove or closed) or session.session_id not in self.sessions:
            return False
        del self.sessions[session.session_id]
        self.grants.pop(session.session_id, None)
        for sl in session.slices():
            if self.fetches.pop(sl.key, None) is not None:
                self._ownership.count(sl.key[0], "fetches", -1)
        return True

    # -- fetches -------------------------------------------------------------------------
    def attach(
        self,
        session: TxSession,
        peer: Peer,
        msg: wire.RequestData,
        dst: np.ndarray,
        deadline: float,
        layers: tuple[int, int],
    ) -> WriteTask | wire.Result:
        """Attach a fetch to a published session; a task, or the refusal.

        ``dst`` is ``msg.dst_blocks`` and ``layers`` its layer range, as the listener
        converted and checked them (once).
        """
        sl = Slice(
            peer.receiver_id,
            msg.fetch_id,
            peer.result_endpoint,
            dst,
            layers[0],
            layers[1],
            msg.aux_slot,
            deadline,
            # A fetch that asks for a digest is told done by a Result carrying it.
            notify=b"" if msg.digest else msg.notify,
            digest=msg.digest,
        )
        try:
            self._check_grant(session, peer, msg)
            if (why := self._ownership.may_add(peer.receiver_id, "fetches")) is not None:
                raise RejectedError(Reason.BUSY, why)
            if dst.size != session.block_ids.size:
                raise RejectedError(
                    Reason.BAD_BLOCKS,
                    f"{dst.size} destination blocks for {session.block_ids.size} published",
                )
            session.add_slice(sl)
        except RejectedError as e:
            return wire.Result(
                request_id=msg.request_id,
                fetch_id=msg.fetch_id,
                status="failed",
                reason=e.reason,
                detail=e.detail[:1024],
            )
        self.fetches[sl.key] = session
        self._ownership.count(peer.receiver_id, "fetches", +1)
        return WriteTask(session, sl, peer)

    def _check_grant(self, session: TxSession, peer: Peer, msg: wire.RequestData) -> None:
        """RejectedError(not_authorized) unless ``peer`` may fetch ``session``.

        The publisher's ``allowed_receivers`` names identities or receiver ids; its fetch
        token is compared in constant time and lives only as long as the request.
        """
        if peer.identity != ANONYMOUS and not self._transport.admits(peer.identity):
            # A fetch parked before its key was removed never attaches after.
            raise RejectedError(Reason.NOT_AUTHORIZED, "this key is no longer in the allow-list")
        grant = self.grants.get(session.session_id)
        if grant is None:
            return
        if grant.allowed and not (
            peer.identity in grant.allowed or peer.receiver_id in grant.allowed
        ):
            self.stats.add("fetches_refused_receiver")
            raise RejectedError(
                Reason.NOT_AUTHORIZED, f"receiver {peer.receiver_id} is not in allowed_receivers"
            )
        if grant.token is not None and not hmac.compare_digest(grant.token, msg.token.encode()):
            self.stats.add("fetches_refused_token")
            raise RejectedError(
                Reason.NOT_AUTHORIZED,
                "fetch token missing or wrong" if msg.token else "this request needs a fetch token",
            )

    def fetches_of(self, receiver_id: str) -> list[tuple[Key, TxSession]]:
        """The fetches of ``receiver_id`` still attached (their sessions not removed)."""
        return [(k, s) for k, s in self.fetches.items() if k[0] == receiver_id]

    def busy_receivers(self) -> set[str]:
        """The receiver ids with a fetch queued, writing or in doubt (a write can target them).

        Cost: one pass over the fetches (only a full peer table asks).
        """
        busy: set[str] = set()
        for key, session in self.fetches.items():
            if key[0] in busy:
                continue
            sl = session.slice(key)
            if sl is not None and (
                sl.state in (SliceState.QUEUED, SliceState.WRITING, SliceState.IN_DOUBT)
                or sl.writes_in_flight > 0
            ):
                busy.add(key[0])
        return busy

    # -- the TTL --------------------------------------------------------------------------
    def due(self, now: float) -> list[TxSession]:
        """The live sessions whose TTL came (their heap entries out)."""
        due: list[TxSession] = []
        heap = self._ttl_heap
        while heap and heap[0][0] <= now:
            s = self.sessions.get(heapq.heappop(heap)[1])
            if s is not None and self.live.get(s.request_id) is s:
                due.append(s)
        return due

    def look_again(self, session: TxSession, at: float) -> None:
        """Come due again at ``at`` (a reader still writing at the lease)."""
        heapq.heappush(self._ttl_heap, (at, session.session_id))

    def _compact_ttl_heap(self) -> None:
        """Drop entries of sessions already removed; amortised O(1)."""
        self._ttl_heap = [e for e in self._ttl_heap if e[1] in self.sessions]
        heapq.heapify(self._ttl_heap)
