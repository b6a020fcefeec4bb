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

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import zmq

from kvxferd.auth import Curve
from kvxferd.engine import engine_protocol as ep
from kvxferd.engine.channel import ChannelClosed, StreamChannel, ZmqChannel, wait_fd
from kvxferd.engine.dialect import Dialect, resend_on
from kvxferd.engine.engine_protocol import EngineReason, Outcome, PoolInfo
from kvxferd.engine.errors import EngineError, EngineRejected, EngineUnavailable
from kvxferd.engine.links import AsyncLinksCall, LinksCall
from kvxferd.engine.mapping import PoolMapping, attach_pool
from kvxferd.transfer.control import process_context
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

DEFAULT_TIMEOUT_S = 5.0  # a round trip to a local daemon; waits add their own timeout
_CLOSE_POLL_S = 0.005  # close_client: how often it checks whether a busy loop has stopped
_call_ids = itertools.count(1)  # process-wide, never reused: a late reply can never match

R = TypeVar("R", bound=ep._Msg)


@dataclass(frozen=True, slots=True)
class Published:
    """A publish's handle and what the decode side needs to fetch it (pass these to ``fetch``)."""

    handle_id: int
    sender_endpoint: str
    sender_key: str  # the sender's CURVE public key (Z85); "" with security off
    token: str  # the fetch token; "" when none was asked for

    @classmethod
    def of(cls, reply: ep.Handle) -> Published:
        return cls(reply.handle_id, reply.sender_endpoint or "", reply.sender_key, reply.token)


def _dealer_options(sock: zmq.Socket[Any], curve: Curve | None = None) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, ep.MAX_FRAME_BYTES)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    if curve is not None:  # a daemon's TCP engine socket: our keys, the daemon's public key
        curve.apply_client(sock)


def _ms(seconds: float) -> int:
    return max(0, min(int(seconds * 1000), 3_600_000))


def _blocks(block_ids: Sequence[int] | np.ndarray) -> list[int]:
    return np.asarray(block_ids, dtype=np.int64).reshape(-1).tolist()  # type: ignore[no-any-return]


def _check(reply: ep.ToEngine, expected: type[R] | tuple[type[Any], ...]) -> Any:
    if isinstance(reply, ep.Error):
        raise EngineRejected(reply.reason, reply.detail)
    if not isinstance(reply, expected):
        raise EngineError(EngineReason.MALFORMED, f"unexpected reply {type(reply).__name__}")
    return reply


def _deadline_ms(bound_s: float) -> int:
    """When a call that waits ``bound_s`` from now gives up, as Unix ms (the daemon shares the clock)."""
    return time.time_ns() // 1_000_000 + int(bound_s * 1000)


Build = Callable[[int, int], ep._Msg]  # (call id, deadline_unix_ms) -> the request
# A prefill instance: (sender endpoints, tokens, sender keys), each indexed by prefill rank.
Instance = tuple[Sequence[str], Sequence[str], Sequence[str]]


def _publish_msg(
    request_id: str,
    block_ids: Sequence[int] | np.ndarray,
    aux: bytes | None,
    expected_fetches: int,
    token: bool | str = False,
    allowed_receivers: Sequence[str] = (),
    wait_ms: int = 0,
    close: bool = False,
    streamed: bool = False,
) -> Build:
    """The Publish message for a call id (block ids converted and checked once, here).

    ``token``: True to have the daemon issue a fetch token, or the token itself.
    ``wait_ms`` > 0: answered once, at the outcome (closed when ``close``).
    """
    if streamed and wait_ms:
        raise ValueError(
            "a streamed publish cannot wait: its handle id (for progress) comes only with the"
            " outcome; use publish or publish_for"
        )
    blocks = _blocks(block_ids)
    allowed = list(allowed_receivers)
    return lambda call_id, deadline: ep.Publish(
        wait_ms=wait_ms,
        close=close,
        call_id=call_id,
        request_id=request_id,
        block_ids=blocks,
        aux=aux,
        expected_fetches=expected_fetches,
        deadline_unix_ms=deadline,
        token=token is True,
        fetch_token=token if isinstance(token, str) else "",
        allowed_receivers=allowed,
        streamed=streamed,
    )


