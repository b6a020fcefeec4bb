"""Discovery's record, settings and factories, and the DNS backend through the system resolver."""

from __future__ import annotations

import json
import queue

import pytest

from kvxferd.config import DiscoverySettings, load_receiver_settings, load_sender_settings
from kvxferd.discovery import (
    NullRegistrar,
    PeerAdded,
    PeerEvent,
    PeerRecord,
    PeerRemoved,
    RecordError,
    decode_record,
    encode_record,
    make_registrar,
    make_watcher,
)
from kvxferd.discovery.dns import DnsWatcher
from kvxferd.discovery.etcd import EtcdRegistrar
from kvxferd.errors import ConfigError

WAIT_S = 10.0

REC = PeerRecord(
    role="receiver",
    name="decode-0",
    incarnation="5b1e",
    endpoints={"result": "tcp://10.0.0.7:6001"},
    topology={"host": "node-3", "zone": "b", "tp_rank": 1},
)


class TestRecord:
    def test_round_trip(self) -> None:
        """A record decodes to what was encoded, and names its main endpoint by role."""
        assert decode_record(encode_record(REC)) == REC
        assert REC.endpoint == "tcp://10.0.0.7:6001"
        assert json.loads(encode_record(REC))["public_key"] == ""

    def test_unknown_fields_are_ignored(self) -> None:
        """A newer daemon's extra fields do not make its record unreadable."""
        doc = json.loads(encode_record(REC))
        doc["future_field"] = {"x": 1}
        assert decode_record(json.dumps(doc)) == REC

    @pytest.mark.parametrize(
        "change",
        [
            {"endpoints": {"result": "tcp://0.0.0.0:6001"}},  # a wildcard dials the reader itself
            {"endpoints": {"listen": "tcp://10.0.0.7:6001"}},  # a receiver without "result"
            {"endpoints": {"result": "tcp://a:1;b:2"}},
            {"role": "router"},
            {"name": "has space"},
            {"incarnation": "x" * 200},
            {"topology": {"k": [1, 2]}},
            {"topology": {f"k{i}": i for i in range(40)}},
        ],
    )
    def test_a_bad_record_is_refused(self, change: dict[str, object]) -> None:
        """Each kind of bad record raises RecordError, never anything else."""
        doc = json.loads(encode_record(REC)) | change
        with pytest.raises(RecordError):
            decode_record(json.dumps(doc))

    def test_garbage_is_refused(self) -> None:
        """Bytes that are not a record, or too many of them, raise RecordError."""
        for data in (b"", b"\xff\xfe", b"[]", b"null", b'{"role": "sender"}', b"x" * 20_000):
            with pytest.raises(RecordError):
                decode_record(data)

    def test_a_daemon_never_advertises_a_bad_record(self) -> None:
        """encode_record refuses what decode_record would refuse."""
        bad = PeerRecord(role="sender", name="p", endpoints={"listen": "tcp://0.0.0.0:1"})
        with pytest.raises(RecordError):
            encode_record(bad)
        with pytest.raises(RecordError):
            NullRegistrar(bad)


