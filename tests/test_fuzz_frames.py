"""100k hostile messages at both daemons' sockets while a real transfer loop runs: no crash, no hang, each one counted.

Two real daemon processes (``python -m kvxferd sender|receiver``, real ZMQ, real NIXL)
serve a legitimate engine loop (publish, fetch, verify every byte, close) while this
process sends pre-built hostile messages (tests/hostile.py) with NOBLOCK, in windows, at
four sockets: the sender's listener ROUTER, the receiver's result ROUTER and the engine
gateway of each (the engine protocol). One run (a module fixture) per peer variant;
each test checks one thing the run must show.

What the daemons count, per message that reaches them (so the assertions are exact):

==================  ==========================================================  =======
socket              counters (sum over labels, from /metrics)                   replies
==================  ==========================================================  =======
sender listener     kvxferd_rejections (a refused Register adds                 1 each
                    registers_refused too: not summed, so one count each)
receiver results    kvxferd_rejections (undecodable, or a RegisterReply on      none
                    the result socket), kvxferd_peer_rejections (a Reject),
                    kvxferd_late_messages (a Result/CancelAck for no fetch)
engine gateways     kvxferd_gateway_rejections (a refused publish/fetch also    1 each
                    counts in the service's fetch_refused_*: not summed)
==================  ==========================================================  =======

A message is what one ``send_multipart`` sends: a multi-frame message is one message,
refused (and counted) once. Frames over ``MAXMSGSIZE`` never reach the daemon: libzmq
closes the connection that carried them, so they are sent on connections of their own
and counted here from the client's socket monitor (one disconnect each) while the
daemon's counters stay as they were.

Variants: ``anonymous`` (security off on loopback, as today: every peer is the empty
identity), ``authenticated`` (a CURVE client whose key is allowed: its frames reach
the daemon and are counted as above) and ``unauthenticated`` (a plaintext client against
a CURVE server: nothing reaches the daemon, the failed handshakes are counted,
``HANDSHAKE_FAILURES``). :class:`Keys` writes the certificates, :func:`hostile_socket`
connects as either peer, :func:`security_env` gives the daemons their ``[security]``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
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
from kvxferd.engine.client import Client, attach_pool
from kvxferd.errors import ProtocolError, Reason
from kvxferd.transfer import protocol as wire
from tests import hostile
from tests.conditions import wait_until
from tests.peers import request_content
from tests.test_daemon import DaemonProcess, daemon_env, http_get, metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

SEED = int(os.environ.get("KVXFERD_FUZZ_SEED", "14"))
# Messages per socket: 100k in all.
COUNTS = {"listener": 36_000, "results": 36_000, "engine-tx": 14_000, "engine-rx": 14_000}
WINDOW = 512  # unanswered messages per socket (a reply per message bounds the queues)
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
        """Whether frames sent to ``endpoint`` get to the daemon (the engine's ipc is not CURVE)."""
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


# -- sending -------------------------------------------------------------------------------


@dataclass
class Aim:
    """One socket under fire: its messages, what it answers, the counters that must grow."""

    name: str
    sock: zmq.Socket[bytes]
    messages: list[hostile.Message]
    replies: bool
    counted: Callable[[], float]
    reaches: bool = True  # False: a refused handshake, nothing gets to the daemon
    sent: int = 0
    answered: int = 0
    blocked: bool = False  # it does not reach, and its client queue is full


def counter_sum(port: int, *families: str) -> float:
    fams = metrics(port)
    return sum(
        s.value for name in families for s in fams[name].samples if s.name.endswith("_total")
    )


def send_all(aims: list[Aim], budget_s: float) -> float:
    """Send every aim's messages (NOBLOCK, at most WINDOW unanswered) and take the replies."""
    t0 = time.monotonic()
    deadline = t0 + budget_s
    poller = zmq.Poller()
    for a in aims:
        poller.register(a.sock, zmq.POLLIN)
    while time.monotonic() < deadline:
        busy = False
        for a in (a for a in aims if not a.blocked):
            waits = a.replies and a.reaches
            limit = a.answered + WINDOW if waits else len(a.messages)
            while a.sent < min(limit, len(a.messages)):
                try:
                    a.sock.send_multipart(a.messages[a.sent], zmq.NOBLOCK)
                except zmq.Again:  # the queue toward the daemon is full: read replies first
                    a.blocked = not a.reaches  # nothing will ever take these
                    break
                a.sent += 1
            busy |= not a.blocked and (a.sent < len(a.messages) or (waits and a.answered < a.sent))
        if not busy:
            break
        for sock, _ in poller.poll(20):
            a = next(a for a in aims if a.sock is sock)
            while True:
                try:
                    a.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                a.answered += 1
    return time.monotonic() - t0


def send_oversized(
    variant: Variant, endpoint: str, header: bytes, max_bytes: int, keys: Keys | None, server: str
) -> int:
    """Send oversized frames, each on a connection of its own; the connections that ended.

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
            sock.send_multipart(hostile.oversized(max_bytes, header), zmq.NOBLOCK)
            while not ended and time.monotonic() < deadline:
                if mon.poll(100):
                    ended = bool(recv_monitor_message(mon)["event"] & ended_by)
            disconnects += ended
        finally:
            sock.disable_monitor()
            mon.close(linger=0)
            sock.close(linger=0)
    return disconnects


# -- the run --------------------------------------------------------------------------------


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
    oversized: dict[str, int]
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
    socks: list[zmq.Socket[bytes]] = []
    try:
        tx, rx = daemons
        tx.wait_ready(STARTUP_S), rx.wait_ready(STARTUP_S)
        layout = hostile.layout_map(LAYERS, BLOCKS, BLOCK_BYTES)  # compatible: Registers reach NIXL
        build = {
            "listener": ("listener", tx.endpoint, True, tx.probe_port, ("kvxferd_rejections",)),
            "results": (
                "results",
                rx.endpoint,
                False,
                rx.probe_port,
                ("kvxferd_rejections", "kvxferd_peer_rejections", "kvxferd_late_messages"),
            ),
            "engine-tx": (
                "engine",
                tx.engine_socket,
                True,
                tx.probe_port,
                ("kvxferd_gateway_rejections",),
            ),
            "engine-rx": (
                "engine",
                rx.engine_socket,
                True,
                rx.probe_port,
                ("kvxferd_gateway_rejections",),
            ),
        }
        aims = []
        server = {"listener": "tx", "results": "rx"}
        for i, (name, (target, endpoint, replies, port, fams)) in enumerate(build.items()):
            msgs = hostile.build(target, COUNTS[name], SEED + i, layout=layout)  # type: ignore[arg-type]
            sock = hostile_socket(variant, endpoint, keys, server.get(name, ""))
            socks.append(sock)
            counted = (lambda p, f: lambda: counter_sum(p, *f))(port, fams)
            aims.append(Aim(name, sock, msgs, replies, counted, variant.reaches(endpoint)))

        def handshakes() -> float:
            return sum(counter_sum(d.probe_port, *HANDSHAKE_FAILURES) for d in daemons)

        legit = Legit(tx, rx)
        legit.start()
        assert legit.first.wait(CALL_S * 3), "the legitimate loop never finished a transfer"
        before = {a.name: a.counted() for a in aims}
        handshakes_before = handshakes()
        send_s = send_all(aims, SEND_BUDGET_S)
        oversized = {
            "listener": send_oversized(variant, tx.endpoint, wire.HEADER, MAX_FRAME, keys, "tx"),
            "results": send_oversized(variant, rx.endpoint, wire.HEADER, MAX_FRAME, keys, "rx"),
            "engine-tx": send_oversized(
                variant, tx.engine_socket, ep.HEADER, ep.MAX_FRAME_BYTES, None, ""
            ),
            "engine-rx": send_oversized(
                variant, rx.engine_socket, ep.HEADER, ep.MAX_FRAME_BYTES, None, ""
            ),
        }
        results = next(a for a in aims if a.name == "results")
        with contextlib.suppress(AssertionError):  # the test says by how much it fell short
            wait_until(
                lambda: results.counted() >= before["results"] + expected(results),
                SETTLE_S,
                "the result socket's counters catch up",
            )
        after = {a.name: a.counted() for a in aims}
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
            f" ({ {a.name: a.sent for a in aims} }), oversized disconnects {oversized},"
            f" legit transfers during the run {done}, load {os.getloadavg()[0]:.1f}"
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
        for s in socks:
            s.close(linger=0)
        for d in daemons:
            d.kill()
        shutil.rmtree(sock_dir, ignore_errors=True)


# -- what must hold -------------------------------------------------------------------------


def expected(a: Aim) -> int:
    """How much ``a``'s rejection counters must grow: one per message that reached the daemon."""
    return a.sent if a.reaches else 0


def test_every_message_was_sent_and_answered_within_the_budget(run: Run) -> None:
    """Every hostile message left within the send budget and each one that is answered got exactly one reply (no hang)."""
    for a in run.aims:
        if not a.reaches:  # a refused handshake: its queue fills, nothing is answered
            assert a.answered == 0, f"{a.name}: {a.answered} replies through a refused handshake"
            continue
        assert a.sent == len(a.messages), f"{a.name}: {a.sent}/{len(a.messages)} sent"
        if a.replies:
            assert a.answered == a.sent, f"{a.name}: {a.answered} replies to {a.sent}"
    assert sum(len(a.messages) for a in run.aims) >= 100_000


def test_every_message_that_reached_a_daemon_is_one_counted_rejection(run: Run) -> None:
    """Each socket's rejection counters grew by exactly the number of hostile messages that reached it (none through a refused handshake)."""
    grew = {a.name: run.after[a.name] - run.before[a.name] for a in run.aims}
    assert grew == {a.name: float(expected(a)) for a in run.aims}


def test_refused_handshakes_are_counted(run: Run) -> None:
    """A peer whose handshake the daemons refuse is counted there (variants where one is refused)."""
    if all(a.reaches for a in run.aims):
        pytest.skip(f"every hostile peer of {run.variant.name} completes its handshake")
    assert run.handshake_failures > 0


def test_oversized_frames_are_dropped_by_libzmq_with_their_connection(run: Run) -> None:
    """Every frame over MAXMSGSIZE closed its connection (seen by the client's monitor) and no daemon counted it."""
    assert run.oversized == dict.fromkeys(run.oversized, OVERSIZED_PER_SOCKET)


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
