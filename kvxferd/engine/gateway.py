"""The engine gateway: a local engine drives this daemon's Sender or Receiver through one socket.

The daemon creates one :class:`Gateway` around its service once the service runs::

    gw = Gateway(sender, settings.service.engine_socket,
                 max_inflight=settings.service.max_client_inflight)
    gw.start()                  # bind; from now on the service's io thread serves it
    gw.refuse_new("draining")   # the drain began: publish/fetch refused, the rest still served
    gw.stop(timeout=2.0)        # outstanding calls get Error(shutting_down); sockets closed

Where things run. The gateway has no thread of its own: it is an
:class:`~kvxferd.transfer.iohooks.IoHook` of its service's io thread (the Sender's
``kvxferd-listener``, the Receiver's ``kvxferd-rx-io``), which polls the engine socket
beside its peers' sockets. An engine's Fetch is therefore read, started and its
RequestData sent by one thread, and its outcome is written back to the engine by the
thread that saw the fetch end, with no hand-off (issue 22: the asyncio loop the
gateway used to run on held 77-86 % of a daemon's GIL, and every hop between it and
the io thread cost a wake-up)::

    what                              runs on                      owns
    --------------------------------  ---------------------------  -----------------------------
    reading frames, every call,       the service's io thread      the listening socket and its
    replies, timers (a Wait's                                      connections (or the ROUTER
    timeout, a Close that waits                                    of a tcp:// socket), _handles,
    for writes in flight)                                          _work, _calls, _timers, _soon
    a transfer ends elsewhere (a      that thread queues the       nothing: ``_post`` hands the
    sender worker, shutdown)          reply (``IoHooks.call_soon``) reply to the io thread

No call ever blocks that thread: a Wait that must wait registers a callback on the
transfer's completion and a timer for its timeout; a Close that must wait for writes in
flight re-checks every ``CLOSE_POLL_S`` until they ended or its timeout passed.

The socket. ``ipc://`` is a unix stream socket carrying length-prefixed frames
(channel.py: one system call per batch of frames, no ZMQ I/O threads); its file gets
``socket_mode`` (0600: the daemon's user only). ``tcp://`` is a ZMQ ROUTER and a CURVE
server admitting only ``engine_keys_dir``'s keys (required by the settings).

Calls in flight are bounded by ``max_inflight``: while that many wait, one more
(inline or not) gets ``Error(busy)`` at once, it is never queued. Describe and Poll
are not counted. A malformed frame gets ``Error(malformed)`` (or the ProtocolError's
reason) and is counted in ``stats``; an unexpected exception in a call goes through
``self.guard`` (logged, counted, ``broken()`` names it) and the engine gets
``Error(internal)``; the io thread goes on.

Deadlines. A call's ``deadline_unix_ms`` is when its engine stops waiting. A call whose
deadline has passed is not executed: it is checked when the frame is decoded (a daemon
that was frozen reads its calls late) and right before the service is called, and gets
``Error(timeout)`` (``rejected_timeout``). A Close waits at most until its deadline.

One round trip. A Publish or Fetch with ``wait_ms`` is started, then waited on as a
Wait of the new handle would be (closing it when ``close``): the engine gets one reply,
the Outcome, with ``handle_id`` (engine_protocol.py).

Keys and handles. Publish is keyed by request id, Fetch by (request id, sender
endpoint, layer range). ``_work`` maps a key to its :class:`_Work`. A call runs on the
io thread, so a key is taken and settled in one step: a retry or Lookup is read only
after the first call returned::

    key state     _work[key]                  a Publish/Fetch with that key        Lookup
    ------------  --------------------------  -----------------------------------  --------------
    free          absent                      runs; -> open (stays free if it      unknown_handle
                                              failed or expired)
    open          _Work with its handle id    same parameters: that handle; other  that handle
                                              parameters: duplicate
    (Close(safe) of the handle: open -> free)

A handle id comes from a counter that starts at the daemon's start time in ms shifted
left by 20 bits, so no id is ever reused, not even by a restarted daemon. A handle
serves the connections that created it or found it by key (a retried Publish/Fetch or
a Lookup; the last ``MAX_OWNERS``); any other connection gets
``Error(unknown_handle)``. Close forgets a handle only when it reports the memory
safe; otherwise the handle stays so the engine can Poll or Close again.

Known limit: handles of an engine that died stay in the table (bounded by
``max_handles``) until an engine finds them by key and closes them, or the daemon
stops; the service ends their sessions (publish_ttl / kv_transfer_timeout) meanwhile.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import itertools
import logging
import os
import secrets
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import msgspec
import zmq

from kvxferd.auth import Transport, watch_server
from kvxferd.engine import engine_protocol as ep
from kvxferd.engine.channel import ChannelClosed, StreamChannel, StreamListener
from kvxferd.engine.roles import Key, Role, role_for
from kvxferd.errors import ProtocolError, RejectedError
from kvxferd.stats import Stats
from kvxferd.transfer.control import process_context
from kvxferd.transfer.guard import Guard
from kvxferd.transfer.iohooks import IoHooks, Item
from kvxferd.transfer.poller import Poller
from kvxferd.transfer.pool import KvPool
from kvxferd.transfer.receiver import Receiver, RxHandle
from kvxferd.transfer.sender import Sender, TxHandle

log = logging.getLogger("kvxferd.gateway")

T = TypeVar("T")

MAX_HANDLES = 65_536  # live handles across all engines; one more publish/fetch gets BUSY
MAX_CONNECTIONS = 1024  # engine connections on a unix socket; one more is closed at once
CLOSE_POLL_S = 0.002  # a Close that waits for writes in flight looks again this often
LINGER_POLL_S = 0.01  # stop(linger): how often it looks whether the engines closed their handles
TICK_S = 1.0  # last_progress while nothing happens
READ_BATCH = 256  # ROUTER frames read per turn before the io thread's other sockets get a turn
MAX_OWNERS = 16  # connections that may use one handle (its creator, then those that found it)

_Key = Key
_conn_ids = itertools.count(1)


@dataclass(slots=True)
class _Entry:
    owners: list[bytes]  # connections that may use the handle, oldest first
    handle: TxHandle | RxHandle
    key: _Key
    token: str = ""  # a publish's fetch token (the same in every reply for this handle)


@dataclass(slots=True)
class _Work:
    """One Publish/Fetch key in use: its parameters' digest and its handle id."""

    digest: bytes
    handle_id: int


