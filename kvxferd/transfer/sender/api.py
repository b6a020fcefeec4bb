"""The sender's facade (``Sender``): the engine API and the wiring of its parts.

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
    kvxferd-adopt       the adopted requests (adopt.py)     with ``[handover] adopt_blocks`` only: follows
                        and an embedded receiver core       the fetches of requests another sender hands
                                                            over, publishes each once done, frees its
                                                            reserved blocks when that publish ended
    API callers         nothing long-lived                  publish / cancel / close / shutdown; publish
                                                            hands refusals to workers and never sends;
                                                            shutdown's parked refusals go through the
                                                            SharedDealerPool, bounded by its deadline

The path of one small request, all on the listener (issue 22): the engine's publish
(gateway -> ``publish``), the receiver's RequestData (listener.py: ``_handle`` ->
``_on_request`` -> ``Published.attach`` -> the inline worker's lane), its WRITE posted
and polled to DONE (``Worker.step``: ``_post`` / ``_post_many``, ``_poll_writes``), the
done notification riding on that WRITE, and the engine's outcome (the session's completion
-> the gateway's reply, flushed at the end of the turn). No other thread is woken.

``_lock`` (the registry lock) guards the tables, none of which has a lock of its own:
``published`` (published.py: requests by id, session and fetch key, grants, the TTL heap),
``peers`` (peers.py), ``parked`` (parked.py) and ``ownership`` (ownership.py). Session
state has its own lock (see session.py); the registry lock is never taken while a session
lock is held. ``agents`` (peer_agents.py, its own lock) counts the writes in flight per
NIXL peer and keeps the peers waiting to be removed and the incarnations gone: a peer that
is evicted, replaced or invalidated loses its NIXL remote agent (and prepared lists) only
once no write toward it is in flight (the worker that ends the last one removes it).
Peers come and go in admission.py; the drain is drain.py.

A session leaves ``published`` once it is drained and closed, whichever comes last:
``close()`` re-reads ``drained`` after taking the session out of ``live``, and a worker
that drains a closed session removes it (``session_drained``).

All work of one (request, receiver) goes to one worker, so its results (and a
CancelAck after them) reach the receiver in order. The workers live in worker.py and
see the sender only through ``worker.WorkerHost``.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import numpy as np

from kvxferd.auth import Transport
from kvxferd.config import SenderSettings
from kvxferd.endpoints import advertise_host, advertised
from kvxferd.errors import Reason, RejectedError
from kvxferd.stats import Stats
from kvxferd.transfer import protocol as wire
from kvxferd.transfer import views
from kvxferd.transfer.control import SharedDealerPool, SocketLimits, process_context, sockets_needed
from kvxferd.transfer.dataplane import DataPlane, NixlDataPlane
from kvxferd.transfer.drain import ShutdownReport
from kvxferd.transfer.guard import Guard
from kvxferd.transfer.iohooks import IoHooks
from kvxferd.transfer.journal import Ending, Journal
from kvxferd.transfer.layout import check_blocks
from kvxferd.transfer.link_probes import LinkProbes
from kvxferd.transfer.ownership import IdentityLimits, Ownership
from kvxferd.transfer.peer_agents import PeerAgents
from kvxferd.transfer.pool import IdAllocator, KvPool
from kvxferd.transfer.reshard import declared
from kvxferd.transfer.sender.admission import Admission
from kvxferd.transfer.sender.adopt import Adopter
from kvxferd.transfer.sender.drain import Drain
from kvxferd.transfer.sender.handover import Handover
from kvxferd.transfer.sender.listener import Listener
from kvxferd.transfer.sender.parked import Parked, ParkedFetches
from kvxferd.transfer.sender.peers import PeerTable
from kvxferd.transfer.sender.published import Grant, Published
from kvxferd.transfer.sender.streams import Streams
from kvxferd.transfer.session import TxOutcome, TxSession, TxState
from kvxferd.transfer.topology import Topology
from kvxferd.transfer.worker import Peer, ReplyTask, Worker, WriteTask

log = logging.getLogger("kvxferd.sender")

_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,256}$")


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

    def progress(self, layers_ready: int) -> None:
        """A streamed publish: layers ``[0, layers_ready)`` are ready (``Sender.progress``)."""
        self._sender.streams.mark(self.session, layers_ready)

    def cancel(self, what: str = "cancelled") -> bool:
        """End the request; queued writes are refused, writes in flight finish."""
        return self._sender.drain.end_by_engine(self.session, what)

    def close(self, timeout: float | None = None) -> bool:
        """Cancel if still open, wait for in-flight writes; True when the source blocks may be reused."""
        return self._sender._close_session(self.session, timeout)


class Sender:
    """The context-side service: publish requests, serve fetches, shut down within a bound.

    The facade over the sender's parts: the engine API (publish, close, cancel), the
    wiring (settings, pool, data plane, workers), what the probes read (``view``) and
    what the workers need (``worker.WorkerHost``).
    """

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
        self.probes = LinkProbes.of(self.dataplane, self.agents, self.stats, self.guard, settings)
        # Before any socket:
        process_context(sockets_needed(settings.num_threads, settings.limits.max_peers))
        self.transport = Transport(settings.security, "sender", self.stats)  # ZAP: a socket
        self.public_key = self.transport.public_key  # what Publish/PoolInfo tell engines
        self.socket_limits = SocketLimits.of(
            settings.limits, settings.deadlines, self.transport.curve
        )
        self.aux_slots = IdAllocator(settings.pool.aux_slots)
        self._shared = SharedDealerPool(self.socket_limits, settings.deadlines.send_timeout_ms)
        # The registry lock: guards the tables below (none has a lock of its own).
        self._lock = threading.Lock()
        # Who owns which receiver id / NIXL agent, and what each identity holds.
        self.ownership = Ownership(IdentityLimits.of(settings.limits))
        self.published = Published(
            self.ownership, self.transport, self.stats, settings.limits.max_live_sessions
        )
        self.peers = PeerTable(self.ownership, settings.limits.max_peers)
        self.parked = ParkedFetches(self.ownership)  # fetches before their publish
        self._draining, self._stopping = threading.Event(), threading.Event()
        self.drain = Drain(self)
        self.handover = Handover(self)  # this drain's offer and redirects (handover.py)
        self.adopt = Adopter.of(self)  # requests other senders hand over here (adopt.py)
        self.streams = Streams(  # streamed publishes (streams.py)
            self.stats,
            lambda t: self._lane_for(t.session, t.peer.receiver_id).put(t),
            settings.deadlines.stream_stall_timeout_ms / 1000,
        )
        self.admission = Admission(self)  # Registers, on the listener thread
        self.listener = Listener(self)  # binds the ROUTER
        self.bound_endpoint = self.listener.bound_endpoint
        self.endpoint = advertised(self.bound_endpoint, adv_host, "listen")  # its real port
        # The engine gateway is served by the listener thread too (iohooks.py).
        self.io = IoHooks(self.guard)
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
            self.listener.thread.start()
        return self

    def __enter__(self) -> Sender:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self, timeout: float | None = None) -> ShutdownReport:
        """Drain up to drain_timeout, end what is left, join, deregister; bounded (drain.py)."""
        return self.drain.shutdown(timeout)

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    @property
    def listener_progress(self) -> float:
        """When the listener last started a turn (monotonic)."""
        return self.listener.progress

    def broken(self) -> str | None:
        """Why this sender is not live (a caught unexpected error, a dead thread), or None."""
        why = self.guard.broken()
        if why is None and self._started and not self._stopping.is_set():
            for t in [self.listener.thread, *(w.thread for w in self._workers)]:
                if not t.is_alive():
                    return f"{t.name}: thread ended"
        return why

    def worker_progress(self) -> list[float]:
        return [w.last_progress for w in self._workers]

    def queue_depths(self) -> list[int]:
        return [w.queue.qsize() for w in self._workers]

    def writes_in_flight(self) -> int:
        with self._lock:
            sessions = list(self.published.sessions.values())
        return sum(s.writes_in_flight for s in sessions)

    def session_count(self) -> int:
        with self._lock:
            return len(self.published.sessions)

    def open_requests(self) -> tuple[int, int]:
        """Open requests: (published and not fetched yet, with a fetch attached)."""
        return self.drain.open_requests()

    def drain_counts_now(self) -> tuple[int, int, int]:
        """(never fetched, transfers cut, in doubt) if the process ended now (drain.py)."""
        return self.drain.counts_now()

    def view(self, *, locked: bool = True) -> views.SenderView:
        """What the probes read (views.py): the registry lock held while its tables are
        copied; ``locked=False``: copied without any lock (the hang dump, best effort)."""

        def tables() -> tuple[
            list[TxSession], list[Peer], list[Parked], int, dict[str, tuple[int, int, int, int]]
        ]:
            parked = list(self.parked)
            who = {
                i: (u.peers, u.fetches, u.parked, len(u.receiver_ids))
                for i, u in self.ownership.identities().items()
            }
            return (
                list(self.published.sessions.values()),
                self.peers.peers(),
                parked,
                len(self.parked),
                who,
            )

        if locked:
            with self._lock:
                sessions, peers, parked, parked_count, who = tables()
            writes, retiring = self.agents.writes(), sorted(self.agents.retiring())
            links = self.probes.figures()
        else:
            sessions, peers, parked, parked_count, who = views.copied(
                tables, lambda: ([], [], [], 0, {})
            )
            writes = views.copied(self.agents.writes_unlocked, dict)
            retiring = views.copied(self.agents.retiring_unlocked, list)
            links = views.copied(self.probes.figures_unlocked, list)
        seen: dict[bytes, float] = views.copied(self.peers.heard_at, dict)  # never locked

        def lane(session: TxSession, receiver_id: str) -> int:
            return self._lane_for(session, receiver_id).index

        return views.SenderView(
            self.sender_id,
            self.endpoint,
            self.draining,
            self.topology,
            self.listener.thread.is_alive(),
            self.listener.progress,
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
            tuple(map(views.LinkSpeedView.of, links)),
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
        streamed: bool = False,
        adopted_ttl_s: float | None = None,
    ) -> TxHandle:
        """Offer a finished request's blocks to receivers; RejectedError with a reason if refused.

        ``token``: only a fetch carrying it is served (compared in constant time; it
        lives as long as the request). ``allowed_receivers``: only receivers whose
        identity (CURVE key) or receiver id is listed may fetch it. Either refusal is
        ``not_authorized``. ``streamed``: published with no layer ready; ``progress``
        marks them as prefill computes them (streams.py, session.py). ``adopted_ttl_s``: a
        request handed over by a draining sender, in blocks reserved for it (adopt.py).
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
        if adopted_ttl_s is None and self.adopt is not None:
            self.adopt.refuse_reserved(blocks)  # bad_blocks: kept for adopted requests
        aux_slot, aux_len = -1, 0
        if aux:
            if len(aux) > self.pool.layout.aux_slot_bytes:
                raise RejectedError(Reason.TOO_LARGE, f"aux of {len(aux)} bytes > aux_slot_bytes")
            aux_slot, aux_len = int(self.aux_slots.take(1)[0]), len(aux)
            self.pool.aux[aux_slot, :aux_len].copy_(_bytes_tensor(aux))
        session = TxSession(
            self.published.next_id(),
            request_id,
            blocks,
            expected_fetches=expected_fetches,
            aux_slot=aux_slot,
            aux_len=aux_len,
            ttl_s=adopted_ttl_s or self.settings.deadlines.publish_ttl_ms / 1000,
            on_end=self._session_ended,
            streamed=streamed,
            num_layers=self.pool.layout.num_layers,
        )
        grant = None
        if token is not None or allowed_receivers:
            grant = Grant(None if token is None else token.encode(), frozenset(allowed_receivers))
        if streamed:  # before a parked fetch attaches: each one is its reader
            self.streams.opened(session)
        with self._lock:
            error = self.published.add(session, grant, self._draining.is_set())
            if error is None:
                parked = self.parked.take(request_id)
                # Attach under the same lock: a CANCEL must find each fetch parked or attached.
                attached = [
                    self.published.attach(session, p.peer, p.msg, p.dst, p.fetch_deadline, p.layers)
                    for p in parked
                ]
                for task in attached:  # queued under the lock too: an ack never overtakes it
                    if isinstance(task, WriteTask):
                        self._dispatch(task, _no_reply)
        if error is not None:
            self.streams.discard(session)
            if aux_slot >= 0:
                self.aux_slots.give_back([aux_slot])
            self.stats.add(f"rejected_{error.reason}")
            raise error
        self.stats.add("published")
        if streamed:
            self.stats.add("streams_published")
        if expected_fetches == 0 and session.release_unread():
            self.stats.add("released_unread")
        for p, outcome in zip(parked, attached, strict=True):
            if isinstance(outcome, wire.Result):  # sent by the pair's worker, never from here
                self.stats.add(f"rejected_{outcome.reason}")
                self._lane_for(session, p.peer.receiver_id).put(ReplyTask(p.peer, outcome))
        return TxHandle(self, session)

    def progress(self, request_id: str, layers_ready: int) -> None:
        """Layers ``[0, layers_ready)`` of the streamed publish ``request_id`` hold their KV.

        Monotone; ``num_layers`` ends the stream. A bad mark (no open publish, not
        streamed, decreasing, past ``num_layers``) is counted, ends the publish failed
        (``bad_progress``) and raises RejectedError(bad_progress).
        """
        with self._lock:
            session = self.published.live.get(request_id)
        self.streams.mark(session, layers_ready)

    def _session_ended(self, session: TxSession) -> None:
        journal_ending(self.journal, session)
        if session.streamed:  # a stream still open: each fetch is refused at once
            self.streams.ended(session)

    def _close_session(self, session: TxSession, timeout: float | None) -> bool:
        self.drain.end_by_engine(session, "closed")
        if timeout is None:
            timeout = self.settings.deadlines.drain_timeout_ms / 1000
        session.drained_event.wait(timeout)
        with self._lock:
            self.published.unlive(session)
        # Read again after the session left _live: a write that ended in between saw it
        # still live and left the removal to us (reading the wait's answer leaked it).
        drained = session.drained
        if drained:
            self.session_drained(session, remove=True)
        return drained

    # -- what the workers call (worker.WorkerHost) ----------------------------------------
    def session_drained(self, session: TxSession, remove: bool = False) -> None:
        """Forget a drained session once the engine closed it (or it was never going to)."""
        with self._lock:
            if not self.published.remove(session, remove):
                return
        if session.aux_slot >= 0:
            self.aux_slots.give_back([session.aux_slot])
            session.aux_slot = -1

    def peer_failed(self, peer: Peer, detail: str) -> None:
        """A transport error toward ``peer`` (a NIXL write error): forget its registration.

        Its next RequestData meets ``unknown_peer`` and kvxferd's receiver registers again:
        a fresh NIXL agent load (the old one is removed once no write toward it is in
        flight). Other fetches of that peer already queued go on as before.
        """
        with self._lock:
            if not self.peers.invalidate(peer):
                return  # already replaced, evicted or invalidated
        self.stats.add("peers_invalidated")
        log.warning("receiver %s invalidated after a transport error: %s", peer.receiver_id, detail)
        self.agents.retire(peer.nixl_name, False)

    # peers' NIXL state: never removed under a write (peer_agents.py)
    def peer_write_started(self, peer: Peer) -> bool:
        """Count a write toward ``peer``; False (nothing counted) when that incarnation is gone."""
        return self.agents.write_started(peer.nixl_name)

    def peer_gone(self, peer: Peer) -> bool:
        """True when a newer incarnation replaced ``peer`` (nothing is sent or written to it)."""
        return self.agents.is_gone(peer.nixl_name)

    def peer_write_ended(self, peer: Peer) -> None:
        self.agents.write_ended(peer.nixl_name)

    def forget_shared(self, endpoint: str) -> None:
        self._shared.forget(endpoint)

    def _heard_from(self, nixl_name: str) -> float:
        """When the receiver with this NIXL name last sent us a message (monotonic; 0: never)."""
        return self.agents.heard_from(nixl_name)

    # -- lanes: which worker writes each (request, receiver) pair -------------------------
    def _dispatch(
        self, outcome: WriteTask | wire.Result, reply: Callable[[wire.Result], None]
    ) -> None:
        """Queue an attached fetch on its worker, or send its refusal (registry lock not held)."""
        if isinstance(outcome, wire.Result):
            self.stats.add(f"rejected_{outcome.reason}")
            reply(outcome)
            return
        if outcome.session.streamed:
            self.streams.attached(outcome)
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


def journal_ending(journal: Journal, session: TxSession) -> None:
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
    journal.record(
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


def _bytes_tensor(data: bytes):  # type: ignore[no-untyped-def]
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _no_reply(msg: wire.Result) -> None:  # pragma: no cover - only refusals are replied to
    raise AssertionError("a queued write has no reply")
