"""The sender (context side): a ROUTER listener, N workers, and the requests the engine published.

Threads and what each owns::

    thread              owns                                does
    ------------------  ----------------------------------  -------------------------------------------
    kvxferd-listener    the ROUTER socket; what the io      decodes and validates every message (a
                        hooks hand it (the engine           receiver's batch frame by frame); REGISTER
                        gateway's socket and calls,         (result endpoint checked, compatibility, NIXL
                        iohooks.py); the inline worker      metadata; a new receiver id at a known result
                        (its lanes, writes in flight and    endpoint replaces that peer; a full table
                        DEALERs), which it drives each      evicts the longest-idle peer); REQUEST_DATA
                        turn                                (deadline from timeout_ms and deadline_unix_ms;
                                                            attach to a session or park until publish,
                                                            queue on the pair's lane: ``_lane_for``);
                                                            CANCEL (end admission, ack through the lane);
                                                            an engine's publish (inline); expires pending
                                                            fetches and unfetched requests (a heap of TTL
                                                            deadlines: cost ~ what expires)
    kvxferd-worker-i    its queue, lanes, writes in flight, the requests over inline_write_max_bytes:
                        its own DEALER + outbox per         admits each write (or refuses it), posts the
                        receiver result endpoint            NIXL WRITE (slices of one receiver queued
                                                            together coalesce into one) and polls every
                                                            write in flight each turn (one lane per
                                                            receiver: a frozen receiver holds only its
                                                            own lane); exactly one notification or Result
                                                            per slice (see worker.py)
    API callers         nothing long-lived                  publish / cancel / close / shutdown; publish
                                                            hands refusals to workers and never sends;
                                                            shutdown's parked refusals go through the
                                                            SharedDealerPool, bounded by its deadline

The path of one small request, all on the listener (issue 22): the engine's publish
(gateway -> ``publish``), the receiver's RequestData (``_handle`` -> ``_on_request`` ->
``_attach_locked`` -> the inline worker's lane), its WRITE posted and polled to DONE
(``Worker.step``: ``_post`` / ``_post_many``, ``_poll_writes``), the done notification
riding on that WRITE, and the engine's outcome (the session's completion -> the gateway's
reply, flushed at the end of the turn). No other thread is woken.

``_lock`` (the registry lock) guards ``_live``, ``_sessions``, ``_fetches``,
``_parked`` (parked.py), ``_peers``, ``_last_at`` and ``_ttl_heap``. Session state has its own lock
(see session.py); the registry lock is never taken while a session lock is held.
``agents`` (peer_agents.py, its own lock) counts the writes in flight per NIXL peer and
keeps the peers waiting to be removed and the incarnations gone: a peer that is
evicted, replaced or invalidated loses its NIXL remote agent (and prepared lists) only
once no write toward it is in flight (the worker that ends the last one removes it).

Receivers are keyed by incarnation (``receiver_id`` = name-uuid, also their NIXL agent's
name), never by address. Which peer state changes how::

    event                                   what the sender does
    --------------------------------------  ------------------------------------------------
    Register, new receiver_id at the        the old incarnation is gone: its parked fetches
    result endpoint of a registered (or     dropped, its open fetches end peer_restarted, no
    invalidated) incarnation                write starts and no message is sent for it, its
                                            DEALERs closed, NIXL agent removed when no write
                                            is in flight (``_end_incarnation``)
    a NIXL write ends ERR / is not posted   invalidated: out of ``_peers`` (next RequestData
    by NIXL                                 gets unknown_peer, the receiver registers again
                                            and its agent is loaded afresh), NIXL agent
                                            removed when no write is in flight
    peer table full                         the longest-idle peer is evicted

A session leaves ``_sessions`` once it is drained and closed, whichever comes last:
``close()`` re-reads ``drained`` after taking the session out of ``_live``, and a worker
that drains a closed session removes it (``session_drained``).

The drain (``shutdown``): publish is refused with ``draining`` from the moment it starts,
and so is a RequestData for a request not published here (parked ones get it at once);
Registers are still taken and a fetch of a request published before the drain is
attached and served. It waits, up to ``drain_timeout_ms``, until every published request
ended (fetched, or expired by its TTL) and no slice is queued or writing. What is still
open then ends ``failed``/``shutting_down``, and so does a request its engine closes or
cancels while the drain runs (the engine lets go because it is stopping too). Each one is
counted (``drain_dropped_never_fetched`` / ``drain_dropped_cut``, and at the end
``drain_dropped_in_doubt``: requests with a write still in flight) in ``stats`` and in
the :class:`~kvxferd.transfer.drain.ShutdownReport`.

All work of one (request, receiver) goes to one worker, so its results (and a
CancelAck after them) reach the receiver in order. The workers live in worker.py and
see the sender only through ``worker.WorkerHost``.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import itertools
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import zmq

from kvxferd.auth import ANONYMOUS, Transport, peer_identity
from kvxferd.config import SenderSettings
from kvxferd.endpoints import advertise_host, advertised, connect_problem
from kvxferd.errors import ProtocolError, Reason, RejectedError, SendTimeout
from kvxferd.stats import Stats
from kvxferd.transfer import protocol as wire
from kvxferd.transfer import views
from kvxferd.transfer.control import (
    SharedDealerPool,
    SocketLimits,
    bind_router,
    process_context,
    router_reply,
    sockets_needed,
)
from kvxferd.transfer.dataplane import DataPlane, NixlDataPlane
from kvxferd.transfer.drain import DROPPED_CUT, DROPPED_NEVER_FETCHED, ShutdownReport
from kvxferd.transfer.guard import Guard
from kvxferd.transfer.iohooks import IoHooks
from kvxferd.transfer.journal import Ending, Journal
from kvxferd.transfer.layout import check_blocks, check_layers
from kvxferd.transfer.ownership import IdentityLimits, Ownership, nixl_agent_name
from kvxferd.transfer.parked import Parked, ParkedFetches
from kvxferd.transfer.peer_agents import PeerAgents
from kvxferd.transfer.poller import Poller, tight_timers
from kvxferd.transfer.pool import IdAllocator, KvPool
from kvxferd.transfer.reshard import declared, piece_for
from kvxferd.transfer.session import Slice, SliceState, TxOutcome, TxSession, TxState
from kvxferd.transfer.topology import Topology
from kvxferd.transfer.waiters import Once
from kvxferd.transfer.worker import (
    STOP,
    TICK_S,
    AckTask,
    ForgetTask,
    Peer,
    ReplyTask,
    Worker,
    WriteTask,
)

log = logging.getLogger("kvxferd.sender")

_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,256}$")


@dataclass(frozen=True, slots=True)
class _Grant:
    """Who may fetch one published request, when its publisher said (Publish's options)."""

    token: bytes | None  # the fetch token issued at publish, or None
    allowed: frozenset[str]  # identities or receiver ids; empty: any registered receiver


class TxHandle:
    """The engine's handle on a published request."""

    def __init__(self, sender: Sender, session: TxSession) -> None:
        self._sender = sender
        self.session = session

    @property
    def request_id(self) -> str:
        return self.session.request_id

    def wait(self, timeout: float | None = None) -> TxOutcome | None:
        """The outcome once the request ended, or None after ``timeout`` seconds."""
        return self.session.completion.wait(timeout)

    async def wait_async(self, timeout: float | None = None) -> TxOutcome | None:
        """Like ``wait``, on the calling task's own event loop."""
        return await self.session.completion.wait_async(timeout)

    def cancel(self) -> bool:
        """End the request; queued writes are refused, writes in flight finish."""
        return self._sender._end_by_engine(self.session, "cancelled")

    def close(self, timeout: float | None = None) -> bool:
        """Cancel if still open, wait for in-flight writes; True when the source blocks may be reused."""
        return self._sender._close_session(self.session, timeout)


class Sender:
    """The context-side service: publish requests, serve fetches, shut down within a bound."""

    def __init__(
        self,
        settings: SenderSettings,
        *,
        pool: KvPool | None = None,
        dataplane: DataPlane | None = None,
        topology: Topology | None = None,
    ) -> None:
        # What receivers and engines are told (PoolInfo, the ready line): never a wildcard.
        svc = settings.service
        adv_host = advertise_host(svc.advertise_host, svc.advertise_interface)
        advertised(settings.listen, adv_host, "listen")  # refuses before anything is set up
        self.settings = settings
        self.stats = Stats()
        self.guard = Guard(self.stats, log)  # unexpected errors of its threads
        health = settings.health
        self.journal = Journal(
            "sender",
            peer_labels=health.metrics_peer_labels,
            window_s=health.peer_failure_window_ms / 1000,
        )
        self.sender_id = f"{settings.name}-{uuid.uuid4().hex[:12]}"
        self.pool = pool or KvPool(settings.pool, owner="tx")
        self._owns_pool = pool is None
        # This prefill rank's record (topology.py), from the constructor or the engine's
        # attach (declare_topology); set once. None: receivers need an equal pool.
        self.topology: Topology | None = None
        if topology is not None:
            self.declare_topology(topology)
        self.dataplane: DataPlane = dataplane or NixlDataPlane(
            self.sender_id,
            settings.dataplane,
            self.pool,
            stall_s=settings.deadlines.xfer_stall_timeout_ms / 1000,
            stats=self.stats,
            heard_from=self._heard_from,
        )
        # Receivers' NIXL agents: writes in flight, deferred removals, replaced incarnations.
        self.agents = PeerAgents(self.dataplane, self.stats)
        process_context(
            sockets_needed(settings.num_threads, settings.limits.max_peers)
        )  # before any socket
        self.transport = Transport(settings.security, "sender", self.stats)  # ZAP: a socket
        self.public_key = self.transport.public_key  # what Publish/PoolInfo tell engines
        self.socket_limits = SocketLimits.of(
            settings.limits, settings.deadlines, self.transport.curve
        )
        self.aux_slots = IdAllocator(settings.pool.aux_slots)
        self._shared = SharedDealerPool(self.socket_limits, settings.deadlines.send_timeout_ms)
        self._lock = threading.Lock()
        self._live: dict[str, TxSession] = {}  # request id -> open session (at most one)
        self._sessions: dict[int, TxSession] = {}  # session id -> every session not yet removed
        self._fetches: dict[tuple[str, int], TxSession] = {}  # (peer, fetch id) -> session
        self._peers: dict[bytes, Peer] = {}  # routing id -> peer
        self._peer_seen: dict[bytes, float] = {}  # routing id -> last message (listener only)
        # result endpoint -> the last incarnation registered there (registry lock), kept when
        # that peer is invalidated, so its restart is still recognised at the next Register.
        self._last_at: dict[str, Peer] = {}
        # Who owns which receiver id / NIXL agent, and what each identity holds (registry lock).
        self.ownership = Ownership(IdentityLimits.of(settings.limits))
        self._parked = ParkedFetches(self.ownership)  # fetches before their publish (parked.py)
        self._grants: dict[int, _Grant] = {}  # session id -> who may fetch it (registry lock)
        self._reap_at = 0.0  # listener only: next orphan reclaim
        self._allowed_keys: frozenset[str] = frozenset()  # listener only: the list last seen
        # (ttl deadline, session id) of every published session, earliest first. Lazy
        # deletion: an entry whose session is gone or fetched is dropped when it comes due,
        # so housekeeping costs what expires, not what is live.
        self._ttl_heap: list[tuple[float, int]] = []
        self._session_ids = itertools.count(1)
        self._draining = threading.Event()
        self._shutdown_once: Once[ShutdownReport] = Once()
        self._stopping = threading.Event()
        self._router, self.bound_endpoint = bind_router(settings.listen, self.socket_limits)
        # A ROUTER with a security mechanism has its peers authenticated (ZAP names each);
        # on a plaintext one every peer is ANONYMOUS, without asking each frame.
        self._authenticated = self._router.getsockopt(zmq.MECHANISM) != zmq.NULL
        self.endpoint = advertised(self.bound_endpoint, adv_host, "listen")  # its real port
        self.listener_progress = time.monotonic()
        # The engine gateway is served by the listener thread too (iohooks.py).
        self.io = IoHooks(self.guard)
        self._listener = threading.Thread(target=self._listen, name="kvxferd-listener", daemon=True)
        self._workers = [Worker(self, i) for i in range(settings.num_threads)]
        # Small requests are written by the listener itself (no hand-off to a worker thread):
        # see ``_worker_for``. The listener drives this worker each turn.
        self._inline_max = settings.inline_write_max_bytes
        self._inline: Worker | None = (
            Worker(self, -1, inline=True, wake=self.io.wake) if self._inline_max > 0 else None
        )
        self._started = False

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> Sender:
        if not self._started:
            self._started = True
            for w in self._workers:
                w.thread.start()
            self._listener.start()
        return self

    def __enter__(self) -> Sender:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def broken(self) -> str | None:
        """Why this sender is not live (a caught unexpected error, a dead thread), or None."""
        why = self.guard.broken()
        if why is None and self._started and not self._stopping.is_set():
            for t in [self._listener, *(w.thread for w in self._workers)]:
                if not t.is_alive():
                    return f"{t.name}: thread ended"
        return why

    def worker_progress(self) -> list[float]:
        return [w.last_progress for w in self._workers]

    def queue_depths(self) -> list[int]:
        return [w.queue.qsize() for w in self._workers]

    def writes_in_flight(self) -> int:
        with self._lock:
            sessions = list(self._sessions.values())
        return sum(s.writes_in_flight for s in sessions)

    def session_count(self) -> int:
        with self._lock:
            return len(self._sessions)

    def view(self, *, locked: bool = True) -> views.SenderView:
        """What the probes read (views.py): the registry lock held while its tables are
        copied; ``locked=False``: copied without any lock (the hang dump, best effort)."""

        def tables() -> tuple[
            list[TxSession], list[Peer], list[Parked], int, dict[str, tuple[int, int, int, int]]
        ]:
            parked = list(self._parked)
            who = {
                i: (u.peers, u.fetches, u.parked, len(u.receiver_ids))
                for i, u in self.ownership.identities().items()
            }
            return (
                list(self._sessions.values()),
                list(self._peers.values()),
                parked,
                len(self._parked),
                who,
            )

        if locked:
            with self._lock:
                sessions, peers, parked, parked_count, who = tables()
            writes, retiring = self.agents.writes(), sorted(self.agents.retiring())
        else:
            sessions, peers, parked, parked_count, who = views.copied(
                tables, lambda: ([], [], [], 0, {})
            )
            writes = views.copied(self.agents.writes_unlocked, dict)
            retiring = views.copied(self.agents.retiring_unlocked, list)
        seen: dict[bytes, float] = views.copied(
            lambda: dict(self._peer_seen), dict
        )  # the listener's, never locked

        def lane(session: TxSession, receiver_id: str) -> int:
            return self._lane_for(session, receiver_id).index

        return views.SenderView(
            self.sender_id,
            self.endpoint,
            self.draining,
            self.topology,
            self._listener.is_alive(),
            self.listener_progress,
            tuple(w.view() for w in self._workers),
            None if self._inline is None else self._inline.view(),
            views.oldest_first(
                (views.tx_session_view(s, locked, lane) for s in sessions), key=lambda s: s.created
            ),
            tuple(
                views.PeerView.of(p, seen.get(p.routing_id), writes.get(p.nixl_name, 0))
                for p in peers
            ),
            tuple(views.IdentityView(i, *counts) for i, counts in sorted(who.items())),
            tuple(views.RetiringView(n, writes.get(n, 0)) for n in retiring),
            parked_count,
            views.oldest_first(map(views.ParkedView.of, parked), key=lambda p: p.parked_at),
            self.aux_slots.free,
            self._shared.size,
            views.dataplane_closed(self.dataplane),
        )

    # -- engine API --------------------------------------------------------------------
    def declare_topology(self, topology: Topology) -> None:
        """Set this rank's record (once; the same record again is fine); INCOMPATIBLE if not.

        The record must describe the pool (block bytes, the stage's layer count): the
        receivers' descriptors are computed from it.
        """
        layout = self.pool.layout
        self.topology = declared(self.topology, topology, layout.block_bytes, layout.num_layers)

    def publish(
        self,
        request_id: str,
        block_ids: Sequence[int] | np.ndarray,
        *,
        aux: bytes | None = None,
        expected_fetches: int = 1,
        token: str | None = None,
        allowed_receivers: Sequence[str] = (),
    ) -> TxHandle:
        """Offer a finished request's blocks to receivers; RejectedError with a reason if refused.

        ``token``: only a fetch carrying it is served (compared in constant time; it
        lives as long as the request). ``allowed_receivers``: only receivers whose
        identity (CURVE key) or receiver id is listed may fetch it. Either refusal is
        ``not_authorized``.
        """
        if self._draining.is_set():
            self.stats.add("rejected_draining")
            raise RejectedError(Reason.DRAINING, "sender is draining")
        if not _REQUEST_ID.match(request_id):
            raise RejectedError(Reason.MALFORMED, "request id must be 1-256 printable ASCII chars")
        if expected_fetches < 0:
            raise RejectedError(Reason.MALFORMED, "expected_fetches must be >= 0")
        blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if blocks.size > self.settings.limits.max_blocks_per_request:
            raise RejectedError(Reason.TOO_LARGE, f"{blocks.size} blocks > max_blocks_per_request")
        check_blocks(self.pool.layout, blocks, "published blocks")
        aux_slot, aux_len = -1, 0
        if aux:
            if len(aux) > self.pool.layout.aux_slot_bytes:
                raise RejectedError(Reason.TOO_LARGE, f"aux of {len(aux)} bytes > aux_slot_bytes")
            aux_slot, aux_len = int(self.aux_slots.take(1)[0]), len(aux)
            self.pool.aux[aux_slot, :aux_len].copy_(_bytes_tensor(aux))
        session = TxSession(
            next(self._session_ids),
            request_id,
            blocks,
            expected_fetches=expected_fetches,
            aux_slot=aux_slot,
            aux_len=aux_len,
            ttl_s=self.settings.deadlines.publish_ttl_ms / 1000,
            on_end=self._journal_request,
        )
        with self._lock:
            error: RejectedError | None = None
            if self._draining.is_set():
                error = RejectedError(Reason.DRAINING, "sender is draining")
            elif request_id in self._live:
                error = RejectedError(
                    Reason.DUPLICATE, f"request {request_id} is already published"
                )
            elif len(self._sessions) >= self.settings.limits.max_live_sessions:
                error = RejectedError(Reason.BUSY, "max_live_sessions reached")
            if error is None:
                self._live[request_id] = session
                self._sessions[session.session_id] = session
                if token is not None or allowed_receivers:
                    self._grants[session.session_id] = _Grant(
                        None if token is None else token.encode(), frozenset(allowed_receivers)
                    )
                heapq.heappush(self._ttl_heap, (session.ttl_deadline, session.session_id))
                if len(self._ttl_heap) > 2 * len(self._sessions) + 1024:
                    self._compact_ttl_heap_locked()
                parked = self._parked.take(request_id)
                # Attach under the same lock: a CANCEL must find each fetch parked or attached.
                attached = [
                    self._attach_locked(session, p.peer, p.msg, p.dst, p.fetch_deadline, p.layers)
                    for p in parked
                ]
                for task in attached:  # queued under the lock too: an ack never overtakes it
                    if isinstance(task, WriteTask):
                        self._dispatch(task, _no_reply)
        if error is not None:
            if aux_slot >= 0:
                self.aux_slots.give_back([aux_slot])
            self.stats.add(f"rejected_{error.reason}")
            raise error
        self.stats.add("published")
        if expected_fetches == 0 and session.release_unread():
            self.stats.add("released_unread")
        for p, outcome in zip(parked, attached, strict=True):
            if isinstance(outcome, wire.Result):  # sent by the pair's worker, never from here
                self.stats.add(f"rejected_{outcome.reason}")
                self._lane_for(session, p.peer.receiver_id).put(ReplyTask(p.peer, outcome))
        return TxHandle(self, session)

    def _journal_request(self, session: TxSession) -> None:
        """Record how a published request ended (its one log line; see journal.py)."""
        outcome = session.outcome
        if outcome is None:  # pragma: no cover - called only after the commit
            return
        if outcome.state is TxState.COMPLETE:
            name = "done"
        elif outcome.in_doubt:
            name = "in_doubt"
        else:
            name = outcome.state.value
        slices = session.slices()
        self.journal.record(
            Ending(
                role="sender",
                kind="request",
                request_id=session.request_id,
                outcome=name,
                reason=outcome.reason.value if outcome.reason else None,
                detail=outcome.detail,
                peer=",".join(sorted({sl.result_endpoint for sl in slices})),
                fetch_id=slices[0].fetch_id if len(slices) == 1 else None,
                duration_s=time.monotonic() - session.created,
                nbytes=sum(sl.nbytes for sl in slices),
                blocks=int(session.block_ids.size),
            )
        )

    def _close_session(self, session: TxSession, timeout: float | None) -> bool:
        self._end_by_engine(session, "closed")
        if timeout is None:
            timeout = self.settings.deadlines.drain_timeout_ms / 1000
        session.drained_event.wait(timeout)
        with self._lock:
            if self._live.get(session.request_id) is session:
                del self._live[session.request_id]
        # Read again after the session left _live: a write that ended in between saw it
        # still live and left the removal to us (reading the wait's answer leaked it).
        drained = session.drained
        if drained:
            self.session_drained(session, remove=True)
        return drained

    def session_drained(self, session: TxSession, remove: bool = False) -> None:
        """Forget a drained session once the engine closed it (or it was never going to)."""
        with self._lock:
            closed = self._live.get(session.request_id) is not session
            if not (remove or closed) or session.session_id not in self._sessions:
                return
            del self._sessions[session.session_id]
            self._grants.pop(session.session_id, None)
            for sl in session.slices():
                if self._fetches.pop(sl.key, None) is not None:
                    self.ownership.count(sl.key[0], "fetches", -1)
        if session.aux_slot >= 0:
            self.aux_slots.give_back([session.aux_slot])
            session.aux_slot = -1

    # -- listener ----------------------------------------------------------------------
    def _listen(self) -> None:
        """Owner of the ROUTER socket (and of what the io hooks add: the engine socket); never
        blocks on a peer."""
        io = self.io
        io.bind_thread()
        tight_timers()
        max_bytes = self.settings.limits.max_frame_bytes
        poller: Poller | None = None
        version = -1
        delay: float | None = None
        try:
            while not self._stopping.is_set():
                try:
                    if poller is None or io.version != version:
                        poller, version = Poller(), io.version
                        poller.register(self._router, zmq.POLLIN)
                        for item, flags in io.items():
                            poller.register(item, flags)
                    delay = self._listen_turn(poller, max_bytes, delay)
                except Exception:
                    self.guard.caught("listener")
                    poller, delay = None, None
        finally:
            io.stop()  # the engine gateway answers what is outstanding and closes
            if self._inline is not None:  # as a worker thread does after STOP
                self._inline.put(STOP)
                self._inline.finish()
            self._router.close(linger=0)

    def _listen_turn(self, poller: Poller, max_bytes: int, delay: float | None) -> float | None:
        self.listener_progress = time.monotonic()
        wait_s = TICK_S if delay is None else min(TICK_S, delay)
        if self.io.pending():
            wait_s = 0.0
        ready = poller.poll(wait_s)
        now = time.monotonic()
        for item, ev in ready:
            if item is self._router:
                router = self._router
                # Bounded batch, then housekeeping. EVENTS says whether a message waits: the
                # zmq.Again that ended each batch cost more than the check (issue 22).
                for _ in range(256):
                    if not router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        break
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames, max_bytes)
            else:
                self.io.dispatch(item, ev, now)
        inline = self._inline
        wait = inline.step() if inline is not None else TICK_S
        now = time.monotonic()
        self._housekeeping(now)
        delay = self.io.turn(now)
        if inline is not None and inline.queue.qsize():
            wait = 0.0
        return wait if delay is None else min(wait, delay)

    def _handle(self, frames: Sequence[zmq.Frame | bytes], max_bytes: int) -> None:
        # The identity is the key ZAP authenticated for the connection, never a field.
        last = frames[-1]
        # With security off no handler authenticates the ROUTER's peers: every identity is
        # ANONYMOUS, and asking each frame for one raised (and caught) an error per message.
        identity = (
            peer_identity(last)
            if self._authenticated and isinstance(last, zmq.Frame)
            else ANONYMOUS
        )
        routing_id, *body = [f.bytes if isinstance(f, zmq.Frame) else f for f in frames]
        if identity and not self.transport.admits(identity):
            # ZAP checks a key once, at the handshake: a key removed from the allow-list
            # since then is refused here, message by message, on its open connection.
            self._refuse_revoked(routing_id, body, identity, max_bytes)
            return
        if len(body) > wire.MAX_BATCH:
            self.stats.add(f"rejected_{Reason.MALFORMED}")
            detail = f"{len(body)} frames in one message, at most {wire.MAX_BATCH}"
            self._reply(routing_id, wire.Reject(reason=Reason.MALFORMED, detail=detail))
            return
        # A receiver batches the messages of one turn (protocol.py): each frame is one.
        frames_: list[bytes | None] = list(body) if body else [None]
        for frame in frames_:
            self._handle_one(routing_id, frame, identity, max_bytes)

    def _refuse_revoked(
        self, routing_id: bytes, body: list[bytes], identity: str, max_bytes: int
    ) -> None:
        """Answer each message of a key removed from the allow-list, naming what it answers.

        A RequestData gets ``Result{failed, not_authorized}`` with its fetch id (nothing
        was written), a Register ``RegisterReply{ok=false, not_authorized}``, a frame that
        does not decode ``Reject{not_authorized}``. A Cancel is still honoured: it only
        gives up the key's own fetch, and its CancelAck is the receiver's proof that no
        write toward those blocks is in flight (docs/protocol.md, Reject).
        """
        detail = "this key is no longer in the allow-list"
        frames: list[bytes | None] = list(body) if 0 < len(body) <= wire.MAX_BATCH else [None]
        for frame in frames:
            try:
                msg = wire.decode_to_sender([] if frame is None else [frame], max_bytes)
            except ProtocolError:
                msg = None
            if isinstance(msg, wire.Cancel):
                self._handle_one(routing_id, frame, identity, max_bytes)
                continue
            if isinstance(msg, wire.RequestData):
                self._refuse_fetch(routing_id, None, msg, Reason.NOT_AUTHORIZED, detail)
                continue
            self.stats.add(f"rejected_{Reason.NOT_AUTHORIZED}")
            if isinstance(msg, wire.Register):
                self.stats.add("registers_refused")
                reply: wire._Msg = wire.RegisterReply(
                    ok=False, sender_id=self.sender_id, reason=Reason.NOT_AUTHORIZED, detail=detail
                )
            else:
                reply = wire.Reject(reason=Reason.NOT_AUTHORIZED, detail=detail)
            self._reply(routing_id, reply)

    def _tell_revoked(self) -> None:
        """After the allow-list changed: tell each registered peer whose key left it.

        Its receiver hears ``Reject{not_authorized}`` on its route and ends the fetches it
        has open here at once instead of at their deadlines; its Cancels are still
        honoured (``_refuse_revoked``), and no fetch of it attaches any more
        (``_check_grant_locked``). Listener thread.
        """
        with self._lock:
            routes = [
                rid
                for rid, p in self._peers.items()
                if p.identity != ANONYMOUS and not self.transport.admits(p.identity)
            ]
        for rid in routes:
            self.stats.add("peers_told_revoked")
            self._reply(
                rid,
                wire.Reject(
                    reason=Reason.NOT_AUTHORIZED,
                    detail="this key was removed from the allow-list",
                ),
            )

    def _handle_one(
        self, routing_id: bytes, frame: bytes | None, identity: str, max_bytes: int
    ) -> None:
        try:
            msg = wire.decode_to_sender([] if frame is None else [frame], max_bytes)
        except ProtocolError as e:
            self.stats.add(f"rejected_{e.reason}")
            self._reply(routing_id, wire.Reject(reason=e.reason, detail=e.detail[:1024]))
            return
        self._note_heard(routing_id, identity)
        try:
            if isinstance(msg, wire.Register):
                self._on_register(routing_id, msg, identity)
            elif isinstance(msg, wire.RequestData):
                self._on_request(routing_id, msg, identity)
            else:
                self._on_cancel(routing_id, msg, identity)
        except Exception:  # a bug on one message must not kill the listener
            self.guard.caught("listener: message")

    def _note_heard(self, routing_id: bytes, identity: str = "") -> None:
        """A receiver that sends us a message is reachable: the data plane may reconnect it.

        Only its own identity counts: another key on a route id it reuses proves nothing.
        """
        peer = self._peers.get(routing_id)  # one atomic read; the table's writers hold the lock
        if peer is not None and peer.identity == identity:
            self.agents.heard(peer.nixl_name)

    def _heard_from(self, nixl_name: str) -> float:
        """When the receiver with this NIXL name last sent us a message (monotonic; 0: never)."""
        return self.agents.heard_from(nixl_name)

    def _reply(self, routing_id: bytes, msg: wire._Msg) -> None:
        if not router_reply(self._router, routing_id, wire.encode(msg)):
            self.stats.add("reply_dropped")

    def _reply_shared(self, peer: Peer, msg: wire._Msg) -> None:
        try:
            self._shared.send(peer.result_endpoint, wire.encode(msg), peer.identity)
        except SendTimeout:
            self.stats.add("send_timeouts")
        except zmq.ZMQError as e:
            self.stats.add("send_errors")
            log.warning("message to %s dropped: %s", peer.receiver_id, e)

    def _on_register(self, routing_id: bytes, msg: wire.Register, identity: str = "") -> None:
        def refuse(reason: Reason, detail: str) -> None:
            self.stats.add(f"rejected_{reason}")
            self.stats.add("registers_refused")
            self._reply(
                routing_id,
                wire.RegisterReply(
                    ok=False, sender_id=self.sender_id, reason=reason, detail=detail
                ),
            )

        # Registers are taken while draining: a receiver may still come for a request
        # published before the drain (its fetch is served); any other fetch gets draining.
        why = connect_problem(msg.result_endpoint)
        if why:
            return refuse(Reason.BAD_ENDPOINT, f"result_endpoint {why}")
        why = wire.check_compatible(self.pool.layout, msg.layout, self.topology, msg.topology)
        if why:
            if self.topology is not None and msg.topology is not None:
                self.stats.add("topology_refused")
            return refuse(Reason.INCOMPATIBLE, why)
        piece = None
        if self.topology is not None and msg.topology is not None:
            piece = piece_for(msg.topology, self.topology)  # None: it reads nothing here
        # Read the NIXL agent's name before NIXL loads anything: loading an impostor's
        # metadata under the owner's name would replace the owner's connection details.
        agent = nixl_agent_name(msg.agent_metadata)
        unregistered: list[Peer] = []  # an earlier incarnation there, invalidated meanwhile
        replaced: list[Peer] = []
        full, evicted = False, None
        with self._lock:
            known = self._peers.get(routing_id)
            why = self._register_problem_locked(routing_id, msg, identity, agent)
            again = (
                known is not None
                and known.receiver_id == msg.receiver_id
                and known.topology == msg.topology
                and (agent is None or known.nixl_name == agent)
            )
            if why is None and not again:
                # Only one process can bind a result endpoint: a new receiver id there (or
                # on this route) means the old process is gone; what it held is released.
                replaced = [
                    p
                    for rid, p in self._peers.items()
                    if rid == routing_id or p.result_endpoint == msg.result_endpoint
                ]
                for p in replaced:
                    del self._peers[p.routing_id]
                    self._peer_seen.pop(p.routing_id, None)
                    self.ownership.release(p.receiver_id)
                last = self._last_at.get(msg.result_endpoint)
                if last is not None and last.receiver_id != msg.receiver_id:
                    if all(p is not last for p in replaced):  # invalidated, not registered
                        unregistered.append(last)
                full = (
                    known is None
                    and not replaced
                    and (
                        len(self._peers) >= self.settings.limits.max_peers
                        or self.ownership.peers_full(identity)
                    )
                )
                evicted = self._evict_idle_peer_locked(identity) if full else None
        if why is not None:
            self.stats.add("registers_refused_owner")
            log.warning("Register of %s refused: %s", msg.receiver_id, why)
            return refuse(Reason.NOT_AUTHORIZED, why)
        if again:
            self._peer_seen[routing_id] = time.monotonic()
            self.stats.add("registers_accepted")
            self._reply(routing_id, self._accepted())
            return
        for old in replaced:
            if old.receiver_id == msg.receiver_id:
                # The same process on a new route: its NIXL agent is the one it sends. A new
                # agent means it destroyed the old one (a receiver's agent per link, torn
                # down when the link went down): nothing more is written or sent toward it.
                if agent is not None and old.nixl_name != agent:
                    self._retire_peer(old, True)
                continue
            self._end_incarnation(old, msg.receiver_id)
        for old in unregistered:
            self._end_incarnation(old, msg.receiver_id, registered=False)
        if evicted is not None:
            self._forget_peer(evicted)
        elif full:
            return refuse(
                Reason.BUSY,
                "max_peers (or this identity's max_peers_per_identity) reached and every"
                " peer of this identity has work in flight",
            )
        try:
            nixl_name = self.dataplane.add_peer(msg.agent_metadata)
        except Exception as e:
            return refuse(Reason.INCOMPATIBLE, f"NIXL metadata not accepted: {e}"[:1024])
        if agent is None:
            with self._lock:
                owner = self.ownership.agent_owner(nixl_name)
            if owner is not None and owner != identity:
                # Only metadata NIXL could not name in advance (a test double's) gets here.
                self.stats.add("registers_refused_owner")
                return refuse(
                    Reason.NOT_AUTHORIZED,
                    f"NIXL agent {nixl_name} is registered by another identity",
                )
        # Registered again (after an invalidation) while writes of its last registration
        # are in flight: the agent just loaded stays; its deferred removal must not run.
        self.agents.registered(nixl_name)
        layout = msg.layout.to_layout()
        prepped = False
        try:
            # A peer read through the reshard mapping gets lists of its piece (False: it
            # gets piece descriptors per request); one that reads nothing here, none.
            if msg.topology is None or self.topology is None:
                prepped = self.dataplane.prepare_peer(
                    nixl_name, layout, msg.kv_base, msg.device, msg.device_id
                )
            elif piece is not None:
                prepped = self.dataplane.prepare_piece(
                    nixl_name,
                    piece,
                    msg.topology,
                    msg.kv_base,
                    layout.num_blocks,
                    msg.device,
                    msg.device_id,
                )
        except Exception:  # the protocol says False, never raises; a bug costs only speed
            log.exception("preparing descriptors for %s failed", msg.receiver_id)
        peer = Peer(
            msg.receiver_id,
            routing_id,
            msg.result_endpoint,
            nixl_name,
            layout,
            msg.kv_base,
            msg.aux_base,
            msg.device,
            msg.device_id,
            prepped,
            identity,  # also the key its result ROUTER presents (CURVE)
            msg.topology if self.topology is not None else None,
            piece,
        )
        with self._lock:
            self._peers[routing_id] = peer
            self.ownership.bind(identity, msg.receiver_id, nixl_name)
            self._last_at.pop(msg.result_endpoint, None)
            self._last_at[msg.result_endpoint] = peer  # newest last: the oldest go first
            while len(self._last_at) > 4 * self.settings.limits.max_peers:
                del self._last_at[next(iter(self._last_at))]
        self._peer_seen[routing_id] = time.monotonic()
        self.stats.add("peers_registered")
        self.stats.add("registers_accepted")
        log.info("receiver %s registered (results at %s)", msg.receiver_id, msg.result_endpoint)
        self._reply(routing_id, self._accepted())

    def _accepted(self) -> wire.RegisterReply:
        """The reply to an accepted Register: it carries this rank's record, if any."""
        return wire.RegisterReply(ok=True, sender_id=self.sender_id, topology=self.topology)

    def _register_problem_locked(
        self, routing_id: bytes, msg: wire.Register, identity: str, agent: str | None
    ) -> str | None:
        """Why ``identity`` may not register ``msg`` on this route (registry lock held), or None.

        Another identity's receiver id, NIXL agent, route or result endpoint is never
        taken over: registering there would end, evict or redirect that identity's peer.
        """
        why = self.ownership.register_problem(identity, msg.receiver_id, agent)
        if why is not None:
            return why
        known = self._peers.get(routing_id)
        if known is not None and known.identity != identity:
            return "this connection's route is registered by another identity"
        for p in self._peers.values():
            if p.result_endpoint == msg.result_endpoint and p.identity != identity:
                return f"result_endpoint {msg.result_endpoint} is registered by another identity"
        last = self._last_at.get(msg.result_endpoint)
        if last is not None and self.ownership.owner_of(last.receiver_id) not in (None, identity):
            return f"result_endpoint {msg.result_endpoint} is registered by another identity"
        return None

    def _evict_idle_peer_locked(self, identity: str = "") -> Peer | None:
        """Remove ``identity``'s least recently heard-from peer that no write can still target.

        Only a peer of the registering identity is evicted: a full table never lets one
        key push another key's receiver out (registry lock held).

        A peer is idle when none of its fetches is queued, writing or in doubt and none is
        parked. Nothing can start a write toward it afterwards: fetches attach only under
        this lock, and its next RequestData meets ``unknown_peer`` (kvxferd's receiver then
        registers again). Cost: one pass over the fetches, only when the table is full.
        """
        busy: set[str] = set()
        for key, session in self._fetches.items():
            if key[0] in busy:
                continue
            sl = session.slice(key)
            if sl is not None and (
                sl.state in (SliceState.QUEUED, SliceState.WRITING, SliceState.IN_DOUBT)
                or sl.writes_in_flight > 0
            ):
                busy.add(key[0])
        busy.update(self._parked.receivers())
        idle = [
            rid
            for rid, peer in self._peers.items()
            if peer.receiver_id not in busy and peer.identity == identity
        ]
        if not idle:
            return None
        victim = min(idle, key=lambda rid: self._peer_seen.get(rid, 0.0))
        self._peer_seen.pop(victim, None)
        peer = self._peers.pop(victim)
        self.ownership.release(peer.receiver_id)
        return peer

    def _end_incarnation(self, old: Peer, new_id: str, registered: bool = True) -> None:
        """A new receiver process replaced ``old``: drop what the old one held, end its fetches.

        Its parked fetches are dropped; its open fetches end ``peer_restarted`` (a write in
        flight toward it still holds the session undrained until NIXL returns); no write
        starts toward it and no Result is sent for it (``peer_gone``); its NIXL agent and
        prepared list go once no write toward it is in flight; the workers' DEALERs to its
        endpoint are closed without linger (what they queued was for the dead process).
        ``registered``: False for an incarnation invalidated earlier (already retired).
        """
        with self._lock:
            self._parked.drop_receiver(old.receiver_id)
            open_fetches = [(k, s) for k, s in self._fetches.items() if k[0] == old.receiver_id]
        if registered:
            self._retire_peer(old, gone=True)
        else:
            self.agents.mark_gone(old.nixl_name)
        detail = f"receiver {old.receiver_id} restarted (now {new_id})"
        ended = 0
        for key, session in open_fetches:
            sl = session.slice(key)
            if sl is not None and sl.state in (SliceState.QUEUED, SliceState.WRITING):
                session.fail_slice(sl, Reason.PEER_RESTARTED, detail)
                session.fail(Reason.PEER_RESTARTED, detail)
                ended += 1
        for i, w in enumerate(self._all_workers()):
            w.put(ForgetTask(old.result_endpoint, shared=i == 0, drop=True))
        self.stats.add("peers_replaced")
        if ended:
            self.stats.add("fetches_ended_peer_restarted", ended)
        log.info(
            "receiver %s replaced by %s: %d open fetch%s ended peer_restarted",
            old.receiver_id,
            new_id,
            ended,
            "" if ended == 1 else "es",
        )

    def peer_failed(self, peer: Peer, detail: str) -> None:
        """A transport error toward ``peer`` (a NIXL write error): forget its registration.

        Its next RequestData meets ``unknown_peer`` and kvxferd's receiver registers again:
        a fresh NIXL agent load (the old one is removed once no write toward it is in
        flight). Other fetches of that peer already queued go on as before.
        """
        with self._lock:
            if self._peers.get(peer.routing_id) is not peer:
                return  # already replaced, evicted or invalidated
            del self._peers[peer.routing_id]
            self._peer_seen.pop(peer.routing_id, None)
            self.ownership.release(peer.receiver_id)
        self.stats.add("peers_invalidated")
        log.warning("receiver %s invalidated after a transport error: %s", peer.receiver_id, detail)
        self._retire_peer(peer)

    # -- peers' NIXL state: never removed under a write (peer_agents.py) ----------------
    def peer_write_started(self, peer: Peer) -> bool:
        """Count a write toward ``peer``; False (nothing counted) when that incarnation is gone."""
        return self.agents.write_started(peer.nixl_name)

    def peer_gone(self, peer: Peer) -> bool:
        """True when a newer incarnation replaced ``peer`` (nothing is sent or written to it)."""
        return self.agents.is_gone(peer.nixl_name)

    def peer_write_ended(self, peer: Peer) -> None:
        self.agents.write_ended(peer.nixl_name)

    def _retire_peer(self, peer: Peer, gone: bool = False) -> None:
        """Release the peer's NIXL remote agent and prepared list once no write uses them."""
        self.agents.retire(peer.nixl_name, gone)

    def forget_shared(self, endpoint: str) -> None:
        self._shared.forget(endpoint)

    def _forget_peer(self, peer: Peer, reclaimed: bool = False) -> None:
        """Release what an evicted (or reclaimed) peer held: its NIXL agent and DEALERs to it."""
        self._retire_peer(peer)
        with self._lock:
            if self._last_at.get(peer.result_endpoint) is peer:
                del self._last_at[peer.result_endpoint]
            still_used = any(
                p.result_endpoint == peer.result_endpoint for p in self._peers.values()
            )
        if not still_used:  # the listener never waits on a socket: the workers close them
            for i, w in enumerate(self._all_workers()):
                w.put(ForgetTask(peer.result_endpoint, shared=i == 0))
        if reclaimed:
            self.stats.add("peers_reclaimed")
            log.info("receiver %s reclaimed: idle past orphan_ttl_ms", peer.receiver_id)
            return
        self.stats.add("peers_evicted")
        log.info("receiver %s evicted: peer table full, it was the longest idle", peer.receiver_id)

    def _on_request(self, routing_id: bytes, msg: wire.RequestData, identity: str = "") -> None:
        with self._lock:
            peer = self._peers.get(routing_id)
        if peer is None:
            return self._refuse_fetch(routing_id, None, msg, Reason.UNKNOWN_PEER, "REGISTER first")
        if peer.identity != identity:  # another key's connection under a route id of this peer
            self.stats.add("messages_refused_identity")
            return self._refuse_fetch(
                routing_id,
                None,
                msg,
                Reason.NOT_AUTHORIZED,
                "this route belongs to another identity",
            )
        self._peer_seen[routing_id] = time.monotonic()
        dst = np.asarray(msg.dst_blocks, dtype=np.int64)
        try:
            if dst.size > self.settings.limits.max_blocks_per_request:
                raise RejectedError(Reason.TOO_LARGE, "too many blocks")
            check_blocks(peer.layout, dst, "destination blocks")
            if peer.topology is not None:
                layers = piece_layers(peer, msg.layer_begin, msg.layer_end)
            else:
                check_layers(
                    self.pool.layout, msg.layer_begin, msg.layer_end or self.pool.layout.num_layers
                )
                layers = (msg.layer_begin, msg.layer_end or self.pool.layout.num_layers)
            if msg.aux_slot >= peer.layout.aux_slots:
                raise RejectedError(Reason.BAD_BLOCKS, "aux slot outside the receiver's pool")
        except RejectedError as e:
            return self._refuse_fetch(routing_id, peer, msg, e.reason, e.detail)
        now = time.monotonic()
        fetch_deadline = self._fetch_deadline(msg, now)
        if fetch_deadline <= now:  # the receiver gave up already: nothing may start for it
            return self._refuse_fetch(
                routing_id,
                peer,
                msg,
                Reason.TIMEOUT,
                "the fetch's deadline passed before it was read",
            )
        outcome: WriteTask | wire.Result | None = None
        with self._lock:
            key = (peer.receiver_id, msg.fetch_id)
            if key in self._fetches or self._parked.holds(key):
                refusal: tuple[Reason, str] | None = (Reason.DUPLICATE, "fetch id in use")
            elif (session := self._live.get(msg.request_id)) is not None:
                refusal = None  # while draining too: the drain waits for published requests
                outcome = self._attach_locked(session, peer, msg, dst, fetch_deadline, layers)
            elif self._draining.is_set():  # nothing can be published here any more
                refusal = (Reason.DRAINING, "sender is draining: request not published here")
            elif len(self._parked) >= self.settings.limits.max_pending_fetches:
                refusal = (Reason.BUSY, "max_pending_fetches reached")
            elif (why := self.ownership.may_add(peer.receiver_id, "parked")) is not None:
                refusal = (Reason.BUSY, why)
            else:
                refusal = None
                ttl = self.settings.deadlines.pending_fetch_ttl_ms / 1000
                self._parked.park(
                    msg.request_id,
                    Parked(peer, msg, dst, min(now + ttl, fetch_deadline), fetch_deadline, layers),
                )
        if refusal is not None:
            return self._refuse_fetch(routing_id, peer, msg, *refusal)
        if outcome is None:
            self.stats.add("fetches_parked")
            return None
        self._dispatch(outcome, lambda m: self._reply(routing_id, m))
        return None

    def _fetch_deadline(self, msg: wire.RequestData, now: float) -> float:
        """When the receiver gives up on ``msg`` (monotonic): no write of it starts later.

        ``timeout_ms`` counts from arrival; ``deadline_unix_ms`` (the receiver's clock, widened
        by ``clock_skew_ms``) also holds when a frozen or slow sender reads the fetch late.
        """
        deadline = now + msg.timeout_ms / 1000
        if msg.deadline_unix_ms > 0:
            left_ms = (
                msg.deadline_unix_ms + self.settings.deadlines.clock_skew_ms - time.time() * 1000
            )
            deadline = min(deadline, now + left_ms / 1000)
        return deadline

    def _refuse_fetch(
        self,
        routing_id: bytes,
        peer: Peer | None,
        msg: wire.RequestData,
        reason: Reason,
        detail: str,
    ) -> None:
        self.stats.add(f"rejected_{reason}")
        result = wire.Result(
            request_id=msg.request_id,
            fetch_id=msg.fetch_id,
            status="failed",
            reason=reason,
            detail=detail[:1024],
        )
        self._reply(routing_id, result)

    def _attach_locked(
        self,
        session: TxSession,
        peer: Peer,
        msg: wire.RequestData,
        dst: np.ndarray,
        deadline: float,
        layers: tuple[int, int],
    ) -> WriteTask | wire.Result:
        """Attach a fetch to a published session (registry lock held); a task, or the refusal.

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
            notify=msg.notify,
        )
        try:
            self._check_grant_locked(session, peer, msg)
            if (why := self.ownership.may_add(peer.receiver_id, "fetches")) is not None:
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
        self._fetches[sl.key] = session
        self.ownership.count(peer.receiver_id, "fetches", +1)
        return WriteTask(session, sl, peer)

    def _check_grant_locked(self, session: TxSession, peer: Peer, msg: wire.RequestData) -> None:
        """RejectedError(not_authorized) unless ``peer`` may fetch ``session`` (registry lock held).

        The publisher's ``allowed_receivers`` names identities or receiver ids; its fetch
        token is compared in constant time and lives only as long as the request.
        """
        if peer.identity != ANONYMOUS and not self.transport.admits(peer.identity):
            # A fetch parked before its key was removed never attaches after.
            raise RejectedError(Reason.NOT_AUTHORIZED, "this key is no longer in the allow-list")
        grant = self._grants.get(session.session_id)
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

    def _dispatch(
        self, outcome: WriteTask | wire.Result, reply: Callable[[wire.Result], None]
    ) -> None:
        """Queue an attached fetch on its worker, or send its refusal (registry lock not held)."""
        if isinstance(outcome, wire.Result):
            self.stats.add(f"rejected_{outcome.reason}")
            reply(outcome)
            return
        self._lane_for(outcome.session, outcome.peer.receiver_id).put(outcome)

    def _all_workers(self) -> list[Worker]:
        return self._workers if self._inline is None else [*self._workers, self._inline]

    def _lane_for(self, session: TxSession, peer_id: str) -> Worker:
        """The worker of every task of one (request, receiver) pair, so they stay in order.

        A request of at most ``inline_write_max_bytes`` (all layers) is written by the
        listener's inline worker: its RequestData is read, its WRITE posted and (with
        these transports) completed by one thread, with no hand-off. Larger ones go to
        the ``num_threads`` workers (``_worker_for``), whose WRITEs overlap.
        """
        if self._inline is not None:
            layout = self.pool.layout
            size = int(session.block_ids.size) * layout.block_bytes * layout.num_layers
            if size + session.aux_len <= self._inline_max:
                return self._inline
        return self._worker_for(session.request_id, peer_id)

    def _worker_for(self, request_id: str, peer_id: str) -> Worker:
        """The worker thread of a (request, receiver) pair written by the workers."""
        # Not CRC32: it is affine, so with 2^k workers two receivers' workers differed by a
        # constant for every request, and 1 pair in 4 always shared one worker.
        key = f"{request_id}\x00{peer_id}".encode()
        h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        return self._workers[h % len(self._workers)]

    def _on_cancel(self, routing_id: bytes, msg: wire.Cancel, identity: str = "") -> None:
        with self._lock:
            peer = self._peers.get(routing_id)
            if peer is not None and peer.identity != identity:
                stolen: Peer | None = peer  # another key under a route id of this peer
                peer = None
            else:
                stolen = None
            if peer is not None:
                self._peer_seen[routing_id] = time.monotonic()
            if peer is None:
                session = None
            else:
                session = self._fetches.get((peer.receiver_id, msg.fetch_id))
                p = self._parked.cancel(msg.request_id, peer, msg.fetch_id)
        if stolen is not None:
            self.stats.add("messages_refused_identity")
            self.stats.add(f"rejected_{Reason.NOT_AUTHORIZED}")
            self._reply(
                routing_id,
                wire.Reject(
                    reason=Reason.NOT_AUTHORIZED, detail="this route belongs to another identity"
                ),
            )
            return
        if peer is None:
            self.stats.add(f"rejected_{Reason.UNKNOWN_PEER}")
            self._reply(
                routing_id, wire.Reject(reason=Reason.UNKNOWN_PEER, detail="CANCEL before REGISTER")
            )
            return
        self.stats.add("cancels")
        if session is None:
            if p is not None:
                self._reply(
                    routing_id,
                    wire.Result(
                        request_id=msg.request_id,
                        fetch_id=msg.fetch_id,
                        status="failed",
                        reason=Reason.CANCELLED,
                        detail="cancelled by the receiver",
                    ),
                )
            # Nothing of ours is in flight toward that fetch.
            self._reply(
                routing_id, wire.CancelAck(request_id=msg.request_id, fetch_id=msg.fetch_id)
            )
            return
        session.cancel(Reason.CANCELLED, "cancelled by the receiver")
        # The ack goes after the slice's own result, from the worker that owns the pair.
        self._lane_for(session, peer.receiver_id).put(AckTask(session, peer, msg.fetch_id))

    def _housekeeping(self, now: float) -> None:
        allow = self.transport.allow
        if allow is not None and allow.keys is not self._allowed_keys:
            self._allowed_keys = allow.keys  # replaced whole by each reload
            self._tell_revoked()
        with self._lock:
            expired = self._parked.expire(now)
            # A receiver that reconnected since its fetch parked answers on its new route
            # (a receiver id is bound to one key: ownership.py).
            routes = {q.receiver_id: rid for rid, q in self._peers.items()} if expired else {}
            due: list[TxSession] = []
            heap = self._ttl_heap
            while heap and heap[0][0] <= now:
                s = self._sessions.get(heapq.heappop(heap)[1])
                if s is not None and self._live.get(s.request_id) is s:
                    due.append(s)
        for p in expired:
            self.stats.add(f"rejected_{Reason.EXPIRED}")
            self.stats.add("parked_fetches_expired")
            self._reply(
                routes.get(p.peer.receiver_id, p.peer.routing_id),
                wire.Result(
                    request_id=p.msg.request_id,
                    fetch_id=p.msg.fetch_id,
                    status="failed",
                    reason=Reason.EXPIRED,
                    detail="request was not published in time",
                ),
            )
        for s in due:  # a session fetched before its TTL refuses to expire; its entry is gone
            if s.expire(now):
                self.stats.add("sessions_expired")
                came = len(s.slices())
                if came and came < s.expected_fetches:  # the TTL is the lease of late readers
                    self.stats.add("reader_lease_expired")
                    log.warning(
                        "request %s expired with %d of %d expected readers",
                        s.request_id,
                        came,
                        s.expected_fetches,
                    )
            elif s.lease_pending():  # a reader still writing at the lease: look again soon
                with self._lock:
                    heapq.heappush(self._ttl_heap, (now + 1.0, s.session_id))
        if now >= self._reap_at:
            self._reap_at = now + min(1.0, self.ownership.limits.orphan_ttl_s / 4)
            self._reclaim_orphans(now)

    def _reclaim_orphans(self, now: float) -> None:
        """Reclaim what identities no longer use (listener thread; see ownership.py).

        A key's registered peer not heard from for ``orphan_ttl_ms`` with nothing open or
        parked leaves the table (its next message meets ``unknown_peer`` and kvxferd's
        receiver registers again); bindings no peer used for that long are released. The
        anonymous identity of security off keeps its idle peers, as before (only a full
        table evicts them).
        """
        ttl = self.ownership.limits.orphan_ttl_s
        with self._lock:
            idle = [
                rid
                for rid, p in self._peers.items()
                if p.identity != ANONYMOUS
                and now - self._peer_seen.get(rid, now) >= ttl
                and self.ownership.unused(p.receiver_id)
            ]
            peers = [self._peers.pop(rid) for rid in idle]
            for p in peers:
                self._peer_seen.pop(p.routing_id, None)
                self.ownership.release(p.receiver_id)
            gone = self.ownership.reap()
        for p in peers:
            self._forget_peer(p, reclaimed=True)
        if gone:
            self.stats.add("bindings_reclaimed", len(gone))

    def _compact_ttl_heap_locked(self) -> None:
        """Drop entries of sessions already removed (registry lock held); amortised O(1)."""
        self._ttl_heap = [e for e in self._ttl_heap if e[1] in self._sessions]
        heapq.heapify(self._ttl_heap)

    # -- shutdown ----------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None) -> ShutdownReport:
        """Drain up to drain_timeout, end what is left, join, deregister; bounded.

        See "The drain" in the module docstring. Safe to call again and from several
        threads: a later call waits (within its own bound) for the first and returns the
        same report, or an incomplete one if the first has not finished by then.
        """
        total = self.settings.deadlines.shutdown_timeout_ms / 1000 if timeout is None else timeout
        t0 = time.monotonic()
        report = self._shutdown_once.run(lambda: self._shutdown(t0, total), total)
        if report is None:  # another call's shutdown is still running (or failed)
            never, cut, doubt = self.drain_counts_now()
            return ShutdownReport(
                drain_complete=False,
                drained=False,
                writes_in_doubt=self.writes_in_flight(),
                threads_joined=False,
                elapsed_s=time.monotonic() - t0,
                never_fetched=never,
                transfers_cut=cut,
                requests_in_doubt=doubt,
            )
        return report

    def _end_by_engine(self, session: TxSession, what: str) -> bool:
        """The engine cancels or closes ``session``: cancelled, or during a drain, dropped by it."""
        if self._draining.is_set():
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
        with self._lock:
            sessions = [s for s in self._sessions.values() if not s.ended]
        unfetched = sum(1 for s in sessions if not s.slices())
        return unfetched, len(sessions) - unfetched

    def drain_counts_now(self) -> tuple[int, int, int]:
        """(never fetched, transfers cut, in doubt) if the process ended now: dropped so far
        plus what is still open, and the requests with a write in flight."""
        unfetched, attached = self.open_requests()
        with self._lock:
            doubt = sum(1 for s in self._sessions.values() if s.writes_in_flight > 0)
        return (
            self.stats.get(DROPPED_NEVER_FETCHED) + unfetched,
            self.stats.get(DROPPED_CUT) + attached,
            doubt,
        )

    def _shutdown(self, t0: float, total: float) -> ShutdownReport:
        d = self.settings.deadlines
        deadline = t0 + total
        join_reserve = min(1.0, 0.2 * total)  # the drain must leave time to join the threads
        drain_deadline = min(t0 + d.drain_timeout_ms / 1000, deadline - join_reserve)
        with self._lock:  # publish and parking check the flag under this lock: none slips past
            self._draining.set()
            parked = self._parked.clear()
        # 1. fetches parked for a request never published: nothing can publish it any more
        for p in parked:
            if time.monotonic() >= deadline - join_reserve:
                self.stats.add("shutdown_refusals_skipped")
                continue
            self.stats.add(f"rejected_{Reason.DRAINING}")
            self._reply_shared(
                p.peer,
                wire.Result(
                    request_id=p.msg.request_id,
                    fetch_id=p.msg.fetch_id,
                    status="failed",
                    reason=Reason.DRAINING,
                    detail="sender is draining: request not published here",
                ),
            )
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
            with self._lock:
                return any(
                    not s.ended
                    or any(sl.state in (SliceState.QUEUED, SliceState.WRITING) for sl in s.slices())
                    for s in self._sessions.values()
                )

        busy = open_work()  # checked once even when drain_timeout_ms is 0
        while busy and time.monotonic() < drain_deadline:
            time.sleep(0.01)  # poll: no event covers "every slice of every session"
            busy = open_work()
        # 3. the drain deadline: end what is still open; workers refuse its queued writes
        with self._lock:
            sessions = list(self._sessions.values())
        for s in sessions:
            if not s.ended:
                self._drain_end(s, "still open at the drain deadline (drain_timeout_ms)")
        # 4. stop threads, each join bounded by what is left
        for w in self._workers:
            w.queue.put(STOP)
        self._stopping.set()
        joined = True
        for t in [self._listener, *(w.thread for w in self._workers)]:
            if t.is_alive() or not self._started:
                if self._started:
                    t.join(max(0.0, deadline - time.monotonic()))
                joined = joined and not t.is_alive()
        if not self._started:
            self._router.close(linger=0)
        elif joined:
            self.io.close()
        self._shared.close_all()
        # 5. deregister only when no write can touch the memory
        # Workers still inside a bounded send cannot post: every session refuses admission now.
        in_flight = sum(s.writes_in_flight for s in sessions)
        in_doubt = sum(1 for s in sessions if s.writes_in_flight > 0)
        if in_doubt:
            self.stats.add("drain_dropped_in_doubt", in_doubt)
        if in_flight == 0:
            self.dataplane.close()
            if self._owns_pool:
                self.pool.close()
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
        )
        log.info("sender shutdown: %s", report)
        return report


def piece_layers(peer: Peer, layer_begin: int, layer_end: int) -> tuple[int, int]:
    """The absolute layers a mapped peer's fetch writes: its piece's, inside the asked range.

    RequestData names layers of the receiver's pool (0 as the end: all of them), as
    always; its record says where they lie in the model. RejectedError when this rank
    holds nothing the peer reads in that range.
    """
    t = peer.topology
    assert t is not None
    num = t.num_stage_layers
    end = layer_end or num
    if not 0 <= layer_begin < end <= num:
        raise RejectedError(
            Reason.BAD_BLOCKS, f"layer range [{layer_begin}, {end}) outside [0, {num})"
        )
    piece = peer.piece
    if piece is None:
        raise RejectedError(
            Reason.INCOMPATIBLE, f"receiver {peer.receiver_id} reads nothing from this prefill rank"
        )
    lb = max(t.layer_begin + layer_begin, piece.layer_begin)
    le = min(t.layer_begin + end, piece.layer_end)
    if lb >= le:
        raise RejectedError(
            Reason.INCOMPATIBLE,
            f"the receiver's layers [{layer_begin}, {end}) hold nothing of this rank's "
            f"[{piece.layer_begin}, {piece.layer_end})",
        )
    return lb, le


def _bytes_tensor(data: bytes):  # type: ignore[no-untyped-def]
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _no_reply(msg: wire.Result) -> None:  # pragma: no cover - only refusals are replied to
    raise AssertionError("a queued write has no reply")