class TestSettings:
    def test_the_default_is_none_and_builds_no_watcher(self) -> None:
        """Without a [discovery] section nothing changes: no watcher, a registrar that is always registered."""
        s = load_sender_settings()
        assert s.discovery.backend == "none"
        assert make_watcher(s.discovery, "receiver") is None
        reg = make_registrar(s.discovery, REC).start()
        assert isinstance(reg, NullRegistrar) and reg.registered
        reg.stop()
        assert not reg.registered

    def test_env_and_file_select_a_backend(
        self, tmp_path: object, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """KVXFERD_DISCOVERY__* and a [discovery] TOML section configure the backend."""
        monkeypatch.setenv("KVXFERD_DISCOVERY__BACKEND", "etcd")
        monkeypatch.setenv("KVXFERD_DISCOVERY__ETCD_ENDPOINTS", '["http://10.0.0.1:2379"]')
        s = load_receiver_settings()
        assert s.discovery.etcd_endpoints == ("http://10.0.0.1:2379",)
        assert isinstance(make_registrar(s.discovery, REC), EtcdRegistrar)
        monkeypatch.delenv("KVXFERD_DISCOVERY__BACKEND")
        monkeypatch.delenv("KVXFERD_DISCOVERY__ETCD_ENDPOINTS")
        # dns finds peers on other hosts: security off (the suite's loopback default) is
        # refused with it, so this part runs with the shipped default (curve).
        monkeypatch.delenv("KVXFERD_SECURITY__MODE", raising=False)
        from pathlib import Path

        toml = Path(str(tmp_path)) / "rx.toml"
        toml.write_text(
            '[discovery]\nbackend = "dns"\ndns_name = "prefill.ns.svc"\ndns_port = 5555\n'
        )
        s = load_receiver_settings(toml)
        assert isinstance(make_watcher(s.discovery, "sender"), DnsWatcher)

    @pytest.mark.parametrize(
        "fields",
        [
            {"backend": "static"},
            {"backend": "dns", "dns_name": "x"},
            {"backend": "etcd", "etcd_endpoints": ("10.0.0.1:2379",)},
            {"backend": "etcd", "etcd_ttl_s": 3, "etcd_timeout_ms": 2000},
            {"backend": "consul"},
        ],
    )
    def test_an_incomplete_backend_is_refused_at_load(self, fields: dict[str, object]) -> None:
        """A backend missing what it needs is a configuration error, not a runtime one."""
        with pytest.raises(ValueError):
            DiscoverySettings(**fields)  # type: ignore[arg-type]

    def test_the_error_names_the_setting(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The load error points at the discovery section."""
        monkeypatch.setenv("KVXFERD_DISCOVERY__BACKEND", "static")
        with pytest.raises(ConfigError, match="discovery"):
            load_sender_settings()


class TestDns:
    def _watch(self, name: str, q: queue.Queue[PeerEvent]) -> DnsWatcher:
        s = DiscoverySettings(backend="dns", dns_name=name, dns_port=5555, dns_interval_ms=100)
        w = make_watcher(s, "sender", q.put)
        assert isinstance(w, DnsWatcher)
        return w.start()

    def test_each_address_of_the_name_is_a_peer_on_the_port(self) -> None:
        """'localhost' resolves on loopback: its address becomes a sender peer dialled on the configured port."""
        q: queue.Queue[PeerEvent] = queue.Queue()
        w = self._watch("localhost", q)
        try:
            ev = q.get(timeout=WAIT_S)
            assert isinstance(ev, PeerAdded)
            assert ev.peer.endpoint in ("tcp://127.0.0.1:5555", "tcp://[::1]:5555")
            assert ev.peer.incarnation == "" and ev.peer.topology == {"dns_name": "localhost"}
            ok = w.wait_for(lambda s: s.version > 0, WAIT_S)
            assert ok is not None and w.connected
        finally:
            assert w.stop()

    def test_no_such_name_means_no_peers(self) -> None:
        """NXDOMAIN (a headless Service with no Ready pod) leaves no peers and is not an error."""
        q: queue.Queue[PeerEvent] = queue.Queue()
        w = self._watch("no-such-service.invalid", q)
        try:
            from tests.support.conditions import wait_until

            wait_until(lambda: w.count("reads") >= 2, WAIT_S, "resolved twice")
            assert w.connected and w.snapshot().peers == {} and q.empty()
        finally:
            assert w.stop()

    def test_a_vanished_address_is_removed(self) -> None:
        """When the name stops resolving to an address, that peer is removed."""
        q: queue.Queue[PeerEvent] = queue.Queue()
        w = self._watch("localhost", q)
        try:
            assert isinstance(q.get(timeout=WAIT_S), PeerAdded)
            w.name = "no-such-service.invalid"  # the Service lost its last Ready pod
            ev = q.get(timeout=WAIT_S)
            assert isinstance(ev, PeerRemoved) and "DNS answer" in ev.reason
        finally:
            assert w.stop()


def test_own_record_fills_the_host_and_refuses_a_bind_address() -> None:
    """A daemon's own record names its host and its role's endpoint, and a wildcard is refused."""
    import socket

    from kvxferd.discovery import own_record

    rec = own_record("sender", "prefill-0", "abc", "tcp://10.0.0.1:5555", {"tp_rank": 3})
    assert rec.endpoints == {"listen": "tcp://10.0.0.1:5555"}
    assert rec.topology == {"host": socket.gethostname(), "tp_rank": 3}
    with pytest.raises(RecordError):
        own_record("receiver", "decode-0", "abc", "tcp://0.0.0.0:6000")
