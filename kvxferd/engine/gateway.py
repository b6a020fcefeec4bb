"""The engine gateway: a local engine drives this daemon's Sender or Receiver through one ROUTER socket.

The daemon creates one :class:`Gateway` around its service and runs it on its
asyncio loop::

    gw = Gateway(sender, settings.service.engine_socket,
                 max_inflight=settings.service.max_client_inflight)
    await gw.start()            # bind; serve until stop
    gw.refuse_new("draining")   # the drain began: publish/fetch refused, the rest still served
    await gw.stop(timeout=2.0)  # cancel outstanding calls (each gets an Error), close the socket

Where things run::

    what                         runs on                   owns
    ---------------------------  ------------------------  -------------------------------------
    reader, serve task (a tick), the loop start() ran on   the ROUTER (a plain zmq socket, read
    call tasks                                             when its fd is readable), _handles,
                                                           _work, _calls, _refusing; no lock: only
                                                           this loop touches them
    publish / fetch / lookup /   the loop, inline, as the  nothing; the service calls never wait
    cancel, a Wait or Close      frame is read             on a peer (a lock held for microseconds,
    that need not wait                                     an eventfd write)
    Wait that must wait          a call task (wait_async)  the awaiting future, on this loop
    Close that must wait         kvxferd-gw-close threads  nothing; they may block up to timeout

A call that may block never runs on the loop; a call that cannot block runs
inline, with no task and no thread hand-off (issue 12: the asyncio socket, the
task and the thread-pool hop per call were most of a daemon's CPU per request).
Calls served at once are bounded by ``max_inflight``: while that many wait, one
more (inline or not) gets ``Error(busy)`` at once, it is never queued.
Describe and Poll answer inline and are not counted. A malformed frame gets
``Error(malformed)`` (or the ProtocolError's reason), is counted in ``stats``,
and never stops the serve task. An unexpected exception in the serve task or a
call task goes through ``self.guard`` (logged, counted, ``broken()`` names it)
and the engine gets ``Error(internal)``; the serve task goes on.

Deadlines. A call's ``deadline_unix_ms`` is when its engine stops waiting. A
call whose deadline has passed is not executed: it is checked when the frame is
decoded (a daemon that was frozen reads its calls late), again right before the
service is called, and on the close thread, and gets ``Error(timeout)``
(``rejected_timeout``). A Close still runs waits at most until its deadline.

Keys and handles. Publish is keyed by request id, Fetch by (request id, sender
endpoint, layer range). ``_work`` maps a key to its :class:`_Work`. The service
call runs inline on the loop, so a key is taken and settled in one step: a
retry or Lookup is read only after the first call returned (before issue 12 the
call ran on a thread and a key had a "running" state that retries waited on)::

    key state     _work[key]                  a Publish/Fetch with that key        Lookup
    ------------  --------------------------  -----------------------------------  --------------
    free          absent                      runs; -> open (stays free if it      unknown_handle
                                              failed or expired)
    open          _Work with its handle id    same parameters: that handle; other  that handle
                                              parameters: duplicate
    (Close(safe) of the handle: open -> free)

A handle id comes from a counter that starts at the daemon's start time in ms
shifted left by 20 bits, so no id is ever reused, not even by a restarted
daemon. A handle serves the connections (routing ids) that created it or found
it by key (a retried Publish/Fetch or a Lookup; the last ``MAX_OWNERS``); any
other connection gets ``Error(unknown_handle)``. Close forgets a handle only when
it reports the memory safe; otherwise the handle stays so the engine can Poll or
Close again.

Known limit: ZMQ does not say when an engine disconnects, so handles of an
engine that died stay in the table (bounded by ``max_handles``) until an engine
finds them by key and closes them, or the daemon stops; the service ends their
sessions (publish_ttl / kv_transfer_timeout) in the meantime.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import logging
import os
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import msgspec
import zmq

from kvxferd.auth import Transport, watch_server
from kvxferd.engine import engine_protocol as ep
from kvxferd.errors import ProtocolError, RejectedError
from kvxferd.stats import Stats
from kvxferd.transfer.control import process_context
from kvxferd.transfer.guard import Guard
from kvxferd.transfer.pool import KvPool
from kvxferd.transfer.receiver import Receiver, RxHandle
from kvxferd.transfer.sender import Sender, TxHandle
from kvxferd.transfer.session import Fence, RxOutcome, TxOutcome

log = logging.getLogger("kvxferd.gateway")

T = TypeVar("T")

MAX_HANDLES = 65_536  # live handles across all engines; one more publish/fetch gets BUSY
CLOSE_THREADS = 32  # close(timeout): may block up to the engine's timeout
TICK_S = 1.0  # the serve task's tick: last_progress, and a read in case an fd edge was missed
READ_BATCH = 256  # frames read per turn of the loop before other callbacks get a turn
MAX_OWNERS = 16  # connections that may use one handle (its creator, then those that found it)

_Key = tuple[str, str, str, int, int]  # (kind, request id, sender endpoint, layer begin, end)


@dataclass(slots=True)
class _Entry:
    owners: list[bytes]  # routing ids that may use the handle, oldest first
    handle: TxHandle | RxHandle
    key: _Key
    token: str = ""  # a publish's fetch token (the same in every reply for this handle)


@dataclass(slots=True)
class _Work:
    """One Publish/Fetch key in use: its parameters' digest and its handle id."""

    digest: bytes
    handle_id: int


