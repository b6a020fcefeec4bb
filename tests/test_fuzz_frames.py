"""100k hostile messages at both daemons' sockets while a real transfer loop runs: no crash, no hang, each one counted.

Two real daemon processes (``python -m kvxferd sender|receiver``, real ZMQ, real NIXL)
serve a legitimate engine loop (publish, fetch, verify every byte, close) while this
process sends pre-built hostile messages (tests/support/hostile.py), non-blocking, in windows,
at four sockets: the sender's listener ROUTER, the receiver's result ROUTER (ZMQ, the
wire protocol) and the engine gateway of each (an ``ipc://`` unix stream of
length-prefixed frames, the engine protocol). One run (a module fixture) per peer
variant; each test checks one thing the run must show.

What the daemons answer and count, per message that reaches them (so the assertions
are exact; every reply is decoded and must be the refusal its frame earns, in order):

================  ===========================================  ==============================
socket            counters (sum over labels, from /metrics)    replies
================  ===========================================  ==============================
sender listener   kvxferd_rejections, one per reply (a         a message is a batch: one per
                  refused Register adds registers_refused      frame, each frame decoded and
                  too: not summed)                             refused on its own, in order
                                                               (``MAX_BATCH`` frames at most;
                                                               more: one Reject{malformed})
receiver results  kvxferd_rejections (undecodable: a multi-    none
                  frame message is one; a RegisterReply on
                  the result socket), kvxferd_peer_rejections
                  (a Reject), kvxferd_late_messages (a
                  Result/CancelAck for no fetch): one per
                  message
engine gateways   kvxferd_gateway_rejections, one per frame    one Error per frame
                  (a refused publish/fetch also counts in
                  the service's fetch_refused_*: not summed)
================  ===========================================  ==============================

A listener reply is predicted from the frame with the sender's own rules
(``wire.decode_to_sender``): an undecodable frame gets Reject{its reason}, a Register
a refused RegisterReply, a RequestData Result{failed, unknown_peer}, a Cancel
Reject{unknown_peer} (the hostile peer never registers). An engine frame gets an Error
with the call id the gateway decodes or salvages. A frame of exactly the engine
bound (``MAX_FRAME_BYTES``) is read and refused like any other.

Oversized frames never reach a decoder, and are sent on connections of their own. On
the ZMQ sockets, a frame over ``MAXMSGSIZE`` makes libzmq close its connection (counted
here from the client's socket monitor, one disconnect each) while the daemon's counters
stay as they were. On an engine socket, a length prefix over the gateway's bound makes
the gateway close the connection with no reply, counted in
``kvxferd_gateway_engine_connections_dropped`` (one each, nothing else counted).

Variants: ``anonymous`` (security off on loopback, as today: every peer is the empty
identity), ``authenticated`` (a CURVE client whose key is allowed: its frames reach
the daemon and are counted as above) and ``unauthenticated`` (a plaintext client against
a CURVE server: nothing reaches the daemon, the failed handshakes are counted,
``HANDSHAKE_FAILURES``). CURVE concerns the two ZMQ sockets only: the engine sockets
are unix sockets protected by their file's mode (0600), and this process, their owner,
reaches them in every variant. :class:`Keys` writes the certificates,
:func:`hostile_socket` connects as either peer, :func:`security_env` gives the daemons
their ``[security]``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvxferd.engine import engine_protocol as ep
from kvxferd.engine.channel import LENGTH, FrameReader, ipc_address
from kvxferd.engine.client import Client, attach_pool
from kvxferd.errors import ProtocolError, Reason
from kvxferd.transfer import protocol as wire
from tests.support import hostile
from tests.support.conditions import wait_until
from tests.support.peers import request_content
from tests.test_daemon import DaemonProcess, daemon_env, http_get, metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

SEED = int(os.environ.get("KVXFERD_FUZZ_SEED", "14"))
# Messages per socket: 100k in all.
COUNTS = {"listener": 36_000, "results": 36_000, "engine-tx": 14_000, "engine-rx": 14_000}
WINDOW = 512  # replies owed per socket (bounds the queues both ways)
SEND_BUDGET_S = 45.0  # the whole send phase; a daemon that stops reading fails here, not hangs
SETTLE_S = 20.0  # counters of the socket that sends no replies catch up within this
CALL_S = 10.0
STARTUP_S = 60.0
LAYERS, BLOCKS, BLOCK_BYTES, REQ_BLOCKS = 2, 64, 4096, 8
MAX_FRAME = 4 << 20  # limits.max_frame_bytes (the default) = the listener's MAXMSGSIZE
OVERSIZED_PER_SOCKET = 2

# the metric families counting refused handshakes (kvxferd/auth.py)
HANDSHAKE_FAILURES: tuple[str, ...] = ("kvxferd_handshakes_failed",)


@dataclass(frozen=True)
class Variant:
    """Who the hostile peer is: whether the daemons run CURVE and whether its key is allowed."""

    name: str
    curve: bool  # the daemons run security.mode = "curve"
    allowed: bool  # the hostile peer is a CURVE client with an allowed key (else plaintext)
    waits_for: str = ""  # why it is skipped; "" = it runs

    def reaches(self, endpoint: str) -> bool:
        """Whether frames sent to ``endpoint`` get to the daemon (an ipc:// engine socket is a
        unix stream, never CURVE: this process, its owner, always gets there)."""
        return not (self.curve and not self.allowed and endpoint.startswith("tcp://"))


VARIANTS = (
    Variant("anonymous", curve=False, allowed=False),
    Variant("authenticated", curve=True, allowed=True),
    Variant("unauthenticated", curve=True, allowed=False),
)


@dataclass(frozen=True)
class Keys:
    """Certificate files (zmq.auth format) for both daemons and the hostile peer."""

    dir: str
    allow_dir: str  # the daemons' allow-list: the peer daemon and, when allowed, the hostile peer

    @classmethod
    def make(cls, base: str, variant: Variant) -> Keys:
        import zmq.auth

        keys, allow = os.path.join(base, "keys"), os.path.join(base, "allow")
        os.makedirs(keys), os.makedirs(allow)
        for name in ("tx", "rx", "fz"):
            public, secret = zmq.auth.create_certificates(keys, name)
            os.chmod(secret, 0o600)  # the daemons refuse a key file others can read
            if name != "fz" or variant.allowed:
                shutil.copy(public, allow)
        return cls(keys, allow)

    def pair(self, name: str) -> tuple[bytes, bytes]:
        import zmq.auth

        public, secret = zmq.auth.load_certificate(os.path.join(self.dir, f"{name}.key_secret"))
        assert secret is not None
        return public, secret


def security_env(variant: Variant, keys: Keys, name: str) -> dict[str, str]:
    """The daemon ``name``'s security settings for ``variant`` (nothing while security is off)."""
    if not variant.curve:
        return {}
    return {
        "KVXFERD_SECURITY__MODE": "curve",
        "KVXFERD_SECURITY__KEY_FILE": os.path.join(keys.dir, f"{name}.key_secret"),
        "KVXFERD_SECURITY__ALLOWED_KEYS_DIR": keys.allow_dir,
        # the receiver expects the sender's key at every sender endpoint
        "KVXFERD_SECURITY__SENDER_KEYS": json.dumps({"*": os.path.join(keys.dir, "tx.key")}),
    }


