"""Discovery wired into real daemons: etcd keys on leases, a receiver that dials what it discovers, readiness.

A sender and a receiver daemon with ``[discovery] backend = "etcd"`` against a
real etcd on loopback: each advertises its record (advertised endpoint, this
incarnation) on its own lease; the receiver dials the sender it discovers and
registers before any fetch asks for it; a drained sender's key goes at once;
an etcd that stays away past the lease's TTL turns ``/readyz`` red with the
``discovery`` reason, and its return turns it green again.
"""

from __future__ import annotations

import json
import signal
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvxferd.config import DiscoverySettings
from kvxferd.discovery import make_watcher
from tests.support.conditions import wait_until
from tests.support.etcd_server import ETCD, SKIP_REASON, EtcdServer
from tests.test_daemon import DaemonProcess

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(ETCD is None, reason=SKIP_REASON),
]

PREFIX = "/kvxferd-daemons"
TTL_S = 3


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd").start()
    try:
        yield server
    finally:
        server.kill()


def _env(etcd: EtcdServer) -> dict[str, str]:
    return {
        "KVXFERD_DISCOVERY__BACKEND": "etcd",
        "KVXFERD_DISCOVERY__ETCD_ENDPOINTS": f'["{etcd.url}"]',
        "KVXFERD_DISCOVERY__ETCD_PREFIX": PREFIX,
        "KVXFERD_DISCOVERY__ETCD_TTL_S": str(TTL_S),
        "KVXFERD_DISCOVERY__ETCD_TIMEOUT_MS": "500",
        "KVXFERD_DISCOVERY__ETCD_BACKOFF_MAX_MS": "500",
    }


def counter(port: int, name: str) -> float:
    """A daemon's counter or gauge from /metrics, summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            return float(sum(s.value for s in fam.samples if not s.name.endswith("_created")))
    return 0.0


def _links(port: int) -> list[dict[str, object]]:
    """The receiver's links to senders, from /debug/state."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/debug/state", timeout=5) as r:
        return list(json.loads(r.read())["links"])


def _ready(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_daemons_advertise_on_leases_and_the_receiver_dials_what_it_discovers(
    etcd: EtcdServer,
) -> None:
    """Both records appear with advertised endpoints; the receiver registers with the sender unasked; a drain removes the sender's key."""
    sock_dir = tempfile.mkdtemp(prefix="kxd")
    env = _env(etcd)
    tx = DaemonProcess(
        "sender",
        "dtx",
        sock_dir,
        {**env, "KVXFERD_NAME": "prefill-0"},
        ["--listen", "tcp://127.0.0.1:0"],
    )
    rx = DaemonProcess("receiver", "drx", sock_dir, {**env, "KVXFERD_NAME": "decode-0"}, [])
    watcher = make_watcher(
        DiscoverySettings(
            backend="etcd", etcd_endpoints=(etcd.url,), etcd_prefix=PREFIX, etcd_timeout_ms=500
        ),
        "sender",
    )
    assert watcher is not None
    watcher.start()
    try:
        tx.wait_ready()
        rx.wait_ready()
        wait_until(lambda: len(watcher.snapshot().peers) == 1, 20, "the sender's record in etcd")
        (peer,) = watcher.snapshot().peers.values()
        assert peer.name == "prefill-0" and peer.endpoint == tx.endpoint
        # Nothing asked the receiver to fetch: discovery alone made it dial and register.
        wait_until(
            lambda: counter(tx.probe_port, "kvxferd_registers_accepted") >= 1,
            20,
            "the receiver registered with the discovered sender",
        )
        assert counter(rx.probe_port, "kvxferd_discovery_events") >= 1
        assert [link["endpoint"] for link in _links(rx.probe_port)] == [tx.endpoint]
        assert _ready(rx.probe_port)[0] == 200
        tx.signal(signal.SIGTERM)
        code, _ = tx.wait_exit(30)
        assert code == 0
        # The drain revoked the lease at once: the key is gone well before its TTL.
        wait_until(lambda: not watcher.snapshot().peers, TTL_S - 1, "the sender's key gone")
        # The receiver heard the removal too and closed its idle link to that sender.
        wait_until(lambda: not _links(rx.probe_port), 10, "the idle link closed")
    finally:
        watcher.stop()
        for d in (tx, rx):
            if d.alive():
                d.proc.kill()


def test_a_lost_lease_turns_readiness_red_until_etcd_is_back(etcd: EtcdServer) -> None:
    """etcd gone past the lease's TTL: /readyz 503 with the discovery reason; etcd back: 200 again."""
    sock_dir = tempfile.mkdtemp(prefix="kxd")
    rx = DaemonProcess("receiver", "lrx", sock_dir, {**_env(etcd), "KVXFERD_NAME": "decode-1"}, [])
    try:
        rx.wait_ready()
        wait_until(lambda: _ready(rx.probe_port)[0] == 200, 20, "ready while registered")
        etcd.kill()
        wait_until(
            lambda: "discovery: not registered with etcd" in _ready(rx.probe_port)[1],
            4 * TTL_S + 10,
            "readiness names the lost registration",
        )
        assert _ready(rx.probe_port)[0] == 503
        assert counter(rx.probe_port, "kvxferd_not_ready") >= 1
        etcd.start()
        wait_until(lambda: _ready(rx.probe_port)[0] == 200, 30, "ready again once re-registered")
    finally:
        if rx.alive():
            rx.proc.kill()