@dataclass(slots=True, eq=False)
class _Call:
    """A call that waits: a Wait (or a waiting Publish/Fetch) or a Close; io thread only."""

    rid: bytes
    call_id: int
    handle_id: int
    entry: _Entry
    close: bool  # close once ended (Wait.close, Close, a waiting Publish/Fetch's close)
    until: float  # monotonic: its timeout (Pending / an open outcome / closed False then)
    deadline_ms: int  # the engine's deadline_unix_ms (0: none)
    kind: Literal["wait", "close", "start"]  # Wait, Close, or a waiting Publish/Fetch
    closing: bool = False  # ended; waiting for its writes before the close answers
    done: bool = False


@dataclass(slots=True, eq=False)
class _Conn:
    """One engine connection on the unix socket."""

    rid: bytes
    channel: StreamChannel
    fd: int
    writing: bool = False  # registered for POLLOUT (its outbox is not empty)


class _UnknownHandle(Exception):
    pass


class _Expired(Exception):
    """The call's deadline passed before the service was called."""


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _left_s(deadline_ms: int) -> float | None:
    """Seconds until ``deadline_ms`` (Unix ms; negative once passed), None for no deadline."""
    return None if deadline_ms == 0 else (deadline_ms - _now_ms()) / 1000


def _before(deadline_ms: int, fn: Callable[[], T]) -> T:
    """``fn()``, only if ``deadline_ms`` has not passed yet."""
    left = _left_s(deadline_ms)
    if left is not None and left <= 0:
        raise _Expired
    return fn()


