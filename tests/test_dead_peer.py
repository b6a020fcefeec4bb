"""A dead or frozen sender ends its fetches fast, is not dialled in a loop, and costs other pairs nothing.

A sender and a receiver daemon discover each other through a real etcd on
loopback (TTL 3 s). The sender is SIGKILLed with fetches open at it (parked
there: their requests are not published yet) and more are asked for just after
the kill. Each fetch must have an engine-visible outcome within 2 s of the
sender's connection being refused (the first redial, 100 ms after the kill):
``peer_lost``, in doubt with the blocks kept for the ones whose RequestData went
out. Once its lease expired, a socket listening on the dead port counts the
receiver's connection attempts: fewer than 5 in 10 s.

A SIGSTOPped sender (``tests/support/peers.py`` children, the receiver in the test
process): once its link is down a fetch toward it fails ``peer_lost`` at once
with nothing sent, while another sender's fetches on the same receiver go on.
"""

from __future__ import annotations

import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvxferd.config import DiscoverySettings, load_receiver_settings
from kvxferd.discovery import make_watcher
from kvxferd.errors import Reason
from kvxferd.service.probes import ReceiverProbe
from kvxferd.transfer.pool import IdAllocator
from kvxferd.transfer.receiver import Receiver
from tests.support.conditions import wait_until
from tests.support.etcd_server import ETCD, SKIP_REASON, EtcdServer
from tests.support.peers import check_request
from tests.test_daemon import TCP_DATA_PLANE, DaemonProcess, Engines, blocks_of, daemon_env
from tests.test_receiver_restart import BLOCKS, STARTUP_S, Spawn, pool, receivers, spawn
from tests.test_receiver_restart import DEADLINES as RESTART_DEADLINES

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
needs_etcd = pytest.mark.skipif(ETCD is None, reason=SKIP_REASON)
__all__ = ["receivers", "spawn"]  # fixtures shared with test_receiver_restart.py

PREFIX = "/kvxferd-dead-peer"
TTL_S = 3
REFUSED_S = 0.5  # the first redial (100 ms after the kill) is refused well within this
OUTCOME_S = 2.0  # the bound: an outcome within this of the refusal
WATCH_S = 10.0  # connection attempts to the dead port are counted this long
MAX_ATTEMPTS = 5


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd").start()
    try:
        yield server
    finally:
        server.kill()


def _env(etcd: EtcdServer, name: str) -> dict[str, str]:
    return daemon_env(
        **TCP_DATA_PLANE,
        KVXFERD_NAME=name,
        KVXFERD_DISCOVERY__BACKEND="etcd",
        KVXFERD_DISCOVERY__ETCD_ENDPOINTS=f'["{etcd.url}"]',
        KVXFERD_DISCOVERY__ETCD_PREFIX=PREFIX,
        KVXFERD_DISCOVERY__ETCD_TTL_S=TTL_S,
        KVXFERD_DISCOVERY__ETCD_TIMEOUT_MS=500,
        KVXFERD_DEADLINES__KV_TRANSFER_TIMEOUT_MS=30_000,
    )


