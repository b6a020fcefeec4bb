"""etcd discovery against a real etcd: leases, keep-alive, watch, lease loss and an etcd outage.

Each test starts its own etcd on loopback (tests/support/etcd_server.py), so a kill in
one never touches another; the TTL is 2 s so expiries happen within the test.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvxferd.config import DiscoverySettings
from kvxferd.discovery import (
    PeerAdded,
    PeerChanged,
    PeerEvent,
    PeerRecord,
    PeerRemoved,
    make_registrar,
    make_watcher,
)
from kvxferd.discovery.etcd import EtcdClient, EtcdRegistrar, EtcdWatcher, directory
from kvxferd.discovery.record import encode_record
from tests.support.conditions import wait_until
from tests.support.etcd_server import ETCD, SKIP_REASON, EtcdServer

pytestmark = [pytest.mark.integration, pytest.mark.skipif(ETCD is None, reason=SKIP_REASON)]

TTL_S = 2
TIMEOUT_S = 0.5
PREFIX = "/kvxferd-test"
WAIT_S = 15.0


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd").start()
    try:
        yield server
    finally:
        server.kill()


def _settings(etcd: EtcdServer) -> DiscoverySettings:
    return DiscoverySettings(
        backend="etcd",
        etcd_endpoints=(etcd.url,),
        etcd_prefix=PREFIX,
        etcd_ttl_s=TTL_S,
        etcd_timeout_ms=int(TIMEOUT_S * 1000),
        etcd_backoff_max_ms=500,
    )


def _sender(name: str = "prefill-0", incarnation: str = "inc-1", port: int = 5555) -> PeerRecord:
    return PeerRecord(
        role="sender",
        name=name,
        incarnation=incarnation,
        endpoints={"listen": f"tcp://127.0.0.1:{port}"},
        topology={"host": "h1", "tp_rank": 0},
    )


class Events:
    """The events a watcher delivered, in order, as a queue the test reads with a deadline."""

    def __init__(self) -> None:
        self.q: queue.Queue[PeerEvent] = queue.Queue()

    def __call__(self, ev: PeerEvent) -> None:
        self.q.put(ev)

    def next(self, timeout: float = WAIT_S) -> PeerEvent:
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no discovery event within {timeout}s") from None

    def none_pending(self) -> bool:
        return self.q.empty()


def _start(etcd: EtcdServer, events: Events) -> EtcdWatcher:
    w = make_watcher(_settings(etcd), "sender", events)
    assert isinstance(w, EtcdWatcher)
    return w.start()


def _registrar(
    etcd: EtcdServer, rec: PeerRecord, changes: list[bool] | None = None
) -> EtcdRegistrar:
    r = make_registrar(_settings(etcd), rec, None if changes is None else changes.append)
    assert isinstance(r, EtcdRegistrar)
    return r


def test_registration_is_seen_by_a_watcher_and_a_stop_removes_it_at_once(etcd: EtcdServer) -> None:
    """A registered daemon appears to a watcher with its whole record; its stop revokes the key at once."""
    events = Events()
    watcher = _start(etcd, events)
    reg = _registrar(etcd, _sender()).start()
    try:
        assert reg.wait_registered(True, WAIT_S)
        ev = events.next()
        assert isinstance(ev, PeerAdded) and ev.peer == _sender()
        assert watcher.snapshot().peers == {"prefill-0": _sender()}
        kv = EtcdClient([etcd.url], TIMEOUT_S).get(directory(PREFIX, "sender") + "prefill-0")
        assert kv is not None and kv.lease == reg.lease != 0
        assert reg.stop()
        assert not reg.registered
        # Revoked, not expired: well within the TTL.
        ev = events.next(timeout=TTL_S / 2)
        assert isinstance(ev, PeerRemoved) and ev.peer.name == "prefill-0"
        # The watch stream is shut down, not waited out (it is silent for 30 s otherwise).
        assert watcher.stop(timeout=2.0)
    finally:
        reg.stop()
        watcher.stop()


def test_an_updated_record_is_a_change(etcd: EtcdServer) -> None:
    """A record the daemon updates (new topology) reaches watchers as a change under the same lease."""
    events = Events()
    watcher = _start(etcd, events)
    reg = _registrar(etcd, _sender()).start()
    try:
        assert isinstance(events.next(), PeerAdded)
        assert reg.wait_registered(True, WAIT_S)
        lease = reg.lease
        moved = _sender(port=5600)
        reg.update(moved)
        ev = events.next()
        assert isinstance(ev, PeerChanged) and ev.new == moved and ev.old == _sender()
        assert reg.lease == lease and reg.registered
    finally:
        reg.stop()
        watcher.stop()


def test_a_watcher_sees_only_its_role(etcd: EtcdServer) -> None:
    """A receiver's record is not reported to a watcher of senders, and the reverse."""
    events = Events()
    watcher = _start(etcd, events)
    rx = PeerRecord(role="receiver", name="decode-0", endpoints={"result": "tcp://127.0.0.1:6000"})
    reg_rx = _registrar(etcd, rx).start()
    reg_tx = _registrar(etcd, _sender()).start()
    try:
        ev = events.next()
        assert isinstance(ev, PeerAdded) and ev.peer.name == "prefill-0"
        assert reg_rx.wait_registered(True, WAIT_S)
        assert set(watcher.snapshot().peers) == {"prefill-0"}
    finally:
        reg_rx.stop()
        reg_tx.stop()
        watcher.stop()