def hostile_socket(
    variant: Variant,
    endpoint: str,
    keys: Keys | None = None,
    server: str = "",
    before_connect: Callable[[zmq.Socket[bytes]], object] | None = None,
) -> zmq.Socket[bytes]:
    """A DEALER toward ``endpoint`` as the hostile peer of ``variant`` connects.

    Toward a CURVE server (``server``: "tx" or "rx", a tcp endpoint) an ``allowed`` peer is
    a CURVE client with its own key and the daemon's server key; any other connects in
    plaintext, and its handshake fails.
    """
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, WINDOW * 2)
    if variant.curve and variant.allowed and endpoint.startswith("tcp://"):
        assert keys is not None and server
        public, secret = keys.pair("fz")
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.pair(server)[0])
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    if before_connect is not None:  # e.g. a monitor, so that it sees the first connection
        before_connect(sock)
    sock.connect(endpoint)
    return sock


# -- the daemons and the legitimate loop -------------------------------------------------


def fuzz_env() -> dict[str, str]:
    return daemon_env(
        KVXFERD_POOL__NUM_LAYERS=LAYERS,
        KVXFERD_POOL__NUM_BLOCKS=BLOCKS,
        KVXFERD_POOL__BLOCK_ELEMS=BLOCK_BYTES,
        KVXFERD_DEADLINES__KV_TRANSFER_TIMEOUT_MS=int(CALL_S * 1000),
    )