class AcceptCounter:
    """A TCP socket listening on a port, counting the connections it accepts (closed at once)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.accepted = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="accept-counter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            conn.close()
            with self._cond:
                self.accepted += 1
                self._cond.notify_all()

    def wait_for(self, count: int, window_s: float) -> int:
        """Connections accepted when ``count`` were, or when ``window_s`` passed: the
        counting window ends early at the bound, woken by each accept."""
        with self._cond:
            self._cond.wait_for(lambda: self.accepted >= count, window_s)
            return self.accepted

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@needs_etcd
def test_a_killed_sender_ends_every_fetch_within_2s_and_is_not_redialled(etcd: EtcdServer) -> None:
    """After a sender's SIGKILL every fetch toward it has an outcome within 2 s of the refused redial (peer_lost; if sent, in doubt until the link's NIXL agent is torn down, then reusable, within the same bound), and its dead port sees fewer than 5 connection attempts in the 10 s after its lease expired."""
    sock_dir = tempfile.mkdtemp(prefix="kxdp")
    tx = DaemonProcess(
        "sender", "dptx", sock_dir, _env(etcd, "prefill-0"), ["--listen", "tcp://127.0.0.1:0"]
    )
    rx = DaemonProcess("receiver", "dprx", sock_dir, _env(etcd, "decode-0"), [])
    watcher = make_watcher(
        DiscoverySettings(
            backend="etcd", etcd_endpoints=(etcd.url,), etcd_prefix=PREFIX, etcd_timeout_ms=500
        ),
        "sender",
    )
    assert watcher is not None
    watcher.start()
    engines = Engines()
    counter: AcceptCounter | None = None
    try:
        tx.wait_ready(), rx.wait_ready()
        wait_until(lambda: len(watcher.snapshot().peers) == 1, 20, "the sender's key in etcd")
        cr, _ = engines.client(rx)
        # Parked at the sender (not published): open, their RequestData accepted.
        parked = [cr.fetch(f"dp-{i}", tx.endpoint, blocks_of(i)) for i in range(3)]
        wait_until(
            lambda: rx_counter(rx, "kvxferd_requests_sent") >= len(parked),
            10,
            "every RequestData sent",
        )
        t_kill = tx.signal(signal.SIGKILL)
        tx.wait_exit(10)
        after = [cr.fetch(f"dp-late-{i}", tx.endpoint, blocks_of(3 + i)) for i in range(2)]
        bound = t_kill + REFUSED_S + OUTCOME_S
        for h in parked:
            out = cr.wait(h, max(0.0, bound - time.monotonic()))
            assert out is not None, (
                f"a parked fetch still open {time.monotonic() - t_kill:.1f}s after the kill"
            )
            assert out.state == "failed" and out.reason == "peer_lost", out
            assert out.in_doubt != out.reusable, out  # sent: in doubt, or already released
        for h in after:
            out = cr.wait(h, max(0.0, bound - time.monotonic()))
            assert out is not None, (
                f"a late fetch still open {time.monotonic() - t_kill:.1f}s after the kill"
            )
            assert out.state == "failed" and out.reason == "peer_lost", out
        print(f"\nevery fetch ended {time.monotonic() - t_kill:.2f}s after the kill")
        # Their fences end with the link's NIXL agent torn down (UCX over TCP: that is proof
        # that nothing sent through it can land), within the same bound.
        wait_until(
            lambda: rx_counter(rx, "kvxferd_fences_released_teardown") >= len(parked),
            max(0.1, bound - time.monotonic()),
            "the parked fetches' fences released by the link's teardown",
        )
        print(f"their blocks reusable {time.monotonic() - t_kill:.2f}s after the kill")
        wait_until(
            lambda: not watcher.snapshot().peers, TTL_S * 3 + 2, "the sender's lease expired"
        )
        # Closed, not kept redialling: nothing is left to dial the dead port.
        wait_until(
            lambda: tx.endpoint not in [link["endpoint"] for link in _links(rx.probe_port)],
            2,
            "the removed sender's link closed",
        )
        port = int(tx.endpoint.rsplit(":", 1)[1])
        counter = AcceptCounter(port)
        counter.wait_for(MAX_ATTEMPTS, WATCH_S)
        print(f"connection attempts to the dead port in {WATCH_S:g}s: {counter.accepted}")
        assert counter.accepted < MAX_ATTEMPTS
    finally:
        if counter is not None:
            counter.close()
        engines.close()
        watcher.stop()
        for d in (tx, rx):
            if d.alive():
                d.proc.kill()


def _links(port: int) -> list[dict[str, object]]:
    from tests.test_discovery_daemons import _links as links

    return links(port)


def rx_counter(d: DaemonProcess, name: str) -> float:
    from tests.test_discovery_daemons import counter

    return counter(d.probe_port, name)


# -- a frozen sender: its link is down, another sender's pair is untouched -----------------

FROZEN_DEADLINES: dict[str, int] = {
    **RESTART_DEADLINES,
    "heartbeat_ivl_ms": 200,
    "heartbeat_timeout_ms": 600,
    "kv_transfer_timeout_ms": 20_000,
}


def test_a_fetch_toward_a_down_link_fails_at_once_and_another_sender_keeps_serving(
    spawn: Spawn, receivers: list[Receiver]
) -> None:
    """A SIGSTOPped sender's link goes down (heartbeat lost, no Register answered): a fetch toward it fails peer_lost at once with nothing sent, its blocks reusable; another sender's fetches on the same receiver complete byte-exact; after SIGCONT the link is back and serves."""
    n = 4
    senders = {}
    for name in ("a", "b"):
        p = spawn(
            "sender", f"tx-{name}", settings=dict(pool=pool(n)), prefix=name, count=n, blocks=BLOCKS
        )
        senders[name] = (p, p.wait_event("ready", STARTUP_S)["endpoint"])
    for p, _ in senders.values():
        p.wait_events("published", n, 30)
    (a, ep_a), (_, ep_b) = senders["a"], senders["b"]
    r = Receiver(load_receiver_settings(pool=pool(2 * n), deadlines=FROZEN_DEADLINES)).start()
    receivers.append(r)
    alloc = IdAllocator(2 * n * BLOCKS, shuffle_seed=5)
    for rid, ep in (("a-0", ep_a), ("b-0", ep_b)):
        out = r.fetch(rid, ep, alloc.take(BLOCKS)).wait(10)
        assert out is not None and out.ok, (rid, out)
    a.signal(signal.SIGSTOP)
    wait_until(lambda: r.stats.get("links_down") >= 1, 10, "the frozen sender's link down")
    probe = ReceiverProbe(r, r.settings)
    assert probe.snapshot().peer_cache["down_links"] == 1  # what /metrics exports
    assert probe.readiness()[0]  # one cut sender does not make the receiver unready
    sent = r.stats.get("requests_sent")
    t0 = time.monotonic()
    h = r.fetch("a-1", ep_a, alloc.take(BLOCKS))
    out = h.wait(1.0)
    took = time.monotonic() - t0
    assert out is not None and out.reason is Reason.PEER_LOST, out
    assert took < 0.5, f"the fetch toward a down link took {took:.2f}s to fail"
    assert h.close(0), "nothing was sent: its blocks are reusable at once"
    assert r.stats.get("requests_sent") == sent
    for i in range(1, n):
        dst = alloc.take(BLOCKS)
        out = r.fetch(f"b-{i}", ep_b, dst).wait(10)
        assert out is not None and out.ok, out
        assert check_request(r.pool, f"b-{i}", dst) == ""
    a.signal(signal.SIGCONT)
    wait_until(lambda: r.stats.get("links_back") >= 1, 15, "the thawed sender's link back")
    dst = alloc.take(BLOCKS)
    out = r.fetch("a-2", ep_a, dst).wait(10)
    assert out is not None and out.ok, out
    assert check_request(r.pool, "a-2", dst) == ""
    assert r.shutdown() is True


def test_a_killed_senders_link_is_redialled_with_a_backoff(
    spawn: Spawn, receivers: list[Receiver]
) -> None:
    """A SIGKILLed sender's link (no discovery) is down within 2 s, and libzmq redials it 100 ms doubling to reconnect_max_ms apart: fewer than 10 redials in 6 s, not one every 100 ms."""
    tx = spawn("sender", "tx-k", settings=dict(pool=pool(1)), prefix="k", count=1, blocks=BLOCKS)
    ep = tx.wait_event("ready", STARTUP_S)["endpoint"]
    tx.wait_events("published", 1, 30)
    r = Receiver(load_receiver_settings(pool=pool(1), deadlines=FROZEN_DEADLINES)).start()
    receivers.append(r)
    out = r.fetch("k-0", ep, IdAllocator(BLOCKS).take(BLOCKS)).wait(10)
    assert out is not None and out.ok, out
    tx.signal(signal.SIGKILL)
    tx.wait_exit(10)
    t_kill = time.monotonic()
    wait_until(lambda: r.stats.get("links_down") >= 1, 2.0, "the dead sender's link down")
    before = r.stats.get("connect_retries")
    time.sleep(max(0.0, t_kill + 6.0 - time.monotonic()))  # a counting window
    retries = r.stats.get("connect_retries")
    print(f"\nredials in the 6 s after the kill: {retries} ({before} when the link went down)")
    assert retries < 10