def test_a_revoked_lease_removes_the_peer_and_the_registrar_registers_again(
    etcd: EtcdServer,
) -> None:
    """Lease revoked behind the daemon's back: the key goes, watchers remove it, the registrar reports not registered, then registers on a new lease."""
    events = Events()
    watcher = _start(etcd, events)
    changes: list[bool] = []
    reg = _registrar(etcd, _sender(), changes).start()
    try:
        assert reg.wait_registered(True, WAIT_S)
        assert isinstance(events.next(), PeerAdded)
        old_lease = reg.lease
        EtcdClient([etcd.url], TIMEOUT_S).revoke(old_lease)
        ev = events.next()
        assert isinstance(ev, PeerRemoved) and ev.peer.name == "prefill-0"
        ev = events.next()
        assert isinstance(ev, PeerAdded) and ev.peer == _sender()
        wait_until(lambda: changes[:3] == [True, False, True], WAIT_S, "registered again")
        assert reg.registered and reg.lease not in (0, old_lease)
    finally:
        reg.stop()
        watcher.stop()


def test_a_deleted_key_is_put_back(etcd: EtcdServer) -> None:
    """Our key deleted while the lease lives: not registered, then the record is back on a new lease."""
    events = Events()
    watcher = _start(etcd, events)
    changes: list[bool] = []
    reg = _registrar(etcd, _sender(), changes).start()
    try:
        assert reg.wait_registered(True, WAIT_S)
        assert isinstance(events.next(), PeerAdded)
        EtcdClient([etcd.url], TIMEOUT_S).delete(reg.key)
        assert isinstance(events.next(), PeerRemoved)
        assert isinstance(events.next(), PeerAdded)
        wait_until(lambda: changes[:3] == [True, False, True], WAIT_S, "registered again")
    finally:
        reg.stop()
        watcher.stop()


_CHILD = textwrap.dedent(
    """
    import sys, time
    from kvxferd.discovery import PeerRecord
    from kvxferd.discovery.etcd import EtcdRegistrar
    rec = PeerRecord(role="sender", name="prefill-9", incarnation="child",
                     endpoints={"listen": "tcp://127.0.0.1:5599"})
    reg = EtcdRegistrar(rec, [sys.argv[1]], sys.argv[2], int(sys.argv[3]), 0.5, 0.5).start()
    assert reg.wait_registered(True, 15)
    print("registered", flush=True)
    time.sleep(120)
    """
)


def test_a_killed_daemon_is_forgotten_when_its_lease_expires(etcd: EtcdServer) -> None:
    """A daemon killed with SIGKILL sends no keep-alive: its lease expires and watchers remove it."""
    events = Events()
    watcher = _start(etcd, events)
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, etcd.url, PREFIX, str(TTL_S)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "registered"
        ev = events.next()
        assert isinstance(ev, PeerAdded) and ev.peer.incarnation == "child"
        child.kill()
        child.wait(10)
        ev = events.next(timeout=TTL_S * 3 + 2)
        assert isinstance(ev, PeerRemoved) and ev.peer.name == "prefill-9"
        assert watcher.snapshot().peers == {}
    finally:
        child.kill()
        child.wait(10)
        watcher.stop()