@dataclass
class Legit:
    """A publish -> fetch -> verify -> close loop through both gateways, on its own thread."""

    tx: DaemonProcess
    rx: DaemonProcess
    done: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    first: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.ct = Client(self.tx.engine_socket, timeout_s=CALL_S)
        self.cr = Client(self.rx.engine_socket, timeout_s=CALL_S)
        self.pt = attach_pool(self.ct.describe())
        self.pr = attach_pool(self.cr.describe())

    def one(self, i: int) -> str:
        """Transfer ``legit-i``; "" when it arrived byte-exact, else what went wrong."""
        rid = f"legit-{i}"
        blocks = [(i * REQ_BLOCKS + b) % BLOCKS for b in range(REQ_BLOCKS)]
        want = request_content(rid, LAYERS, REQ_BLOCKS, BLOCK_BYTES)
        self.pt[:, blocks] = want
        h = self.ct.publish(rid, blocks)
        g = self.cr.fetch(rid, self.tx.endpoint, blocks)
        out = self.cr.wait(g, CALL_S)
        why = ""
        if out is None or out.state != "done":
            why = f"{rid}: {out}"
        elif not torch.equal(self.pr[:, blocks], want):
            why = f"{rid}: done, bytes differ"
        if not self.cr.close(g, CALL_S) or not self.ct.close(h, CALL_S):
            why = why or f"{rid}: blocks not released"
        return why

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            try:
                why = self.one(i)
            except Exception as e:  # a refused or failed call is a failure of the run, reported
                why = f"legit-{i}: {e!r}"
            if why:
                self.failures.append(why)
            else:
                self.done += 1
            self.first.set()
            i += 1

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="legit-loop", daemon=True)
        self.thread.start()

    def join(self) -> bool:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(CALL_S * 4)
        return not self.thread.is_alive()

    def close(self) -> None:
        self.ct.close_client()
        self.cr.close_client()


# -- what a daemon answers -------------------------------------------------------------------

# A reply as (kind, reason, call id); in an expectation None matches anything.
Reply = tuple[str, str | None, int | None]


def listener_replies(msg: hostile.Message) -> list[Reply]:
    """What the sender's listener answers ``msg`` from a peer that never registered.

    A message is a batch: each frame is decoded (with the sender's rules) and answered on
    its own, in order; a message of more than ``MAX_BATCH`` frames gets one Reject.
    """
    if len(msg) > wire.MAX_BATCH:
        return [("reject", Reason.MALFORMED.value, None)]
    out: list[Reply] = []
    for frame in msg:
        try:
            m = wire.decode_to_sender([frame], MAX_FRAME)
        except ProtocolError as e:
            out.append(("reject", e.reason.value, None))
            continue
        if isinstance(m, wire.Register):  # refused: its NIXL metadata is junk
            out.append(("register_refused", None, None))
        elif isinstance(m, wire.RequestData):
            out.append(("result_failed", Reason.UNKNOWN_PEER.value, None))
        else:
            out.append(("reject", Reason.UNKNOWN_PEER.value, None))
    return out


def engine_replies(msg: hostile.Message) -> list[Reply]:
    """What a gateway answers a one-frame ``msg``: an Error with the call id it read or salvaged."""
    (frame,) = msg
    try:
        call = ep.decode_to_gateway([frame])
    except ProtocolError as e:
        return [("error", e.reason.value, ep.salvage_call_id([frame]))]
    return [("error", None, call.call_id)]  # the reason depends on the call: not predicted


def listener_reply(frames: list[bytes]) -> Reply:
    """A reply the hostile peer got from the listener, as a :data:`Reply`."""
    try:
        m = wire.decode_to_receiver(frames, MAX_FRAME)
    except ProtocolError as e:
        return ("undecodable", e.reason.value, None)
    if isinstance(m, wire.Reject):
        return ("reject", m.reason.value, None)
    if isinstance(m, wire.RegisterReply):
        reason = None if m.reason is None else m.reason.value
        return ("register_accepted" if m.ok else "register_refused", reason, None)
    if isinstance(m, wire.Result):
        return (f"result_{m.status}", None if m.reason is None else m.reason.value, None)
    return (str(m.__struct_config__.tag), None, None)


