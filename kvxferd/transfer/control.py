"""The control plane's sockets: one zmq.Context per process, bounded sends, a guarded dealer pool.

ZMQ sockets are not thread-safe. The rules kvxferd keeps:

* every socket has one owner thread, named where it is created, except the
  dealers of :class:`SharedDealerPool`, which any thread may use through
  :meth:`SharedDealerPool.send` (the pool lock covers get-or-connect; each
  dealer's own lock serialises its sends, so a peer that stops reading stalls
  only senders to that peer);
* every send has a deadline (``SNDTIMEO``); a send that times out raises
  :class:`~kvxferd.errors.SendTimeout` and is counted, it never blocks forever;
* every DEALER sends ZMTP heartbeats (``heartbeat_ivl_ms``): a connection that
  carries nothing back for ``heartbeat_timeout_ms`` (a cut link, a host gone) is
  dropped and reopened with a fresh TCP connection, each connect attempt bounded
  by ``connect_timeout_ms``, instead of waiting out TCP's retransmission backoff
  (up to two minutes after a long cut). ``TCP_MAXRT`` bounds unacknowledged data
  the same way. What was queued on the dropped connection is lost; every message
  kvxferd sends is covered by a deadline and a retry or a failure (docs/hosts.md);
* with ``SocketLimits.curve`` set (``security.mode = "curve"``) a ROUTER is a CURVE
  server judged by the auth thread (kvxferd/auth.py: allow-list, User-Id = the
  client's key, failed handshakes counted) and a DEALER is a CURVE client that
  verifies the server's key (``server_key``); without it a DEALER dials only loopback
  and ipc endpoints (:class:`PlaintextRefused`), so plaintext never leaves the host;
* ``LINGER`` is 0 while a socket is open; ``close_all`` refuses new sends, then
  closes each dealer under its lock (never during a send on it) with a linger of
  one send timeout, so a final Result queued just before is still delivered (the
  process context is never terminated, so ``close`` itself never blocks).
"""

from __future__ import annotations

import ctypes
import errno
import secrets
import threading
from dataclasses import dataclass

import zmq

from kvxferd.auth import Curve, serve_context, watch_server
from kvxferd.config import Deadlines, Limits
from kvxferd.endpoints import is_local_endpoint
from kvxferd.errors import SendTimeout

_context_lock = threading.Lock()
_context: zmq.Context[zmq.Socket[bytes]] | None = None


def seed_routing_ids() -> bool:
    """Seed the C library's ``rand`` from the OS, once per process, before any ROUTER exists.

    libzmq names a connection that presents no routing id from a counter that starts at
    ``rand()``, and never seeds it: every process generates the same ids
    (``00 6b 8b 45 67`` first). A client that connects with the id the ROUTER will
    generate next makes libzmq assert when it does, and the daemon aborts; any key the
    handshake lets in could do it. From an unknown seed the next id cannot be guessed.
    True when seeded (False where the C library has no ``srand``).
    """
    try:
        ctypes.CDLL(None).srand(secrets.randbits(32))
    except (OSError, AttributeError):  # pragma: no cover - no C library to seed
        return False
    return True


ZMQ_DEFAULT_MAX_SOCKETS = 1023  # libzmq's own default


def process_context(max_sockets: int = 0) -> zmq.Context[zmq.Socket[bytes]]:
    """The one zmq.Context of this process (contexts are thread-safe; never terminated early).

    ``max_sockets`` raises libzmq's limit of sockets in the context (1 023 by default), which
    libzmq applies when the context opens its first socket: the daemons ask for what their
    configuration needs (:func:`sockets_needed`) before they open any.
    """
    global _context
    with _context_lock:
        if _context is None or _context.closed:
            if _context is None:
                seed_routing_ids()  # before the first ROUTER of this process
            _context = zmq.Context()
        if max_sockets > _context.get(zmq.MAX_SOCKETS):
            _context.set(zmq.MAX_SOCKETS, max_sockets)
        return _context


serve_context(process_context)  # the auth thread (kvxferd/auth.py) serves this context


