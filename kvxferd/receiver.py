"""The receiver (generation side): fetch a published request's KV into our own blocks.

Threads and what each owns::

    thread          owns                                  does
    --------------  ------------------------------------  -----------------------------------------
    kvxferd-rx-io   the result ROUTER, one DEALER per     registers with each sender once, sends
                    sender endpoint, the command queue    REQUEST_DATA / CANCEL, takes Results and
                                                          CancelAcks, enforces every deadline
                                                          (register, kv_transfer_timeout, cancel fence)
    API callers     nothing long-lived                    fetch / cancel / close: they enqueue a
                                                          command and wake the io thread (eventfd)

``_lock`` guards ``_fetches`` (fetch id -> RxSession), ``_forgotten_in_doubt``
and ``_commands``; each RxSession has its own lock (session.py). Fetch ids are a process-wide counter,
never reused, so a late result can never land on a newer fetch.

A fetch completes only on the sender's ``done`` Result, which the sender sends
only after NIXL reported its WRITE complete. On cancel or timeout the blocks
stay fenced until the sender acknowledges that no write is in flight, or until
``cancel_fence_ms`` passes (then the outcome is in doubt and the blocks must
not be reused).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import zmq

from kvxferd import protocol as wire
from kvxferd.config import ReceiverSettings
from kvxferd.control import SocketLimits, bind_router, connect_dealer, send_bounded
from kvxferd.dataplane import DataPlane, NixlDataPlane
from kvxferd.errors import ConfigError, ProtocolError, Reason, RejectedError, SendTimeout
from kvxferd.guard import Guard
from kvxferd.layout import check_blocks, check_layers
from kvxferd.pool import IdAllocator, KvPool
from kvxferd.session import Fence, RxOutcome, RxSession, RxState
from kvxferd.stats import Stats
from kvxferd.waiters import Once

log = logging.getLogger("kvxferd.receiver")

_fetch_ids = itertools.count(1)
_REQUEST_ID = re.compile(wire.REQUEST_ID_PATTERN)
_TICK_S = 0.05


@dataclass(slots=True)
class _Link:
    """Our connection to one sender."""

    endpoint: str
    dealer: zmq.Socket[bytes]
    register_deadline: float
    ready: bool = False
    sender_id: str = ""
    waiting: list[RxSession] = field(default_factory=list)  # fetches queued until registered


class RxHandle:
    """The engine's handle on one fetch."""

    def __init__(self, receiver: Receiver, session: RxSession) -> None:
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
        self._receiver._command(("cancel", self.session))

    def close(self, timeout: float | None = None) -> bool:
        """Cancel if open; True once the destination blocks are safe to reuse."""
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
    ) -> None:
        if re.match(r"^tcp://(0\.0\.0\.0|\*|\[::\]):", settings.result_endpoint):
            # This address is sent to senders as is; a wildcard would point them at themselves.
            raise ConfigError(
                f"result_endpoint {settings.result_endpoint!r} is a wildcard; "
                "give the routable address senders should connect to"
            )
        self.settings = settings
        self.stats = Stats()
        self.guard = Guard(self.stats, log)  # unexpected errors of its threads
        self.receiver_id = f"{settings.name}-{uuid.uuid4().hex[:12]}"
        self.pool = pool or KvPool(settings.pool, owner="rx")
        self._owns_pool = pool is None
        self.dataplane: DataPlane = dataplane or NixlDataPlane(
            self.receiver_id, settings.dataplane, self.pool
        )
        self.socket_limits = SocketLimits(settings.limits.max_frame_bytes, settings.limits.sndhwm)
        self.aux_slots = IdAllocator(settings.pool.aux_slots)
        self._router, self.result_endpoint = bind_router(
            settings.result_endpoint, self.socket_limits
        )
        self._lock = threading.Lock()
        self._fetches: dict[int, RxSession] = {}
        self._forgotten_in_doubt = 0  # fetches dropped from _fetches with blocks in doubt
        self._commands: deque[tuple[str, RxSession]] = deque()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._links: dict[str, _Link] = {}  # io thread only
        self._by_dealer: dict[zmq.Socket[bytes], _Link] = {}  # io thread only
        self._reregistered: set[int] = set()  # io thread only: fetches retried after UNKNOWN_PEER
        self._stopping = threading.Event()
        self._draining = threading.Event()
        self._shutdown_once: Once[bool] = Once()
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

    # -- engine API --------------------------------------------------------------------
    def fetch(
        self,
        request_id: str,
        sender_endpoint: str,
        block_ids: Sequence[int] | np.ndarray,
        *,
        layers: tuple[int, int] | None = None,
        want_aux: bool = True,
        timeout_ms: int | None = None,
    ) -> RxHandle:
        """Ask ``sender_endpoint`` to write ``request_id`` into ``block_ids``; returns at once."""
        if self._draining.is_set():
            raise RejectedError(Reason.DRAINING, "receiver is draining")
        if not _REQUEST_ID.match(request_id):
            raise RejectedError(Reason.MALFORMED, "request id must be 1-256 printable ASCII chars")
        blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if blocks.size > self.settings.limits.max_blocks_per_request:
            raise RejectedError(Reason.TOO_LARGE, f"{blocks.size} blocks > max_blocks_per_request")
        check_blocks(self.pool.layout, blocks, "destination blocks")
        lb, le = layers or (0, self.pool.layout.num_layers)
        check_layers(self.pool.layout, lb, le)
        with self._lock:
            if len(self._fetches) >= self.settings.limits.max_fetches_in_flight:
                raise RejectedError(Reason.BUSY, "max_fetches_in_flight reached")
        aux_slot = int(self.aux_slots.take(1)[0]) if want_aux else -1
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
        )
        with self._lock:
            self._fetches[rx.fetch_id] = rx
        self._command(("fetch", rx))
        return RxHandle(self, rx)

    def _command(self, cmd: tuple[str, RxSession]) -> None:
        with self._lock:
            if self._stopping.is_set():
                return
            self._commands.append(cmd)
            os.eventfd_write(self._wake, 1)

    # -- io thread ---------------------------------------------------------------------
    def _run(self) -> None:
        poller: zmq.Poller | None = None
        polled: list[zmq.Socket[bytes]] = []
        try:
            while not self._stopping.is_set():
                self.io_progress = time.monotonic()
                dealers = list(self._by_dealer)
                if poller is None or dealers != polled:  # links changed: rebuild the poll set
                    poller, polled = zmq.Poller(), dealers
                    poller.register(self._router, zmq.POLLIN)
                    poller.register(self._wake, zmq.POLLIN)
                    for sock in dealers:
                        poller.register(sock, zmq.POLLIN)
                events = dict(poller.poll(int(_TICK_S * 1000)))
                if self._wake in events:
                    try:
                        os.eventfd_read(self._wake)
                    except BlockingIOError:
                        pass
                self._run_commands()
                for sock in events:
                    if sock is self._router or sock in self._by_dealer:
                        self._drain_socket(sock)  # type: ignore[arg-type]
                self._check_deadlines(time.monotonic())
                self.dataplane.progress()
        finally:
            for link in self._links.values():
                link.dealer.close(linger=0)
            self._router.close(linger=0)

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                kind, rx = self._commands.popleft()
            if kind == "fetch":
                self._start_fetch(rx)
            else:
                self._cancel(rx, RxState.CANCELLED, Reason.CANCELLED, "cancelled by the engine")

    def _link(self, endpoint: str) -> _Link:
        link = self._links.get(endpoint)
        if link is not None:
            return link
        # Our identity is our receiver id: a reconnect hands the sender's route over to us.
        dealer = connect_dealer(
            endpoint,
            self.socket_limits,
            self.settings.deadlines.send_timeout_ms,
            identity=self.receiver_id.encode(),
        )
        link = _Link(
            endpoint, dealer, time.monotonic() + self.settings.deadlines.register_timeout_ms / 1000
        )
        self._links[endpoint] = link
        self._by_dealer[dealer] = link
        reg = wire.Register(
            receiver_id=self.receiver_id,
            result_endpoint=self.result_endpoint,
            agent_metadata=self.dataplane.metadata(),
            layout=wire.WireLayout.of(self.pool.layout),
            kv_base=self.pool.kv_base,
            aux_base=self.pool.aux_base,
            device="VRAM" if self.pool.mem_type == "VRAM" else "DRAM",
            device_id=self.pool.device_id,
        )
        try:
            send_bounded(dealer, wire.encode(reg))
        except SendTimeout:
            self._drop_link(link, Reason.PEER_LOST, "REGISTER could not be sent")
        return link

    def _drop_link(self, link: _Link, reason: Reason, detail: str) -> None:
        waiting, link.waiting = link.waiting, []
        for rx in waiting:
            self._fail(rx, reason, detail)
        if self._links.get(link.endpoint) is link:
            del self._links[link.endpoint]
        self._by_dealer.pop(link.dealer, None)
        link.dealer.close(linger=0)

    def _start_fetch(self, rx: RxSession) -> None:
        if rx.ended:
            return
        link = self._link(rx.sender_endpoint)
        if link.ready:
            self._send_request(link, rx)
        elif self._links.get(rx.sender_endpoint) is link:
            link.waiting.append(rx)
        else:
            self._fail(rx, Reason.PEER_LOST, "sender unreachable")

    def _send_request(self, link: _Link, rx: RxSession) -> None:
        remaining_ms = max(1, int((rx.deadline - time.monotonic()) * 1000))
        msg = wire.RequestData(
            request_id=rx.request_id,
            fetch_id=rx.fetch_id,
            dst_blocks=rx.dst_blocks.tolist(),
            layer_begin=rx.layer_begin,
            layer_end=rx.layer_end,
            aux_slot=rx.aux_slot,
            timeout_ms=min(remaining_ms, 3_600_000),
        )
        try:
            send_bounded(link.dealer, wire.encode(msg))
        except SendTimeout:
            self._fail(rx, Reason.PEER_LOST, "REQUEST_DATA could not be sent (sender not reading)")
            return
        rx.mark_sent()
        self.stats.add("requests_sent")

    def _cancel(self, rx: RxSession, state: RxState, reason: Reason, detail: str) -> None:
        fence_s = self.settings.deadlines.cancel_fence_ms / 1000
        if not rx.end_locally(state, reason, detail, fence_s):
            return
        self.stats.add(f"fetches_{state}")
        link = self._links.get(rx.sender_endpoint)
        if link is not None:
            if rx in link.waiting:
                link.waiting.remove(rx)
            if rx.sent:
                try:
                    send_bounded(
                        link.dealer,
                        wire.encode(wire.Cancel(request_id=rx.request_id, fetch_id=rx.fetch_id)),
                    )
                except SendTimeout:
                    self.stats.add("send_timeouts")  # the fence deadline still bounds the wait
        self._maybe_forget(rx)

    def _fail(self, rx: RxSession, reason: Reason, detail: str) -> None:
        if rx.fail(reason, detail):
            self.stats.add("fetches_failed")
            self.stats.add(f"failed_{reason}")
        self._maybe_forget(rx)

    def _maybe_forget(self, rx: RxSession) -> None:
        """Drop a fetch once no write toward its blocks can come; free its aux slot if safe."""
        if not rx.ended or rx.fence is Fence.FENCED:
            return
        self._reregistered.discard(rx.fetch_id)
        with self._lock:
            if self._fetches.pop(rx.fetch_id, None) is None:
                return
            if rx.fence is Fence.IN_DOUBT:
                self._forgotten_in_doubt += 1
        if rx.aux_slot >= 0:
            if rx.fence is Fence.IN_DOUBT:
                self.stats.add("aux_slots_quarantined")
            else:
                self.aux_slots.give_back([rx.aux_slot])

    def _drain_socket(self, sock: zmq.Socket[bytes]) -> None:
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            body = frames[1:] if sock is self._router else frames
            try:
                msg = wire.decode_to_receiver(body, self.settings.limits.max_frame_bytes)
            except ProtocolError as e:
                self.stats.add(f"rejected_{e.reason}")
                continue
            try:
                self._on_message(sock, msg)
            except Exception:
                log.exception("receiver: message failed")
                self.stats.add("io_errors")

    def _on_message(self, sock: zmq.Socket[bytes], msg: wire.ToReceiver) -> None:
        if isinstance(msg, wire.RegisterReply):
            link = self._by_dealer.get(sock)
            if link is None or link.ready:
                return
            if not msg.ok:
                self._drop_link(link, msg.reason or Reason.INCOMPATIBLE, msg.detail)
                return
            link.ready, link.sender_id = True, msg.sender_id
            waiting, link.waiting = link.waiting, []
            for rx in waiting:
                if not rx.ended:
                    self._send_request(link, rx)
            return
        if isinstance(msg, wire.Reject):
            self.stats.add(f"peer_rejected_{msg.reason}")
            log.warning("sender rejected a message: %s %s", msg.reason, msg.detail)
            return
        with self._lock:
            found = self._fetches.get(msg.fetch_id)
        if found is None or found.request_id != msg.request_id:
            self.stats.add("late_messages")
            return
        rx = found
        if isinstance(msg, wire.CancelAck):
            rx.on_cancel_ack(msg.in_doubt)
            self._maybe_forget(rx)
            return
        if (
            msg.status == "failed"
            and msg.reason is Reason.UNKNOWN_PEER
            and rx.fetch_id not in self._reregistered
            and not rx.ended
        ):
            # The sender forgot us (it restarted): nothing was written; register again, once.
            self._reregistered.add(rx.fetch_id)
            self.stats.add("reregistrations")
            link = self._links.get(rx.sender_endpoint)
            if link is not None:
                self._drop_link(link, Reason.PEER_LOST, "sender forgot this receiver")
            self._start_fetch(rx)
            return
        aux = None
        if msg.status == "done" and rx.aux_slot >= 0 and msg.aux_bytes:
            n = min(msg.aux_bytes, self.pool.layout.aux_slot_bytes)
            aux = bytes(self.pool.aux[rx.aux_slot, :n].numpy().tobytes())
        if rx.on_result(msg.status, msg.reason, msg.detail, msg.nbytes, aux):
            self.stats.add(f"fetches_{rx.state}")
            self.stats.observe("fetch_seconds", time.monotonic() - rx.started)
            if msg.status == "done":
                self.stats.add("bytes_received", msg.nbytes)
        self._maybe_forget(rx)

    def _check_deadlines(self, now: float) -> None:
        for link in list(self._links.values()):
            if not link.ready and now >= link.register_deadline:
                self._drop_link(link, Reason.TIMEOUT, f"no REGISTER reply from {link.endpoint}")
        with self._lock:
            fetches = list(self._fetches.values())
        for rx in fetches:
            if not rx.ended and now >= rx.deadline:
                self._cancel(rx, RxState.TIMED_OUT, Reason.TIMEOUT, "kv_transfer_timeout passed")
            elif rx.fence is Fence.FENCED and rx.fence_expired(now):
                self.stats.add("fences_in_doubt")
                self._maybe_forget(rx)

    # -- shutdown ----------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None) -> bool:
        """Drain, then cancel what is left, wait for fences, stop; True if all blocks are safe.

        Open fetches may finish by themselves until ``drain_timeout_ms``
        (``drain_complete`` tells whether all did); the rest are cancelled and
        their fences awaited within the remaining bound. Safe to call again and from
        several threads: a later call waits (within its own bound) for the first and
        returns its answer, or False if the first has not finished by then.
        """
        total = self.settings.deadlines.shutdown_timeout_ms / 1000 if timeout is None else timeout
        t0 = time.monotonic()
        return bool(self._shutdown_once.run(lambda: self._shutdown(t0, total), total))

    def _shutdown(self, t0: float, total: float) -> bool:
        d = self.settings.deadlines
        deadline = t0 + total
        drain_deadline = min(t0 + d.drain_timeout_ms / 1000, deadline - 0.2 * total)
        self._draining.set()
        with self._lock:
            open_fetches = list(self._fetches.values())
        for rx in open_fetches:
            if self._started:
                rx.completion.wait(max(0.0, drain_deadline - time.monotonic()))
        self.drain_complete = all(rx.ended for rx in open_fetches)
        for rx in open_fetches:
            if not rx.ended:
                self._command(("cancel", rx))
        safe = True
        for rx in open_fetches:
            if self._started:
                rx.fence_done.wait(max(0.0, deadline - 0.1 * total - time.monotonic()))
            safe = safe and rx.blocks_reusable
        with self._lock:  # fetches that ended in doubt earlier: a late write may still land
            safe = safe and self._forgotten_in_doubt == 0
        with self._lock:  # _command writes the eventfd under this lock
            self._stopping.set()
        if self._started:
            self._io.join(max(0.0, deadline - time.monotonic()))
        else:
            self._router.close(linger=0)
        os.close(self._wake)
        self.dataplane.close()
        if self._owns_pool and safe:
            self.pool.close()
        log.info("receiver shutdown in %.3fs (blocks safe: %s)", time.monotonic() - t0, safe)
        return safe and not self._io.is_alive()