class Gateway:
    """Serves the engine protocol for one Sender or Receiver, on that service's io thread."""

    def __init__(
        self,
        service: Sender | Receiver,
        endpoint: str,
        *,
        max_inflight: int = 1024,
        socket_mode: int = 0o600,
        max_handles: int = MAX_HANDLES,
        max_frame_bytes: int = ep.MAX_FRAME_BYTES,
        transport: Transport | None = None,
        engine_keys_dir: str | None = None,
    ) -> None:
        if max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        self.service = service
        self.adapter: Role = role_for(service)  # what differs by role (roles.py)
        self.role: Literal["sender", "receiver"] = self.adapter.name
        self.requested_endpoint = endpoint
        self.endpoint: str | None = None  # the bound address, once started
        self.max_inflight = max_inflight
        self.socket_mode = socket_mode
        self.max_handles = max_handles
        self.max_frame_bytes = max_frame_bytes
        # A TCP engine socket is a CURVE server (the settings refuse it plaintext).
        self.transport = transport
        self.engine_keys_dir = engine_keys_dir  # its allow-list: the engines' keys
        self.stats = Stats()
        self.guard = Guard(self.stats, log)  # unexpected errors while serving
        self.last_progress = time.monotonic()  # the io thread served us (or ticked)
        self._handle_ids = itertools.count((_now_ms() << 20) + 1)  # never an earlier daemon's
        self._handles: dict[int, _Entry] = {}
        self._work: dict[_Key, _Work] = {}
        self._calls: set[_Call] = set()
        # (when, seq, call, what): a call's timeout or its next close check; an entry whose
        # call was answered meanwhile is skipped when due, and dropped by ``_compact``.
        self._timers: list[tuple[float, int, _Call, Callable[[], None]]] = []
        self._timer_seq = itertools.count()
        self._soon: deque[Callable[[], None]] = deque()  # io thread only: replies to send now
        self._refusing: ep.EngineReason | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._listener: StreamListener | None = None
        self._conns: dict[bytes, _Conn] = {}
        self._by_fd: dict[int, _Conn] = {}
        self._dirty: set[_Conn] = set()  # connections with replies queued this turn
        self._ipc_path: str | None = None
        self._pool_info: ep.PoolInfo | None = None
        self._started = False
        self._stopped = threading.Event()  # io_stop ran: every socket is closed
        self._closing = False  # stop() was called: the next io_stop closes for good
        # The service's io thread serves us until its shutdown; then this thread (io_stop).
        self._io: IoHooks = service.io
        self._tail: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> str:
        """Bind the engine socket and hand the gateway to the service's io thread; the endpoint."""
        if self._started:
            raise RuntimeError("gateway already started")
        self._pool_info = _pool_info(self.service, self.adapter)
        endpoint = self.requested_endpoint
        if endpoint.startswith("ipc://"):
            self._listen_ipc(endpoint)
        else:
            self._listen_tcp(endpoint)
        self._started = True
        self._io.attach(self)
        log.info("engine gateway (%s) serving at %s", self.role, self.endpoint)
        assert self.endpoint is not None
        return self.endpoint

    def _listen_ipc(self, endpoint: str) -> None:
        if not endpoint.startswith("ipc://@"):
            path = endpoint[len("ipc://") :]
            parent = os.path.dirname(os.path.abspath(path))
            os.makedirs(parent, mode=_dir_mode(self.socket_mode), exist_ok=True)
            try:
                if stat.S_ISSOCK(os.stat(path).st_mode):
                    os.unlink(path)  # stale (preflight made sure no daemon serves it), as ZMQ does
            except FileNotFoundError:
                pass
            self._ipc_path = path
        self._listener = StreamListener(endpoint)
        if self._ipc_path is not None:
            # bind created the file with the umask's mode; narrow it before serving.
            os.chmod(self._ipc_path, self.socket_mode)
        self.endpoint = endpoint

    def _listen_tcp(self, endpoint: str) -> None:
        sock: zmq.Socket[bytes] = process_context().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a gone engine fails, is counted
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        if endpoint.endswith(":0"):
            endpoint = endpoint[:-2] + ":*"
        try:
            if self.transport is not None:
                curve = self.transport.server_curve("engine", self.stats, self.engine_keys_dir)
                if curve is not None:
                    curve.apply_server(sock)
                    watch_server(sock, self.stats, curve.zap_domain)
            sock.bind(endpoint)
        except BaseException:
            sock.close(linger=0)
            raise
        bound = sock.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint = bound.decode() if isinstance(bound, bytes) else str(bound)
        self._router = sock

    def refuse_new(self, reason: str | ep.EngineReason = ep.EngineReason.DRAINING) -> None:
        """From now on Publish/Fetch get ``Error(reason)``; Wait/Poll/Cancel/Close still work.

        Open handles stay served through the drain: engines wait for their requests'
        outcomes, and a Cancel or Close ends a request the service is draining as dropped
        by the drain (``failed``/``shutting_down``). ``reason`` is ``"draining"`` or
        ``"shutting_down"``. Safe to call from any thread.
        """
        r = ep.EngineReason(reason)
        if r not in (ep.EngineReason.DRAINING, ep.EngineReason.SHUTTING_DOWN):
            raise ValueError(f"refuse_new reason must be draining or shutting_down, not {r}")
        self._refusing = r

    def broken(self) -> str | None:
        """Why the gateway is not live (a caught unexpected error, its io thread gone), or None."""
        why = self.guard.broken()
        if (
            why is None
            and self._started
            and self._refusing is None
            and not self._stopped.is_set()
            and not self._io.running
        ):
            return "the service's io thread no longer serves the engine socket"
        return why

    @property
    def refusing(self) -> ep.EngineReason | None:
        return self._refusing

    @property
    def calls_in_flight(self) -> int:
        return len(self._calls)

    @property
    def handle_count(self) -> int:
        return len(self._handles)

    def stop(self, timeout: float, linger: float = 0.0) -> None:
        """Stop serving: outstanding calls get Error(shutting_down), sockets close; bounded.

        ``linger``: first wait up to that long for the engines to close the handles they
        still hold (a publish whose outcome its engine has not asked for yet: the engine's
        next wait gets it instead of a closed socket). Safe from any thread.
        """
        if not self._started or self._stopped.is_set():
            return
        until = time.monotonic() + max(0.0, linger)
        while self._handles and time.monotonic() < until:
            time.sleep(LINGER_POLL_S)  # engines are closing: no event says when the last did
        if self._refusing is None:
            self._refusing = ep.EngineReason.SHUTTING_DOWN
        self._closing = True
        io = self._io
        if io.call_soon(self.io_stop):
            if not self._stopped.wait(max(0.0, timeout)):
                log.warning("gateway stop: the io thread did not close it within %.1fs", timeout)
                return
        elif not io.running:  # never served, or the io thread has ended: nobody else touches it
            self.io_stop()
        io.detach(self)
        log.info("engine gateway stopped (%s)", self.endpoint)

    # -- the io thread's side (IoHook) -------------------------------------------------------
    def io_items(self) -> Sequence[Item]:
        if self._stopped.is_set():
            return []
        if self._router is not None:
            return [(self._router, zmq.POLLIN)]
        items: list[Item] = []
        if self._listener is not None:
            items.append((self._listener.fileno(), zmq.POLLIN))
        for c in self._conns.values():
            items.append((c.fd, zmq.POLLIN | (zmq.POLLOUT if c.writing else 0)))
        return items

    def io_ready(self, item: Any, events: int, now: float) -> None:
        self.last_progress = now
        try:
            self._ready(item, events)
        except Exception:  # a bug on one turn must not stop the gateway; the fd is read again
            self.guard.caught("gateway")

    def _ready(self, item: Any, events: int) -> None:
        if item is self._router:
            self._read_router()
            return
        if self._listener is not None and item == self._listener.fileno():
            self._accept()
            return
        conn = self._by_fd.get(item)
        if conn is None:
            return
        try:
            if events & zmq.POLLOUT:
                self._flush(conn)
            if events & zmq.POLLIN:
                for frame in conn.channel.recv():
                    self._on_frame(conn.rid, frame)
                if conn.channel.failed is not None:  # its frames before the fault answered
                    self._flush_replies()
                    raise ChannelClosed(conn.channel.failed)
        except ChannelClosed as e:
            self._drop(conn, str(e))

    def io_turn(self, now: float) -> float | None:
        if now - self.last_progress >= TICK_S:
            self.last_progress = now
        soon = self._soon
        for _ in range(65_536):
            if not soon:
                break
            fn = soon.popleft()
            self._guarded(fn)
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, call, fn = heapq.heappop(timers)
            if not call.done:
                self._guarded(fn)
        if self._dirty:
            self._flush_replies()
        if self._router is not None and self._router_readable():
            return 0.0  # ZMQ's fd is edge-triggered: a reply may have taken the edge
        if soon:
            return 0.0
        return TICK_S if not timers else max(0.0, timers[0][0] - now)

    def io_stop(self) -> None:
        """The io thread serving us ends.

        Asked by ``stop``: outstanding calls get shutting_down and every socket closes.
        Otherwise the service's io thread ends with its shutdown, before the daemon stops
        the gateway: engines still wait for, poll and close what they published or
        fetched until then, so the gateway goes on, served by a thread of its own
        (``kvxferd-gw-tail``, the service's threads are gone: every answer comes from
        sessions that ended).
        """
        if self._stopped.is_set():
            return
        if not self._closing and self._tail is None:
            self._serve_tail()
            return
        for call in list(self._calls):
            self._answer(
                call,
                ep.Error(
                    call_id=call.call_id,
                    reason=ep.EngineReason.SHUTTING_DOWN,
                    detail="the gateway is stopping",
                ),
            )
        self._flush_replies()
        for c in list(self._conns.values()):
            try:
                c.channel.flush()
            except ChannelClosed:
                pass
            c.channel.close()
        self._conns.clear()
        self._by_fd.clear()
        if self._listener is not None:
            self._listener.close()
        if self._router is not None:
            self._router.close(linger=0)
        self._handles.clear()
        self._work.clear()
        self._timers.clear()
        self._stopped.set()
        self._io.changed()  # the io thread must not poll the closed descriptors

    def _serve_tail(self) -> None:
        """Serve on a thread of our own from now on (``io_stop``)."""
        old = self._io
        io = IoHooks(self.guard)
        self._io = io
        self._tail = threading.Thread(
            target=self._tail_loop, args=(io,), name="kvxferd-gw-tail", daemon=True
        )
        io.attach(self)
        old.detach(self)
        self._tail.start()

    def _tail_loop(self, io: IoHooks) -> None:
        """The gateway's own poll loop, once its service's io thread has ended."""
        io.bind_thread()
        poller: Poller | None = None
        version, delay = -1, None
        try:
            while not self._stopped.is_set():
                try:
                    if poller is None or io.version != version:
                        poller, version = Poller(), io.version
                        for item, flags in io.items():
                            poller.register(item, flags)
                    wait = TICK_S if delay is None else min(TICK_S, delay)
                    if io.pending() or self._soon:
                        wait = 0.0
                    now = time.monotonic()
                    for item, ev in poller.poll(wait):
                        io.dispatch(item, ev, now)
                    delay = io.turn(time.monotonic())
                except Exception:
                    self.guard.caught("gateway tail")
                    poller = None
        finally:
            io.stop()
            io.close()

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            self.guard.caught("gateway")

    def _post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the io thread: at the end of this turn if we are on it, else soon."""
        io = self._io
        if io.on_io_thread():
            self._soon.append(fn)
        elif not io.call_soon(functools.partial(self._soon_append, fn)):
            self._soon_append(fn)  # the tail thread serves us now (``io_stop``)

    def _soon_append(self, fn: Callable[[], None]) -> None:
        self._soon.append(fn)
        self._io.wake()  # the tail thread, if ``_post`` raced the hand-over to it

    def _timer(self, when: float, call: _Call, fn: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (when, next(self._timer_seq), call, fn))
        if len(self._timers) > 2 * len(self._calls) + 1024:
            # Answered calls' timeouts (a publish_wait answered in a millisecond keeps its
            # 2-minute timeout here): dropped, so the heap is bounded by the calls waiting.
            self._timers = [t for t in self._timers if not t[2].done]
            heapq.heapify(self._timers)

    # -- connections -----------------------------------------------------------------------
    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(64):
            sock = self._listener.accept()
            if sock is None:
                return
            if len(self._conns) >= MAX_CONNECTIONS:
                self.stats.add("engine_connections_refused")
                sock.close()
                continue
            channel = StreamChannel(sock, self.max_frame_bytes)
            rid = b"\x01" + next(_conn_ids).to_bytes(8, "little")
            conn = _Conn(rid, channel, channel.fileno())
            self._conns[rid] = conn
            self._by_fd[conn.fd] = conn
            self.stats.add("engine_connections")
            self._io.changed()

    def _drop(self, conn: _Conn, why: str) -> None:
        if self._conns.pop(conn.rid, None) is None:
            return
        self._by_fd.pop(conn.fd, None)
        conn.channel.close()
        if "closed by the peer" not in why:
            self.stats.add("engine_connections_dropped")
            log.warning("engine connection dropped: %s", why)
        self._io.changed()

    def _flush(self, conn: _Conn) -> None:
        if conn.channel.flush() and conn.writing:
            conn.writing = False
            self._io.changed()

    def _read_router(self) -> None:
        sock = self._router
        assert sock is not None
        for _ in range(READ_BATCH):
            try:
                if not self._router_readable():
                    return
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                if sock.closed:
                    return
                self.stats.add("recv_errors")
                log.warning("gateway: receive failed: %s", e)
                return
            if len(frames) != 2:
                self.stats.add(f"rejected_{ep.EngineReason.MALFORMED}")
                self._reply(
                    frames[0],
                    ep.Error(
                        call_id=ep.salvage_call_id(frames[1:]),
                        reason=ep.EngineReason.MALFORMED,
                        detail=f"{len(frames) - 1} frames, expected 1",
                    ),
                )
                continue
            self._on_frame(frames[0], frames[1])

    def _router_readable(self) -> bool:
        sock = self._router
        return (
            sock is not None
            and not sock.closed
            and bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
        )

    def _reply(self, rid: bytes, msg: ep._Msg) -> None:
        frame = ep.encode(msg)
        if self._router is not None:
            # NOBLOCK: a gone engine (ROUTER_MANDATORY), a full queue or a closing socket
            # drops the reply, counted.
            try:
                self._router.send_multipart([rid, frame], flags=zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:
                self.stats.add("reply_dropped")
            return
        conn = self._conns.get(rid)
        if conn is None:
            self.stats.add("reply_dropped")
            return
        try:
            conn.channel.queue(frame)  # written at the end of this turn, with the others
        except ChannelClosed as e:
            self.stats.add("reply_dropped")
            self._drop(conn, str(e))
            return
        self._dirty.add(conn)

    def _flush_replies(self) -> None:
        """Write every reply queued this turn: one system call (one wake-up) per engine."""
        dirty, self._dirty = self._dirty, set()
        for conn in dirty:
            if conn.rid not in self._conns:
                continue
            try:
                empty = conn.channel.flush()
            except ChannelClosed as e:
                self.stats.add("reply_dropped")
                self._drop(conn, str(e))
                continue
            if not empty and not conn.writing:  # the kernel took only part: wait to write
                conn.writing = True
                self._io.changed()

    # -- calls -------------------------------------------------------------------------------
    def _on_frame(self, rid: bytes, body: bytes) -> None:
        try:
            self._serve(rid, body)
        except Exception:
            self.guard.caught("gateway")
            self.stats.add("internal_errors")
            self._reply(
                rid,
                ep.Error(
                    call_id=ep.salvage_call_id([body]),
                    reason=ep.EngineReason.INTERNAL,
                    detail="the daemon failed on this message (a bug; see its log)",
                ),
            )

    def _serve(self, rid: bytes, body: bytes) -> None:
        try:
            msg = ep.decode_to_gateway([body], self.max_frame_bytes)
        except ProtocolError as e:
            self.stats.add(f"rejected_{e.reason}")
            self._reply(
                rid,
                ep.Error(
                    call_id=ep.salvage_call_id([body]),
                    reason=ep.EngineReason(e.reason.value),
                    detail=e.detail[:1024],
                ),
            )
            return
        tag = msg.__struct_config__.tag
        self.stats.add(f"calls_{tag}")
        deadline = getattr(msg, "deadline_unix_ms", 0)
        if deadline and _now_ms() >= deadline:
            self.stats.add("rejected_timeout")
            self._reply(rid, _expired(msg.call_id, "it arrived"))
            return
        if isinstance(msg, ep.Describe):
            self._reply(rid, self._describe(msg))
            return
        if isinstance(msg, ep.Poll):
            self._reply(rid, self._poll(rid, msg))
            return
        if len(self._calls) >= self.max_inflight:
            self.stats.add("rejected_busy")
            self._reply(
                rid,
                ep.Error(
                    call_id=msg.call_id,
                    reason=ep.EngineReason.BUSY,
                    detail=f"{self.max_inflight} calls in flight (max_inflight)",
                ),
            )
            return
        try:
            reply = self._call(rid, msg)
        except Exception as e:
            reply = self._call_error(msg, e)
        if reply is not None:
            self._reply(rid, reply)

    def _call(self, rid: bytes, msg: ep.ToGateway) -> ep._Msg | None:
        """The reply of a call, or None when it waits (its reply comes from ``_answer``)."""
        if isinstance(msg, ep.Publish | ep.Fetch):
            return self._start(rid, msg)
        if isinstance(msg, ep.Lookup):
            return self._lookup(rid, msg)
        if isinstance(msg, ep.Wait):
            entry = self._entry(rid, msg.handle_id)
            if msg.timeout_ms == 0 and not entry.handle.session.completion.done():
                return ep.Pending(call_id=msg.call_id)
            return self._wait(
                _Call(
                    rid,
                    msg.call_id,
                    msg.handle_id,
                    entry,
                    msg.close,
                    time.monotonic() + msg.timeout_ms / 1000,
                    msg.deadline_unix_ms,
                    "wait",
                )
            )
        if isinstance(msg, ep.Cancel):
            entry = self._entry(rid, msg.handle_id)
            _before(msg.deadline_unix_ms, entry.handle.cancel)
            return ep.Ok(call_id=msg.call_id)
        if isinstance(msg, ep.Close):
            entry = self._entry(rid, msg.handle_id)
            call = _Call(
                rid,
                msg.call_id,
                msg.handle_id,
                entry,
                True,
                time.monotonic() + msg.timeout_ms / 1000,
                msg.deadline_unix_ms,
                "close",
            )
            return self._begin_close(call)
        raise AssertionError(f"unexpected message {type(msg).__name__}")

    # -- waiting ----------------------------------------------------------------------------
    def _wait(self, call: _Call) -> ep._Msg | None:
        """Answer ``call`` now if its transfer ended (and, closing, its writes too), else later."""
        completion = call.entry.handle.session.completion
        if completion.done():
            return self._ended(call)
        self._calls.add(call)
        completion.add_done_callback(functools.partial(self._done_callback, call))
        self._timer(call.until, call, functools.partial(self._on_timeout, call))
        return None

    def _done_callback(self, call: _Call, _value: object) -> None:
        """The transfer ended (on whatever thread ended it): answer on the io thread."""
        self._post(functools.partial(self._on_done, call))

    def _on_done(self, call: _Call) -> None:
        if call.done or call.closing:
            return
        reply = self._ended(call)
        if reply is not None:
            self._answer(call, reply)

    def _on_timeout(self, call: _Call) -> None:
        if call.done:
            return
        if call.closing:  # the writes did not end in time: close answers what it can
            self._answer(call, self._close_now(call))
            return
        if call.kind == "wait":
            self._answer(call, ep.Pending(call_id=call.call_id))
        else:
            self._answer(call, self._open_outcome(call))

    def _ended(self, call: _Call) -> ep._Msg | None:
        """The transfer of ``call`` ended: its outcome, closed if asked (None: the close waits)."""
        if not call.close:
            return self._outcome_of(call)
        if self.adapter.closes_at_once(call.entry.handle) or time.monotonic() >= call.until:
            return self._close_now(call)
        if not call.closing:  # the outcome is known; its writes in flight are not over yet
            call.closing = True
            self._calls.add(call)
            self._timer(
                time.monotonic() + CLOSE_POLL_S, call, functools.partial(self._close_poll, call)
            )
        return None

    def _close_poll(self, call: _Call) -> None:
        if call.done:
            return
        if self.adapter.closes_at_once(call.entry.handle) or time.monotonic() >= call.until:
            self._answer(call, self._close_now(call))
        else:
            self._timer(
                time.monotonic() + CLOSE_POLL_S, call, functools.partial(self._close_poll, call)
            )

    def _begin_close(self, call: _Call) -> ep._Msg | None:
        """A Close: cancel if open; answered at once when safe, else once its writes ended."""
        handle = call.entry.handle
        if self.adapter.closes_at_once(handle):
            return self._close_now(call)
        safe = _before(call.deadline_ms, lambda: handle.close(0))  # cancels an open transfer
        if safe or time.monotonic() >= call.until:
            return self._closed_reply(call, safe)
        call.closing = True
        self._calls.add(call)
        self._timer(
            time.monotonic() + CLOSE_POLL_S, call, functools.partial(self._close_poll, call)
        )
        return None

    def _close_now(self, call: _Call) -> ep._Msg:
        """Close the handle with no further wait; the reply (Closed, or the closed Outcome)."""
        try:
            safe = _close(call.entry.handle, call.deadline_ms)
        except _Expired:
            self.stats.add("rejected_timeout")
            return _expired(call.call_id, "its close was due")
        return self._closed_reply(call, safe)

    def _closed_reply(self, call: _Call, safe: bool) -> ep._Msg:
        self._forget(call.handle_id, call.entry, safe)
        if call.kind == "close":
            return ep.Closed(call_id=call.call_id, safe=bool(safe))
        out = self._outcome_of(call)
        return msgspec.structs.replace(out, closed=bool(safe))

    def _outcome_of(self, call: _Call) -> ep.Outcome:
        handle = call.entry.handle
        value = handle.session.completion.value()
        if value is None:  # pragma: no cover - only asked once ended
            return self._open_outcome(call)
        hid = call.handle_id if call.kind == "start" else 0
        return self.adapter.outcome(call.call_id, handle, value, hid)

    def _open_outcome(self, call: _Call) -> ep.Outcome:
        """A waiting Publish/Fetch not ended within its wait: its open state and handle."""
        return ep.Outcome(
            call_id=call.call_id, state=self.adapter.open_state, handle_id=call.handle_id
        )

    def _answer(self, call: _Call, reply: ep._Msg) -> None:
        if call.done:
            return
        call.done = True
        self._calls.discard(call)
        self._reply(call.rid, reply)

    # -- publish / fetch ----------------------------------------------------------------------
    def _forget(self, handle_id: int, entry: _Entry, safe: bool) -> None:
        if safe and self._handles.get(handle_id) is entry:
            del self._handles[handle_id]
            work = self._work.get(entry.key)
            if work is not None and work.handle_id == handle_id:
                del self._work[entry.key]

    def _start(self, rid: bytes, msg: ep.Publish | ep.Fetch) -> ep._Msg | None:
        """Publish or Fetch: the handle of the open call with this key, or a new one; with
        ``wait_ms``, waited on in the same call."""
        if not self.adapter.serves(msg):
            return self._refuse(
                msg.call_id, ep.EngineReason.WRONG_ROLE, f"this daemon is a {self.role}"
            )
        if msg.wait_ms and isinstance(msg, ep.Publish) and msg.token:
            return self._refuse(
                msg.call_id,
                ep.EngineReason.MALFORMED,
                "a waiting publish cannot ask for a token: pass fetch_token",
            )
        key, digest = self.adapter.key(msg), _digest(msg)
        if (work := self._work.get(key)) is not None and work.handle_id in self._handles:
            if work.digest != digest:
                what = "published" if isinstance(msg, ep.Publish) else "fetched"
                return self._refuse(
                    msg.call_id,
                    ep.EngineReason.DUPLICATE,
                    f"request {msg.request_id} is already {what} with other parameters",
                )
            found = self._share(rid, key)
            assert found is not None
            self.stats.add("calls_found_by_key")
            return self._started_reply(rid, msg, found)
        if self._refusing is not None:
            return self._refuse(
                msg.call_id,
                self._refusing,
                f"the daemon is {self._refusing.value.replace('_', ' ')}",
            )
        if len(self._handles) >= self.max_handles:
            return self._refuse(
                msg.call_id, ep.EngineReason.BUSY, f"{self.max_handles} handles open (max_handles)"
            )
        token = ""
        if isinstance(msg, ep.Publish):
            if msg.fetch_token and len(msg.fetch_token) < ep.MIN_TOKEN_CHARS:
                return self._refuse(
                    msg.call_id,
                    ep.EngineReason.MALFORMED,
                    f"fetch_token shorter than {ep.MIN_TOKEN_CHARS} characters",
                )
            # 128 random bits, URL-safe: it travels in the engine's transfer parameters.
            token = msg.fetch_token or (secrets.token_urlsafe(16) if msg.token else "")
        handle = _before(msg.deadline_unix_ms, self.adapter.start(msg, token))
        hid = next(self._handle_ids)
        self._handles[hid] = _Entry([rid], handle, key, token)
        self._work[key] = _Work(digest, hid)
        return self._started_reply(rid, msg, hid)

    def _started_reply(self, rid: bytes, msg: ep.Publish | ep.Fetch, hid: int) -> ep._Msg | None:
        """The Handle; for a waiting call, its Outcome (now or later)."""
        entry = self._handles[hid]
        if not msg.wait_ms:
            return self.adapter.handle_reply(msg, hid, entry.token)
        return self._wait(
            _Call(
                rid,
                msg.call_id,
                hid,
                entry,
                msg.close,
                time.monotonic() + msg.wait_ms / 1000,
                msg.deadline_unix_ms,
                "start",
            )
        )

    def _describe(self, msg: ep.Describe) -> ep._Msg:
        """PoolInfo; with a topology, the engine declares its rank's record first."""
        assert self._pool_info is not None
        if msg.topology is not None:
            try:
                self.service.declare_topology(msg.topology)
            except RejectedError as e:
                return self._refuse(msg.call_id, ep.EngineReason(e.reason.value), e.detail)
        return msgspec.structs.replace(
            self._pool_info, call_id=msg.call_id, topology=self.service.topology
        )

    def _lookup(self, rid: bytes, msg: ep.Lookup) -> ep._Msg:
        """The open call with this key, shared with this connection."""
        problem = self.adapter.lookup_problem(msg)
        if problem is not None:
            return self._refuse(msg.call_id, ep.EngineReason.MALFORMED, problem)
        found = self._share(rid, self.adapter.key(msg))
        if found is not None:
            return ep.Handle(call_id=msg.call_id, handle_id=found)
        return self._refuse(
            msg.call_id,
            ep.EngineReason.UNKNOWN_HANDLE,
            f"no open {self.adapter.opens} of request {msg.request_id}",
        )

    def _share(self, rid: bytes, key: _Key) -> int | None:
        """The open handle of ``key``, now also usable by connection ``rid``; None: key free."""
        work = self._work.get(key)
        entry = None if work is None else self._handles.get(work.handle_id)
        if work is None or entry is None:
            self._work.pop(key, None)
            return None
        if rid not in entry.owners:
            entry.owners.append(rid)
            del entry.owners[:-MAX_OWNERS]
        return work.handle_id

    def _refuse(self, call_id: int, reason: ep.EngineReason, detail: str) -> ep.Error:
        self.stats.add(f"rejected_{reason}")
        return ep.Error(call_id=call_id, reason=reason, detail=detail)

    def _entry(self, rid: bytes, handle_id: int) -> _Entry:
        entry = self._handles.get(handle_id)
        if entry is None or rid not in entry.owners:
            raise _UnknownHandle
        return entry

    def _poll(self, rid: bytes, msg: ep.Poll) -> ep._Msg:
        entry = self._handles.get(msg.handle_id)
        if entry is None or rid not in entry.owners:
            self.stats.add("rejected_unknown_handle")
            return ep.Error(
                call_id=msg.call_id,
                reason=ep.EngineReason.UNKNOWN_HANDLE,
                detail="no such handle on this connection",
            )
        completion = entry.handle.session.completion
        value = completion.value() if completion.done() else None
        if value is None:
            return ep.Pending(call_id=msg.call_id)
        return self.adapter.outcome(msg.call_id, entry.handle, value)

    def _call_error(self, msg: ep.ToGateway, e: Exception) -> ep.Error:
        """The Error reply for a call that raised ``e`` (counted; a bug is logged as one)."""
        if isinstance(e, _UnknownHandle):
            self.stats.add("rejected_unknown_handle")
            return ep.Error(
                call_id=msg.call_id,
                reason=ep.EngineReason.UNKNOWN_HANDLE,
                detail="no such handle on this connection",
            )
        if isinstance(e, _Expired):
            self.stats.add("rejected_timeout")
            return _expired(msg.call_id, "the gateway got to it")
        if isinstance(e, RejectedError):
            self.stats.add(f"rejected_{e.reason}")
            return ep.Error(
                call_id=msg.call_id, reason=ep.EngineReason(e.reason.value), detail=e.detail[:1024]
            )
        try:
            raise e
        except Exception:
            self.guard.caught(f"gateway {msg.__struct_config__.tag} call")
        self.stats.add("internal_errors")
        return ep.Error(call_id=msg.call_id, reason=ep.EngineReason.INTERNAL, detail=repr(e)[:1024])