def sockets_needed(num_threads: int, max_peers: int) -> int:
    """ZMQ sockets a daemon may hold: a DEALER per (worker or link, peer), the shared pool's
    DEALER per peer, monitors, routers and the engine gateway, with room to spare."""
    return max(ZMQ_DEFAULT_MAX_SOCKETS, (num_threads + 2) * max_peers + 64)


@dataclass(frozen=True, slots=True)
class SocketLimits:
    max_frame_bytes: int
    sndhwm: int
    heartbeat_ivl_ms: int = 0  # 0: no heartbeats
    heartbeat_timeout_ms: int = 0
    connect_timeout_ms: int = 0  # 0: the OS's (about two minutes of SYN retries)
    curve: Curve | None = None  # this daemon's keys and ZAP domain; None: plaintext, local only
    reconnect_max_ms: int = 0  # cap of the redial backoff (doubling from 100 ms); 0: no backoff

    @classmethod
    def of(cls, limits: Limits, deadlines: Deadlines, curve: Curve | None = None) -> SocketLimits:
        """The socket options a role's settings ask for."""
        return cls(
            limits.max_frame_bytes,
            limits.sndhwm,
            deadlines.heartbeat_ivl_ms,
            deadlines.heartbeat_timeout_ms,
            deadlines.connect_timeout_ms,
            curve,
            deadlines.reconnect_max_ms,
        )