def engine_reply(frames: list[bytes]) -> Reply:
    """A reply the hostile engine got from a gateway, as a :data:`Reply`."""
    try:
        m = ep.decode_to_engine(frames)
    except ProtocolError as e:
        return ("undecodable", e.reason.value, None)
    if isinstance(m, ep.Error):
        return ("error", m.reason.value, m.call_id)
    return (str(m.__struct_config__.tag), None, m.call_id)


def matches(want: Reply, got: Reply) -> bool:
    return all(w is None or w == g for w, g in zip(want, got, strict=True))


# -- the hostile peers -----------------------------------------------------------------------


class ZmqPeer:
    """A hostile DEALER (:func:`hostile_socket`): one message per ``send_multipart``."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock

    def pollable(self) -> zmq.Socket[bytes]:
        return self.sock

    def events(self) -> int:
        return zmq.POLLIN

    def send(self, msg: hostile.Message) -> bool:
        """Queue ``msg`` without blocking; False when ZMQ's queue toward the daemon is full."""
        try:
            self.sock.send_multipart(msg, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def flush(self) -> None:
        pass

    def recv(self) -> list[list[bytes]]:
        """The replies readable now (each one message)."""
        out = []
        while True:
            try:
                out.append(self.sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return out

    def close(self) -> None:
        self.sock.close(linger=0)


class StreamPeer:
    """A hostile engine on a unix engine socket: length-prefixed frames, never blocking.

    What the kernel does not take now waits in an outbox (``OUTBOX`` bytes at most: then
    ``send`` says False until the gateway read more), written on POLLOUT.
    """

    OUTBOX = 8 << 20
    CHUNK = 1 << 18

    def __init__(self, endpoint: str) -> None:
        assert endpoint.startswith("ipc://"), endpoint
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(CALL_S)
        self.sock.connect(ipc_address(endpoint))
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()  # what zmq.Poller gives back
        self.reader = FrameReader(ep.MAX_FRAME_BYTES)
        self.out = bytearray()
        self.at = 0  # bytes of ``out`` written

    def pollable(self) -> int:
        return self.fd

    def events(self) -> int:
        return zmq.POLLIN | (zmq.POLLOUT if self.at < len(self.out) else 0)

    def send(self, msg: hostile.Message) -> bool:
        (frame,) = msg  # a stream has no multi-frame message
        if len(self.out) - self.at >= self.OUTBOX:
            self.flush()
            if len(self.out) - self.at >= self.OUTBOX:
                return False
        self.out += LENGTH.pack(len(frame))
        self.out += frame
        self.flush()
        return True

    def flush(self) -> None:
        """Write what the kernel takes now; ConnectionError if the gateway closed the connection."""
        while self.at < len(self.out):
            try:
                n = self.sock.send(self.out[self.at : self.at + self.CHUNK])
            except BlockingIOError:
                break
            except OSError as e:
                raise ConnectionError(f"write failed: {e!r}") from None
            self.at += n
        if self.at == len(self.out) or self.at > self.OUTBOX:
            del self.out[: self.at]
            self.at = 0

    def recv(self) -> list[list[bytes]]:
        """The replies readable now (each one frame); ConnectionError at EOF or a reset."""
        out: list[list[bytes]] = []
        while True:
            try:
                data = self.sock.recv(self.CHUNK)
            except BlockingIOError:
                return out
            except OSError as e:
                raise ConnectionError(f"read failed: {e!r}") from None
            if not data:
                raise ConnectionError("the gateway closed the connection")
            out += [[f] for f in self.reader.feed(data)]

    def close(self) -> None:
        self.sock.close()


Peer = ZmqPeer | StreamPeer


# -- sending -------------------------------------------------------------------------------


@dataclass
class Aim:
    """One socket under fire: its messages, the replies each earns, the counters that must grow."""

    name: str
    peer: Peer
    messages: list[hostile.Message]
    expect: list[list[Reply]]  # per message, the replies it earns ([] when none come)
    decode: Callable[[list[bytes]], Reply]
    counted: Callable[[], float]
    replies: bool  # the socket answers (else its counters are one per message)
    reaches: bool = True  # False: a refused handshake, nothing gets to the daemon
    sent: int = 0
    promised: int = 0  # the replies the messages sent so far earn
    got: list[Reply] = field(default_factory=list)
    blocked: bool = False  # it does not reach, and its client queue is full
    broken: str = ""  # the connection ended under the hostile peer (it must not)

    def expected_replies(self) -> list[Reply]:
        return [r for m in self.expect[: self.sent] for r in m]


def counter_sum(port: int, *families: str) -> float:
    fams = metrics(port)
    return sum(
        s.value for name in families for s in fams[name].samples if s.name.endswith("_total")
    )


def send_all(aims: list[Aim], budget_s: float) -> float:
    """Send every aim's messages (without blocking, at most WINDOW replies owed) and take the replies."""
    t0 = time.monotonic()
    deadline = t0 + budget_s
    poller = zmq.Poller()
    by_item: dict[object, Aim] = {a.peer.pollable(): a for a in aims}
    while time.monotonic() < deadline:
        busy = False
        for a in (a for a in aims if not (a.blocked or a.broken)):
            try:
                while a.sent < len(a.messages) and a.promised - len(a.got) < WINDOW:
                    if not a.peer.send(a.messages[a.sent]):  # full: read replies first
                        a.blocked = not a.reaches  # nothing will ever take these
                        break
                    a.promised += len(a.expect[a.sent])
                    a.sent += 1
            except ConnectionError as e:
                a.broken = str(e)
            busy |= not (a.blocked or a.broken) and (
                a.sent < len(a.messages) or len(a.got) < a.promised
            )
        if not busy:
            break
        for a in aims:
            if a.broken:
                with contextlib.suppress(KeyError):
                    poller.unregister(a.peer.pollable())
            else:
                poller.register(a.peer.pollable(), a.peer.events())
        for item, events in poller.poll(20):
            a = by_item[item]
            try:
                if events & zmq.POLLOUT:
                    a.peer.flush()
                if events & zmq.POLLIN:
                    a.got += [a.decode(r) for r in a.peer.recv()]
            except ConnectionError as e:
                a.broken = str(e)
    return time.monotonic() - t0


def send_oversized(
    variant: Variant, endpoint: str, header: bytes, max_bytes: int, keys: Keys | None, server: str
) -> int:
    """Send oversized frames to a ZMQ socket, each on a connection of its own; the connections that ended.

    A connection ends in a disconnect (libzmq dropped the oversized frame with it) or, for
    a peer whose handshake the daemon refuses, possibly in the failed handshake first.
    """
    ended_by = (
        zmq.EVENT_DISCONNECTED
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    )
    disconnects = 0
    for _ in range(OVERSIZED_PER_SOCKET):
        # The monitor is attached before the connect: a handshake refused at once must not
        # end the connection before anything watches it (it flaked under load).
        mons: list[zmq.Socket[bytes]] = []
        sock = hostile_socket(
            variant,
            endpoint,
            keys,
            server,
            lambda s, m=mons: m.append(s.get_monitor_socket(zmq.EVENT_CONNECTED | ended_by)),
        )
        mon = mons[0]
        try:
            deadline = time.monotonic() + CALL_S
            ended = False
            try:
                sock.send_multipart(hostile.oversized(max_bytes, header), zmq.NOBLOCK)
            except zmq.Again:
                # The handshake was refused before the frame could go (no pipe left to
                # queue it on): the monitor below must still report how it ended.
                pass
            while not ended and time.monotonic() < deadline:
                if mon.poll(100):
                    ended = bool(recv_monitor_message(mon)["event"] & ended_by)
            disconnects += ended
        finally:
            sock.disable_monitor()
            mon.close(linger=0)
            sock.close(linger=0)
    return disconnects


def send_oversized_stream(endpoint: str, max_bytes: int) -> tuple[int, int]:
    """Length prefixes over an engine socket's bound, each on a connection of its own.

    Returns (the connections the gateway closed, the frames it sent on them). The first
    connection announces the frame and sends its header only; the others send it whole
    (the gateway closes at the prefix, so the rest of the write may fail: that is fine).
    """
    frame = hostile.oversized(max_bytes, ep.HEADER)[0]
    closed = replies = 0
    for i in range(OVERSIZED_PER_SOCKET):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(CALL_S)
            sock.connect(ipc_address(endpoint))
            reader = FrameReader(ep.MAX_FRAME_BYTES)
            data = LENGTH.pack(len(frame)) + (frame[: len(ep.HEADER)] if i == 0 else frame)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError, TimeoutError):
                sock.sendall(data)
            deadline = time.monotonic() + CALL_S
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                try:
                    chunk = sock.recv(1 << 16)
                except ConnectionResetError:  # closed with our bytes unread
                    chunk = b""
                except TimeoutError:
                    break
                if not chunk:
                    closed += 1
                    break
                replies += len(reader.feed(chunk))
        finally:
            sock.close()
    return closed, replies


# -- the run --------------------------------------------------------------------------------

ENGINES = ("engine-tx", "engine-rx")
CONNECTIONS_DROPPED = "kvxferd_gateway_engine_connections_dropped"


@dataclass
class Run:
    variant: Variant
    tx: DaemonProcess
    rx: DaemonProcess
    aims: list[Aim]
    before: dict[str, float]
    after: dict[str, float]
    handshake_failures: float  # growth of HANDSHAKE_FAILURES, both daemons
    send_s: float
    oversized: dict[str, int]  # connections that ended, per socket
    oversized_replies: dict[str, int]  # frames an engine socket sent on them
    dropped: dict[str, float]  # growth of CONNECTIONS_DROPPED, per engine socket
    legit_done: int
    legit_failures: list[str]
    legit_stopped: bool
    after_request_s: float | None
    after_request: str


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: v.name)
def run(request: pytest.FixtureRequest) -> Iterator[Run]:
    """Both daemons, the legitimate loop and 100k hostile messages, once per variant."""
    variant: Variant = request.param
    if variant.waits_for:
        pytest.skip(variant.waits_for)
    sock_dir = tempfile.mkdtemp(prefix="kxfz")
    keys = Keys.make(sock_dir, variant) if variant.curve else None

    def env(name: str) -> dict[str, str]:
        return {**fuzz_env(), **(security_env(variant, keys, name) if keys else {})}

    daemons = [
        DaemonProcess("sender", "tx", sock_dir, env("tx"), ["--listen", "tcp://127.0.0.1:0"]),
        DaemonProcess("receiver", "rx", sock_dir, env("rx"), []),
    ]
    legit: Legit | None = None
    peers: list[Peer] = []
    try:
        tx, rx = daemons
        tx.wait_ready(STARTUP_S), rx.wait_ready(STARTUP_S)
        layout = hostile.layout_map(LAYERS, BLOCKS, BLOCK_BYTES)  # compatible: Registers reach NIXL
        results_fams = ("kvxferd_rejections", "kvxferd_peer_rejections", "kvxferd_late_messages")
        build = {
            "listener": ("listener", tx.endpoint, tx.probe_port, ("kvxferd_rejections",)),
            "results": ("results", rx.endpoint, rx.probe_port, results_fams),
            "engine-tx": (
                "engine",
                tx.engine_socket,
                tx.probe_port,
                ("kvxferd_gateway_rejections",),
            ),
            "engine-rx": (
                "engine",
                rx.engine_socket,
                rx.probe_port,
                ("kvxferd_gateway_rejections",),
            ),
        }
        aims = []
        server = {"listener": "tx", "results": "rx"}
        for i, (name, (target, endpoint, port, fams)) in enumerate(build.items()):
            msgs = hostile.build(target, COUNTS[name], SEED + i, layout=layout)  # type: ignore[arg-type]
            reaches = variant.reaches(endpoint)
            peer: Peer
            if target == "engine":
                peer = StreamPeer(endpoint)
                predict, decode = engine_replies, engine_reply
            else:
                peer = ZmqPeer(hostile_socket(variant, endpoint, keys, server[name]))
                predict, decode = listener_replies, listener_reply
            peers.append(peer)
            replies = target != "results"
            expect = [predict(m) if replies and reaches else [] for m in msgs]
            counted = (lambda p, f: lambda: counter_sum(p, *f))(port, fams)
            aims.append(Aim(name, peer, msgs, expect, decode, counted, replies, reaches))
        engine_port = {"engine-tx": tx.probe_port, "engine-rx": rx.probe_port}

        def dropped_now() -> dict[str, float]:
            return {e: counter_sum(p, CONNECTIONS_DROPPED) for e, p in engine_port.items()}

        def handshakes() -> float:
            return sum(counter_sum(d.probe_port, *HANDSHAKE_FAILURES) for d in daemons)

        legit = Legit(tx, rx)
        legit.start()
        assert legit.first.wait(CALL_S * 3), "the legitimate loop never finished a transfer"
        before = {a.name: a.counted() for a in aims}
        dropped_before = dropped_now()
        handshakes_before = handshakes()
        send_s = send_all(aims, SEND_BUDGET_S)
        oversized = {
            "listener": send_oversized(variant, tx.endpoint, wire.HEADER, MAX_FRAME, keys, "tx"),
            "results": send_oversized(variant, rx.endpoint, wire.HEADER, MAX_FRAME, keys, "rx"),
        }
        oversized_replies = {}
        for name, endpoint in (("engine-tx", tx.engine_socket), ("engine-rx", rx.engine_socket)):
            oversized[name], oversized_replies[name] = send_oversized_stream(
                endpoint, ep.MAX_FRAME_BYTES
            )
        results = next(a for a in aims if a.name == "results")
        with contextlib.suppress(AssertionError):  # the tests say by how much it fell short
            wait_until(
                lambda: results.counted() >= before["results"] + expected(results),
                SETTLE_S,
                "the result socket's counters catch up",
            )
        with contextlib.suppress(AssertionError):  # a gateway counts a drop after the close
            wait_until(
                lambda: all(
                    n >= dropped_before[e] + OVERSIZED_PER_SOCKET for e, n in dropped_now().items()
                ),
                CALL_S,
                "the gateways count the connections they closed",
            )
        after = {a.name: a.counted() for a in aims}
        dropped = {e: n - dropped_before[e] for e, n in dropped_now().items()}
        handshake_failures = handshakes() - handshakes_before
        stopped = legit.join()
        done, failures = legit.done, list(legit.failures)
        t0 = time.monotonic()
        try:
            why = legit.one(10**6)
            after_s: float | None = time.monotonic() - t0
        except Exception as e:
            why, after_s = repr(e), None
        print(
            f"\n[fuzz {variant.name}] {sum(a.sent for a in aims)} messages in {send_s:.1f}s"
            f" ({ {a.name: a.sent for a in aims} }), replies { {a.name: len(a.got) for a in aims} },"
            f" oversized connections closed {oversized}, legit transfers during the run {done},"
            f" load {os.getloadavg()[0]:.1f}"
        )
        yield Run(
            variant,
            tx,
            rx,
            aims,
            before,
            after,
            handshake_failures,
            send_s,
            oversized,
            oversized_replies,
            dropped,
            done,
            failures,
            stopped,
            after_s,
            why,
        )
    finally:
        if legit is not None:
            legit.stop.set()
            legit.close()
        for p in peers:
            p.close()
        for d in daemons:
            d.kill()
        shutil.rmtree(sock_dir, ignore_errors=True)


