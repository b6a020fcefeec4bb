"""Routes belong to keys: no connection another key opens can move a receiver's route.

A real Sender and Receiver (real ZMQ with CURVE, real NIXL) in this process, and an
attacker holding a second allowed key whose raw DEALER presents a routing id of its
choice: the victim's own route (read from the sender's peer table, the strongest
guess there is) or the victim's receiver id (what kvxferd's receiver presented when
it still set one). The listener never hands a route over (no ``ROUTER_HANDOVER``) and
kvxferd's receiver sets no routing id (the listener names each connection), so the
victim's fetches go on; a real network blip (a TCP relay that drops every connection)
shows that the receiver's own new connection still takes over its registration.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from kvxferd.auth import Curve
from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.sender import Sender
from tests.support.conditions import wait_until
from tests.support.peers import check_request, fill_request
from tests.test_auth import DEADLINES, POOL, Keyring, keys

__all__ = ["keys"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FETCH_MS = 2500  # a victim fetch must be served well within this (a lost route costs >= 3 s)
WAIT_S = 10.0


class Pair:
    """A CURVE sender allowing two receiver keys, and the victim receiver (key ``rx``)."""

    def __init__(self, keys: Keyring) -> None:
        self.keys = keys
        self.tx = Sender(
            load_sender_settings(
                listen="tcp://127.0.0.1:0",
                num_threads=1,
                pool=POOL,
                deadlines=DEADLINES,
                security=keys.security(keys.tx, keys.allowed("tx", keys.rx, keys.stranger)),
            )
        ).start()
        self.rx: Receiver | None = None
        self.n = 0

    def receiver(self, endpoint: str) -> Receiver:
        self.rx = Receiver(
            load_receiver_settings(
                pool=POOL,
                deadlines=DEADLINES,
                security=self.keys.security(
                    self.keys.rx,
                    self.keys.allowed("rx", self.keys.tx),
                    sender_keys={endpoint: self.keys.tx.pair.public},
                ),
            )
        ).start()
        return self.rx

    def transfer(self, endpoint: str) -> None:
        """Publish, fetch (within FETCH_MS) and compare one request: byte-exact, or fail."""
        assert self.rx is not None
        self.n += 1
        rid = f"route-{self.n}"
        src = np.arange(4, dtype=np.int64)
        dst = np.arange(8, 12, dtype=np.int64)
        fill_request(self.tx.pool, rid, src)
        th = self.tx.publish(rid, src)
        f = self.rx.fetch(rid, endpoint, dst, want_aux=False, timeout_ms=FETCH_MS)
        out = f.wait(WAIT_S)
        assert out is not None and out.ok, (rid, out)
        assert check_request(self.rx.pool, rid, dst) == ""
        th.close()

    def route_of(self, receiver_id: str) -> bytes:
        routes = [p.routing_id for p in self.tx.peers.peers() if p.receiver_id == receiver_id]
        assert len(routes) == 1, routes
        return routes[0]

    def close(self) -> None:
        if self.rx is not None:
            self.rx.shutdown(3.0)
        self.tx.shutdown(3.0)


@pytest.fixture
def pair(keys: Keyring) -> Iterator[Pair]:
    p = Pair(keys)
    try:
        yield p
    finally:
        p.close()


class Attacker:
    """A thread that connects with the second allowed key and a chosen routing id, again and again."""

    def __init__(self, p: Pair, route: bytes, every_s: float = 0.1) -> None:
        self.curve = Curve(p.keys.stranger.pair).client(p.keys.tx.pair.public)
        self.endpoint = p.tx.endpoint
        self.route = route
        self.every_s = every_s
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="attacker", daemon=True)

    def connect(self) -> zmq.Socket[bytes]:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self.route)
        self.curve.apply_client(sock)
        sock.connect(self.endpoint)
        return sock

    def _run(self) -> None:
        while not self._stop.is_set():
            sock = self.connect()
            try:
                # Anything the listener answers: were the route ours, the reply would come here.
                sock.send(wire.encode(wire.Cancel(request_id="route-1", fetch_id=1)))
                sock.poll(int(self.every_s * 1000))
            finally:
                sock.close(linger=0)
            self.connections += 1

    def __enter__(self) -> Attacker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)


def test_another_key_presenting_the_victims_route_never_takes_it(pair: Pair) -> None:
    """A second allowed key connecting again and again with the victim's own routing id leaves the victim's route alone: 5 of 5 fetches are byte-exact in time."""
    rx = pair.receiver(pair.tx.endpoint)
    pair.transfer(pair.tx.endpoint)  # registered: the listener named its connection
    route = pair.route_of(rx.receiver_id)
    with Attacker(pair, route) as attacker:
        wait_until(lambda: attacker.connections >= 3, WAIT_S, "the attacker connected")
        for _ in range(5):
            pair.transfer(pair.tx.endpoint)
            n = attacker.connections  # the attacker comes back in between every fetch
            wait_until(lambda n=n: attacker.connections >= n + 2, WAIT_S, "attacker again")
    assert pair.route_of(rx.receiver_id) == route, "the victim's route changed"
    assert pair.tx.stats.get("registers_accepted") == 1


def test_a_key_squatting_the_receiver_id_does_not_lock_the_receiver_out(pair: Pair) -> None:
    """A second allowed key that holds the victim's receiver id as its routing id before the victim dials, and keeps reconnecting with it, costs the victim nothing."""
    rx = pair.receiver(pair.tx.endpoint)
    squatter = Attacker(pair, rx.receiver_id.encode())
    held = squatter.connect()
    try:
        held.send(b"first")  # a route by that name exists before the victim's connection
        assert held.poll(int(WAIT_S * 1000)), "the squatter was not let in"
        with squatter:
            for _ in range(3):
                pair.transfer(pair.tx.endpoint)
    finally:
        held.close(linger=0)
    assert pair.tx.stats.get("registers_accepted") == 1