def _fetch_msg(
    request_id: str,
    sender_endpoint: str,
    block_ids: Sequence[int] | np.ndarray,
    layers: tuple[int, int] | None,
    timeout_ms: int | None,
    want_aux: bool,
    token: str = "",
    sender_key: str = "",
    instance: Instance = ((), (), ()),
    wait_ms: int = 0,
    close: bool = False,
    digest: bool | None = None,
) -> Build:
    lb, le = layers if layers is not None else (0, 0)
    blocks = _blocks(block_ids)
    endpoints, tokens, keys = (list(x) for x in instance)
    return lambda call_id, deadline: ep.Fetch(
        wait_ms=wait_ms,
        close=close,
        digest=digest,
        token=token,
        sender_key=sender_key,
        sender_endpoints=endpoints,
        tokens=tokens,
        sender_keys=keys,
        call_id=call_id,
        request_id=request_id,
        sender_endpoint=sender_endpoint,
        block_ids=blocks,
        layer_begin=lb,
        layer_end=le,
        timeout_ms=timeout_ms or 0,
        want_aux=want_aux,
        deadline_unix_ms=deadline,
    )


def _lookup_msg(
    request_id: str, sender_endpoint: str | None, layers: tuple[int, int] | None
) -> Build:
    lb, le = layers if layers is not None else (0, 0)
    return lambda call_id, deadline: ep.Lookup(
        call_id=call_id,
        request_id=request_id,
        sender_endpoint=sender_endpoint,
        layer_begin=lb,
        layer_end=le,
        deadline_unix_ms=deadline,
    )


def _wait_msg(handle: int, timeout: float, close: bool) -> Build:
    return lambda call_id, deadline: ep.Wait(
        call_id=call_id,
        handle_id=handle,
        timeout_ms=_ms(timeout),
        deadline_unix_ms=deadline,
        close=close,
    )


def _found(reply: ep.ToEngine) -> int | None:
    """A Lookup's handle id, or None when nothing is open under that key."""
    if isinstance(reply, ep.Error) and reply.reason is EngineReason.UNKNOWN_HANDLE:
        return None
    return _check(reply, ep.Handle).handle_id  # type: ignore[no-any-return]


# -- the connection under both clients ------------------------------------------------------
def _connect(endpoint: str, timeout: float, curve: Curve | None) -> StreamChannel | ZmqChannel:
    """A channel to the daemon's engine socket (channel.py): a unix stream for ipc://, a
    ZMQ DEALER (CURVE when ``curve``) for tcp://; EngineUnavailable when nothing listens."""
    if endpoint.startswith("ipc://"):
        try:
            return StreamChannel.connect(endpoint, ep.MAX_FRAME_BYTES, timeout)
        except OSError as e:
            raise EngineUnavailable(
                EngineReason.PEER_LOST, f"cannot connect to {endpoint}: {e}"
            ) from None
    sock: zmq.Socket[bytes] = process_context().socket(zmq.DEALER)
    try:
        _dealer_options(sock, curve)
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise EngineUnavailable(
            EngineReason.PEER_LOST, f"cannot connect to {endpoint}: {e}"
        ) from None
    return ZmqChannel(sock)


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
        return _check(reply, ep.PoolInfo)  # type: ignore[no-any-return]

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
        build = _publish_msg(request_id, block_ids, aux, expected_fetches, streamed=streamed)
        return _check(self._call(build), ep.Handle).handle_id  # type: ignore[no-any-return]

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
            _publish_msg(
                request_id,
                block_ids,
                aux,
                expected_fetches,
                fetch_token or False,
                allowed_receivers,
                _ms(timeout) or 1,
                close,
            ),
            timeout,
        )
        return _check(reply, ep.Outcome)  # type: ignore[no-any-return]

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
            _publish_msg(
                request_id,
                block_ids,
                aux,
                expected_fetches,
                token,
                allowed_receivers,
                streamed=streamed,
            )
        )
        return Published.of(_check(reply, ep.Handle))

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
            _fetch_msg(
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
        return _check(reply, ep.Handle).handle_id  # type: ignore[no-any-return]

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
            _fetch_msg(
                request_id,
                sender_endpoint,
                block_ids,
                layers,
                timeout_ms,
                want_aux,
                token,
                sender_key,
                (sender_endpoints, tokens, sender_keys),
                _ms(timeout) or 1,
                close,
                digest,
            ),
            timeout,
        )
        return _check(reply, ep.Outcome)  # type: ignore[no-any-return]

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
        return _found(self._call(_lookup_msg(request_id, sender_endpoint, layers)))

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
        reply = self._call(_wait_msg(handle, timeout, close), timeout)
        out = _check(reply, (ep.Outcome, ep.Pending))
        return out if isinstance(out, ep.Outcome) else None

    def poll(self, handle: int) -> Outcome | None:
        """The outcome if the transfer ended, else None; never waits on the transfer."""
        reply = self._call(lambda c, _: ep.Poll(call_id=c, handle_id=handle))
        out = _check(reply, (ep.Outcome, ep.Pending))
        return out if isinstance(out, ep.Outcome) else None

    def cancel(self, handle: int) -> None:
        """End the transfer; its blocks stay fenced until ``close`` reports them safe."""
        _check(
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
                call_id=c, handle_id=handle, timeout_ms=_ms(timeout), deadline_unix_ms=d
            ),
            timeout,
        )
        return bool(_check(reply, ep.Closed).safe)

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
            chan = _connect(self.endpoint, bound, self.curve)
            with self._lock:
                if self._closed:
                    chan.close()
                    raise EngineUnavailable(EngineReason.PEER_LOST, "client closed")
                self._chan, self._dialect = chan, Dialect()
        return chan

    def _call(self, build: Build, wait_s: float = 0.0) -> ep.ToEngine:
        call_id = next(_call_ids)
        bound = max(0.0, wait_s) + self.timeout_s
        deadline = time.monotonic() + bound
        msg = build(call_id, _deadline_ms(bound))  # before the wait below starts
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


