"""The receiver (generation side): fetch a published request's KV into our own blocks.

Threads and what each owns::

    thread          owns                                  does
    --------------  ------------------------------------  -----------------------------------------
    kvxferd-rx-io   the result ROUTER, one DEALER per     registers with each sender (again after
                    sender endpoint and its monitor       a reconnect), sends REQUEST_DATA (the
                    socket, the command queue, what the   turn's batch per link) / CANCEL, takes
                    io hooks hand it (the engine          Results, CancelAcks and NIXL
                    gateway's socket and calls,           notifications, enforces every deadline
                    iohooks.py)                           (register, connect refused,
                                                          kv_transfer_timeout, cancel fence),
                                                          re-asks about fetches in doubt, serves
                                                          the engine gateway
    API callers     nothing long-lived                    fetch / cancel / close: they enqueue a
                                                          command and wake the io thread (eventfd);
                                                          called on the io thread (the gateway),
                                                          the command runs in the same turn

The path of one fetch, all on the io thread (issue 22): the engine's Fetch (gateway ->
``fetch``), its RequestData (``_start_fetch`` -> ``_send_request``, flushed with the
turn's batch by ``_flush_links``), the done notification its sender's last WRITE
carried (``_take_notifications``), and the engine's outcome (the session's completion
-> the gateway's reply, flushed at the end of the turn). No other thread is woken.

``_lock`` guards ``_fetches`` (fetch id -> open RxSession, or ended with its fence
up), ``_in_doubt`` (ended in doubt, still asked about), ``_forgotten_in_doubt``,
``_aux_quarantined`` and ``_commands``; each RxSession has its own lock
(session.py). Fetch ids are a process-wide counter from a random start, never
reused (nor, in practice, reused by the next incarnation), so a late result can
never land on a newer fetch. The io thread's loop body is guarded
(guard.py): an unexpected exception is logged and counted, the thread goes on,
and ``broken()`` makes liveness fail.

A fetch completes only on its sender's word that NIXL reported its WRITEs complete: the
done notification its last WRITE carried (with the fetch's nonce, from the sender's NIXL
agent, the link's key still allowed: ``_notified_by_its_sender``), or a ``done`` Result
(``dataplane.notifications`` off, or a peer that sends no notification). On cancel or timeout the blocks
stay fenced until the sender acknowledges that no write is in flight, or until
``cancel_fence_ms`` passes; then the outcome is in doubt and the blocks (and aux
slot) must not be reused. A fetch in doubt moves to ``_in_doubt`` (bounded by
``max_fetches_in_flight``); the io thread re-sends its Cancel with a bounded
backoff (``in_doubt_retry_ms`` .. ``in_doubt_retry_max_ms``), and a
CancelAck(in_doubt=false), late or unsolicited, or a late done/failed Result
releases it.

A link (one sender endpoint) and its sender's incarnation::

    new link --Register--> waiting --RegisterReply ok--> ready
       |  every connect refused for connect_refused_ms --> dropped (waiting fetches: peer_lost)
       |  no reply within register_timeout_ms ----------> dropped (waiting fetches: timeout)
    ready --disconnected, then connected (monitor)--> Register again --> waiting
    disconnected, no RegisterReply for peer_down_ms --> down: fetches not sent fail peer_lost, sent
       ones end failed/peer_lost with their fence in doubt (a write may have been posted);
       new fetches fail peer_lost at once; libzmq redials with a backoff (reconnect_max_ms)
       and the next CONNECTED registers again; the reply makes it ready (and re-asks about
       the doubt, or a new incarnation settles it, see below)
    discovery removed the sender (lease expired) --> if the link is not connected: as down,
       and the link is closed; the endpoint is not dialled again (not even to re-ask about
       fetches in doubt) until discovery or a new fetch brings it back. A connected link
       stays (a lease expiry is no proof of death); its next disconnect closes it so.
    ready --Result failed/unknown_peer--> Register again, that fetch waits (once per fetch)
    RegisterReply with another sender_id: a new sender process. Open fetches sent to the
    old one are sent again (same fetch id) while their deadline allows, else fail
    peer_restarted; fences toward the old one are released (it is gone).

Shutdown admits no fetch once draining (``fetch`` checks under ``_lock``), waits
up to ``drain_timeout_ms`` for the open ones, ends the rest ``failed``/``shutting_down``
(so does an engine's cancel or close during the drain; each counted as
``drain_dropped_cut``), asks once more about fetches in doubt, and deregisters memory
(data plane, pool) only when no outcome is in doubt (else ``drain_dropped_in_doubt``).
"""

from __future__ import annotations

import hmac
import itertools
import logging
import math
import os
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvxferd.auth import HANDSHAKE_FAILED, Transport, handshake_kind, peer_identity
from kvxferd.config import ReceiverSettings
from kvxferd.endpoints import DialAllow, advertise_host, advertised
from kvxferd.errors import ProtocolError, Reason, RejectedError, SendTimeout
from kvxferd.stats import Stats
from kvxferd.transfer import commands as cmd
from kvxferd.transfer import protocol as wire
from kvxferd.transfer import views
from kvxferd.transfer.control import (
    SocketLimits,
    bind_router,
    connect_dealer,
    process_context,
    send_bounded,
    send_bounded_many,
    sockets_needed,
)
from kvxferd.transfer.dataplane import DataPlane, NixlDataPlane
from kvxferd.transfer.drain import DROPPED_CUT, RxShutdownReport
from kvxferd.transfer.guard import Guard
from kvxferd.transfer.iohooks import IoHooks
from kvxferd.transfer.journal import Ending, Journal
from kvxferd.transfer.layout import check_blocks, check_layers
from kvxferd.transfer.link_agents import LinkAgent, LinkAgents, SharedAgent, teardown_proves
from kvxferd.transfer.poller import Poller, tight_timers
from kvxferd.transfer.pool import IdAllocator, KvPool
from kvxferd.transfer.reshard import declared, plan_rank
from kvxferd.transfer.session import Fence, RxGroup, RxOutcome, RxSession, RxState
from kvxferd.transfer.topology import Topology, instance_ranks
from kvxferd.transfer.waiters import Once

log = logging.getLogger("kvxferd.receiver")

# From a random point: a restarted receiver never reuses its last incarnation's fetch ids,
# so a Result a sender still had queued for the old process can never match a new fetch.
_fetch_ids = itertools.count((int.from_bytes(os.urandom(6), "little") << 8) + 1)
_monitor_ids = itertools.count(1)
_REQUEST_ID = re.compile(wire.REQUEST_ID_PATTERN)
_TICK_S = 0.05
_DEADLINES_EVERY_S = 0.002  # deadlines and in-doubt re-asks are looked at this often, at most
# How often NIXL is asked for notifications while fetches are open: from this, doubling
# while nothing arrives (a notification comes tens of microseconds after the WRITE).
# A fetch sent less than _NOTIF_FRESH_S ago is looked for every _NOTIF_WAIT_FRESH_S at most:
# most notifications come within a millisecond, and a doubling that had reached 400 us
# added a third of a small request's time (issue 22).
_NOTIF_WAIT_MIN_S, _NOTIF_WAIT_MAX_S = 25e-6, 2e-3
_NOTIF_FRESH_S, _NOTIF_WAIT_FRESH_S = 0.002, 60e-6
# With at most _SPIN_OPEN fetches open, one sent less than _SPIN_S ago is looked for without
# a timed wait (the thread yields its core between looks): UCX over TCP completes the WRITE
# only while this side progresses it, and every timed wait added its wake-up to the request
# (issue 22: 0.74 -> 0.56 ms p50 at 1 in flight, CPU unchanged: the looks replace the
# wake-ups). Bounded, because on a loaded host a longer spin took the sender's core.
_SPIN_OPEN, _SPIN_S = 2, 300e-6
_NO_RECORD = "sender at {} declared no topology: a fetch from a prefill instance needs one"
_MONITORED = (
    zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | HANDSHAKE_FAILED
)


@dataclass(slots=True)
class _Link:
    """Our connection to one sender endpoint, and what its monitor told us about it."""

    endpoint: str
    dealer: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]  # libzmq's events for ``dealer`` (connected, disconnected, retried)
    register_deadline: float
    server_key: str = ""  # the key the sender must present here (CURVE verifies it); "": off
    ready: bool = False  # the last Register was answered ok
    sender_id: str = ""  # the incarnation that answered it; another one means a restart
    ever_connected: bool = False
    disconnected: bool = False  # the connection dropped; the next CONNECTED registers again
    refused_since: float | None = None  # first refused connect while never connected
    lost_since: float | None = None  # the connection dropped and is not back since then
    down: bool = False  # lost for peer_down_ms: new fetches fail peer_lost until it is back
    removed: bool = False  # discovery removed the sender while this link was connected
    waiting: list[RxSession] = field(default_factory=list)  # fetches queued until registered
    # The NIXL agent its Register names (link_agents.py); None until one is taken (a link
    # waiting for a spare sends its Register when one is ready) and after a teardown.
    agent: LinkAgent | None = None
    # RequestData frames of this turn, sent together at its end (``_flush_link``): one
    # multipart message, one wake-up of ZMQ's I/O threads and of the sender's listener.
    batch: list[tuple[RxSession, bytes, bool]] = field(default_factory=list)