class Relay:
    """A TCP relay in front of the sender whose ``cut`` drops every connection (a network blip)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream[len("tcp://") :].rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepted = 0
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream, timeout=5)
            with self._lock:
                self._open += [down, up]
                self.accepted += 1
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        with self._lock:
            dropped, self._open = self._open, []
        for s in dropped:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.listener.close()
        self.cut()


def test_a_receiver_reconnecting_after_a_blip_takes_over_its_own_registration(
    pair: Pair,
) -> None:
    """After every connection to the sender drops, the receiver's new connection (same key, a new route) registers again, replaces its old route, and fetches are byte-exact."""
    relay = Relay(pair.tx.endpoint)
    try:
        rx = pair.receiver(relay.endpoint)
        pair.transfer(relay.endpoint)
        first = pair.route_of(rx.receiver_id)
        for blip in range(1, 3):
            relay.cut()
            wait_until(lambda b=blip: rx.stats.get("reconnects") >= b, WAIT_S, "reconnected")
            wait_until(
                lambda b=blip: pair.tx.stats.get("registers_accepted") >= 1 + b,
                WAIT_S,
                "registered again",
            )
            pair.transfer(relay.endpoint)
        assert relay.accepted >= 3
        assert pair.route_of(rx.receiver_id) != first, "a new connection, a new route"
        assert pair.tx.stats.get("peers_replaced") == 0, "a reconnect is not a new incarnation"
    finally:
        relay.close()


# libzmq names a connection that presents no routing id from a counter starting at rand(),
# unseeded: in every process the first generated id is this one. A client presenting it
# before that id is generated made libzmq assert (the process aborted, exit 134).
_UNSEEDED_FIRST_ID = b"\x00k\x8bEg"
_COLLIDE = r"""
import sys, zmq
from kvxferd.transfer.control import process_context
ctx = process_context()
router = ctx.socket(zmq.ROUTER)
port = router.bind_to_random_port("tcp://127.0.0.1")
router.rcvtimeo = 5000
ep = f"tcp://127.0.0.1:{port}"
plain = zmq.Context()
attacker = plain.socket(zmq.DEALER)
attacker.setsockopt(zmq.ROUTING_ID, bytes.fromhex(sys.argv[1]))
attacker.connect(ep)
attacker.send(b"a")
router.recv_multipart()
victim = plain.socket(zmq.DEALER)
victim.connect(ep)
victim.send(b"v")
rid, body = router.recv_multipart()
print(rid.hex(), flush=True)
"""


def _collide() -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _COLLIDE, _UNSEEDED_FIRST_ID.hex()],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_a_client_cannot_abort_the_daemon_with_the_routing_id_libzmq_generates_next() -> None:
    """kvxferd's process context seeds rand() from the OS: the id libzmq would generate next
    cannot be guessed, so a client presenting it does not collide (libzmq would abort)."""
    runs = [_collide() for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-500:]}"
    generated = [run.stdout.strip() for run in runs]
    assert _UNSEEDED_FIRST_ID.hex() not in generated
    assert generated[0] != generated[1], "each process starts from its own seed"