class PlaintextRefused(zmq.ZMQError):
    """A plaintext DEALER (security off) toward an endpoint that is not loopback or ipc."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(
            errno.EACCES,
            f"security.mode is off: {endpoint!r} is not loopback or ipc (plaintext stays local)",
        )


def _common(sock: zmq.Socket[bytes], limits: SocketLimits) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_frame_bytes)
    sock.setsockopt(zmq.SNDHWM, limits.sndhwm)
    sock.setsockopt(zmq.RCVHWM, limits.sndhwm)


def bind_router(endpoint: str, limits: SocketLimits) -> tuple[zmq.Socket[bytes], str]:
    """A ROUTER bound at ``endpoint`` (``:0`` picks a free port); returns the bound address.

    ROUTER_MANDATORY makes a send to a gone peer fail loudly instead of dropping silently;
    its sends are always NOBLOCK (the owner thread never waits on a peer). A route belongs
    to one connection for its life (no ROUTER_HANDOVER, docs/protocol.md section 1).
    """
    sock = process_context().socket(zmq.ROUTER)
    _common(sock, limits)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # Never hand a route over: with ROUTER_HANDOVER a connection that presents another
    # peer's routing id (any allowed key may choose one) takes that peer's route, and
    # the victim's replies go to it. Without it libzmq ignores such a connection while
    # the route's own one is open. kvxferd's DEALERs set no identity: each connection
    # gets a route of its own, and a receiver registers again on every reconnect.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        endpoint = endpoint[:-2] + ":*"
    try:
        if limits.curve is not None:
            limits.curve.apply_server(sock)
            watch_server(sock, limits.curve.stats, limits.curve.zap_domain)
        sock.bind(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return sock, bound.decode() if isinstance(bound, bytes) else str(bound)


def connect_dealer(
    endpoint: str,
    limits: SocketLimits,
    send_timeout_ms: int,
    *,
    server_key: str = "",
) -> zmq.Socket[bytes]:
    """A DEALER connected to ``endpoint`` whose sends give up after ``send_timeout_ms``.

    It sets no routing identity: the server's ROUTER names each connection itself.

    With ``limits.curve`` the server at ``endpoint`` must present ``server_key`` (Z85);
    without, ``endpoint`` must be loopback or ipc (PlaintextRefused, a ZMQError).
    """
    if limits.curve is None and not is_local_endpoint(endpoint):
        raise PlaintextRefused(endpoint)
    sock = process_context().socket(zmq.DEALER)
    _common(sock, limits)
    sock.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
    sock.setsockopt(zmq.IMMEDIATE, 0)
    if limits.heartbeat_ivl_ms:
        sock.setsockopt(zmq.HEARTBEAT_IVL, limits.heartbeat_ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, limits.heartbeat_timeout_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, limits.heartbeat_timeout_ms)
        if endpoint.startswith("tcp://"):
            sock.setsockopt(zmq.TCP_MAXRT, limits.heartbeat_timeout_ms)
    if limits.connect_timeout_ms and endpoint.startswith("tcp://"):
        sock.setsockopt(zmq.CONNECT_TIMEOUT, limits.connect_timeout_ms)
    if limits.reconnect_max_ms:
        # A dead peer is redialled 100 ms, 200 ms, ... up to the cap apart, not every 100 ms.
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, limits.reconnect_max_ms)
    try:
        if limits.curve is not None:
            limits.curve.apply_client(sock, server_key)
        sock.connect(endpoint)
    except zmq.ZMQError:  # never leak the socket of a refused endpoint
        sock.close(linger=0)
        raise
    return sock


def send_bounded(sock: zmq.Socket[bytes], frame: bytes) -> None:
    """Send one frame on a socket with SNDTIMEO set; SendTimeout when the peer is not reading."""
    try:
        sock.send(frame, 0, copy=len(frame) < 65536)
    except zmq.Again:
        raise SendTimeout("peer is not reading (send timed out)") from None


def send_bounded_many(sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
    """Send frames as one multipart message (one wake-up of ZMQ's I/O thread and of the
    peer; the message is queued whole or not at all); SendTimeout as ``send_bounded``."""
    if len(frames) == 1:
        send_bounded(sock, frames[0])
        return
    try:
        sock.send_multipart(frames, 0, copy=False)
    except zmq.Again:
        raise SendTimeout("peer is not reading (send timed out)") from None


def router_reply(sock: zmq.Socket[bytes], routing_id: bytes, frame: bytes) -> bool:
    """Reply on a ROUTER without ever blocking; False when the peer is gone or full."""
    try:
        sock.send_multipart([routing_id, frame], flags=zmq.NOBLOCK)
        return True
    except (zmq.Again, zmq.ZMQError):
        return False


class _SharedDealer:
    __slots__ = ("lock", "sock", "closed")

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.lock = threading.Lock()  # serialises sends and close on this socket
        self.sock = sock
        self.closed = False


class SharedDealerPool:
    """DEALERs shared by several threads, one per endpoint, each guarded by its own lock."""

    def __init__(self, limits: SocketLimits, send_timeout_ms: int) -> None:
        self._limits = limits
        self._timeout_ms = send_timeout_ms
        self._lock = threading.Lock()  # guards _dealers and _closed (get-or-connect)
        self._dealers: dict[str, _SharedDealer] = {}
        self._closed = False

    @property
    def size(self) -> int:
        """DEALERs open now (len() without the lock: a probe never waits on it)."""
        return len(self._dealers)

    def send(self, endpoint: str, frame: bytes, server_key: str = "") -> None:
        """Send one frame to ``endpoint``; SendTimeout within the deadline, or when closed.

        ``server_key``: the key the server at ``endpoint`` must present (CURVE), used when
        the DEALER is made.
        """
        for _ in range(2):  # a DEALER forgotten between lookup and send: take a fresh one, once
            with self._lock:
                if self._closed:
                    raise SendTimeout("dealer pool is closed")
                dealer = self._dealers.get(endpoint)
                if dealer is None:
                    sock = connect_dealer(
                        endpoint, self._limits, self._timeout_ms, server_key=server_key
                    )
                    dealer = self._dealers[endpoint] = _SharedDealer(sock)
            with dealer.lock:
                if not dealer.closed:
                    send_bounded(dealer.sock, frame)
                    return
        raise SendTimeout(f"the DEALER to {endpoint} was closed twice during this send")

    def forget(self, endpoint: str) -> None:
        """Close the DEALER to ``endpoint`` (its peer is gone) once its current send ends."""
        with self._lock:
            dealer = self._dealers.pop(endpoint, None)
        if dealer is not None:
            with dealer.lock:
                dealer.closed = True
                dealer.sock.close(linger=self._timeout_ms)

    def close_all(self) -> None:
        """Refuse new sends, then close each dealer once its current send (bounded) ends."""
        with self._lock:
            self._closed = True
            dealers = list(self._dealers.values())
            self._dealers.clear()
        for dealer in dealers:
            with dealer.lock:
                dealer.closed = True
                # linger=0 dropped a frame still queued on a fresh connection (a final Result)
                dealer.sock.close(linger=self._timeout_ms)
