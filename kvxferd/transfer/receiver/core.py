"""The receiver's facade: the engine API, and the io thread's loop and command dispatch.

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
``fetch``), its RequestData (fetches.py's ``start`` -> ``send_request``, flushed with the
turn's batch by links.py's ``flush_all``), the done notification its sender's last WRITE
carried (messages.py's ``take_notifications``), and the engine's outcome (the session's
completion -> the gateway's reply, flushed at the end of the turn). No other thread is
woken.

The receiver's state lives in its tables, one module each (the package's __init__ lists
them): the fetch table (``fetches``), the in-doubt table (``doubts``), instance fetches
(``groups``), the links (``links``). ``_lock`` guards the fetch table, the in-doubt table,
the unplanned groups and ``_commands``; each RxSession has its own lock (session.py); the
links and what else a table says are the io thread's only. The io thread's loop body is
guarded (guard.py): an unexpected exception is logged and counted, the thread goes on,
and ``broken()`` makes liveness fail.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from kvxferd.auth import Transport
from kvxferd.config import ReceiverSettings
from kvxferd.endpoints import DialAllow, advertise_host, advertised
from kvxferd.errors import Reason, RejectedError
from kvxferd.stats import Stats
from kvxferd.transfer import commands as cmd
from kvxferd.transfer import views
from kvxferd.transfer.control import SocketLimits, bind_router, process_context, sockets_needed
from kvxferd.transfer.dataplane import DataPlane, NixlDataPlane
from kvxferd.transfer.drain import RxShutdownReport
from kvxferd.transfer.guard import Guard
from kvxferd.transfer.iohooks import IoHooks
from kvxferd.transfer.journal import Journal
from kvxferd.transfer.link_agents import LinkAgents, SharedAgent, teardown_proves
from kvxferd.transfer.poller import Poller, tight_timers
from kvxferd.transfer.pool import IdAllocator, KvPool
from kvxferd.transfer.receiver.digests import Digests
from kvxferd.transfer.receiver.fetches import Fetches
from kvxferd.transfer.receiver.groups import Groups
from kvxferd.transfer.receiver.handle import RxHandle
from kvxferd.transfer.receiver.in_doubt import InDoubt
from kvxferd.transfer.receiver.links import Links
from kvxferd.transfer.receiver.messages import Messages
from kvxferd.transfer.receiver.moved import MovedTable
from kvxferd.transfer.receiver.shutdown import shut_down
from kvxferd.transfer.reshard import declared
from kvxferd.transfer.session import RxGroup, RxSession, RxState
from kvxferd.transfer.topology import Topology
from kvxferd.transfer.waiters import Once

log = logging.getLogger("kvxferd.receiver")

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


class NotificationPacing:
    """How long the io thread's poll may wait while fetches are open (io thread only)."""

    def __init__(self) -> None:
        self.wait_s = _NOTIF_WAIT_MIN_S
        self.sent_at = 0.0  # when RequestData last left (links.py)

    def reset(self) -> None:
        """Something arrived: look again soon."""
        self.wait_s = _NOTIF_WAIT_MIN_S

    def wait(self, open_fetches: int) -> float:
        """The poll's bound now; the next one doubles, capped by the last send's age."""
        wait_s = self.wait_s
        age = time.monotonic() - self.sent_at
        if age >= _NOTIF_FRESH_S:
            cap = _NOTIF_WAIT_MAX_S
        elif age < _SPIN_S and open_fetches <= _SPIN_OPEN:
            cap = 0.0
            os.sched_yield()
        else:
            cap = _NOTIF_WAIT_FRESH_S
        # From a spin (0) the waits start again at the minimum: doubling 0 stayed 0, and a
        # fetch that waited longer than the spin (one parked at its sender) kept the io
        # thread spinning at 100 % of a core until its result.
        self.wait_s = min(max(self.wait_s, _NOTIF_WAIT_MIN_S) * 2, cap)
        return wait_s


