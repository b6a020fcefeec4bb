"""How engine frames travel between an engine and its daemon: a unix stream (ipc://) or ZMQ (tcp://).

Every engine-protocol frame (``b"KE" + version + msgpack``, engine_protocol.py) is
one message. Two transports carry them:

* **ipc:// -- a unix stream socket** (the default engine socket). Each frame is sent
  as a 4-byte little-endian length and the frame itself. A frame is read and written
  by the thread that owns the connection, with no thread in between: one system call
  per batch of frames each way. ZMQ's ipc transport passed every message through two
  more threads (its I/O threads), which cost 3x the latency and CPU of a plain unix
  socket per round trip on the 2-core hosts this was measured on (docs/performance.md,
  "Issue 22"). ``ipc://@name`` is a Linux abstract socket, as in ZMQ.
* **tcp:// -- a ZMQ DEALER/ROUTER pair**, because a TCP engine socket must be a CURVE
  server (auth.py): engines on another host authenticate with their keys.

Both sides are non-blocking. A sender never blocks on a peer that does not read:
what the kernel does not take waits in the connection's outbox (bounded by
``MAX_OUTBOX_BYTES``; past it the connection is closed, counted by its owner) and is
written when the socket turns writable. A frame longer than the reader's bound
closes the connection (the length prefix cannot be trusted past it).

``connect`` opens the engine side of either for both clients (client.py, async_client.py).
"""

from __future__ import annotations

import errno
import select
import socket
import struct
import time
from typing import Any

import zmq

from kvxferd.auth import Curve
from kvxferd.engine import engine_protocol as ep
from kvxferd.engine.engine_protocol import EngineReason
from kvxferd.engine.errors import EngineUnavailable
from kvxferd.transfer.control import process_context

LENGTH = struct.Struct("<I")
MAX_OUTBOX_BYTES = 64 << 20  # written-but-unread bytes a connection may hold before it is closed
RECV_CHUNK = 1 << 18
_MAX_READS = 64  # reads per call of ``recv``: a fast peer cannot keep one thread forever


def wait_fd(fd: int, timeout_s: float, *, writable: bool = False) -> bool:
    """Wait up to ``timeout_s`` for ``fd`` to turn readable (or writable); whether it did.

    ``poll``, not ``select``: an engine process (vLLM with its workers, NCCL and pools)
    easily holds more than 1024 descriptors, and ``select`` refuses any descriptor past
    ``FD_SETSIZE`` (ValueError), which took the engine's calls down with it.
    """
    p = select.poll()
    p.register(fd, select.POLLOUT if writable else select.POLLIN)
    return bool(p.poll(max(0.0, timeout_s) * 1000.0))


class ChannelClosed(Exception):
    """The peer closed the connection, or it broke, or it sent a frame past the bound."""


def ipc_address(endpoint: str) -> str:
    """The unix socket address of an ``ipc://`` endpoint (``@name``: abstract, leading NUL)."""
    path = endpoint[len("ipc://") :]
    return "\0" + path[1:] if path.startswith("@") else path


class FrameReader:
    """Splits a byte stream into length-prefixed frames.

    A length over ``max_bytes`` ends the stream: the frames before it are returned (each
    still gets its answer), ``error`` says why, and nothing after it is read.
    """

    __slots__ = ("_buf", "_max", "error")

    def __init__(self, max_bytes: int) -> None:
        self._buf = bytearray()
        self._max = max_bytes
        self.error: str | None = None

    def feed(self, data: bytes) -> list[bytes]:
        if self.error is not None:
            return []
        buf = self._buf
        buf += data
        frames: list[bytes] = []
        at, end = 0, len(buf)
        while end - at >= 4:
            (n,) = LENGTH.unpack_from(buf, at)
            if n > self._max:
                self.error = f"a frame of {n} bytes is over the bound of {self._max}"
                buf.clear()
                return frames
            if end - at - 4 < n:
                break
            frames.append(bytes(buf[at + 4 : at + 4 + n]))
            at += 4 + n
        if at:
            del buf[:at]
        return frames


