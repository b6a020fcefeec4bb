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
    timeout, a Close that waits                                    of a tcp:// socket), handles,
    for writes in flight)                                          waits, _soon
    a transfer ends elsewhere (a      that thread queues the       nothing: ``_post`` hands the
    sender worker, shutdown)          reply (``IoHooks.call_soon``) reply to the io thread

No call ever blocks that thread (waits.py). What the gateway hands on::

    calls.py     one engine call from its frame to its reply (deadlines, max_inflight)
    waits.py     the calls that wait, with their timers (a Wait, a Close, a waiting Publish/Fetch)
    handles.py   the handles by id and the open Publish/Fetch of each key (retries, Lookup)
    roles.py     what differs for a sender and a receiver: one adapter per role

The socket. ``ipc://`` is a unix stream socket carrying length-prefixed frames
(channel.py: one system call per batch of frames, no ZMQ I/O threads); its file gets
``socket_mode`` (0600: the daemon's user only). ``tcp://`` is a ZMQ ROUTER and a CURVE
server admitting only ``engine_keys_dir``'s keys (required by the settings). Replies
queued during one io turn are written at its end: one system call per engine.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from kvxferd.auth import Transport, watch_server
from kvxferd.engine import engine_protocol as ep
from kvxferd.engine.calls import Calls
from kvxferd.engine.channel import ChannelClosed, StreamChannel, StreamListener
from kvxferd.engine.handles import MAX_HANDLES, HandleTable
from kvxferd.engine.roles import Role, role_for
from kvxferd.engine.waits import Waits
from kvxferd.stats import Stats
from kvxferd.transfer.control import process_context
from kvxferd.transfer.guard import Guard
from kvxferd.transfer.iohooks import IoHooks, Item
from kvxferd.transfer.poller import Poller
from kvxferd.transfer.pool import KvPool
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.sender import Sender

log = logging.getLogger("kvxferd.gateway")

MAX_CONNECTIONS = 1024  # engine connections on a unix socket; one more is closed at once
LINGER_POLL_S = 0.01  # stop(linger): how often it looks whether the engines closed their handles
TICK_S = 1.0  # last_progress while nothing happens
READ_BATCH = 256  # ROUTER frames read per turn before the io thread's other sockets get a turn

_conn_ids = itertools.count(1)


@dataclass(slots=True, eq=False)
class _Conn:
    """One engine connection on the unix socket."""

    rid: bytes
    channel: StreamChannel
    fd: int
    writing: bool = False  # registered for POLLOUT (its outbox is not empty)


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
        self.requested_endpoint = endpoint
        self.endpoint: str | None = None  # the bound address, once started
        self.socket_mode = socket_mode
        self.max_frame_bytes = max_frame_bytes
        # A TCP engine socket is a CURVE server (the settings refuse it plaintext).
        self.transport = transport
        self.engine_keys_dir = engine_keys_dir  # its allow-list: the engines' keys
        self.stats = Stats()
        self.guard = Guard(self.stats, log)  # unexpected errors while serving
        self.last_progress = time.monotonic()  # the io thread served us (or ticked)
        self.handles = HandleTable(self.stats, max_handles)
        self.waits = Waits(
            self.adapter, self.handles, self.stats, self.guard, self._reply, self._post
        )
        self.calls = Calls(
            service,
            self.adapter,
            self.handles,
            self.waits,
            self.stats,
            self.guard,
            self._reply,
            max_inflight=max_inflight,
            max_frame_bytes=max_frame_bytes,
        )
        self._soon: deque[Callable[[], None]] = deque()  # io thread only: replies to send now
        self._router: zmq.Socket[bytes] | None = None
        self._listener: StreamListener | None = None
        self._conns: dict[bytes, _Conn] = {}
        self._by_fd: dict[int, _Conn] = {}
        self._dirty: set[_Conn] = set()  # connections with replies queued this turn
        # Connections whose last frame came in an older engine protocol version (a client
        # of the previous release): their replies go in it. Bounded: MAX_CONNECTIONS.
        self._older: dict[bytes, int] = {}
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
        self.calls.pool_info = _pool_info(self.service, self.adapter)
        endpoint = self.requested_endpoint
        if endpoint.startswith("ipc://"):
            self._listener = _listen_ipc(endpoint, self.socket_mode)
            self.endpoint = endpoint
        else:
            self._router, self.endpoint = _listen_tcp(
                endpoint, self.max_frame_bytes, self.stats, self.transport, self.engine_keys_dir
            )
        self._started = True
        self._io.attach(self)
        log.info("engine gateway (%s) serving at %s", self.adapter.name, self.endpoint)
        assert self.endpoint is not None
        return self.endpoint

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
        self.calls.refusing = r

    def broken(self) -> str | None:
        """Why the gateway is not live (a caught unexpected error, its io thread gone), or None."""
        why = self.guard.broken()
        if (
            why is None
            and self._started
            and self.calls.refusing is None
            and not self._stopped.is_set()
            and not self._io.running
        ):
            return "the service's io thread no longer serves the engine socket"
        return why

    @property
    def refusing(self) -> ep.EngineReason | None:
        return self.calls.refusing

    @property
    def calls_in_flight(self) -> int:
        return len(self.waits)

    @property
    def handle_count(self) -> int:
        return len(self.handles)

    def stop(self, timeout: float, linger: float = 0.0) -> None:
        """Stop serving: outstanding calls get Error(shutting_down), sockets close; bounded.

        ``linger``: first wait up to that long for the engines to close the handles they
        still hold (a publish whose outcome its engine has not asked for yet: the engine's
        next wait gets it instead of a closed socket). Safe from any thread.
        """
        if not self._started or self._stopped.is_set():
            return
        until = time.monotonic() + max(0.0, linger)
        while self.handles and time.monotonic() < until:
            time.sleep(LINGER_POLL_S)  # engines are closing: no event says when the last did
        if self.calls.refusing is None:
            self.calls.refusing = ep.EngineReason.SHUTTING_DOWN
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
                    self._serve(conn.rid, frame)
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
        due = self.waits.run_due(now)
        if self._dirty:
            self._flush_replies()
        if self._router is not None and self._router_readable():
            return 0.0  # ZMQ's fd is edge-triggered: a reply may have taken the edge
        if soon:
            return 0.0
        return TICK_S if due is None else due

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
        self.waits.stop()
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
        self.handles.clear()
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
        self._older.pop(conn.rid, None)
        conn.channel.close()
        self.calls.orphaned(conn.rid, set(self._conns))  # a stream it left open is aborted
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
            self._serve(frames[0], frames[1])

    def _serve(self, rid: bytes, frame: bytes) -> None:
        """Serve one frame; it and what follows on ``rid`` are answered in its version."""
        version = ep.frame_version(frame)
        self._older.pop(rid, None)
        if version != ep.ENGINE_PROTOCOL_VERSION:
            if len(self._older) >= MAX_CONNECTIONS:
                del self._older[next(iter(self._older))]  # the longest-quiet one
            self._older[rid] = version
        self.calls.serve(rid, frame)

    def _router_readable(self) -> bool:
        sock = self._router
        return (
            sock is not None
            and not sock.closed
            and bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
        )

    def _reply(self, rid: bytes, msg: ep._Msg) -> None:
        frame = ep.encode(msg, self._older.get(rid, ep.ENGINE_PROTOCOL_VERSION))
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


def _listen_ipc(endpoint: str, socket_mode: int) -> StreamListener:
    """The unix stream socket of ``ipc://``: a stale file replaced, ``socket_mode`` set."""
    ipc_path = None
    if not endpoint.startswith("ipc://@"):
        path = endpoint[len("ipc://") :]
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, mode=_dir_mode(socket_mode), exist_ok=True)
        try:
            if stat.S_ISSOCK(os.stat(path).st_mode):
                os.unlink(path)  # stale (preflight made sure no daemon serves it), as ZMQ does
        except FileNotFoundError:
            pass
        ipc_path = path
    listener = StreamListener(endpoint)
    if ipc_path is not None:
        # bind created the file with the umask's mode; narrow it before serving.
        os.chmod(ipc_path, socket_mode)
    return listener


def _listen_tcp(
    endpoint: str,
    max_frame_bytes: int,
    stats: Stats,
    transport: Transport | None,
    engine_keys_dir: str | None,
) -> tuple[zmq.Socket[bytes], str]:
    """The ROUTER of ``tcp://`` (a CURVE server once ``transport`` has keys) and its bound address."""
    sock: zmq.Socket[bytes] = process_context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a gone engine fails, is counted
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    if endpoint.endswith(":0"):
        endpoint = endpoint[:-2] + ":*"
    try:
        if transport is not None:
            curve = transport.server_curve("engine", stats, engine_keys_dir)
            if curve is not None:
                curve.apply_server(sock)
                watch_server(sock, stats, curve.zap_domain)
        sock.bind(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return sock, bound.decode() if isinstance(bound, bytes) else str(bound)


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