# -- what must hold -------------------------------------------------------------------------


def expected(a: Aim) -> int:
    """How much ``a``'s rejection counters must grow: one per reply it earned (a socket that
    answers), else one per message that reached the daemon."""
    if a.replies:
        return a.promised
    return a.sent if a.reaches else 0


def test_every_message_was_sent_and_answered_within_the_budget(run: Run) -> None:
    """Every hostile message left within the send budget and got exactly the replies it earns (no hang, no connection lost)."""
    for a in run.aims:
        assert a.broken == "", f"{a.name}: {a.broken}"
        if not a.reaches:  # a refused handshake: its queue fills, nothing is answered
            assert a.got == [], f"{a.name}: {len(a.got)} replies through a refused handshake"
            continue
        assert a.sent == len(a.messages), f"{a.name}: {a.sent}/{len(a.messages)} sent"
        assert len(a.got) == a.promised, f"{a.name}: {len(a.got)} replies, {a.promised} owed"
    assert sum(len(a.messages) for a in run.aims) >= 100_000


def test_every_reply_is_the_refusal_its_frame_earns_in_order(run: Run) -> None:
    """Each reply is the one its frame earns (a listener batch answered frame by frame, a batch over MAX_BATCH once), in the order sent."""
    for a in run.aims:
        want = a.expected_replies()
        wrong = [
            (i, w, g)
            for i, (w, g) in enumerate(zip(want, a.got, strict=False))
            if not matches(w, g)
        ]
        assert wrong == [], (
            f"{a.name}: {len(wrong)} replies not the expected one, first {wrong[:5]}"
        )
        assert len(a.got) == len(want), a.name
    listener = next(a for a in run.aims if a.name == "listener")
    if listener.reaches:  # the batches were there: some answered frame by frame, some whole
        sizes = {len(m) for m in listener.messages}
        assert max(sizes) > wire.MAX_BATCH and wire.MAX_BATCH in sizes and 2 in sizes