def test_a_restart_before_the_old_lease_expired_is_a_change_and_survives_that_expiry(
    etcd: EtcdServer,
) -> None:
    """A daemon restarted while its crashed incarnation's lease lives: watchers see a change of incarnation, and the old lease's end leaves the new key."""
    client = EtcdClient([etcd.url], TIMEOUT_S)
    crashed = client.grant(60)
    key = directory(PREFIX, "sender") + "prefill-0"
    client.put(key, encode_record(_sender(incarnation="old")), crashed)
    events = Events()
    watcher = _start(etcd, events)
    reg = _registrar(etcd, _sender(incarnation="new", port=5556)).start()
    try:
        ev = events.next()
        assert isinstance(ev, PeerAdded) and ev.peer.incarnation == "old"
        ev = events.next()
        assert isinstance(ev, PeerChanged)
        assert (ev.old.incarnation, ev.new.incarnation) == ("old", "new")
        assert ev.new.endpoint == "tcp://127.0.0.1:5556"
        client.revoke(crashed)  # the crashed incarnation's lease ends
        # A marker written after the revoke: once the watcher saw it, it saw everything before.
        client.put(directory(PREFIX, "sender") + "marker", b"not a record")
        wait_until(lambda: watcher.count("malformed") == 1, WAIT_S, "the marker seen")
        assert events.none_pending()
        assert watcher.snapshot().peers["prefill-0"].incarnation == "new"
        assert reg.registered
    finally:
        reg.stop()
        watcher.stop()


def test_malformed_records_are_counted_and_skipped(etcd: EtcdServer) -> None:
    """Garbage, a wildcard endpoint and a record under another name's key are counted, not reported; the watcher goes on."""
    client = EtcdClient([etcd.url], TIMEOUT_S)
    d = directory(PREFIX, "sender")
    client.put(d + "garbage", b"{not json")  # there before the watcher lists
    events = Events()
    watcher = _start(etcd, events)
    wait_until(lambda: watcher.count("malformed") == 1, WAIT_S, "listed garbage counted")
    wild = PeerRecord(role="sender", name="wild", endpoints={"listen": "tcp://127.0.0.1:1"})
    client.put(d + "wild", encode_record(wild).replace(b"127.0.0.1", b"0.0.0.0"))
    client.put(d + "other", encode_record(_sender(name="prefill-0")))
    client.put(d + "prefill-1", encode_record(_sender(name="prefill-1")))
    ev = events.next()
    assert isinstance(ev, PeerAdded) and ev.peer.name == "prefill-1"
    assert watcher.count("malformed") == 3
    assert set(watcher.snapshot().peers) == {"prefill-1"}
    # A known peer whose record turns bad is removed, not kept with stale data.
    client.put(d + "prefill-1", b"[]")
    ev = events.next()
    assert isinstance(ev, PeerRemoved) and "malformed" in ev.reason
    assert watcher.alive and watcher.count("errors") == 0
    watcher.stop()


def test_an_etcd_outage_times_out_calls_keeps_peers_and_recovers(etcd: EtcdServer) -> None:
    """etcd killed: calls fail within their timeout, no thread dies, the registrar reports not registered past the TTL, the watcher keeps its peers; etcd back: registered and watched again."""
    events = Events()
    watcher = _start(etcd, events)
    changes: list[bool] = []
    reg = _registrar(etcd, _sender(), changes).start()
    try:
        assert reg.wait_registered(True, WAIT_S)
        assert isinstance(events.next(), PeerAdded)
        etcd.kill()
        assert reg.wait_registered(False, TTL_S + 3 * TIMEOUT_S + 2)
        wait_until(lambda: not watcher.connected, WAIT_S, "watcher disconnected")
        assert reg.alive and watcher.alive
        assert reg.counts["call_failures"] >= 1
        assert set(watcher.snapshot().peers) == {"prefill-0"}  # not forgotten for an outage
        etcd.start()
        assert reg.wait_registered(True, WAIT_S)
        wait_until(lambda: watcher.connected, WAIT_S, "watcher connected again")
        wait_until(
            lambda: watcher.snapshot().peers.get("prefill-0") == _sender(), WAIT_S, "peer listed"
        )
        assert changes[:3] == [True, False, True]
        assert reg.counts["errors"] == 0 and watcher.count("errors") == 0
        assert reg.alive and watcher.alive
    finally:
        reg.stop()
        watcher.stop()