# -- asyncio client -----------------------------------------------------------------------
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
        self.chan = _connect(endpoint, connect_timeout, curve)
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
            call_id = next(_call_ids)
            fut: asyncio.Future[ep.ToEngine] = conn.loop.create_future()
            conn.pending[call_id] = fut
            # A timer on the future, not asyncio.wait_for: the same bound without wait_for's
            # extra task and future per call (issue 12: the engine side's cost per call).
            timer = conn.loop.call_later(bound, _time_out, fut)
            try:
                conn.send(conn.dialect.encode(build(call_id, _deadline_ms(bound))))
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
        return _check(reply, ep.PoolInfo)  # type: ignore[no-any-return]

    async def publish(
        self,
        request_id: str,
        block_ids: Sequence[int] | np.ndarray,
        *,
        aux: bytes | None = None,
        expected_fetches: int = 1,
        streamed: bool = False,
    ) -> int:
        build = _publish_msg(request_id, block_ids, aux, expected_fetches, streamed=streamed)
        return _check(await self._call(build), ep.Handle).handle_id  # type: ignore[no-any-return]

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
            _publish_msg(
                request_id,
                block_ids,
                aux,
                expected_fetches,
                fetch_token or False,
                allowed_receivers,
                _ms(timeout) or 1,
                close,
            ),
            timeout,
        )
        return _check(reply, ep.Outcome)  # type: ignore[no-any-return]

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
            _publish_msg(
                request_id,
                block_ids,
                aux,
                expected_fetches,
                token,
                allowed_receivers,
                streamed=streamed,
            )
        )
        return Published.of(_check(reply, ep.Handle))

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
            _fetch_msg(
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
        return _check(reply, ep.Handle).handle_id  # type: ignore[no-any-return]

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
            _fetch_msg(
                request_id,
                sender_endpoint,
                block_ids,
                layers,
                timeout_ms,
                want_aux,
                token,
                sender_key,
                (sender_endpoints, tokens, sender_keys),
                _ms(timeout) or 1,
                close,
                digest,
            ),
            timeout,
        )
        return _check(reply, ep.Outcome)  # type: ignore[no-any-return]

    async def lookup(
        self,
        request_id: str,
        *,
        sender_endpoint: str | None = None,
        layers: tuple[int, int] | None = None,
    ) -> int | None:
        return _found(await self._call(_lookup_msg(request_id, sender_endpoint, layers)))

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
        reply = await self._call(_wait_msg(handle, timeout, close), timeout)
        out = _check(reply, (ep.Outcome, ep.Pending))
        return out if isinstance(out, ep.Outcome) else None

    async def poll(self, handle: int) -> Outcome | None:
        out = _check(
            await self._call(lambda c, _: ep.Poll(call_id=c, handle_id=handle)),
            (ep.Outcome, ep.Pending),
        )
        return out if isinstance(out, ep.Outcome) else None

    async def cancel(self, handle: int) -> None:
        _check(
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
                call_id=c, handle_id=handle, timeout_ms=_ms(timeout), deadline_unix_ms=d
            ),
            timeout,
        )
        return bool(_check(reply, ep.Closed).safe)

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


# -- the pool, mapped in the engine process ----------------------------------------------