def test_every_message_that_reached_a_daemon_is_counted_exactly(run: Run) -> None:
    """Each socket's rejection counters grew by exactly what its hostile messages earned: one per reply, or one per message on the result socket (none through a refused handshake)."""
    grew = {a.name: run.after[a.name] - run.before[a.name] for a in run.aims}
    assert grew == {a.name: float(expected(a)) for a in run.aims}


def test_refused_handshakes_are_counted(run: Run) -> None:
    """A peer whose handshake the daemons refuse is counted there (variants where one is refused)."""
    if all(a.reaches for a in run.aims):
        pytest.skip(f"every hostile peer of {run.variant.name} completes its handshake")
    assert run.handshake_failures > 0


def test_oversized_frames_end_their_connection_and_nothing_else(run: Run) -> None:
    """Every frame over the bound ended its connection: libzmq's (seen by the client's monitor, counted by no daemon), or the gateway's (closed unanswered, one connection dropped counted each)."""
    assert run.oversized == dict.fromkeys(run.oversized, OVERSIZED_PER_SOCKET)
    assert run.oversized_replies == dict.fromkeys(ENGINES, 0)
    assert run.dropped == dict.fromkeys(ENGINES, float(OVERSIZED_PER_SOCKET))


def test_both_daemons_live_healthy_and_met_no_unexpected_error(run: Run) -> None:
    """Both daemons still run, answer /healthz and /readyz 200, and counted no thread or internal error."""
    for d in (run.tx, run.rx):
        assert d.alive(), d.describe()
        for path in ("/healthz", "/readyz"):
            status, body = http_get(d.probe_port, path)
            assert status == 200, (d.name, path, body)
        errors = counter_sum(
            d.probe_port,
            "kvxferd_thread_errors",
            "kvxferd_threads_dead",
            "kvxferd_gateway_thread_errors",
            "kvxferd_gateway_threads_dead",
            "kvxferd_gateway_internal_errors",
        )
        assert errors == 0, d.describe()


