"""The engine side of the engine protocol: drive a local kvxferd daemon without importing its internals.

Errors (both are :class:`~kvxferd.errors.KvxferdError`)::

    EngineError            .reason (EngineReason), .detail
    ├── EngineRejected     the daemon answered with Error: busy, draining, unknown_handle,
    │                      bad_blocks, duplicate, malformed, ...
    └── EngineUnavailable  no answer within the bound (reason timeout), or the client or its
                           socket is closed / the daemon is not reading (reason peer_lost)

Every call is bounded: a call that waits (``wait``, ``close``) is allowed its own
timeout plus ``timeout_s``; every other call ``timeout_s``. A dead or stopped
daemon therefore costs at most that long, then raises EngineUnavailable. The
call carries that bound as ``deadline_unix_ms`` (computed before it is sent), and
the daemon does not execute a call whose deadline has passed; ``publish`` and
``fetch`` are idempotent by key, and ``lookup`` / ``close_request`` find work
whose handle was lost (docs/engine-api.md, section 5).

One round trip per request: ``fetch_wait`` and ``publish_wait`` start the transfer and
are answered once, at its outcome (closing the handle unless ``close=False``); the
two-step ``fetch``/``publish`` + ``wait`` remain for engines that poll.

Streamed publish: ``publish`` / ``publish_for`` with ``streamed=True``, then ``progress``
as prefill computes layers. ``progress`` sends one frame and never waits for a reply
(a bad mark fails the publish: its outcome says ``bad_progress``). A Client's
``progress`` may be called from any thread; an AsyncClient's only from code running on
the loop that published the handle (it queues the frame on that loop's connection).
``publish_wait`` cannot stream (the handle id comes only with its answer).

Threads, loops and sockets (the socket: channel.py; a unix stream for ipc://, a ZMQ
DEALER for tcp://)::

    Client        one connection, no thread of its own: a caller sends its frame (under
                  ``_send_lock``) and reads the socket itself if no other caller does
                  (``_read_lock``), handing other callers' replies to their events; else it
                  waits on its own event for its reply or its turn to read. A long wait()
                  in one thread never holds up another thread's call.
    AsyncClient   one connection per event loop, created on first use in that loop, read by
                  a reader callback on that loop (``add_reader``) and written by the calling
                  task; a reply resolves a future on the loop that made the call. ``_lock``
                  guards only the loop -> connection map. ``close_client`` (any thread) hands
                  each connection's close to its loop and, if that loop stops first, closes
                  it itself (``_LoopConn.close_raw``).

A connection that breaks (the daemon restarted or closed it) fails the calls in flight
with ``peer_lost``; the next call opens a new one. Handles are per connection: after a
reconnect, find open work with ``lookup``.

A handle serves the daemon connection that created it, and those that found it
by key (``lookup`` or a retried publish/fetch): for a Client, any thread may use
it; for an AsyncClient, use it from the loop that created or found it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvxferd.auth import Curve
from kvxferd.engine import engine_protocol as ep
from kvxferd.engine.async_client import AsyncClient
from kvxferd.engine.channel import ChannelClosed, StreamChannel, ZmqChannel, connect, wait_fd
from kvxferd.engine.dialect import Dialect, resend_on
from kvxferd.engine.engine_protocol import EngineReason, Outcome, PoolInfo
from kvxferd.engine.errors import EngineError, EngineRejected, EngineUnavailable
from kvxferd.engine.links import LinksCall
from kvxferd.engine.mapping import PoolMapping, attach_pool
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

__all__ = [
    "AsyncClient",
    "Client",
    "EngineError",
    "EngineRejected",
    "EngineUnavailable",
    "Outcome",
    "PoolInfo",
    "PoolMapping",
    "Published",
    "attach_pool",
]


# -- synchronous client -------------------------------------------------------------------
@dataclass(slots=True)
class _Slot:
    event: threading.Event = field(default_factory=threading.Event)  # "look": done, or lead
    reply: ep.ToEngine | EngineError | None = None


class Client(LinksCall):
    """A thread-safe, synchronous connection to one kvxferd daemon's engine socket.

    No thread of its own: the calling thread sends its frame and, if no other caller is
    reading the socket, reads it itself until its reply comes (handing other callers'
    replies to them); otherwise it waits on its own event until its reply is handed to
    it or the reading caller is done and it takes over the reading. One caller in flight
    therefore costs one system call each way and no thread wake-up on the engine side.
    """

    def __init__(
        self, endpoint: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, curve: Curve | None = None
    ) -> None:
        """``curve``: for a TCP engine socket, this engine's keys and the daemon's public key
        (``Curve(KeyPair(...), server_key=...)``); None for the ipc socket."""
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.curve = curve
        self._lock = threading.Lock()  # guards _pending, _closed, _chan (replacement)
        self._send_lock = threading.Lock()  # one writer at a time (and every ZMQ socket call)
        self._read_lock = threading.Lock()  # held by the caller that reads the socket
        self._pending: dict[int, _Slot] = {}
        self._closed = False
        self._chan: StreamChannel | ZmqChannel | None = None
        self._dialect = Dialect()  # the connection's engine protocol version (dialect.py)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_client()

    # -- calls ---------------------------------------------------------------------------
    def describe(self, topology: Topology | None = None) -> PoolInfo:
        """The daemon's role, pool layout, shared-memory name and endpoint.

        ``topology``: declare this rank's record (kvxferd/transfer/topology.py) at attach; an
        EngineRejected(incompatible) when it does not describe the daemon's pool.
        """
        reply = self._call(lambda c, _: ep.Describe(call_id=c, topology=topology))
        return check_reply(reply, ep.PoolInfo)  # type: ignore[no-any-return]

    def publish(
        self,
        request_id: str,
        block_ids: Sequence[int] | np.ndarray,
        *,
        aux: bytes | None = None,
        expected_fetches: int = 1,
        streamed: bool = False,
    ) -> int:
        """Sender daemon: offer these blocks as ``request_id``; the handle id.

        Safe to retry with the same arguments (after a timeout, or from a new
        Client): the daemon returns the same handle while it is open. ``streamed``: no
        layer holds its KV yet; ``progress`` marks them as prefill computes them.
        """
        build = publish_msg(request_id, block_ids, aux, expected_fetches, streamed=streamed)
        return check_reply(self._call(build), ep.Handle).handle_id  # type: ignore[no-any-return]

    def publish_wait(
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
        """``publish``, answered once: when the request ended (fetched, expired, ...), its
        Outcome, closed as by ``close`` when ``close`` (``outcome.closed``).

        Not ended within ``timeout``: an Outcome in state ``published`` whose ``handle_id``
        serves ``wait`` / ``close`` later. One round trip per request instead of publish +
        wait. ``fetch_token``: a fetch token of the engine's own (a waiting publish cannot
        ask the daemon for one). It cannot stream: ``progress`` needs the handle id first.
        """
        reply = self._call(
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

    def publish_for(
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
        """``publish``, restricted to who may fetch it; what the decode side needs, with the handle.

        ``token``: True (the daemon issues a random fetch token), a token of the engine's
        own (at least 16 of ``[A-Za-z0-9_-]``), or False. ``allowed_receivers``: receiver
        identities (CURVE keys) or receiver ids; empty means any. Pass the result's
        ``sender_endpoint``, ``token`` and ``sender_key`` to the decode side's ``fetch``
        (with neither a token nor a list, the daemon does not describe itself: its
        endpoint is in ``describe()``).
        """
        reply = self._call(
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

    def fetch(
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
        """Receiver daemon: have ``sender_endpoint`` write ``request_id`` into ``block_ids``; the handle id.

        Keyed by (request_id, sender_endpoint, layers): safe to retry like ``publish``.
        ``token`` and ``sender_key``: what the publish side's :class:`Published` said.
        ``sender_endpoints``: the prefill instance, one endpoint per prefill rank (rank 0
        first; pass rank 0's as ``sender_endpoint``), with per-rank ``tokens`` and
        ``sender_keys`` if its Publishes gave them: the daemon reads from each rank what
        the reshard mapping gives this rank (needs ``describe(topology=...)`` first).
        ``digest``: check what landed against the sender's digest before the fetch is done
        (a mismatch fails it ``digest_mismatch``); None: the daemon's ``integrity.digest``.
        """
        reply = self._call(
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

    def fetch_wait(
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
        """``fetch``, answered once (one round trip, not fetch + wait): its Outcome when the
        fetch ended, closed when ``close`` (``outcome.closed``: the blocks may be reused now).
        Not ended within ``timeout``: an Outcome in state ``requested`` whose ``handle_id``
        serves ``wait`` / ``close`` later. ``timeout_ms``: the transfer's bound, as for fetch.
        """
        reply = self._call(
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

    def lookup(
        self,
        request_id: str,
        *,
        sender_endpoint: str | None = None,
        layers: tuple[int, int] | None = None,
    ) -> int | None:
        """The handle of the open publish (sender) or fetch (receiver) with this key, or None.

        On a receiver give the fetch's ``sender_endpoint`` (and ``layers`` if it had
        a range). The handle becomes usable on this Client too.
        """
        return found(self._call(lookup_msg(request_id, sender_endpoint, layers)))

    def close_request(
        self,
        request_id: str,
        timeout: float,
        *,
        sender_endpoint: str | None = None,
        layers: tuple[int, int] | None = None,
    ) -> bool:
        """``close`` the work open under this key (found with ``lookup``); True when nothing is open."""
        handle = self.lookup(request_id, sender_endpoint=sender_endpoint, layers=layers)
        if handle is None:
            return True
        try:
            return self.close(handle, timeout)
        except EngineRejected as e:
            if e.reason is EngineReason.UNKNOWN_HANDLE:  # closed safe by another connection
                return True
            raise

    def wait(self, handle: int, timeout: float, *, close: bool = False) -> Outcome | None:
        """The outcome once the transfer ended, or None after ``timeout`` seconds.

        ``close=True`` also closes the handle once it ended (one round trip instead of
        ``wait`` + ``close``): ``outcome.closed`` is then what ``close`` would have
        returned; while it is False the handle stays open for another ``close``.
        """
        reply = self._call(wait_msg(handle, timeout, close), timeout)
        out = check_reply(reply, (ep.Outcome, ep.Pending))
        return out if isinstance(out, ep.Outcome) else None

    def poll(self, handle: int) -> Outcome | None:
        """The outcome if the transfer ended, else None; never waits on the transfer."""
        reply = self._call(lambda c, _: ep.Poll(call_id=c, handle_id=handle))
        out = check_reply(reply, (ep.Outcome, ep.Pending))
        return out if isinstance(out, ep.Outcome) else None

    def cancel(self, handle: int) -> None:
        """End the transfer; its blocks stay fenced until ``close`` reports them safe."""
        check_reply(
            self._call(lambda c, d: ep.Cancel(call_id=c, handle_id=handle, deadline_unix_ms=d)),
            ep.Ok,
        )

    def progress(self, handle: int, layers_ready: int) -> None:
        """A streamed publish: layers ``[0, layers_ready)`` hold their KV. One frame, never
        answered (a bad mark fails the publish: its outcome says ``bad_progress``); any
        thread. EngineUnavailable if the frame cannot be sent."""
        msg = ep.Progress(handle_id=handle, layers_ready=layers_ready)
        deadline = time.monotonic() + self.timeout_s
        try:
            with self._send_lock:
                self._channel(self.timeout_s).send_blocking(self._dialect.encode(msg), deadline)
        except ChannelClosed as e:
            raise EngineUnavailable(EngineReason.PEER_LOST, f"send failed: {e}") from None

    def close(self, handle: int, timeout: float) -> bool:
        """Cancel if open and wait for in-flight writes; True once the blocks may be reused."""
        reply = self._call(
            lambda c, d: ep.Close(
                call_id=c, handle_id=handle, timeout_ms=ms(timeout), deadline_unix_ms=d
            ),
            timeout,
        )
        return bool(check_reply(reply, ep.Closed).safe)

    def close_client(self) -> None:
        """Fail calls still waiting and close the connection."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = self._pending, {}
            chan, self._chan = self._chan, None
        for slot in pending.values():
            slot.reply = EngineUnavailable(EngineReason.PEER_LOST, "client closed")
            slot.event.set()
        if chan is not None:
            with self._send_lock:
                chan.close()

    # -- plumbing ------------------------------------------------------------------------
    def _channel(self, bound: float) -> StreamChannel | ZmqChannel:
        """The open connection, (re)connected if there is none (call with ``_send_lock``)."""
        with self._lock:
            if self._closed:
                raise EngineUnavailable(EngineReason.PEER_LOST, "client closed")
            chan = self._chan
        if chan is None or chan.closed:
            chan = connect(self.endpoint, bound, self.curve)
            with self._lock:
                if self._closed:
                    chan.close()
                    raise EngineUnavailable(EngineReason.PEER_LOST, "client closed")
                self._chan, self._dialect = chan, Dialect()
        return chan

    def _call(self, build: Build, wait_s: float = 0.0) -> ep.ToEngine:
        call_id = next(call_ids)
        bound = max(0.0, wait_s) + self.timeout_s
        deadline = time.monotonic() + bound
        msg = build(call_id, deadline_ms(bound))  # before the wait below starts
        slot = _Slot()
        with self._lock:
            if self._closed:
                raise EngineUnavailable(EngineReason.PEER_LOST, "client closed")
            self._pending[call_id] = slot
        try:
            with self._send_lock:
                chan = self._channel(bound)
                chan.send_blocking(self._dialect.encode(msg), deadline)
        except ChannelClosed as e:
            error = EngineUnavailable(EngineReason.PEER_LOST, f"send failed: {e}")
            if isinstance(chan, ZmqChannel):  # ZMQ refused this one frame; it reconnects itself
                with self._lock:
                    self._pending.pop(call_id, None)
                raise error from None
            self._broken(error)  # a broken stream: every call on it fails, the next reconnects
        except EngineUnavailable as e:
            with self._lock:
                self._pending.pop(call_id, None)
            raise e from None
        while slot.reply is None:
            left = deadline - time.monotonic()
            if left <= 0:
                with self._lock:
                    self._pending.pop(call_id, None)
                raise EngineUnavailable(
                    EngineReason.TIMEOUT, f"no reply from {self.endpoint} within {bound:.1f}s"
                )
            if self._read_lock.acquire(blocking=False):
                try:
                    self._lead(slot, chan, deadline)
                finally:
                    self._read_lock.release()
                    self._hand_over()
            else:
                slot.event.wait(left)
                slot.event.clear()
        reply = slot.reply
        if isinstance(reply, EngineError):
            raise reply
        return reply

    def _lead(self, slot: _Slot, chan: StreamChannel | ZmqChannel, deadline: float) -> None:
        """Read the socket (handing replies to their callers) until ours came or time is up."""
        zmq_chan = isinstance(chan, ZmqChannel)
        while slot.reply is None:
            try:
                if zmq_chan:
                    with self._send_lock:
                        frames = chan.recv()
                else:
                    frames = chan.recv()
            except ChannelClosed as e:
                self._broken(EngineUnavailable(EngineReason.PEER_LOST, f"connection lost: {e}"))
                return
            again = resend_on(chan, self._send_lock, deadline, self.endpoint)
            for reply in self._dialect.take(frames, self.endpoint, again):
                self._finish(reply.call_id, reply)
            if slot.reply is not None or frames:
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return
            # ZMQ's fd is edge-triggered and another caller's send may take an edge: look
            # again every few ms there; a unix stream is level-triggered.
            wait_fd(chan.fileno(), min(left, 0.005 if zmq_chan else left))

    def _hand_over(self) -> None:
        """The reading caller is done: wake one caller still waiting, to read in its place."""
        with self._lock:
            for s in self._pending.values():
                if s.reply is None:
                    s.event.set()
                    return

    def _finish(self, call_id: int, reply: ep.ToEngine | EngineError) -> None:
        with self._lock:
            slot = self._pending.pop(call_id, None)
        if slot is not None:
            slot.reply = reply
            slot.event.set()

    def _broken(self, error: EngineUnavailable) -> None:
        """The connection broke: every call in flight fails; the next call reconnects."""
        with self._lock:
            pending, self._pending = self._pending, {}
            chan, self._chan = self._chan, None
        if chan is not None:
            chan.close()
        for s in pending.values():
            s.reply = error
            s.event.set()