class _UnknownHandle(Exception):
    pass


class _Expired(Exception):
    """The call's deadline passed before the service was called."""


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _left_s(deadline_ms: int) -> float | None:
    """Seconds until ``deadline_ms`` (Unix ms; negative once passed), None for no deadline."""
    return None if deadline_ms == 0 else (deadline_ms - _now_ms()) / 1000


def _before(deadline_ms: int, fn: Callable[[], T]) -> Callable[[], T]:
    """``fn``, run only if ``deadline_ms`` has not passed when a gateway thread gets to it."""

    def run() -> T:
        left = _left_s(deadline_ms)
        if left is not None and left <= 0:
            raise _Expired
        return fn()

    return run


class Gateway:
    """Serves the engine protocol for one Sender or Receiver, on the loop ``start`` ran on."""

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
        self.role: Literal["sender", "receiver"] = (
            "sender" if isinstance(service, Sender) else "receiver"
        )
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
        self.guard = Guard(self.stats, log)  # unexpected errors of its threads
        self.last_progress = time.monotonic()  # the serve task took a message or ticked
        self._handle_ids = itertools.count((_now_ms() << 20) + 1)  # never an earlier daemon's
        self._handles: dict[int, _Entry] = {}
        self._work: dict[_Key, _Work] = {}
        self._calls: dict[asyncio.Task[None], int] = {}  # call task -> call id
        self._refusing: ep.EngineReason | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._fd: int | None = None  # the ROUTER's fd, watched by the loop (add_reader)
        self._read_soon = False  # a _read is scheduled with call_soon
        self._serve_task: asyncio.Task[None] | None = None
        self._ipc_path: str | None = None
        self._slow: ThreadPoolExecutor | None = None
        self._pool_info: ep.PoolInfo | None = None

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> str:
        """Bind the ROUTER and start serving on the running loop; the bound endpoint."""
        if self._sock is not None:
            raise RuntimeError("gateway already started")
        self._loop = asyncio.get_running_loop()
        self._pool_info = _pool_info(self.service)
        sock: zmq.Socket[bytes] = process_context().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a gone engine fails, is counted
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        endpoint = self.requested_endpoint
        try:
            if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):
                self._ipc_path = endpoint[len("ipc://") :]
                parent = os.path.dirname(os.path.abspath(self._ipc_path))
                os.makedirs(parent, mode=_dir_mode(self.socket_mode), exist_ok=True)
            elif endpoint.startswith("tcp://") and endpoint.endswith(":0"):
                endpoint = endpoint[:-2] + ":*"
            if self.transport is not None and endpoint.startswith("tcp://"):
                curve = self.transport.server_curve("engine", self.stats, self.engine_keys_dir)
                if curve is not None:
                    curve.apply_server(sock)
                    watch_server(sock, self.stats, curve.zap_domain)
            sock.bind(endpoint)
            if self._ipc_path is not None:
                # libzmq creates the file with the umask's mode; narrow it before serving.
                os.chmod(self._ipc_path, self.socket_mode)
        except BaseException:
            sock.close(linger=0)
            raise
        bound = sock.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint = bound.decode() if isinstance(bound, bytes) else str(bound)
        self._sock = sock
        self._slow = ThreadPoolExecutor(
            max_workers=min(self.max_inflight, CLOSE_THREADS), thread_name_prefix="kvxferd-gw-close"
        )
        self._fd = fd = cast(int, sock.getsockopt(zmq.FD))
        self._loop.add_reader(fd, self._read)
        self._serve_task = self._loop.create_task(self._serve(), name="kvxferd-gateway")
        self._serve_task.add_done_callback(self._serve_done)
        self._read_later()  # frames that came before the reader was in place
        log.info("engine gateway (%s) serving at %s", self.role, self.endpoint)
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
        self._refusing = r

    def broken(self) -> str | None:
        """Why the gateway is not live (a caught unexpected error, its serve task ended), or None."""
        why = self.guard.broken()
        task = self._serve_task
        if why is None and task is not None and task.done() and self._sock is not None:
            return "gateway serve task ended"
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

    async def stop(self, timeout: float) -> None:
        """Stop serving: outstanding calls are cancelled (each engine gets Error(shutting_down)),
        then the socket is closed; returns within ``timeout`` (plus a loop turn).

        Must be awaited on the loop the gateway was started on.
        """
        sock = self._sock
        if sock is None:
            return
        if self._refusing is None:
            self._refusing = ep.EngineReason.SHUTTING_DOWN
        tasks: list[asyncio.Task[Any]] = list(self._calls)
        if self._serve_task is not None:
            tasks.append(self._serve_task)
        for t in tasks:
            t.cancel()
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=max(0.0, timeout))
            if late:
                log.warning("gateway stop: %d tasks still running after %.1fs", len(late), timeout)
        self._sock = None
        if self._fd is not None:
            self._loop.remove_reader(self._fd)  # type: ignore[union-attr]
            self._fd = None
        sock.close(linger=0)
        if self._slow is not None:  # running closes end on their own bounds; queued ones drop
            self._slow.shutdown(wait=False, cancel_futures=True)
        self._handles.clear()
        self._work.clear()
        log.info("engine gateway stopped (%s)", self.endpoint)

    # -- serving ------------------------------------------------------------------------
    async def _serve(self) -> None:
        """The tick: ``last_progress`` while the loop runs, and a read in case an edge was missed."""
        while self._sock is not None:
            await asyncio.sleep(TICK_S)
            self.last_progress = time.monotonic()
            self._read()

    def _read_later(self, delay: float = 0.0) -> None:
        """Read again soon: after a send (ZMQ's fd is edge-triggered; a send can take the
        edge of a frame that arrived meanwhile), after a full batch, after an error."""
        if self._loop is None or self._sock is None:
            return
        if delay:
            self._loop.call_later(delay, self._read)
        elif not self._read_soon:
            self._read_soon = True
            self._loop.call_soon(self._read)

    def _read(self) -> None:
        """Take every frame waiting on the ROUTER (up to a batch), each handled inline."""
        self._read_soon = False
        sock = self._sock
        if sock is None:
            return
        for _ in range(READ_BATCH):
            try:
                if not cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    return
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                if sock.closed:
                    return
                self.stats.add("recv_errors")
                log.warning("gateway: receive failed: %s", e)
                self._read_later(0.01)
                return
            except Exception:  # a bug on one turn must not stop the gateway
                self.guard.caught("gateway")
                self._read_later(0.01)  # never spin on a persistent error
                return
            self.last_progress = time.monotonic()
            try:
                self._on_frames(frames)
            except Exception:
                self.guard.caught("gateway")
                self.stats.add("internal_errors")
                self._reply(
                    frames[0],
                    ep.Error(
                        call_id=ep.salvage_call_id(frames[1:]),
                        reason=ep.EngineReason.INTERNAL,
                        detail="the daemon failed on this message (a bug; see its log)",
                    ),
                )
        self._read_later()  # more may wait: let the loop's other callbacks run first

    def _serve_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("gateway: serve task died", exc_info=exc)
            self.guard.dead("gateway")
        elif self._sock is not None:  # its socket closed while the gateway was not stopping
            self.guard.dead("gateway")

    def _on_frames(self, frames: list[bytes]) -> None:
        rid, body = frames[0], frames[1:]
        try:
            msg = ep.decode_to_gateway(body, self.max_frame_bytes)
        except ProtocolError as e:
            self.stats.add(f"rejected_{e.reason}")
            call_id = ep.salvage_call_id(body)
            self._reply(
                rid,
                ep.Error(
                    call_id=call_id, reason=ep.EngineReason(e.reason.value), detail=e.detail[:1024]
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
        reply = self._now(rid, msg)
        if reply is not None:
            self._reply(rid, reply)
            return
        assert self._loop is not None
        task = self._loop.create_task(self._call(rid, msg))
        self._calls[task] = msg.call_id
        task.add_done_callback(self._call_done)

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

    def _now(self, rid: bytes, msg: ep.ToGateway) -> ep._Msg | None:
        """The reply of a call that needs no wait, served inline; None: it needs a call task."""
        try:
            if isinstance(msg, ep.Publish | ep.Fetch):
                return self._start(rid, msg)
            if isinstance(msg, ep.Lookup):
                return self._lookup(rid, msg)
            if isinstance(msg, ep.Wait):
                entry = self._entry(rid, msg.handle_id)
                completion = entry.handle.session.completion
                if completion.done():
                    if msg.close and not _closes_at_once(entry.handle):
                        return None  # the close may wait for writes in flight
                    value = completion.value()
                    assert value is not None
                    out = _outcome(msg.call_id, entry.handle, value)
                    if msg.close:
                        safe = _close(entry.handle, 0, msg.deadline_unix_ms)
                        out = self._closed_outcome(out, msg.handle_id, entry, safe)
                    return out
                return ep.Pending(call_id=msg.call_id) if msg.timeout_ms == 0 else None
            if isinstance(msg, ep.Cancel):
                entry = self._entry(rid, msg.handle_id)
                _before(msg.deadline_unix_ms, entry.handle.cancel)()
                return ep.Ok(call_id=msg.call_id)
            if isinstance(msg, ep.Close):
                entry = self._entry(rid, msg.handle_id)
                if not _closes_at_once(entry.handle):
                    return None
                safe = _close(entry.handle, 0, msg.deadline_unix_ms)
                return self._closed(msg, entry, safe)
        except Exception as e:
            return self._call_error(msg, e)
        return None

    def _call_done(self, task: asyncio.Task[None]) -> None:
        self._calls.pop(task, None)
        exc = None if task.cancelled() else task.exception()
        if exc is not None:  # _call answers every error itself; this one escaped it (a bug)
            self.stats.add("internal_errors")
            try:
                raise exc
            except Exception:
                self.guard.caught("gateway call")

    def _reply(self, rid: bytes, msg: ep._Msg) -> None:
        sock = self._sock
        if sock is None:
            self.stats.add("reply_dropped")
            return
        # NOBLOCK: the loop never waits; a gone engine (ROUTER_MANDATORY), a full queue or a
        # closing socket drops the reply, counted.
        try:
            sock.send_multipart([rid, ep.encode(msg)], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            self.stats.add("reply_dropped")
        self._read_later()

    async def _call(self, rid: bytes, msg: ep.ToGateway) -> None:
        reply: ep._Msg
        try:
            reply = await self._dispatch(rid, msg)
        except asyncio.CancelledError:
            self._reply(
                rid,
                ep.Error(
                    call_id=msg.call_id,
                    reason=ep.EngineReason.SHUTTING_DOWN,
                    detail="the gateway is stopping",
                ),
            )
            raise
        except Exception as e:
            reply = self._call_error(msg, e)
        # No longer in flight once answered: the engine's next call must not find it counted.
        self._calls.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
        self._reply(rid, reply)

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

    async def _dispatch(self, rid: bytes, msg: ep.ToGateway) -> ep._Msg:
        """A Wait or Close that must wait (every other call is answered inline by ``_now``)."""
        if isinstance(msg, ep.Wait):
            entry = self._entry(rid, msg.handle_id)
            started = time.monotonic()
            value = await entry.handle.wait_async(msg.timeout_ms / 1000)
            if value is None:
                return ep.Pending(call_id=msg.call_id)
            out = _outcome(msg.call_id, entry.handle, value)
            if not msg.close:
                return out
            left_ms = max(0, msg.timeout_ms - int((time.monotonic() - started) * 1000))
            if _closes_at_once(entry.handle):
                safe = _close(entry.handle, 0, msg.deadline_unix_ms)
            else:
                safe = await self._blocking(
                    self._slow,
                    functools.partial(_close, entry.handle, left_ms, msg.deadline_unix_ms),
                )
            # The outcome as it stands after the close (reusable may have turned true).
            out = _outcome(msg.call_id, entry.handle, value)
            return self._closed_outcome(out, msg.handle_id, entry, safe)
        if isinstance(msg, ep.Close):
            entry = self._entry(rid, msg.handle_id)
            safe = await self._blocking(
                self._slow,
                functools.partial(_close, entry.handle, msg.timeout_ms, msg.deadline_unix_ms),
            )
            return self._closed(msg, entry, safe)
        raise AssertionError(f"unexpected message {type(msg).__name__}")  # the rest inline

    def _closed(self, msg: ep.Close, entry: _Entry, safe: bool) -> ep.Closed:
        """A Close's reply; a handle closed safe is forgotten, and its key freed."""
        self._forget(msg.handle_id, entry, safe)
        return ep.Closed(call_id=msg.call_id, safe=bool(safe))

    def _closed_outcome(
        self, out: ep.Outcome, handle_id: int, entry: _Entry, safe: bool
    ) -> ep.Outcome:
        """A Wait(close=True)'s outcome; the handle forgotten as by Close when safe."""
        self._forget(handle_id, entry, safe)
        return msgspec.structs.replace(out, closed=bool(safe))

    def _forget(self, handle_id: int, entry: _Entry, safe: bool) -> None:
        if safe and self._handles.get(handle_id) is entry:
            del self._handles[handle_id]
            work = self._work.get(entry.key)
            if work is not None and work.handle_id == handle_id:
                del self._work[entry.key]

    def _start(self, rid: bytes, msg: ep.Publish | ep.Fetch) -> ep._Msg:
        """Publish or Fetch: the handle of the open call with this key, or a new one (inline)."""
        want = "sender" if isinstance(msg, ep.Publish) else "receiver"
        if want != self.role:
            return self._refuse(
                msg.call_id, ep.EngineReason.WRONG_ROLE, f"this daemon is a {self.role}"
            )
        key, digest = self._key(msg), _digest(msg)
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
            return self._handle_reply(msg, found, self._handles[found].token)
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
        handle = _before(msg.deadline_unix_ms, self._service_call(msg, token))()
        hid = next(self._handle_ids)
        self._handles[hid] = _Entry([rid], handle, key, token)
        self._work[key] = _Work(digest, hid)
        return self._handle_reply(msg, hid, token)

    def _handle_reply(self, msg: ep.Publish | ep.Fetch, hid: int, token: str) -> ep.Handle:
        """A Handle; a Publish that restricted its fetchers also gets the sender's description.

        (Only then: an engine that never asks keeps reading the Handle it always got.)
        """
        if not (
            isinstance(msg, ep.Publish)
            and isinstance(self.service, Sender)
            and (msg.token or msg.fetch_token or msg.allowed_receivers)
        ):
            return ep.Handle(call_id=msg.call_id, handle_id=hid)
        return ep.Handle(
            call_id=msg.call_id,
            handle_id=hid,
            sender_endpoint=self.service.endpoint,
            # The sender's CURVE public key once security is configured ("" while off).
            sender_key=getattr(self.service, "public_key", "") or "",
            token=token,
        )

    def _lookup(self, rid: bytes, msg: ep.Lookup) -> ep._Msg:
        """The open call with this key, shared with this connection (inline)."""
        if self.role == "receiver" and msg.sender_endpoint is None:
            return self._refuse(
                msg.call_id, ep.EngineReason.MALFORMED, "lookup on a receiver needs sender_endpoint"
            )
        found = self._share(rid, self._key(msg))
        if found is not None:
            return ep.Handle(call_id=msg.call_id, handle_id=found)
        return self._refuse(
            msg.call_id,
            ep.EngineReason.UNKNOWN_HANDLE,
            f"no open {'publish' if self.role == 'sender' else 'fetch'} of request {msg.request_id}",
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

    def _key(self, msg: ep.Publish | ep.Fetch | ep.Lookup) -> _Key:
        if self.role == "sender":
            return ("publish", msg.request_id, "", 0, 0)
        assert not isinstance(msg, ep.Publish)
        end = msg.layer_end or self.service.pool.layout.num_layers
        return ("fetch", msg.request_id, msg.sender_endpoint or "", msg.layer_begin, end)

    def _service_call(
        self, msg: ep.Publish | ep.Fetch, token: str = ""
    ) -> Callable[[], TxHandle | RxHandle]:
        if isinstance(msg, ep.Publish):
            sender = self.service
            assert isinstance(sender, Sender)
            return functools.partial(
                sender.publish,
                msg.request_id,
                msg.block_ids,
                aux=msg.aux,
                expected_fetches=msg.expected_fetches,
                token=token or None,
                allowed_receivers=msg.allowed_receivers,
            )
        receiver = self.service
        assert isinstance(receiver, Receiver)
        layers = None
        if msg.layer_begin or msg.layer_end:
            layers = (msg.layer_begin, msg.layer_end or receiver.pool.layout.num_layers)
        return functools.partial(
            receiver.fetch,
            msg.request_id,
            msg.sender_endpoint,
            msg.block_ids,
            layers=layers,
            want_aux=msg.want_aux,
            timeout_ms=msg.timeout_ms or None,
            token=msg.token,
            sender_key=msg.sender_key,
            sender_endpoints=msg.sender_endpoints,
            tokens=msg.tokens,
            sender_keys=msg.sender_keys,
        )

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
        return _outcome(msg.call_id, entry.handle, value)

    async def _blocking(self, executor: ThreadPoolExecutor | None, fn: Callable[[], T]) -> T:
        """Run ``fn`` on a gateway thread (a Close that may wait); shielded from cancellation:
        a cancelled call leaves the close to finish on its own bound."""
        assert self._loop is not None and executor is not None
        return await asyncio.shield(self._loop.run_in_executor(executor, fn))


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


def _close(handle: TxHandle | RxHandle, timeout_ms: int, deadline_ms: int) -> bool:
    """Close on a gateway thread: not at all once the deadline passed, else waiting at most until it."""
    left = _left_s(deadline_ms)
    if left is not None and left <= 0:
        raise _Expired
    timeout = timeout_ms / 1000 if left is None else min(timeout_ms / 1000, left)
    return handle.close(timeout)


def _closes_at_once(handle: TxHandle | RxHandle) -> bool:
    """True when ``close`` needs no wait: the transfer ended and its memory is settled."""
    if isinstance(handle, TxHandle):
        return handle.session.drained_event.is_set()
    rx = handle.session
    return rx.ended and rx.fence_done.is_set()


def _outcome(call_id: int, handle: TxHandle | RxHandle, value: TxOutcome | RxOutcome) -> ep.Outcome:
    if isinstance(handle, TxHandle):
        assert isinstance(value, TxOutcome)
        tx = handle.session
        return ep.Outcome(
            call_id=call_id,
            state=value.state.value,  # type: ignore[arg-type]
            reason=ep.engine_reason(value.reason),
            detail=value.detail[:1024],
            nbytes=sum(sl.nbytes for sl in tx.slices()),
            in_doubt=value.in_doubt,
            reusable=tx.drained,
        )
    assert isinstance(value, RxOutcome)
    rx = handle.session
    return ep.Outcome(
        call_id=call_id,
        state=value.state.value,  # type: ignore[arg-type]
        reason=ep.engine_reason(value.reason),
        detail=value.detail[:1024],
        nbytes=value.nbytes,
        aux=value.aux,
        in_doubt=rx.fence is Fence.IN_DOUBT,
        reusable=rx.blocks_reusable,
    )


def _dir_mode(socket_mode: int) -> int:
    """Mode of a socket directory we create: the owner always; group/other only if the socket lets them."""
    mode = 0o700
    if socket_mode & 0o060:
        mode |= 0o050
    if socket_mode & 0o006:
        mode |= 0o005
    return mode


def _pool_info(service: Sender | Receiver) -> ep.PoolInfo:
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
    if isinstance(service, Sender):
        role: Literal["sender", "receiver"] = "sender"
        endpoint, daemon_id = service.endpoint, service.sender_id
    else:
        role, endpoint, daemon_id = "receiver", service.result_endpoint, service.receiver_id
    return ep.PoolInfo(
        call_id=0,
        role=role,
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