def test_the_legitimate_loop_stayed_byte_exact_during_the_fuzz(run: Run) -> None:
    """Transfers kept completing byte-exact through the fuzz, none failed, and the loop stopped when asked."""
    assert run.legit_failures == []
    assert run.legit_done >= 2
    assert run.legit_stopped


def test_a_legitimate_request_after_the_fuzz_completes_in_bound(run: Run) -> None:
    """A transfer started after the fuzz arrives byte-exact within its call deadlines."""
    assert run.after_request == ""
    assert run.after_request_s is not None


@pytest.mark.timeout(10)
@pytest.mark.parametrize("deep", [hostile.deep_array(5000), hostile.deep_map(5000)])
def test_nesting_past_the_recursion_limit_is_a_malformed_frame_not_an_exception(
    deep: hostile.Raw,
) -> None:
    """~5 KB of nesting before the tag is refused malformed by both protocols' decoders (it raised RecursionError)."""
    body = hostile.pack_map([("fz", deep), ("t", "cancel")])
    with pytest.raises(ProtocolError) as kx:
        wire.decode_to_sender([wire.HEADER + body], MAX_FRAME)
    with pytest.raises(ProtocolError) as ke:
        ep.decode_to_gateway([ep.HEADER + body])
    assert kx.value.reason == ke.value.reason == Reason.MALFORMED
    assert ep.salvage_call_id([ep.HEADER + body]) == 0