def _expired(call_id: int, when: str) -> ep.Error:
    return ep.Error(
        call_id=call_id,
        reason=ep.EngineReason.TIMEOUT,
        detail=f"the call's deadline had passed when {when}; it was not executed",
    )


def _digest(msg: ep.Publish | ep.Fetch) -> bytes:
    """What a retry must repeat to get the same handle: blocks and aux / aux wanted."""
    if isinstance(msg, ep.Publish):
        params: list[object] = [msg.block_ids, msg.aux, msg.expected_fetches]
        if msg.token or msg.fetch_token or msg.allowed_receivers:
            params += [msg.token, msg.fetch_token, sorted(msg.allowed_receivers)]
    else:
        params = [msg.block_ids, msg.want_aux]
        if msg.token or msg.sender_key:
            params += [msg.token, msg.sender_key]
        if msg.sender_endpoints:
            params += [msg.sender_endpoints, msg.tokens, msg.sender_keys]
    return hashlib.blake2b(msgspec.msgpack.encode(params), digest_size=16).digest()


def _close(handle: TxHandle | RxHandle, deadline_ms: int) -> bool:
    """Close without waiting (the io thread never waits): not at all once the deadline passed."""
    left = _left_s(deadline_ms)
    if left is not None and left <= 0:  # the engine gave up: it never hears of this close
        raise _Expired
    return handle.close(0)