def _agents(
    receiver_id: str,
    settings: ReceiverSettings,
    pool: KvPool,
    stats: Stats,
    dataplane: DataPlane | None,
    command: Callable[[cmd.Command], None],
) -> tuple[LinkAgents | SharedAgent, DataPlane | None]:
    """NIXL: one agent per sender link (link_agents.py: a link that is down is torn down,
    which ends its doubts), or one agent shared by every link, with its data plane (None
    with agents per link)."""
    per_link = settings.dataplane.agent_per_link
    if dataplane is None and (
        per_link == "on"
        or (
            per_link == "auto"
            and teardown_proves(settings.dataplane.ucx_tls or os.environ.get("UCX_TLS"))
        )
    ):
        agents = LinkAgents(
            receiver_id,
            settings.dataplane,
            pool,
            stats,
            on_spare=lambda: command(cmd.AgentReady()),
            on_torn=lambda gen: command(cmd.AgentTorn(gen)),
        )
        return agents, None
    dataplane = dataplane or NixlDataPlane(receiver_id, settings.dataplane, pool)
    return SharedAgent(dataplane), dataplane


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
        self._lock = threading.Lock()
        self._commands: deque[cmd.Command] = deque()  # from other threads (commands.py)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.agents, self.dataplane = _agents(
            self.receiver_id, settings, self.pool, self.stats, dataplane, self._command
        )
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
        # The engine gateway is served by the io thread too (iohooks.py).
        self.io = IoHooks(self.guard)
        self.pacing = NotificationPacing()  # io thread only
        self._io_due = 0.0  # io thread only: when the io hooks' next timer is due
        self._deadlines_at = 0.0  # io thread only: when deadlines are looked at next
        # The tables (each module's docstring says which lock guards what).
        self.fetches = Fetches(self)
        self.doubts = InDoubt(self)
        self.groups = Groups(self)
        self.links = Links(self)
        self.messages = Messages(self)
        self.digests = Digests(self)
        self.moved = MovedTable()  # requests a draining sender handed over (moved.py)
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
            return len(self.fetches.by_id)

    def in_doubt(self) -> int:
        """Fetches whose outcome is in doubt: a write may still land in their blocks."""
        with self._lock:
            return self.doubts.unresolved

    def aux_slot_counts(self) -> tuple[int, int]:
        """(free aux slots, aux slots quarantined by fetches in doubt)."""
        return self.aux_slots.free, self.doubts.aux_quarantined

    def view(self, *, locked: bool = True) -> views.ReceiverView:
        """What the probes read (views.py): ``_lock`` held while the fetch and in-doubt tables
        are copied; ``locked=False``: copied without it (the hang dump, best effort)."""

        def tables() -> tuple[list[RxSession], list[RxSession], int, int, int]:
            return (
                list(self.fetches.by_id.values()),
                list(self.doubts.by_id.values()),
                self.doubts.unresolved,
                self.doubts.aux_quarantined,
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
            tuple(map(views.LinkView.of, views.copied_values(self.links.links))),
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
        digest: bool | None = None,
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
        ``digest``: check what landed against its sender's digest (receiver/digests.py);
        None: ``integrity.digest``. Refusals are :class:`RejectedError` with a reason
        (draining, malformed, bad_endpoint, not_authorized, too_large, bad_blocks, busy),
        raised on the caller's thread.
        """
        if digest is None:
            digest = self.settings.integrity.digest
        try:
            if sender_endpoints:
                return self.groups.admit(
                    request_id,
                    list(sender_endpoints),
                    block_ids,
                    layers,
                    want_aux,
                    timeout_ms,
                    list(tokens),
                    list(sender_keys),
                    digest,
                )
            return self.fetches.admit(
                request_id,
                sender_endpoint,
                block_ids,
                layers,
                want_aux,
                timeout_ms,
                token,
                # the key it must present: security.sender_keys first, else the fetch's,
                # and in the allow-list (not_authorized otherwise); security off: as given
                self.transport.server_key_for(sender_endpoint, sender_key),
                digest,
            )
        except RejectedError as e:
            self.stats.add(f"fetch_refused_{e.reason}")
            raise

    def on_peer_event(self, event: Any) -> None:
        """Discovery saw a sender come, change or go (its watcher thread): handled by the io thread."""
        self._command(cmd.PeerEvent(event))

    def _command(self, command: cmd.Command) -> None:
        with self._lock:
            if self._stopping.is_set():
                return  # the io thread is gone; shutdown ends every open fetch itself
            self.enqueue_locked(command)

    def enqueue_locked(self, command: cmd.Command) -> None:
        """Queue ``command`` for the io thread and wake it (the caller holds ``_lock``)."""
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
                    socks = list(self.links.by_socket)
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
                    if self.fetches.by_id:  # fetches sent: their notifications come through NIXL
                        wait_s = min(wait_s, self.pacing.wait(len(self.fetches.by_id)))
                    if self._commands or io.pending():
                        wait_s = 0.0
                    ready = poller.poll(wait_s, check_zmq=not quiet)
                    if ready:
                        self.pacing.reset()
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
            self.digests.stop()
            self.links.close_all()
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
        if self.messages.take_notifications():
            self.pacing.reset()
            busy = True
        if not busy and now < self._io_due:
            return self._io_due - now, True
        self._run_commands()
        self.links.flush_all()
        return self._io_turn(now), False

    def _deadlines(self, now: float) -> bool:
        """Deadlines and in-doubt re-asks, when due (not every turn: they walk every open
        fetch); True when they were looked at."""
        if now < self._deadlines_at:
            return False
        self._deadlines_at = now + _DEADLINES_EVERY_S
        self.links.check_deadlines(now)
        self.fetches.check_deadlines(now)
        self.doubts.retry(now)
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
            link = self.links.by_socket.get(sock)
            if link is not None and sock is link.monitor:
                self.links.on_monitor(link)
            elif sock is self._router or link is not None:
                self.messages.drain_socket(sock)
        self._run_commands()  # what the engine gateway started this turn goes out now
        self.links.flush_all()
        now = time.monotonic()
        self._deadlines(now)
        if self.messages.take_notifications():
            self.pacing.reset()
        self.links.flush_all()
        return self._io_turn(now)

    def _run_commands(self) -> None:
        fetches = self.fetches
        while True:
            with self._lock:
                if not self._commands:
                    return
                command = self._commands.popleft()
            match command:
                case cmd.StartFetch(rx):
                    fetches.start(rx)
                case cmd.StartGroup(group):
                    self.groups.start(group)
                case cmd.CancelPiece(rx):
                    fetches.cancel(
                        rx, RxState.CANCELLED, Reason.CANCELLED, "another piece ended first"
                    )
                case cmd.Cancel(RxGroup() as group) | cmd.DrainEnd(RxGroup() as group):
                    # the engine cancels (or the drain ends) a group
                    self.groups.end(
                        group, RxState.CANCELLED, Reason.CANCELLED, "cancelled by the engine"
                    )
                case cmd.DrainEnd(RxSession() as rx):  # shutdown: the drain deadline passed
                    fetches.drain_end(rx, "still open at the drain deadline (drain_timeout_ms)")
                case cmd.Cancel(RxSession() as rx) if self._draining.is_set():
                    # an engine lets go because it is stopping too
                    fetches.drain_end(rx, "cancelled by the engine during the drain")
                case cmd.Cancel(RxSession() as rx):
                    fetches.cancel(
                        rx, RxState.CANCELLED, Reason.CANCELLED, "cancelled by the engine"
                    )
                case cmd.RetryInDoubt():  # shutdown: ask about every fetch in doubt now
                    self.doubts.ask_all_now()
                case cmd.PeerEvent(event):
                    self.links.on_peer_event(event)
                case cmd.AgentReady():  # a spare NIXL agent: links waiting for one register
                    self.links.agent_ready()
                case cmd.AgentTorn(gen):
                    self.doubts.agent_torn(gen)
                case cmd.DigestChecked(check, ours):  # the kvxferd-rx-digest thread's verdict
                    self.digests.verdict(check, ours)

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
        return self._shutdown_once.run(lambda: shut_down(self, t0, total), total)