class RxHandle:
    """The engine's handle on one fetch."""

    def __init__(self, receiver: Receiver, session: RxSession | RxGroup) -> None:
        self._receiver = receiver
        self.session = session

    @property
    def fetch_id(self) -> int:
        return self.session.fetch_id

    def wait(self, timeout: float | None = None) -> RxOutcome | None:
        """The outcome once the fetch ended, or None after ``timeout`` seconds."""
        return self.session.completion.wait(timeout)

    async def wait_async(self, timeout: float | None = None) -> RxOutcome | None:
        """Like ``wait``, on the calling task's own event loop."""
        return await self.session.completion.wait_async(timeout)

    def cancel(self) -> None:
        """Tell the sender to stop; the blocks stay fenced until it acknowledges."""
        self._receiver._command(cmd.Cancel(self.session))

    def close(self, timeout: float | None = None) -> bool:
        """Cancel if open; True once the destination blocks are safe to reuse.

        False while the outcome is in doubt. That can change: when the sender later
        answers, the blocks are released and ``close`` returns True (``session.reusable``
        is set then).
        """
        if not self.session.ended:
            self.cancel()
        if timeout is None:
            timeout = self._receiver.settings.deadlines.cancel_fence_ms / 1000 + 1.0
        self.session.fence_done.wait(timeout)
        return self.session.blocks_reusable