class StreamChannel:
    """One non-blocking unix stream connection: frames in, frames out, an outbox for the rest.

    Not thread-safe: its owner serialises every call (the gateway's io thread; a client
    under its own locks).
    """

    __slots__ = ("sock", "reader", "_out", "closed")

    # Frames go through the outbox: several queued in one turn leave in one system call
    # (and wake the peer once), which is most of the cost of a small frame.

    def __init__(self, sock: socket.socket, max_frame_bytes: int) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.reader = FrameReader(max_frame_bytes)
        self._out = bytearray()
        self.closed = False

    @classmethod
    def connect(cls, endpoint: str, max_frame_bytes: int, timeout: float) -> StreamChannel:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(max(0.001, timeout))
            sock.connect(ipc_address(endpoint))
        except BaseException:
            sock.close()
            raise
        return cls(sock, max_frame_bytes)

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def wants_write(self) -> bool:
        """Bytes wait in the outbox: watch the socket for writability and ``flush``."""
        return bool(self._out)

    def send(self, frame: bytes) -> None:
        """Queue one frame and write what the kernel takes now; ChannelClosed when broken
        or when the outbox passed ``MAX_OUTBOX_BYTES`` (the peer does not read)."""
        self.queue(frame)
        self.flush()

    def queue(self, frame: bytes) -> None:
        """Add one frame to the outbox without writing (``flush`` writes a batch in one call)."""
        if self.closed:
            raise ChannelClosed("connection closed")
        out = self._out
        out += LENGTH.pack(len(frame))
        out += frame
        if len(out) > MAX_OUTBOX_BYTES:
            raise ChannelClosed(f"peer not reading: {len(out)} bytes unsent")

    def flush(self) -> bool:
        """Write queued bytes; True when the outbox is empty. ChannelClosed when broken."""
        out = self._out
        while out:
            try:
                n = self.sock.send(out)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as e:
                raise ChannelClosed(f"send failed: {e}") from None
            del out[:n]
        return True

    @property
    def failed(self) -> str | None:
        """Why the stream cannot be read any further (a frame over the bound), or None.

        The frames before that point were returned by ``recv``; answer them, then close.
        """
        return self.reader.error

    def recv(self) -> list[bytes]:
        """Every complete frame readable now (maybe none); ChannelClosed at EOF or on error.

        A frame over the bound ends the stream: the frames before it are returned and
        ``failed`` says why; the next ``recv`` raises ChannelClosed.
        """
        if self.reader.error is not None:
            raise ChannelClosed(self.reader.error)
        frames: list[bytes] = []
        for _ in range(_MAX_READS):
            try:
                data = self.sock.recv(RECV_CHUNK)
            except (BlockingIOError, InterruptedError):
                return frames
            except OSError as e:
                raise ChannelClosed(f"receive failed: {e}") from None
            if not data:
                if frames:
                    return frames  # answered first; the next recv sees the end
                raise ChannelClosed("closed by the peer")
            frames += self.reader.feed(data)
            if self.reader.error is not None or len(data) < RECV_CHUNK:
                return frames
        return frames

    def send_blocking(self, frame: bytes, deadline: float) -> None:
        """``send``, then wait (until ``deadline``, monotonic) for the outbox to empty."""
        self.send(frame)
        while self._out:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelClosed("the daemon is not reading (send timed out)")
            wait_fd(self.sock.fileno(), left, writable=True)
            self.flush()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass


class StreamListener:
    """A listening unix stream socket (non-blocking accept)."""

    def __init__(self, endpoint: str, backlog: int = 128) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(ipc_address(endpoint))
            sock.listen(backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> socket.socket | None:
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                raise
            return None
        conn.set_inheritable(False)
        return conn

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class ZmqChannel:
    """The engine end of a tcp:// engine socket: a ZMQ DEALER (CURVE) behind the same calls.

    ZMQ's file descriptor is edge-triggered: ``recv`` drains until nothing is left, and
    a send may take the edge of a frame that arrived meanwhile, so callers read again
    after sending (``reread_after_send``).
    """

    reread_after_send = True

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.sock = sock
        self.closed = False

    def fileno(self) -> int:
        return int(self.sock.getsockopt(zmq.FD))

    wants_write = False

    def send(self, frame: bytes) -> None:
        try:
            self.sock.send(frame, zmq.NOBLOCK, copy=len(frame) < 65536)
        except zmq.ZMQError as e:  # Again: the daemon is not reading (high-water mark)
            raise ChannelClosed(f"send failed: {e}") from None

    def queue(self, frame: bytes) -> None:
        self.send(frame)  # ZMQ queues it itself

    def flush(self) -> bool:
        return True

    def send_blocking(self, frame: bytes, deadline: float) -> None:
        self.send(frame)

    def recv(self) -> list[bytes]:
        frames: list[bytes] = []
        for _ in range(256):
            try:
                if not int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    break
                parts = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError as e:
                raise ChannelClosed(f"receive failed: {e}") from None
            if len(parts) == 1:
                frames.append(parts[0])
        return frames

    def readable(self) -> bool:
        return bool(int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close(linger=0)


def dealer_options(sock: zmq.Socket[Any], curve: Curve | None = None) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, ep.MAX_FRAME_BYTES)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    if curve is not None:  # a daemon's TCP engine socket: our keys, the daemon's public key
        curve.apply_client(sock)


# -- the connection under both clients (client.py, async_client.py) ------------------------------------------------------
def connect(endpoint: str, timeout: float, curve: Curve | None) -> StreamChannel | ZmqChannel:
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
        dealer_options(sock, curve)
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise EngineUnavailable(
            EngineReason.PEER_LOST, f"cannot connect to {endpoint}: {e}"
        ) from None
    return ZmqChannel(sock)
