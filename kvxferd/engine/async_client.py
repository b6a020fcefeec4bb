"""The asyncio client: one connection per event loop, each read by a reader callback on its loop.

:class:`AsyncClient` has the operations of client.py's ``Client`` as coroutines (what
each does, the errors and bounds: client.py's module docstring and docs/engine-api.md).
Threads and loops: a connection (``_LoopConn``) is created on first use in a loop, read
by a reader callback on that loop (``add_reader``) and written by the calling task; a
reply resolves a future on the loop that made the call. ``_lock`` guards only the loop
-> connection map. ``close_client`` (any thread) hands each connection's close to its
loop and, if that loop stops first, closes it itself (``_LoopConn.close_raw``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Sequence

import numpy as np

from kvxferd.auth import Curve
from kvxferd.engine import engine_protocol as ep
from kvxferd.engine.channel import ChannelClosed, ZmqChannel, connect
from kvxferd.engine.dialect import Dialect
from kvxferd.engine.engine_protocol import EngineReason, Outcome, PoolInfo
from kvxferd.engine.errors import EngineRejected, EngineUnavailable
from kvxferd.engine.links import AsyncLinksCall
from kvxferd.engine.requests import (
    DEFAULT_TIMEOUT_S,
    Build,
    Published,
    call_ids,
    check_reply,
    deadline_ms,
    fetch_msg,
    found,
    lookup_msg,
    ms,
    publish_msg,
    wait_msg,
)
from kvxferd.transfer.topology import Topology

log = logging.getLogger("kvxferd.client")

_CLOSE_POLL_S = 0.005  # close_client: how often it checks whether a busy loop has stopped


# -- the connection of one loop -----------------------------------------------------------------------
class _LoopConn:
    """One event loop's connection and in-flight calls; touched only on that loop.

    The socket is read by a reader callback on the loop (``add_reader``), written
    directly by the calling task (what the kernel does not take is written by a writer
    callback); no task or thread of its own. The one exception: once the loop does not
    run, ``close_raw`` closes it from another thread (nothing on the loop can touch it).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        endpoint: str,
        max_inflight: int,
        curve: Curve | None = None,
        connect_timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.loop = loop
        self.endpoint = endpoint
        self.chan = connect(endpoint, connect_timeout, curve)
        self.fd = self.chan.fileno()
        self.zmq = isinstance(self.chan, ZmqChannel)
        self.sem = asyncio.Semaphore(max_inflight)
        self.pending: dict[int, asyncio.Future[ep.ToEngine]] = {}
        self.closed = False
        self._writing = False
        self._flushing = False  # a _flush is scheduled on the loop
        self._close_lock = threading.Lock()  # closed: set once, by the loop or by close_client
        self.shut = threading.Event()  # the socket is closed
        self.dialect = Dialect()  # its engine protocol version (dialect.py)
        loop.add_reader(self.fd, self._on_readable)

    def send(self, frame: bytes) -> None:
        """Queue a call's frame; the calls made in one turn of the loop leave together, in
        one system call, when the loop gets to ``_flush`` (one wake-up of the daemon)."""
        if self.closed:
            raise EngineUnavailable(EngineReason.PEER_LOST, "client closed")
        try:
            self.chan.queue(frame)
        except ChannelClosed as e:
            self._fail_all(f"send failed: {e}")
            raise EngineUnavailable(EngineReason.PEER_LOST, f"send failed: {e}") from None
        if not self._flushing:
            self._flushing = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        if self.closed:
            return
        try:
            empty = self.chan.flush()
        except ChannelClosed as e:
            self._fail_all(f"send failed: {e}")
            return
        if not empty and not self._writing:
            self._writing = True
            self.loop.add_writer(self.fd, self._on_writable)
        if self.zmq:  # a send may take the edge of a reply that arrived meanwhile
            self._on_readable()

    def _on_writable(self) -> None:
        try:
            empty = self.chan.flush()
        except ChannelClosed as e:
            self._fail_all(f"send failed: {e}")
            return
        if empty and self._writing:
            self._writing = False
            self.loop.remove_writer(self.fd)

    def _on_readable(self) -> None:
        if self.closed:
            return
        try:
            frames = self.chan.recv()
        except ChannelClosed as e:
            self._fail_all(f"connection lost: {e}")
            return
        pending = self.pending
        for reply in self.dialect.take(frames, self.endpoint, self._send_again):
            fut = pending.pop(reply.call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    def _send_again(self, frames: list[bytes]) -> None:
        """Calls the daemon refused in our newest version, in its (dialect.py)."""
        for frame in frames:
            with contextlib.suppress(EngineUnavailable):  # then their callers hear peer_lost
                self.send(frame)

    def _fail_all(self, why: str) -> None:
        """The connection broke: calls in flight fail; the client opens a new one next time."""
        self._close(on_loop=True, error=EngineUnavailable(EngineReason.PEER_LOST, why))

    def shutdown(self) -> None:
        """Fail calls in flight, stop reading, close the socket: on this conn's loop."""
        self._close(on_loop=True)

    def close_raw(self) -> None:
        """The same, from another thread, once this conn's loop does not run (stopped or closed).

        Calls in flight fail with peer_lost when the loop runs again; on a closed
        loop nothing can run again and only the socket matters.
        """
        self._close(on_loop=False)

    def _close(self, on_loop: bool, error: EngineUnavailable | None = None) -> None:
        with self._close_lock:  # at most once, whichever thread comes first
            if self.closed:
                return
            self.closed = True
            pending, self.pending = self.pending, {}
        error = error or EngineUnavailable(EngineReason.PEER_LOST, "client closed")
        try:
            if on_loop or not self.loop.is_closed():
                self.loop.remove_reader(self.fd)
                if self._writing:
                    self.loop.remove_writer(self.fd)
            for fut in pending.values():
                if not fut.done():
                    if on_loop:
                        fut.set_exception(error)
                    else:
                        self.loop.call_soon_threadsafe(_fail, fut, error)
        except RuntimeError as e:  # the loop is closed: no callback can be scheduled on it
            log.debug("failing a closed loop's calls: %s", e)
        try:
            self.chan.close()
        except Exception as e:
            if on_loop:
                raise
            log.debug("closing a stopped loop's socket: %s", e)  # it is closed regardless
        self.shut.set()


def _fail(fut: asyncio.Future[ep.ToEngine], error: Exception) -> None:
    if not fut.done():
        fut.set_exception(error)


def _time_out(fut: asyncio.Future[ep.ToEngine]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class AsyncClient(AsyncLinksCall):
    """The engine protocol as coroutines; usable from several event loops in several threads."""

    def __init__(
        self,
        endpoint: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        max_inflight: int = 256,
        curve: Curve | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.curve = curve  # as for Client
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight  # per loop
        self._lock = threading.Lock()  # guards _conns and _closed
        self._conns: dict[asyncio.AbstractEventLoop, _LoopConn] = {}
        self._closed = False

    def _conn(self) -> _LoopConn:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise EngineUnavailable(EngineReason.PEER_LOST, "client closed")
            conn = self._conns.get(loop)
            if conn is None or conn.closed:
                for lp in [lp for lp in self._conns if lp.is_closed()]:  # loops gone for good
                    self._conns.pop(lp).close_raw()
                conn = self._conns[loop] = _LoopConn(
                    loop, self.endpoint, self.max_inflight, self.curve, self.timeout_s
                )
        return conn

    async def _call(self, build: Build, wait_s: float = 0.0) -> ep.ToEngine:
        conn = self._conn()
        bound = max(0.0, wait_s) + self.timeout_s
        async with conn.sem:
            call_id = next(call_ids)
            fut: asyncio.Future[ep.ToEngine] = conn.loop.create_future()
            conn.pending[call_id] = fut
            # A timer on the future, not asyncio.wait_for: the same bound without wait_for's
            # extra task and future per call (issue 12: the engine side's cost per call).
            timer = conn.loop.call_later(bound, _time_out, fut)
            try:
                conn.send(conn.dialect.encode(build(call_id, deadline_ms(bound))))
                return await fut
            except TimeoutError:
                raise EngineUnavailable(
                    EngineReason.TIMEOUT, f"no reply from {self.endpoint} within {bound:.1f}s"
                ) from None
            finally:
                timer.cancel()
                conn.pending.pop(call_id, None)

    async def describe(self, topology: Topology | None = None) -> PoolInfo:
        """See :meth:`Client.describe`."""
        reply = await self._call(lambda c, _: ep.Describe(call_id=c, topology=topology))
        return check_reply(reply, ep.PoolInfo)  # type: ignore[no-any-return]

    async def publish(
        self,
        request_id: str,
        block_ids: Sequence[int] | np.ndarray,
        *,
        aux: bytes | None = None,
        expected_fetches: int = 1,
        streamed: bool = False,
    ) -> int:
        build = publish_msg(request_id, block_ids, aux, expected_fetches, streamed=streamed)
        return check_reply(await self._call(build), ep.Handle).handle_id  # type: ignore[no-any-return]

    async def publish_wait(
        self,
        request_id: str,
        block_ids: Sequence[int] | np.ndarray,
        timeout: float,
        *,
        close: bool = True,
        aux: bytes | None = None,
        expected_fetches: int = 1,
        fetch_token: str = "",
        allowed_receivers: Sequence[str] = (),
    ) -> Outcome:
        """See :meth:`Client.publish_wait`."""
        reply = await self._call(
            publish_msg(
                request_id,
                block_ids,
                aux,
                expected_fetches,
                fetch_token or False,
                allowed_receivers,
                ms(timeout) or 1,
                close,
            ),
            timeout,
        )
        return check_reply(reply, ep.Outcome)  # type: ignore[no-any-return]

    async def publish_for(
        self,
        request_id: str,
        block_ids: Sequence[int] | np.ndarray,
        *,
        aux: bytes | None = None,
        expected_fetches: int = 1,
        token: bool | str = True,
        allowed_receivers: Sequence[str] = (),
        streamed: bool = False,
    ) -> Published:
        """See :meth:`Client.publish_for`."""
        reply = await self._call(
            publish_msg(
                request_id,
                block_ids,
                aux,
                expected_fetches,
                token,
                allowed_receivers,
                streamed=streamed,
            )
        )
        return Published.of(check_reply(reply, ep.Handle))

    async def fetch(
        self,
        request_id: str,
        sender_endpoint: str,
        block_ids: Sequence[int] | np.ndarray,
        *,
        layers: tuple[int, int] | None = None,
        timeout_ms: int | None = None,
        want_aux: bool = True,
        token: str = "",
        sender_key: str = "",
        sender_endpoints: Sequence[str] = (),
        tokens: Sequence[str] = (),
        sender_keys: Sequence[str] = (),
        digest: bool | None = None,
    ) -> int:
        """See :meth:`Client.fetch`."""
        reply = await self._call(
            fetch_msg(
                request_id,
                sender_endpoint,
                block_ids,
                layers,
                timeout_ms,
                want_aux,
                token,
                sender_key,
                (sender_endpoints, tokens, sender_keys),
                digest=digest,
            )
        )
        return check_reply(reply, ep.Handle).handle_id  # type: ignore[no-any-return]

    async def fetch_wait(
        self,
        request_id: str,
        sender_endpoint: str,
        block_ids: Sequence[int] | np.ndarray,
        timeout: float,
        *,
        close: bool = True,
        layers: tuple[int, int] | None = None,
        timeout_ms: int | None = None,
        want_aux: bool = True,
        token: str = "",
        sender_key: str = "",
        sender_endpoints: Sequence[str] = (),
        tokens: Sequence[str] = (),
        sender_keys: Sequence[str] = (),
        digest: bool | None = None,
    ) -> Outcome:
        """See :meth:`Client.fetch_wait`."""
        reply = await self._call(
            fetch_msg(
                request_id,
                sender_endpoint,
                block_ids,
                layers,
                timeout_ms,
                want_aux,
                token,
                sender_key,
                (sender_endpoints, tokens, sender_keys),
                ms(timeout) or 1,
                close,
                digest,
            ),
            timeout,
        )
        return check_reply(reply, ep.Outcome)  # type: ignore[no-any-return]

    async def lookup(
        self,
        request_id: str,
        *,
        sender_endpoint: str | None = None,
        layers: tuple[int, int] | None = None,
    ) -> int | None:
        return found(await self._call(lookup_msg(request_id, sender_endpoint, layers)))

    async def close_request(
        self,
        request_id: str,
        timeout: float,
        *,
        sender_endpoint: str | None = None,
        layers: tuple[int, int] | None = None,
    ) -> bool:
        handle = await self.lookup(request_id, sender_endpoint=sender_endpoint, layers=layers)
        if handle is None:
            return True
        try:
            return await self.close(handle, timeout)
        except EngineRejected as e:
            if e.reason is EngineReason.UNKNOWN_HANDLE:
                return True
            raise

    async def wait(self, handle: int, timeout: float, *, close: bool = False) -> Outcome | None:
        reply = await self._call(wait_msg(handle, timeout, close), timeout)
        out = check_reply(reply, (ep.Outcome, ep.Pending))
        return out if isinstance(out, ep.Outcome) else None

    async def poll(self, handle: int) -> Outcome | None:
        out = check_reply(
            await self._call(lambda c, _: ep.Poll(call_id=c, handle_id=handle)),
            (ep.Outcome, ep.Pending),
        )
        return out if isinstance(out, ep.Outcome) else None

    async def cancel(self, handle: int) -> None:
        check_reply(
            await self._call(
                lambda c, d: ep.Cancel(call_id=c, handle_id=handle, deadline_unix_ms=d)
            ),
            ep.Ok,
        )

    def progress(self, handle: int, layers_ready: int) -> None:
        """See :meth:`Client.progress`. A plain method, for code running on the event loop
        that published ``handle`` (a coroutine or a callback of that loop: the handle is
        its connection's); it queues the frame and returns (sent at the loop's next turn).
        """
        conn = self._conn()
        conn.send(conn.dialect.encode(ep.Progress(handle_id=handle, layers_ready=layers_ready)))

    async def close(self, handle: int, timeout: float) -> bool:
        reply = await self._call(
            lambda c, d: ep.Close(
                call_id=c, handle_id=handle, timeout_ms=ms(timeout), deadline_unix_ms=d
            ),
            timeout,
        )
        return bool(check_reply(reply, ep.Closed).safe)

    async def aclose(self) -> None:
        """Close the running loop's connection (call before that loop stops)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            conn = self._conns.pop(loop, None)
        if conn is not None:
            conn.shutdown()
            await asyncio.sleep(0)  # let failed calls see their errors

    def close_client(self, timeout: float = 1.0) -> None:
        """Close every loop's connection; calls still in flight fail with peer_lost.

        Safe from any thread, a loop's own included. A connection is closed on its
        own loop while that loop runs: this waits up to ``timeout`` for that; a loop
        that stops meanwhile (before it got to the close) has its connection closed
        here, so no socket is left open behind a stopped loop.
        """
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns.values()), {}
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        handed: list[_LoopConn] = []
        for conn in conns:
            if conn.loop is here:
                conn.shutdown()
            elif not conn.loop.is_running():  # stopped or closed: nobody else touches it
                conn.close_raw()
            else:
                try:
                    conn.loop.call_soon_threadsafe(conn.shutdown)
                    handed.append(conn)
                except RuntimeError:  # closed meanwhile
                    conn.close_raw()
        deadline = time.monotonic() + timeout
        for conn in handed:
            # The loop may stop before it runs the close; then it is ours to do.
            while not conn.shut.wait(_CLOSE_POLL_S):
                if not conn.loop.is_running():
                    conn.close_raw()
                    break
                if time.monotonic() >= deadline:
                    log.warning("a loop did not close its connection to %s in time", self.endpoint)
                    break