def _dir_mode(socket_mode: int) -> int:
    """Mode of a socket directory we create: the owner always; group/other only if the socket lets them."""
    mode = 0o700
    if socket_mode & 0o060:
        mode |= 0o050
    if socket_mode & 0o006:
        mode |= 0o005
    return mode


def _pool_info(service: Sender | Receiver, adapter: Role) -> ep.PoolInfo:
    pool: KvPool = service.pool
    s = pool.settings
    kv_bytes = s.kv_bytes
    aux_bytes = s.aux_slots * s.aux_slot_bytes
    on_cpu = s.device == "cpu"
    layout = ep.PoolLayout(
        num_layers=s.num_layers,
        num_blocks=s.num_blocks,
        block_bytes=s.block_bytes,
        dtype=s.dtype,
        aux_slots=s.aux_slots,
        aux_slot_bytes=s.aux_slot_bytes,
        kv_offset=0,
        aux_offset=kv_bytes if on_cpu else 0,
    )
    endpoint, daemon_id = adapter.identity()
    return ep.PoolInfo(
        call_id=0,
        role=adapter.name,
        shm_name=pool.shm_name,
        shm_bytes=aux_bytes + (kv_bytes if on_cpu else 0),
        layout=layout,
        device="cpu" if on_cpu else "cuda",
        cuda_device=0 if on_cpu else s.cuda_device,
        cuda_ipc_handle=None if on_cpu else cuda_ipc_handle(pool),
        endpoint=endpoint,
        daemon_id=daemon_id,
        # The daemon's CURVE public key once security is configured ("" while off).
        public_key=getattr(service, "public_key", "") or "",
    )


def cuda_ipc_handle(pool: KvPool) -> bytes:  # pragma: no cover - needs a GPU
    """The KV tensor's CUDA IPC handle, msgpack-encoded (see docs/engine-api.md, "GPU pools").

    ``UntypedStorage._share_cuda_()`` gives the fields ``torch.multiprocessing``
    would hand over; we send them as a typed msgspec struct. The daemon keeps
    the pool (and so the allocation) alive for its whole life.
    """
    kv = pool.kv
    storage = kv.untyped_storage()
    (
        device,
        handle,
        size_bytes,
        offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()
    return ep.encode_cuda_ipc(
        ep.CudaIpcHandle(
            device=int(device),
            handle=bytes(handle),
            storage_size_bytes=int(size_bytes),
            storage_offset_bytes=int(offset_bytes),
            ref_counter_handle=bytes(ref_counter_handle),
            ref_counter_offset=int(ref_counter_offset),
            event_handle=bytes(event_handle or b""),
            event_sync_required=bool(event_sync_required),
            tensor_offset=int(kv.storage_offset()),
            shape=[int(d) for d in kv.shape],
            stride=[int(d) for d in kv.stride()],
        )
    )