class Receiver:
    """The generation-side service: fetch requests from senders into our pool."""

    def __init__(
        self,
        settings: ReceiverSettings,
        *,
        pool: KvPool | None = None,
        dataplane: DataPlane | None = None,
        topology: Topology | None = None,
    ) -> None:
        # What senders are told (Register.result_endpoint): never a wildcard, which would
        # point them at themselves. Checked before anything is set up.
        svc = settings.service
        adv_host = advertise_host(svc.advertise_host, svc.advertise_interface)
        advertised(settings.result_endpoint, adv_host, "result_endpoint")
        self.settings = settings
        self.stats = Stats()
        self.guard = Guard(self.stats, log)  # unexpected errors of its threads
        health = settings.health
        self.journal = Journal(
            "receiver",
            peer_labels=health.metrics_peer_labels,
            window_s=health.peer_failure_window_ms / 1000,
        )
        self.receiver_id = f"{settings.name}-{uuid.uuid4().hex[:12]}"
        self.pool = pool or KvPool(settings.pool, owner="rx")
        self._owns_pool = pool is None
        # This decode rank's record (topology.py): sent in every Register; needed for a
        # fetch that names a prefill instance (sender_endpoints). Set once.
        self.topology: Topology | None = None
        if topology is not None:
            self.declare_topology(topology)
        # NIXL: one agent per sender link (link_agents.py: a link that is down is torn down,
        # which ends its doubts), or one agent shared by every link. ``dataplane`` is that
        # shared agent's data plane (None with agents per link).
        self._lock = threading.Lock()
        self._commands: deque[cmd.Command] = deque()  # from other threads (commands.py)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.agents: LinkAgents | SharedAgent
        self.dataplane: DataPlane | None = dataplane
        per_link = settings.dataplane.agent_per_link
        if dataplane is None and (
            per_link == "on"
            or (
                per_link == "auto"
                and teardown_proves(settings.dataplane.ucx_tls or os.environ.get("UCX_TLS"))
            )
        ):
            self.agents = LinkAgents(
                self.receiver_id,
                settings.dataplane,
                self.pool,
                self.stats,
                on_spare=lambda: self._command(cmd.AgentReady()),
                on_torn=lambda gen: self._command(cmd.AgentTorn(gen)),
            )
        else:
            self.dataplane = dataplane or NixlDataPlane(
                self.receiver_id, settings.dataplane, self.pool
            )
            self.agents = SharedAgent(self.dataplane)
        process_context(sockets_needed(0, settings.limits.max_peers))  # before any socket
        # Sender endpoints come from request data: only those the operator allows are dialled.
        self.dial_allow = DialAllow(settings.access.dial_allow)
        self.transport = Transport(settings.security, "receiver", self.stats)  # ZAP: a socket
        self.public_key = self.transport.public_key  # what Publish/PoolInfo tell engines
        self.socket_limits = SocketLimits.of(
            settings.limits, settings.deadlines, self.transport.curve
        )
        self.aux_slots = IdAllocator(settings.pool.aux_slots)
        self._router, self.bound_result_endpoint = bind_router(
            settings.result_endpoint, self.socket_limits
        )
        # the advertised form: sent in every Register, in PoolInfo and the ready line
        self.result_endpoint = advertised(self.bound_result_endpoint, adv_host, "result_endpoint")
        self._settled = threading.Condition(self._lock)  # notified when an in-doubt fetch resolves
        self._fetches: dict[int, RxSession] = {}
        self._in_doubt: dict[int, RxSession] = {}  # ended in doubt, still asked about (bounded)
        self._forgotten_in_doubt = 0  # fetches ended in doubt and not resolved yet
        self._aux_quarantined = 0  # aux slots held by those fetches
        # The engine gateway is served by the io thread too (iohooks.py).
        self.io = IoHooks(self.guard)
        self._notif_wait = _NOTIF_WAIT_MIN_S  # io thread only
        self._sent_at = 0.0  # io thread only: when RequestData last left
        self._io_due = 0.0  # io thread only: when the io hooks' next timer is due
        self._deadlines_at = 0.0  # io thread only: when deadlines are looked at next
        self._links: dict[str, _Link] = {}  # io thread only
        self._batched: list[_Link] = []  # io thread only: links with RequestData to send
        self._by_socket: dict[zmq.Socket[bytes], _Link] = {}  # io thread only: dealers, monitors
        self._reregistered: set[int] = set()  # io thread only: fetches retried after UNKNOWN_PEER
        # io thread only: endpoints discovery removed; not dialled (not even to re-ask about
        # a fetch in doubt) until discovery adds them again or a new fetch names one.
        self._removed: set[str] = set()
        # Instance fetches: each sender's record from its RegisterReply, the groups waiting
        # for one (io thread only), and the groups not planned yet (``_lock``).
        self._records: dict[str, Topology] = {}
        self._resolving: dict[str, list[RxGroup]] = {}
        self._unplanned: dict[int, RxGroup] = {}
        self._stopping = threading.Event()
        self._draining = threading.Event()
        self._shutdown_once: Once[RxShutdownReport] = Once()
        self.drain_complete = True  # set by shutdown(): every open fetch ended by itself
        self.io_progress = time.monotonic()
        self._io = threading.Thread(target=self._run, name="kvxferd-rx-io", daemon=True)
        self._started = False

    def start(self) -> Receiver:
        if not self._started:
            self._started = True
            self._io.start()
        return self

    def __enter__(self) -> Receiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def broken(self) -> str | None:
        """Why this receiver is not live (a caught unexpected error, a dead io thread), or None."""
        why = self.guard.broken()
        if (
            why is None
            and self._started
            and not self._stopping.is_set()
            and not self._io.is_alive()
        ):
            return f"{self._io.name}: thread ended"
        return why

    def fetches_in_flight(self) -> int:
        with self._lock:
            return len(self._fetches)

    def in_doubt(self) -> int:
        """Fetches whose outcome is in doubt: a write may still land in their blocks."""
        with self._lock:
            return self._forgotten_in_doubt

    def aux_slot_counts(self) -> tuple[int, int]:
        """(free aux slots, aux slots quarantined by fetches in doubt)."""
        return self.aux_slots.free, self._aux_quarantined

    def view(self, *, locked: bool = True) -> views.ReceiverView:
        """What the probes read (views.py): ``_lock`` held while the fetch and in-doubt tables
        are copied; ``locked=False``: copied without it (the hang dump, best effort)."""

        def tables() -> tuple[list[RxSession], list[RxSession], int, int, int]:
            return (
                list(self._fetches.values()),
                list(self._in_doubt.values()),
                self._forgotten_in_doubt,
                self._aux_quarantined,
                len(self._commands),
            )

        if locked:
            with self._lock:
                fetches, doubtful, unresolved, quarantined, queued = tables()
        else:
            fetches, doubtful, unresolved, quarantined, queued = views.copied(
                tables, lambda: ([], [], 0, 0, 0)
            )
        return views.ReceiverView(
            self.receiver_id,
            self.result_endpoint,
            self._draining.is_set(),
            self._io.is_alive(),
            self.io_progress,
            views.oldest_first((views.RxFetchView.of(f) for f in fetches), key=lambda v: v.started),
            views.InDoubtView(
                unresolved,
                views.oldest_first(
                    (views.RxFetchView.of(f) for f in doubtful), key=lambda v: v.started
                ),
            ),
            # io thread only: never locked
            tuple(map(views.LinkView.of, views.copied_values(self._links))),
            queued,
            self.aux_slots.free,
            quarantined,
            self.agents.closed,
        )

    # -- engine API --------------------------------------------------------------------
    def declare_topology(self, topology: Topology) -> None:
        """Set this rank's record (once; the same again is fine); INCOMPATIBLE if it does not
        describe the pool. Declare it before the first fetch: Registers carry it."""
        layout = self.pool.layout
        self.topology = declared(self.topology, topology, layout.block_bytes, layout.num_layers)

    def _check_dialable(self, endpoint: str) -> None:
        """Refuse a sender endpoint from request data before anything dials it: one libzmq
        would read otherwise (``bad_endpoint``), or one ``access.dial_allow`` does not admit
        (``not_authorized``, counted ``endpoints_refused``)."""
        verdict = self.dial_allow.verdict(endpoint)
        if verdict is None:
            return
        by_policy, why = verdict
        if by_policy:
            self.stats.add("endpoints_refused")
            raise RejectedError(Reason.NOT_AUTHORIZED, why)
        raise RejectedError(Reason.BAD_ENDPOINT, why)

    def fetch(
        self,
        request_id: str,
        sender_endpoint: str,
        block_ids: Sequence[int] | np.ndarray,
        *,
        layers: tuple[int, int] | None = None,
        want_aux: bool = True,
        timeout_ms: int | None = None,
        token: str = "",
        sender_key: str = "",
        sender_endpoints: Sequence[str] = (),
        tokens: Sequence[str] = (),
        sender_keys: Sequence[str] = (),
    ) -> RxHandle:
        """Ask ``sender_endpoint`` to write ``request_id`` into ``block_ids``; returns at once.

        ``sender_endpoints``: the prefill instance, one sender endpoint per prefill rank
        (index = rank); this receiver then reads what the reshard mapping gives it from
        each rank it needs (one RequestData per piece) and the fetch is done when every
        piece is. ``tokens`` / ``sender_keys``: per rank, as each rank's Publish said
        (empty: none). Needs this receiver's topology.

        ``token``: the fetch token the publisher issued (passed on in RequestData).
        ``sender_key``: the sender's public key (Z85) from the publish side; its Results
        and CancelAcks are taken only from that identity ("" with security off).
        Refusals are :class:`RejectedError` with a reason (draining, malformed,
        bad_endpoint, not_authorized, too_large, bad_blocks, busy), raised on the
        caller's thread.
        """
        try:
            if sender_endpoints:
                return self._fetch_instance(
                    request_id,
                    list(sender_endpoints),
                    block_ids,
                    layers,
                    want_aux,
                    timeout_ms,
                    list(tokens),
                    list(sender_keys),
                )
            return self._fetch(
                request_id,
                sender_endpoint,
                block_ids,
                layers,
                want_aux,
                timeout_ms,
                token,
                self._expected_sender_key(sender_endpoint, sender_key),
            )
        except RejectedError as e:
            self.stats.add(f"fetch_refused_{e.reason}")
            raise

    def _fetch(
        self,
        request_id: str,
        sender_endpoint: str,
        block_ids: Sequence[int] | np.ndarray,
        layers: tuple[int, int] | None,
        want_aux: bool,
        timeout_ms: int | None,
        token: str = "",
        sender_key: str = "",
    ) -> RxHandle:
        if self._draining.is_set():
            raise RejectedError(Reason.DRAINING, "receiver is draining")
        if not _REQUEST_ID.match(request_id):
            raise RejectedError(Reason.MALFORMED, "request id must be 1-256 printable ASCII chars")
        self._check_dialable(sender_endpoint)
        blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if blocks.size > self.settings.limits.max_blocks_per_request:
            raise RejectedError(Reason.TOO_LARGE, f"{blocks.size} blocks > max_blocks_per_request")
        check_blocks(self.pool.layout, blocks, "destination blocks")
        lb, le = layers or (0, self.pool.layout.num_layers)
        check_layers(self.pool.layout, lb, le)
        aux_slot = -1
        if want_aux:
            try:
                aux_slot = int(self.aux_slots.take(1)[0])
            except RejectedError:
                raise RejectedError(
                    Reason.BUSY,
                    f"no free aux slot ({self._aux_quarantined} quarantined by outcomes in doubt)",
                ) from None
        timeout_ms = timeout_ms or self.settings.deadlines.kv_transfer_timeout_ms
        rx = RxSession(
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
            on_end=self._journal_fetch,
        )
        # Admission is atomic with the start of a drain: shutdown sets _draining under this
        # lock and then takes its list of open fetches, so a fetch is refused or on that list.
        with self._lock:
            if self._draining.is_set():
                refusal = RejectedError(Reason.DRAINING, "receiver is draining")
            elif len(self._fetches) >= self.settings.limits.max_fetches_in_flight:
                refusal = RejectedError(Reason.BUSY, "max_fetches_in_flight reached")
            else:
                self._fetches[rx.fetch_id] = rx
                self._commands.append(cmd.StartFetch(rx))
                if not self.io.on_io_thread():  # the io thread itself runs it this turn
                    os.eventfd_write(self._wake, 1)
                return RxHandle(self, rx)
        if aux_slot >= 0:
            self.aux_slots.give_back([aux_slot])
        raise refusal

    def _fetch_instance(
        self,
        request_id: str,
        endpoints: list[str],
        block_ids: Sequence[int] | np.ndarray,
        layers: tuple[int, int] | None,
        want_aux: bool,
        timeout_ms: int | None,
        tokens: list[str],
        keys: list[str],
    ) -> RxHandle:
        """A fetch from a prefill instance: planned on the io thread once a record is known."""
        if self.topology is None:
            raise RejectedError(
                Reason.INCOMPATIBLE,
                "a fetch from a prefill instance needs this receiver's topology (declare it)",
            )
        if self._draining.is_set():
            raise RejectedError(Reason.DRAINING, "receiver is draining")
        if not _REQUEST_ID.match(request_id):
            raise RejectedError(Reason.MALFORMED, "request id must be 1-256 printable ASCII chars")
        for what, extra in (("tokens", tokens), ("sender_keys", keys)):
            if extra and len(extra) != len(endpoints):
                raise RejectedError(
                    Reason.MALFORMED, f"{len(extra)} {what} for {len(endpoints)} sender endpoints"
                )
        for ep_ in endpoints:
            self._check_dialable(ep_)
        keys = [
            self._expected_sender_key(e, keys[i] if keys else "") for i, e in enumerate(endpoints)
        ]
        blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if blocks.size > self.settings.limits.max_blocks_per_request:
            raise RejectedError(Reason.TOO_LARGE, f"{blocks.size} blocks > max_blocks_per_request")
        check_blocks(self.pool.layout, blocks, "destination blocks")
        lb, le = layers or (0, self.pool.layout.num_layers)
        check_layers(self.pool.layout, lb, le)
        aux_slot = int(self.aux_slots.take(1)[0]) if want_aux else -1
        timeout_ms = timeout_ms or self.settings.deadlines.kv_transfer_timeout_ms
        group = RxGroup(
            next(_fetch_ids),
            request_id,
            endpoints,
            blocks,
            lb,
            le,
            aux_slot,
            time.monotonic() + timeout_ms / 1000,
            tokens,
            keys,
            self._cancel_pieces,
        )
        with self._lock:
            if self._draining.is_set():  # atomic with the drain's start, as in _fetch
                refusal = RejectedError(Reason.DRAINING, "receiver is draining")
            elif len(self._fetches) + len(self._unplanned) >= (
                self.settings.limits.max_fetches_in_flight
            ):
                refusal = RejectedError(Reason.BUSY, "max_fetches_in_flight reached")
            else:
                self._unplanned[group.fetch_id] = group
                self._commands.append(cmd.StartGroup(group))
                if not self.io.on_io_thread():
                    os.eventfd_write(self._wake, 1)
                self.stats.add("instance_fetches")
                return RxHandle(self, group)
        if aux_slot >= 0:
            self.aux_slots.give_back([aux_slot])
        raise refusal

    def _cancel_pieces(self, pieces: list[RxSession]) -> None:
        """A piece of a group ended without its bytes: the others are cancelled (io thread)."""
        for p in pieces:
            self._command(cmd.CancelPiece(p))

    def _journal_fetch(self, rx: RxSession) -> None:
        """Record how a fetch ended (its one log line; see journal.py)."""
        outcome = rx.outcome
        if outcome is None:  # pragma: no cover - called only after the commit
            return
        self.journal.record(
            Ending(
                role="receiver",
                kind="fetch",
                request_id=rx.request_id,
                outcome=outcome.state.value,
                reason=outcome.reason.value if outcome.reason else None,
                detail=outcome.detail,
                peer=rx.sender_endpoint,
                fetch_id=rx.fetch_id,
                duration_s=time.monotonic() - rx.started,
                nbytes=outcome.nbytes,
                blocks=int(rx.dst_blocks.size),
            )
        )

    def on_peer_event(self, event: Any) -> None:
        """Discovery saw a sender come, change or go (its watcher thread): handled by the io thread."""
        self._command(cmd.PeerEvent(event))

    def _command(self, command: cmd.Command) -> None:
        with self._lock:
            if self._stopping.is_set():
                return  # the io thread is gone; shutdown ends every open fetch itself
            self._commands.append(command)
            if not self.io.on_io_thread():  # the io thread itself runs it later this turn
                os.eventfd_write(self._wake, 1)

    # -- io thread ---------------------------------------------------------------------
    def _run(self) -> None:
        poller: Poller | None = None
        polled: tuple[list[zmq.Socket[bytes]], int] = ([], -1)
        io = self.io
        io.bind_thread()
        tight_timers()
        delay: float | None = None
        quiet = False  # the last turn used no socket: the ZMQ EVENTS the poll saw still hold
        try:
            while not self._stopping.is_set():
                self.io_progress = time.monotonic()
                try:
                    socks = list(self._by_socket)
                    if poller is None or (socks, io.version) != polled:
                        # links or the hooks' sockets changed: rebuild the poll set
                        poller, polled = Poller(), (socks, io.version)
                        poller.register(self._router, zmq.POLLIN)
                        poller.register(self._wake, zmq.POLLIN)
                        for sock in socks:
                            poller.register(sock, zmq.POLLIN)
                        for item, flags in io.items():
                            poller.register(item, flags)
                        quiet = False
                    wait_s = _TICK_S if delay is None else min(_TICK_S, delay)
                    if self._fetches:  # fetches sent: their notifications come through NIXL
                        wait_s = min(wait_s, self._notif_wait)
                        age = time.monotonic() - self._sent_at
                        if age >= _NOTIF_FRESH_S:
                            cap = _NOTIF_WAIT_MAX_S
                        elif age < _SPIN_S and len(self._fetches) <= _SPIN_OPEN:
                            cap = 0.0
                            os.sched_yield()
                        else:
                            cap = _NOTIF_WAIT_FRESH_S
                        self._notif_wait = min(self._notif_wait * 2, cap)
                    if self._commands or io.pending():
                        wait_s = 0.0
                    ready = poller.poll(wait_s, check_zmq=not quiet)
                    if ready:
                        self._notif_wait = _NOTIF_WAIT_MIN_S
                    elif not (self._commands or io.pending()):
                        delay, quiet = self._quiet_turn()
                        continue
                    quiet = False
                    delay = self._turn(ready)
                except Exception:
                    self.guard.caught("rx-io")
                    poller = None
                    delay = None
        finally:
            io.stop()  # the engine gateway answers what is outstanding and closes
            for link in list(self._links.values()):
                self._close_link(link)
            self._router.close(linger=0)

    def _quiet_turn(self) -> tuple[float | None, bool]:
        """A turn after a wait that nothing ended: only what time alone can bring.

        Notifications (NIXL is polled), deadlines when due, the io hooks' timers when due.
        When none of them had anything, no socket was touched: returns ``(delay, True)``
        and the next poll skips the ZMQ EVENTS check. At one request in flight most turns
        are these (a fetch waits for its notification): a full turn cost three times as
        much CPU (issue 22). Otherwise it goes on as a full turn would.
        """
        now = time.monotonic()
        busy = self._deadlines(now)
        if self._take_notifications():
            self._notif_wait = _NOTIF_WAIT_MIN_S
            busy = True
        if not busy and now < self._io_due:
            return self._io_due - now, True
        self._run_commands()
        self._flush_links()
        return self._io_turn(now), False

    def _deadlines(self, now: float) -> bool:
        """Deadlines and in-doubt re-asks, when due (not every turn: they walk every open
        fetch); True when they were looked at."""
        if now < self._deadlines_at:
            return False
        self._deadlines_at = now + _DEADLINES_EVERY_S
        self._check_deadlines(now)
        self._retry_in_doubt(now)
        return True

    def _io_turn(self, now: float) -> float | None:
        """The io hooks' turn (queued calls, timers); remembers when their next timer is due."""
        delay = self.io.turn(now)
        self._io_due = math.inf if delay is None else now + delay
        return delay

    def _turn(self, ready: list[tuple[Any, int]]) -> float | None:
        """One turn of the io thread: commands, sockets, deadlines, NIXL progress, hooks.

        Returns how soon the hooks need the next turn (None: no timer of theirs is due).
        """
        now = time.monotonic()
        events: dict[Any, int] = {}
        for sock, ev in ready:
            if sock is self._wake or (isinstance(sock, int) and sock == self._wake):
                try:
                    os.eventfd_read(self._wake)
                except BlockingIOError:
                    pass
            elif not self.io.dispatch(sock, ev, now):
                events[sock] = ev
        self._run_commands()
        for sock in events:
            link = self._by_socket.get(sock)
            if link is not None and sock is link.monitor:
                self._on_monitor(link)
            elif sock is self._router or link is not None:
                self._drain_socket(sock)
        self._run_commands()  # what the engine gateway started this turn goes out now
        self._flush_links()
        now = time.monotonic()
        self._deadlines(now)
        if self._take_notifications():
            self._notif_wait = _NOTIF_WAIT_MIN_S
        self._flush_links()
        return self._io_turn(now)

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                command = self._commands.popleft()
            match command:
                case cmd.StartFetch(rx):
                    self._start_fetch(rx)
                case cmd.StartGroup(group):
                    self._start_group(group)
                case cmd.CancelPiece(rx):
                    self._cancel(
                        rx, RxState.CANCELLED, Reason.CANCELLED, "another piece ended first"
                    )
                case cmd.Cancel(RxGroup() as group) | cmd.DrainEnd(RxGroup() as group):
                    # the engine cancels (or the drain ends) a group
                    self._end_group(
                        group, RxState.CANCELLED, Reason.CANCELLED, "cancelled by the engine"
                    )
                case cmd.DrainEnd(RxSession() as rx):  # shutdown: the drain deadline passed
                    self._drain_end(rx, "still open at the drain deadline (drain_timeout_ms)")
                case cmd.Cancel(RxSession() as rx) if self._draining.is_set():
                    # an engine lets go because it is stopping too
                    self._drain_end(rx, "cancelled by the engine during the drain")
                case cmd.Cancel(RxSession() as rx):
                    self._cancel(rx, RxState.CANCELLED, Reason.CANCELLED, "cancelled by the engine")
                case cmd.RetryInDoubt():  # shutdown: ask about every fetch in doubt now
                    with self._lock:
                        doubtful = list(self._in_doubt.values())
                    for d in doubtful:
                        d.retry_at = 0.0
                case cmd.PeerEvent(event):
                    self._on_peer_event(event)
                case cmd.AgentReady():  # a spare NIXL agent: links waiting for one register
                    for link in list(self._links.values()):
                        if link.agent is None and not link.ready and not link.disconnected:
                            self._register(link, waited=True)
                case cmd.AgentTorn(gen):
                    self._agent_torn(gen)

    def _on_peer_event(self, event: Any) -> None:
        """Discovery (io thread): dial a sender before its first fetch; re-register on a restart.

        Added: open the link (it registers at once, so the first fetch finds it ready).
        Changed: a new incarnation at a known link registers again now (the reply
        settles what was sent to the old one, see _on_register_reply); a new endpoint
        is dialled. Removed: a link that is not connected is down now and closed
        (``_peer_gone``); a connected idle one is closed; a connected one in use stays (a
        lease expiry is no proof of death: it may be an etcd problem while the data path
        is fine) until its connection drops, which closes it as down.
        """
        from kvxferd.discovery import PeerAdded, PeerChanged, PeerRemoved

        self.stats.add("discovery_events")
        if isinstance(event, PeerAdded | PeerChanged):
            peer = event.peer if isinstance(event, PeerAdded) else event.new
            self._removed.discard(peer.endpoint)
            if peer.public_key:  # the key to expect there, if our allow-list holds it
                learned = self.transport.learn_key(peer.endpoint, peer.public_key)
                self.stats.add("discovery_keys_learned" if learned else "discovery_keys_refused")
            known = self._links.get(peer.endpoint)
            if known is None:
                if len(self._links) < self.settings.limits.max_peers:
                    self._link(peer.endpoint)
            elif known.ready and known.sender_id and known.sender_id != peer.incarnation:
                self._register(known)  # a restart seen by discovery before the sender said so
        elif isinstance(event, PeerRemoved):
            self._removed.add(event.peer.endpoint)
            link = self._links.get(event.peer.endpoint)
            if link is not None and (link.disconnected or not link.ever_connected):
                self._peer_gone(link, "discovery removed the sender and its link is down")
                return
            if link is None or link.waiting:
                if link is not None:
                    link.removed = True
                return
            with self._lock:  # _fetches: engine threads add to it under this lock
                busy = any(
                    f.sender_endpoint == link.endpoint and not f.ended
                    for f in self._fetches.values()
                )
            if not busy:
                self._close_link(link)
            else:
                link.removed = True  # its connection dropping closes it (_on_monitor)

    # -- links -------------------------------------------------------------------------
    def _link(self, endpoint: str) -> _Link | str:
        """The link to ``endpoint``, opened and registering if new; why not, if it cannot be."""
        link = self._links.get(endpoint)
        if link is not None:
            return link
        try:
            server_key = self.transport.server_key_for(endpoint)  # "" when security is off
        except RejectedError as e:
            self.stats.add("connect_errors")
            return f"not_authorized: {e.detail}"
        try:
            # No routing identity: the sender's ROUTER names each connection, so no other
            # key can take our route; after a reconnect we register again (_on_monitor).
            dealer = connect_dealer(
                endpoint,
                self.socket_limits,
                self.settings.deadlines.send_timeout_ms,
                server_key=server_key,
            )
        except zmq.ZMQError as e:  # connect_problem let it through, libzmq did not
            self.stats.add("connect_errors")
            return f"cannot connect to {endpoint!r}: {e}"
        try:
            # A name of our own: pyzmq's default (the socket's fd) can repeat after a close.
            monitor = dealer.get_monitor_socket(
                _MONITORED, f"inproc://kvxferd-rx-monitor-{next(_monitor_ids)}"
            )
        except zmq.ZMQError as e:
            dealer.close(linger=0)
            self.stats.add("connect_errors")
            return f"cannot watch the connection to {endpoint!r}: {e}"
        link = _Link(endpoint, dealer, monitor, 0.0, server_key)
        self._links[endpoint] = link
        self._by_socket[dealer] = link
        self._by_socket[monitor] = link
        self._register(link)
        return link

    def _register(self, link: _Link, waited: bool = False) -> None:
        """Send Register on ``link``; fetches wait for the reply (``register_timeout_ms``).

        ``waited``: the link waited for a NIXL agent; its deadline runs from the first try.
        """
        link.ready = False
        if not waited:
            link.register_deadline = (
                time.monotonic() + self.settings.deadlines.register_timeout_ms / 1000
            )
        if link.agent is None:
            link.agent = self.agents.take()
            if link.agent is None:  # sent when a spare is ready ("agent_ready")
                self.stats.add("registers_waiting_agent")
                return
        reg = wire.Register(
            receiver_id=self.receiver_id,
            result_endpoint=self.result_endpoint,
            agent_metadata=link.agent.metadata,
            layout=wire.WireLayout.of(self.pool.layout),
            kv_base=self.pool.kv_base,
            aux_base=self.pool.aux_base,
            device="VRAM" if self.pool.mem_type == "VRAM" else "DRAM",
            device_id=self.pool.device_id,
            topology=self.topology,
        )
        self._flush_link(link)
        try:
            send_bounded(link.dealer, wire.encode(reg))
        except SendTimeout:
            self._drop_link(link, Reason.PEER_LOST, "REGISTER could not be sent")
            return
        self.stats.add("registers_sent")

    def _close_link(self, link: _Link) -> None:
        if link.batch:
            self._flush_link(link)
        self._tear_down(link)
        if self._links.get(link.endpoint) is link:
            del self._links[link.endpoint]
        self._by_socket.pop(link.dealer, None)
        self._by_socket.pop(link.monitor, None)
        try:
            link.dealer.disable_monitor()
        except zmq.ZMQError:
            pass
        link.monitor.close(linger=0)
        link.dealer.close(linger=0)

    def _drop_link(self, link: _Link, reason: Reason, detail: str) -> None:
        """Close ``link``; the fetches waiting for its registration fail with ``reason``."""
        waiting, link.waiting = link.waiting, []
        self._close_link(link)
        self.stats.add("links_dropped")
        for rx in waiting:
            self._fail(rx, reason, detail)
        for g in self._resolving.pop(link.endpoint, []):
            self._fail_group(g, reason, f"{link.endpoint}: {detail}")

    def _link_down(self, link: _Link, detail: str) -> None:
        """``link`` is down: every fetch toward it ends now, not at its deadline.

        A fetch whose RequestData never left fails ``peer_lost`` (nothing can be written).
        One sent ends ``failed``/``peer_lost`` with its fence in doubt at once: a write of
        it may have been posted, and only proof (an answer, a new incarnation) releases
        its blocks; the engine hears both now and decides. New fetches fail ``peer_lost``
        at once until the link is back.
        """
        self._flush_link(link)  # a RequestData of this turn is sent: it may be accepted
        link.down, link.ready = True, False
        self.stats.add("links_down")
        log.warning("link to %s down: %s", link.endpoint, detail)
        waiting, link.waiting = link.waiting, []
        for rx in waiting:
            self._fail(rx, Reason.PEER_LOST, detail)
        for g in self._resolving.pop(link.endpoint, []):
            self._fail_group(g, Reason.PEER_LOST, f"{link.endpoint}: {detail}")
        with self._lock:
            open_here = [
                rx
                for rx in self._fetches.values()
                if rx.sender_endpoint == link.endpoint and not rx.ended
            ]
        for rx in open_here:
            if not rx.sent:
                self._fail(rx, Reason.PEER_LOST, detail)
            elif rx.abandon(Reason.PEER_LOST, detail):
                self.stats.add("fetches_failed")
                self.stats.add(f"failed_{Reason.PEER_LOST}")
                self.stats.add("fetches_ended_peer_down")
                self._maybe_forget(rx)
        # Our side of the data plane toward it goes: once it is destroyed, no write
        # addressed to it can land (with revocable transports), and that proof
        # (_agent_torn) ends its doubts.
        self._tear_down(link)

    def _tear_down(self, link: _Link) -> None:
        """Have ``link``'s NIXL agent destroyed (its next Register takes a fresh one)."""
        agent, link.agent = link.agent, None
        if agent is not None:
            self.agents.tear_down(agent)

    def _agent_torn(self, gen: int) -> None:
        """A link's NIXL agent is destroyed: no write sent through it can land any more.

        With revocable transports (``LinkAgents.proves``) that is proof: every fetch sent
        through it ends (``peer_lost``, if still open) and its fence is released
        (``fences_released_teardown``). Otherwise its fetches stay in doubt.
        """
        if not self.agents.proves:
            return
        with self._lock:
            through = [
                rx
                for rx in (*self._fetches.values(), *self._in_doubt.values())
                if rx.sent and rx.agent_gen == gen
            ]
        for rx in through:
            if not rx.ended and rx.abandon(
                Reason.PEER_LOST, "the link's data plane was torn down (link down)"
            ):
                self.stats.add("fetches_failed")
                self.stats.add(f"failed_{Reason.PEER_LOST}")
            if rx.release():
                self.stats.add("fences_released_teardown")
                self._settle(rx)

    def _peer_gone(self, link: _Link, detail: str) -> None:
        """Discovery removed the sender and ``link`` is not connected: down, and closed."""
        self._removed.add(link.endpoint)
        self._link_down(link, detail)
        self._close_link(link)
        self.stats.add("links_dropped")

    # -- fetches from a prefill instance ----------------------------------------------
    def _start_group(self, g: RxGroup) -> None:
        """Plan ``g`` now if its instance's record is known, else register to learn it."""
        if g.ended:
            return self._forget_group(g)
        ep0 = g.sender_endpoints[0]
        if ep0 in self._records:
            return self._plan_group(g)
        link = self._link(ep0)
        if isinstance(link, str):
            denied = link.startswith(Reason.NOT_AUTHORIZED)
            return self._fail_group(
                g, Reason.NOT_AUTHORIZED if denied else Reason.BAD_ENDPOINT, link
            )
        if link.ready:  # registered, and its reply carried no record
            return self._fail_group(g, Reason.INCOMPATIBLE, _NO_RECORD.format(ep0))
        self._resolving.setdefault(ep0, []).append(g)
        return None

    def _plan_group(self, g: RxGroup) -> None:
        """Plan ``g`` against the instance (derived from rank 0's record) and start its pieces."""
        own, rec = self.topology, self._records[g.sender_endpoints[0]]
        assert own is not None
        n = rec.tp_size * rec.pp_size
        if rec.rank != 0 or len(g.sender_endpoints) != n:
            return self._fail_group(
                g,
                Reason.INCOMPATIBLE,
                f"sender_endpoints lists {len(g.sender_endpoints)} endpoints, the first one "
                f"being prefill rank {rec.rank}: the instance has {n} ranks, rank 0 first",
            )
        try:
            plan = plan_rank(own, instance_ranks(rec))
        except RejectedError as e:
            self.stats.add("topology_refused")
            return self._fail_group(g, e.reason, e.detail)
        lb, le = own.layer_begin + g.layer_begin, own.layer_begin + g.layer_end  # absolute
        pieces: list[RxSession] = []
        for piece in plan.pieces:
            p_lb, p_le = max(lb, piece.layer_begin), min(le, piece.layer_end)
            if p_lb >= p_le:
                continue
            r = piece.prefill_rank
            pieces.append(
                RxSession(
                    fetch_id=next(_fetch_ids),
                    request_id=g.request_id,
                    sender_endpoint=g.sender_endpoints[r],
                    dst_blocks=g.dst_blocks,
                    layer_begin=p_lb - own.layer_begin,  # layers of our pool, as always
                    layer_end=p_le - own.layer_begin,
                    aux_slot=g.aux_slot if not pieces else -1,
                    deadline=g.deadline,
                    token=g.tokens[r] if g.tokens else "",
                    sender_key=g.sender_keys[r],
                    on_end=self._journal_fetch,
                    on_change=g.piece_changed,
                    prefill_rank=r,
                    prefill_compat=rec.compat,
                )
            )
        limit = self.settings.limits.max_fetches_in_flight
        with self._lock:
            # Each piece is a fetch in flight: the group's one slot becomes len(pieces).
            room = limit - len(self._fetches) - (len(self._unplanned) - 1)
            if len(pieces) <= room:
                self._unplanned.pop(g.fetch_id, None)
                if not g.plan(pieces):
                    return None
                for p in pieces:
                    self._fetches[p.fetch_id] = p
        if len(pieces) > room:
            self.stats.add("instance_fetches_busy")
            return self._fail_group(
                g,
                Reason.BUSY,
                f"max_fetches_in_flight {limit}: this fetch reads {len(pieces)} pieces, "
                f"room for {max(0, room)}",
            )
        self.stats.add("instance_pieces", len(pieces))
        for p in pieces:
            self._start_fetch(p)
        return None

    def _fail_group(self, g: RxGroup, reason: Reason, detail: str) -> None:
        if g.fail(reason, detail):
            self.stats.add("instance_fetches_failed")
        self._forget_group(g)

    def _end_group(self, g: RxGroup, state: RxState, reason: Reason, detail: str) -> None:
        """Cancel (or time out) a group: its open pieces are cancelled, each with its fence."""
        for p in g.end_locally(state, reason, detail):
            self._cancel(p, state, reason, detail)
        self._forget_group(g)

    def _forget_group(self, g: RxGroup) -> None:
        """An ended group not planned gives its aux slot back (a planned one's piece holds it)."""
        with self._lock:
            gone = self._unplanned.pop(g.fetch_id, None) is not None
        if gone and not g.planned and g.aux_slot >= 0:
            self.aux_slots.give_back([g.aux_slot])
            g.aux_slot = -1

    def _on_monitor(self, link: _Link) -> None:
        """libzmq's connection events of one link: reconnects register again."""
        for _ in range(64):
            if link.monitor.closed:
                return
            try:
                event = recv_monitor_message(link.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_CONNECTED:
                # A TCP connect is no sign of life (a frozen process's kernel accepts it):
                # a lost link is back only once its sender answers the Register.
                link.refused_since = None
                if link.disconnected:
                    # The sender may be a new process that never heard of us: tell it who we
                    # are; its reply says whether it is the same incarnation.
                    link.disconnected = False
                    self.stats.add("reconnects")
                    self._register(link)
                    if self._links.get(link.endpoint) is not link:
                        return
                link.ever_connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                link.disconnected = True
                if link.lost_since is None:
                    link.lost_since = time.monotonic()
                self.stats.add("disconnects")
                if link.removed:  # discovery removed it and now its connection dropped
                    self._peer_gone(link, "discovery removed the sender and its link dropped")
                    return
            elif event & HANDSHAKE_FAILED:  # a sender presenting another key, or plaintext
                self.stats.add(f"handshakes_failed_{handshake_kind(event)}")
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self.stats.add("connect_retries")  # a redial, refused or lost (backs off)
                if not link.ever_connected and link.refused_since is None:
                    link.refused_since = time.monotonic()

    def _on_register_reply(self, link: _Link, msg: wire.RegisterReply) -> None:
        known, link.sender_id = link.sender_id, msg.sender_id
        self.stats.add("register_replies_ok" if msg.ok else "register_replies_refused")
        # Fetches sent to another incarnation at this endpoint, whether this link or an
        # earlier one (dropped meanwhile) carried them: that process is gone.
        with self._lock:
            stale = [
                rx
                for rx in (*self._fetches.values(), *self._in_doubt.values())
                if rx.sender_endpoint == link.endpoint
                and rx.sent
                and rx.sent_to not in ("", msg.sender_id)
            ]
        if stale or (known and known != msg.sender_id):
            self._sender_restarted(link, stale, resend=msg.ok)
        if not msg.ok:
            self._drop_link(link, msg.reason or Reason.INCOMPATIBLE, msg.detail)
            return
        if link.agent is None:
            # It answers a Register whose NIXL agent was torn down since (the link went down
            # meanwhile): register again with a fresh one; that reply makes the link ready.
            self.stats.add("registers_stale_agent")
            self._register(link)
            return
        link.ready = True
        link.lost_since = None
        if link.down:
            link.down = False
            self.stats.add("links_back")
            log.info("link to %s back", link.endpoint)
        self._ask_again_now(link.endpoint)
        if msg.topology is not None:
            self._records[link.endpoint] = msg.topology
        for g in self._resolving.pop(link.endpoint, []):
            if g.ended:
                self._forget_group(g)
            elif msg.topology is None:
                self._fail_group(g, Reason.INCOMPATIBLE, _NO_RECORD.format(link.endpoint))
            else:
                self._plan_group(g)
        waiting, link.waiting = link.waiting, []
        for rx in waiting:
            if not rx.ended:
                self._send_request(link, rx)

    def _sender_restarted(self, link: _Link, stale: list[RxSession], *, resend: bool) -> None:
        """A new sender process answers at ``link``: nothing of the old one can still land.

        Open fetches sent to an old incarnation are sent again (same fetch id: the new
        one never saw it) while their deadline allows, or fail with peer_restarted;
        fences toward an old incarnation are released.
        """
        self.stats.add("sender_restarts")
        log.warning("sender at %s is a new process (%s)", link.endpoint, link.sender_id)
        now = time.monotonic()
        for rx in stale:
            if not rx.ended:
                self._reregistered.discard(rx.fetch_id)
                if resend and now < rx.deadline:
                    if rx not in link.waiting:  # sent once the reply made the link ready
                        link.waiting.append(rx)
                    self.stats.add("fetches_resent")
                else:
                    self._fail(rx, Reason.PEER_RESTARTED, f"sender {rx.sent_to} restarted")
            elif rx.release():
                self.stats.add("fences_released_restart")
                self._settle(rx)

    # -- fetches -----------------------------------------------------------------------
    def _start_fetch(self, rx: RxSession) -> None:
        if rx.ended:
            return
        self._removed.discard(rx.sender_endpoint)  # a fetch brings a removed sender back
        link = self._link(rx.sender_endpoint)
        if isinstance(link, str):
            denied = link.startswith(Reason.NOT_AUTHORIZED)  # no allowed key for the sender
            self._fail(rx, Reason.NOT_AUTHORIZED if denied else Reason.BAD_ENDPOINT, link)
        elif link.down:  # nothing is sent that could put its blocks in doubt
            self.stats.add("fetches_refused_link_down")
            self._fail(rx, Reason.PEER_LOST, f"link to {link.endpoint} is down")
        elif link.ready and link.lost_since is None:
            self._send_request(link, rx)
        elif self._links.get(rx.sender_endpoint) is link:
            link.waiting.append(rx)
        else:
            self._fail(rx, Reason.PEER_LOST, "sender unreachable")

    def _send_request(self, link: _Link, rx: RxSession) -> None:
        if rx.prefill_rank >= 0:  # a piece: its sender must be the rank it was planned for
            rec = self._records.get(link.endpoint)
            if rec is None or (rec.rank, rec.compat) != (rx.prefill_rank, rx.prefill_compat):
                what = "declared no topology" if rec is None else f"is prefill rank {rec.rank}"
                self.stats.add("topology_refused")
                self._fail(
                    rx,
                    Reason.INCOMPATIBLE,
                    f"sender at {link.endpoint} {what}; the fetch lists it as rank "
                    f"{rx.prefill_rank} of the instance",
                )
                return
        left_s = rx.deadline - time.monotonic()
        msg = wire.RequestData(
            request_id=rx.request_id,
            fetch_id=rx.fetch_id,
            dst_blocks=rx.dst_blocks.tolist(),
            layer_begin=rx.layer_begin,
            layer_end=rx.layer_end,
            aux_slot=rx.aux_slot,
            timeout_ms=min(max(1, int(left_s * 1000)), 3_600_000),
            deadline_unix_ms=max(1, int((time.time() + left_s) * 1000)),
            token=rx.token,
            notify=rx.nonce if self.settings.dataplane.notifications else b"",
        )
        was_sent = rx.sent
        # Marked sent now: a Cancel of this fetch goes on the same link after the batch
        # (``_send_cancel`` flushes it first), so the sender always sees them in order.
        rx.mark_sent(link.sender_id)
        rx.agent_gen = link.agent.gen if link.agent is not None else -1
        if not link.batch:
            self._batched.append(link)
        link.batch.append((rx, wire.encode(msg), was_sent))
        if len(link.batch) >= wire.MAX_BATCH:
            self._flush_link(link)

    def _flush_links(self) -> None:
        """Send every link's RequestData batch of this turn."""
        batched, self._batched = self._batched, []
        for link in batched:
            self._flush_link(link)

    def _flush_link(self, link: _Link) -> None:
        batch, link.batch = link.batch, []
        if not batch or link.dealer.closed:
            return
        try:
            send_bounded_many(link.dealer, [frame for _, frame, _ in batch])
        except SendTimeout:
            self.stats.add("send_timeouts", len(batch))
            for rx, _, was_sent in batch:
                if not was_sent:  # nothing left: no write can come for it
                    self._fail(
                        rx, Reason.PEER_LOST, "REQUEST_DATA could not be sent (sender not reading)"
                    )
                # A resend that could not leave: the fetch's own deadline still ends it.
            return
        self.stats.add("requests_sent", len(batch))
        self._sent_at = time.monotonic()

    def _cancel(self, rx: RxSession, state: RxState, reason: Reason, detail: str) -> bool:
        fence_s = self.settings.deadlines.cancel_fence_ms / 1000
        if not rx.end_locally(state, reason, detail, fence_s):
            return False
        self.stats.add(f"fetches_{state}")
        link = self._links.get(rx.sender_endpoint)
        if link is not None and rx in link.waiting:
            link.waiting.remove(rx)
        if rx.sent:
            self._send_cancel(rx)
        self._maybe_forget(rx)
        return True

    def _send_cancel(self, rx: RxSession) -> None:
        """Cancel ``rx`` at its sender: on a registered link, else (re)open one for next time
        (not to a sender discovery removed: nothing dials it until it is back)."""
        if rx.sender_endpoint in self._removed:
            return
        link = self._link(rx.sender_endpoint)
        if isinstance(link, str) or not link.ready:
            return  # the fence deadline, or the next in-doubt retry, covers it
        self._flush_link(link)  # a RequestData of this turn goes first
        try:
            send_bounded(
                link.dealer,
                wire.encode(wire.Cancel(request_id=rx.request_id, fetch_id=rx.fetch_id)),
            )
            self.stats.add("cancels_sent")
        except SendTimeout:
            self.stats.add("send_timeouts")  # the fence deadline still bounds the wait

    def _fail(self, rx: RxSession, reason: Reason, detail: str) -> None:
        if rx.fail(reason, detail):
            self.stats.add("fetches_failed")
            self.stats.add(f"failed_{reason}")
        self._maybe_forget(rx)

    def _maybe_forget(self, rx: RxSession) -> None:
        """Drop a fetch once no write toward its blocks can come, or keep asking while in doubt."""
        if not rx.ended or rx.fence is Fence.FENCED:
            return
        self._reregistered.discard(rx.fetch_id)
        in_doubt = rx.fence is Fence.IN_DOUBT
        untracked: RxSession | None = None
        with self._lock:
            if self._fetches.pop(rx.fetch_id, None) is None:
                return
            if in_doubt:
                self._forgotten_in_doubt += 1
                self._in_doubt[rx.fetch_id] = rx
                if rx.aux_slot >= 0:
                    self._aux_quarantined += 1
                if len(self._in_doubt) > self.settings.limits.max_fetches_in_flight:
                    # Bounded: the oldest stays in doubt (its blocks and slot kept) unasked.
                    untracked = self._in_doubt.pop(next(iter(self._in_doubt)))
        if in_doubt:
            self.stats.add("fetches_in_doubt")
            if rx.aux_slot >= 0:
                self.stats.add("aux_slots_quarantined")
            rx.retry_every = self.settings.deadlines.in_doubt_retry_ms / 1000
            rx.retry_at = 0.0 if self._draining.is_set() else time.monotonic() + rx.retry_every
            if untracked is not None:
                self.stats.add("in_doubt_untracked")
        elif rx.aux_slot >= 0:
            self.aux_slots.give_back([rx.aux_slot])

    def _settle(self, rx: RxSession) -> None:
        """After a fence moved: forget an open-table fetch, or resolve one that was in doubt."""
        self._maybe_forget(rx)
        if not rx.blocks_reusable:
            return
        with self._lock:
            if self._in_doubt.pop(rx.fetch_id, None) is None:
                return
            self._forgotten_in_doubt -= 1
            if rx.aux_slot >= 0:
                self._aux_quarantined -= 1
            self._settled.notify_all()
        if rx.aux_slot >= 0:
            self.aux_slots.give_back([rx.aux_slot])
            self.stats.add("aux_slots_released")
        self.stats.add("in_doubt_resolved")
        log.info("fetch %d of %s: outcome no longer in doubt", rx.fetch_id, rx.request_id)

    def _ask_again_now(self, endpoint: str) -> None:
        """The sender at ``endpoint`` answered a Register: ask about its fetches in doubt now.

        Their re-asks backed off while it was away (up to ``in_doubt_retry_max_ms``); waiting
        that out after a heal kept blocks fenced for tens of seconds with the link back.
        """
        with self._lock:
            doubtful = [rx for rx in self._in_doubt.values() if rx.sender_endpoint == endpoint]
        for rx in doubtful:
            rx.retry_at = 0.0
            rx.retry_every = self.settings.deadlines.in_doubt_retry_ms / 1000

    def _retry_in_doubt(self, now: float) -> None:
        """Ask again about fetches in doubt, backing off to ``in_doubt_retry_max_ms``."""
        with self._lock:
            due = [rx for rx in self._in_doubt.values() if now >= rx.retry_at]
        cap = self.settings.deadlines.in_doubt_retry_max_ms / 1000
        for rx in due:
            rx.retry_at = now + rx.retry_every
            rx.retry_every = min(rx.retry_every * 2, cap)
            self.stats.add("in_doubt_retries")
            self._send_cancel(rx)

    # -- messages ------------------------------------------------------------------------
    def _drain_socket(self, sock: zmq.Socket[bytes]) -> None:
        for _ in range(256):
            if sock.closed:
                return  # a message closed its link (a refused Register)
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError:
                self.stats.add("recv_errors")
                return
            identity = peer_identity(parts[-1])  # the key ZAP authenticated, never a field
            if sock is self._router and identity and not self.transport.admits(identity):
                # ZAP checked the key once, at the handshake: a sender key removed from
                # the allow-list since is refused here, message by message, on the
                # connection it already opened. Its Result never makes a fetch done: the
                # fetch ends by its deadline, fenced as any fetch whose sender went quiet.
                self.stats.add(f"rejected_{Reason.NOT_AUTHORIZED}")
                continue
            frames = [p.bytes for p in parts]
            body = frames[1:] if sock is self._router else frames
            try:
                msg = wire.decode_to_receiver(body, self.settings.limits.max_frame_bytes)
            except ProtocolError as e:
                self.stats.add(f"rejected_{e.reason}")
                continue
            try:
                self._on_message(sock, msg, identity)
            except Exception:
                self.guard.caught("rx-io message")

    def _on_message(
        self, sock: zmq.Socket[bytes], msg: wire.ToReceiver, identity: str = ""
    ) -> None:
        if isinstance(msg, wire.RegisterReply):
            link = self._by_socket.get(sock)
            if link is not None and sock is link.dealer:
                self._on_register_reply(link, msg)
            else:  # on the result socket: no sender sends one there
                self.stats.add(f"rejected_{Reason.UNKNOWN_MESSAGE}")
            return
        if isinstance(msg, wire.Reject):
            self.stats.add(f"peer_rejected_{msg.reason}")
            log.warning("sender rejected a message: %s %s", msg.reason, msg.detail)
            link = self._by_socket.get(sock)
            if msg.reason is Reason.NOT_AUTHORIZED and link is not None and sock is link.dealer:
                self._key_refused(link, msg.detail)
            return
        with self._lock:
            found = self._fetches.get(msg.fetch_id) or self._in_doubt.get(msg.fetch_id)
        if found is None or found.request_id != msg.request_id:
            self.stats.add("late_messages")
            return
        rx = found
        if not self._from_asked_sender(sock, rx, identity):
            self.stats.add("results_unsolicited")
            log.warning(
                "%s for fetch %d dropped: not from the sender it was sent to",
                type(msg).__name__,
                rx.fetch_id,
            )
            return
        if isinstance(msg, wire.CancelAck):
            rx.on_cancel_ack(msg.in_doubt)
            self._settle(rx)
            return
        if (
            msg.status == "failed"
            and msg.reason is Reason.UNKNOWN_PEER
            and rx.fetch_id not in self._reregistered
            and not rx.ended
        ):
            # The sender forgot us (it restarted, or evicted us): nothing was written.
            # Register again on the same link, once per fetch, and resend after the reply.
            self._reregistered.add(rx.fetch_id)
            self.stats.add("reregistrations")
            link = self._links.get(rx.sender_endpoint)
            if link is None:
                self._start_fetch(rx)
                return
            if link.ready:
                self._register(link)
            if self._links.get(rx.sender_endpoint) is link:
                link.waiting.append(rx)
            else:
                self._fail(rx, Reason.PEER_LOST, "REGISTER could not be sent")
            return
        self._apply_result(rx, msg.status, msg.reason, msg.detail, msg.nbytes, msg.aux_bytes)

    def _key_refused(self, link: _Link, detail: str) -> None:
        """The sender at ``link`` refuses our key (``Reject{not_authorized}``, e.g. revoked):
        end every fetch open toward it now, not at its deadline.

        One not yet sent fails (nothing can be written). One sent ends ``not_authorized``
        with its blocks fenced, since a write of it may be in flight, and its Cancel goes
        out: the sender still honours a revoked key's Cancel, so its CancelAck (or the
        fetch's failed Result) releases them; else the fence deadline puts them in doubt.
        """
        why = f"sender at {link.endpoint} refused this receiver's key: {detail}"
        with self._lock:
            open_here = [
                rx
                for rx in self._fetches.values()
                if rx.sender_endpoint == link.endpoint and not rx.ended
            ]
        for rx in open_here:
            if rx.sent:
                self._cancel(rx, RxState.FAILED, Reason.NOT_AUTHORIZED, why)
            else:
                if rx in link.waiting:
                    link.waiting.remove(rx)
                self._fail(rx, Reason.NOT_AUTHORIZED, why)
        for g in self._resolving.pop(link.endpoint, []):
            self._fail_group(g, Reason.NOT_AUTHORIZED, why)
        if open_here:
            self.stats.add("fetches_ended_key_refused", len(open_here))

    def _apply_result(
        self,
        rx: RxSession,
        status: str,
        reason: Reason | None,
        detail: str,
        nbytes: int,
        aux_bytes: int,
    ) -> None:
        """The sender's final word on ``rx`` (a Result, or the notification of its last WRITE)."""
        aux = None
        if status == "done" and rx.aux_slot >= 0 and aux_bytes and not rx.ended:
            n = min(aux_bytes, self.pool.layout.aux_slot_bytes)
            aux = bytes(self.pool.aux[rx.aux_slot, :n].numpy().tobytes())
        if rx.on_result(status, reason, detail, nbytes, aux):
            self.stats.add(f"fetches_{rx.state}")
            self.stats.observe("fetch_seconds", time.monotonic() - rx.started)
            if status == "done":
                self.stats.add("bytes_received", nbytes)
        self._settle(rx)

    def _take_notifications(self) -> bool:
        """Progress NIXL and complete the fetches whose last WRITE's notification came.

        A notification counts only with the fetch's nonce (sent over the authenticated
        control plane, so no other process can forge it) and from the NIXL agent of the
        sender incarnation the fetch was sent to (its sender id, or a spare path of it).
        NIXL sends it once the WRITE is complete: the bytes are in our blocks.
        """
        got = self.agents.notifications()
        for gen, agent, payload in got:
            records = wire.decode_notification(payload)
            if records is None:
                self.stats.add("notifications_unknown")
                continue
            for fetch_id, nonce, nbytes, aux_bytes in records:
                with self._lock:
                    rx = self._fetches.get(fetch_id) or self._in_doubt.get(fetch_id)
                if rx is None:
                    self.stats.add("late_messages")
                    continue
                if rx.agent_gen != gen or not self._notified_by_its_sender(rx, agent, nonce):
                    self.stats.add("notifications_refused")
                    log.warning("notification for fetch %d refused: not from its sender", fetch_id)
                    continue
                self.stats.add("notifications")
                self._apply_result(rx, "done", None, "", nbytes, aux_bytes)
        return bool(got)

    def _notified_by_its_sender(self, rx: RxSession, agent: str, nonce: bytes) -> bool:
        """True when a notification for ``rx`` is its sender's word, as a Result would be.

        The nonce went only to that sender, over the link whose server key (CURVE verifies
        it) is the key the fetch expects; the NIXL agent is that sender incarnation's; and
        the key is still in the allow-list (a revoked key completes nothing, counted as a
        refused Result would be).
        """
        sender = rx.sent_to
        if not (
            rx.nonce
            and hmac.compare_digest(nonce, rx.nonce)
            and sender
            and (agent == sender or agent.startswith(sender + ".p"))
        ):
            return False
        link = self._links.get(rx.sender_endpoint)
        if link is None or link.server_key != rx.sender_key:
            return False
        if rx.sender_key and not self.transport.admits(rx.sender_key):
            self.stats.add(f"rejected_{Reason.NOT_AUTHORIZED}")
            return False
        return True

    def _from_asked_sender(self, sock: zmq.Socket[bytes], rx: RxSession, identity: str) -> bool:
        """True when a Result/CancelAck for ``rx`` came from the sender ``rx`` was sent to.

        On the result ROUTER: the authenticated identity must be the fetch's expected
        sender key (both "" with security off). On a link's DEALER (the listener's own
        refusals): it must be the link to the fetch's sender endpoint.
        """
        if sock is self._router:
            return identity == rx.sender_key
        link = self._by_socket.get(sock)
        return link is not None and link.dealer is sock and link.endpoint == rx.sender_endpoint

    def _expected_sender_key(self, endpoint: str, given: str = "") -> str:
        """The key a sender at ``endpoint`` must present: ``security.sender_keys`` first,
        else ``given`` (the fetch's), and in the allow-list (RejectedError not_authorized
        otherwise); with security off the fetch's key as given ("" when none)."""
        return self.transport.server_key_for(endpoint, given)

    def _check_deadlines(self, now: float) -> None:
        refused_s = self.settings.deadlines.connect_refused_ms / 1000
        down_s = self.settings.deadlines.peer_down_ms / 1000
        for link in list(self._links.values()):
            if not link.down and link.lost_since is not None and now - link.lost_since >= down_s:
                self._link_down(
                    link, f"connection to {link.endpoint} lost, not back in {down_s:g}s"
                )
                continue
            if link.ready or link.down:
                continue
            if link.refused_since is not None and now - link.refused_since >= refused_s:
                self._drop_link(
                    link,
                    Reason.PEER_LOST,
                    f"connection to {link.endpoint} refused for {refused_s:g}s",
                )
            elif now >= link.register_deadline:
                self._drop_link(link, Reason.TIMEOUT, f"no REGISTER reply from {link.endpoint}")
        with self._lock:
            fetches = list(self._fetches.values())
            late = [g for g in self._unplanned.values() if now >= g.deadline]
        for g in late:
            self._end_group(
                g, RxState.TIMED_OUT, Reason.TIMEOUT, "the instance's record never came"
            )
        for rx in fetches:
            if not rx.ended and now >= rx.deadline:
                self._cancel(rx, RxState.TIMED_OUT, Reason.TIMEOUT, "kv_transfer_timeout passed")
            elif rx.fence is Fence.FENCED and rx.fence_expired(now):
                self.stats.add("fences_in_doubt")
                self._maybe_forget(rx)

    # -- shutdown ----------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None) -> bool:
        """Drain, then end what is left, wait for fences, stop; True if all blocks are safe.

        :meth:`shutdown_report` with only its ``blocks_safe and threads_joined``.
        """
        report = self.shutdown_report(timeout)
        return report is not None and report.blocks_safe and report.threads_joined

    def shutdown_report(self, timeout: float | None = None) -> RxShutdownReport | None:
        """Drain, then end what is left, wait for fences, stop; what it dropped.

        Open fetches (sent or waiting for their sender) may finish by themselves until
        ``drain_timeout_ms`` (``drain_complete`` tells whether all did); the rest end
        ``failed``/``shutting_down`` (a Cancel is sent, the fence awaited), as does a fetch
        its engine cancels or closes during the drain, and each is counted
        (``drain_dropped_cut``). Every fetch in doubt is asked about once more, within
        the remaining bound; those still in doubt are counted (``drain_dropped_in_doubt``)
        and memory is deregistered only when there are none. Safe to call again and from
        several threads: a later call waits (within its own bound) for the first and
        returns its report, or None if the first has not finished by then.
        """
        total = self.settings.deadlines.shutdown_timeout_ms / 1000 if timeout is None else timeout
        t0 = time.monotonic()
        return self._shutdown_once.run(lambda: self._shutdown(t0, total), total)

    def _drain_end(self, rx: RxSession, detail: str) -> None:
        """End an open fetch for the drain (failed/shutting_down, fenced if sent); count it."""
        if self._cancel(rx, RxState.FAILED, Reason.SHUTTING_DOWN, detail):
            self.stats.add("drain_dropped_cut")

    def _shutdown(self, t0: float, total: float) -> RxShutdownReport:
        d = self.settings.deadlines
        deadline = t0 + total
        drain_deadline = min(t0 + d.drain_timeout_ms / 1000, deadline - 0.2 * total)
        settle_deadline = deadline - 0.1 * total
        with self._lock:  # fetch() admits under this lock: no fetch slips past this list
            self._draining.set()
            open_fetches = list(self._fetches.values())
            unplanned = list(self._unplanned.values())
        for g in unplanned:  # no piece started: nothing can land
            self._fail_group(g, Reason.SHUTTING_DOWN, "receiver shut down before it was planned")
        waiting = sum(1 for rx in open_fetches if not rx.ended)
        if waiting:
            log.info(
                "draining: %d fetch%s open; waiting up to %.1f s",
                waiting,
                "" if waiting == 1 else "es",
                max(0.0, drain_deadline - time.monotonic()),
            )
        for rx in open_fetches:
            if self._started:
                rx.completion.wait(max(0.0, drain_deadline - time.monotonic()))
        self.drain_complete = all(rx.ended for rx in open_fetches)
        for rx in open_fetches:
            if not rx.ended:
                self._command(cmd.DrainEnd(rx))
        self._command(cmd.RetryInDoubt())
        for rx in open_fetches:
            if self._started:
                rx.fence_done.wait(max(0.0, settle_deadline - time.monotonic()))
        if self._started:
            with self._settled:  # late answers about fetches in doubt, until the bound
                self._settled.wait_for(
                    lambda: self._forgotten_in_doubt == 0,
                    max(0.0, settle_deadline - time.monotonic()),
                )
        with self._lock:  # _command writes the eventfd under this lock
            self._stopping.set()
        if self._started:
            self._io.join(max(0.0, deadline - time.monotonic()))
        else:
            self._router.close(linger=0)
        joined = not self._io.is_alive()
        if joined:
            os.close(self._wake)
            self.io.close()
        abandoned = 0
        for rx in open_fetches:  # nobody will answer for these any more
            if rx.abandon(Reason.SHUTTING_DOWN, "receiver shut down before the fetch ended"):
                abandoned += 1
                self.stats.add("drain_dropped_cut")
        with self._lock:
            in_doubt = self._forgotten_in_doubt
            in_doubt += sum(1 for rx in self._fetches.values() if not rx.blocks_reusable)
        in_doubt = max(in_doubt, sum(1 for rx in open_fetches if not rx.blocks_reusable))
        safe = in_doubt == 0
        if not safe and joined and self.agents.proves:
            # Our side of every link torn down: nothing sent through them can land now.
            self.agents.close()
            released = 0
            with self._lock:
                doubtful = [*self._in_doubt.values(), *self._fetches.values(), *open_fetches]
            for rx in doubtful:
                if rx.release():
                    released += 1
            self.stats.add("fences_released_teardown", released)
            with self._lock:  # those no longer tracked (over the table's bound) too
                self._in_doubt.clear()
                self._forgotten_in_doubt = 0
            log.info("receiver shutdown: %d outcome(s) in doubt ended by tearing down", in_doubt)
            in_doubt, safe = 0, True
        elif in_doubt:
            self.stats.add("drain_dropped_in_doubt", in_doubt)
        if safe and joined:
            self.agents.close()
            if self._owns_pool:
                self.pool.close()
        else:
            # A write may still land: deregistering now would let it hit freed memory.
            log.warning(
                "receiver shutdown: %d outcome(s) in doubt; memory stays registered until exit",
                in_doubt,
            )
        report = RxShutdownReport(
            fetches_cut=self.stats.get(DROPPED_CUT),
            in_doubt=in_doubt,
            blocks_safe=safe,
            threads_joined=joined,
            elapsed_s=time.monotonic() - t0,
        )
        log.info("receiver shutdown: %s (abandoned: %d)", report, abandoned)
        return report
