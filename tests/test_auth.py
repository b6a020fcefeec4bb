"""Transport security: keys, the allow-list, CURVE on real sockets, and settings that fail closed.

The attacks run against a real Sender and Receiver (real ZMQ, real NIXL) in this
process: a plaintext peer, a peer whose key is not allowed and a server that
presents another key are each refused and counted, and a legitimate fetch
afterwards is byte-exact. The SIGHUP reload runs against a real daemon process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from kvxferd.auth import AllowList, Curve, KeyPair, Transport, keygen, load_key_pair
from kvxferd.config import SecuritySettings, load_receiver_settings, load_sender_settings
from kvxferd.errors import ConfigError, Reason, RejectedError
from kvxferd.stats import Stats
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.control import SocketLimits, connect_dealer, process_context
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.sender import Sender
from kvxferd.transfer.session import RxState
from tests.support.child import ROOT
from tests.support.conditions import wait_until
from tests.support.peers import check_request, fill_request
from tests.test_daemon import DaemonProcess, daemon_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WAIT_S = 10.0
POOL = dict(num_layers=2, num_blocks=64, block_elems=4096, dtype="uint8")
DEADLINES = dict(
    kv_transfer_timeout_ms=5000,
    register_timeout_ms=2000,
    drain_timeout_ms=500,
    shutdown_timeout_ms=3000,
)


# -- keys ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Key:
    name: str
    public_file: Path
    secret_file: Path
    pair: KeyPair


@dataclass(frozen=True)
class Keyring:
    """Key pairs of a sender, a receiver and a stranger; each daemon allows the other."""

    root: Path
    tx: Key
    rx: Key
    stranger: Key

    def allowed(self, name: str, *keys: Key) -> Path:
        d = self.root / f"allowed-{name}"
        d.mkdir(exist_ok=True)
        for k in keys:
            shutil.copy(k.public_file, d / f"{k.name}.key")
        return d

    def security(self, own: Key, allowed: Path, **extra: Any) -> dict[str, Any]:
        return {
            "mode": "curve",
            "key_file": str(own.secret_file),
            "allowed_keys_dir": str(allowed),
            **extra,
        }


def _key(root: Path, name: str) -> Key:
    public, secret = keygen(root / "own", name)
    return Key(name, public, secret, load_key_pair(secret))


@pytest.fixture
def keys(tmp_path: Path) -> Keyring:
    return Keyring(tmp_path, _key(tmp_path, "tx"), _key(tmp_path, "rx"), _key(tmp_path, "eve"))


# -- raw clients --------------------------------------------------------------------------------


def raw_dealer(endpoint: str, curve: Curve | None) -> zmq.Socket[bytes]:
    """A DEALER that is not kvxferd's: plaintext, or CURVE with the given keys."""
    sock = process_context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply_client(sock)
    sock.connect(endpoint)
    return sock


def answered(sock: zmq.Socket[bytes], timeout_ms: int = 300) -> bool:
    """Send a frame the listener refuses; True when its Reject comes back (we were let in)."""
    try:
        sock.send(b"not a kvxferd frame", zmq.NOBLOCK)
    except zmq.Again:  # no connection to queue on: the handshake failed already
        return False
    return bool(sock.poll(timeout_ms))


# -- keygen ----------------------------------------------------------------------------------


class TestKeygen:
    def test_keygen_writes_a_pair_that_loads_with_a_private_secret(self, tmp_path: Path) -> None:
        """`kvxferd keygen` writes NAME.key and NAME.key_secret (0600); the pair loads and matches."""
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvxferd",
                "keygen",
                "--dir",
                str(tmp_path / "k"),
                "--name",
                "a",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        paths = json.loads(out.stdout)
        secret, public = Path(paths["secret"]), Path(paths["public"])
        assert public.name == "a.key" and secret.name == "a.key_secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o700
        pair = load_key_pair(secret)
        assert AllowList(tmp_path / "k").keys == {pair.public}
        assert len(pair.public) == 40 and pair.secret not in repr(pair)

    def test_keygen_never_overwrites(self, tmp_path: Path) -> None:
        """A second keygen of the same name exits 1 and leaves the first pair as it was."""
        public, secret = keygen(tmp_path, "a")
        before = secret.read_bytes()
        out = subprocess.run(
            [sys.executable, "-m", "kvxferd", "keygen", "--dir", str(tmp_path), "--name", "a"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 1 and "exists" in out.stderr
        assert secret.read_bytes() == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a.key", "a.key_secret"]

    def test_a_secret_readable_by_others_is_refused(self, tmp_path: Path) -> None:
        """A key file with group or other permissions is a ConfigError naming security.key_file."""
        _, secret = keygen(tmp_path, "a")
        os.chmod(secret, 0o644)
        with pytest.raises(ConfigError, match="security.key_file.*chmod 600"):
            load_key_pair(secret)


# -- settings that fail closed ----------------------------------------------------------------


class TestFailClosed:
    def test_the_default_mode_is_curve(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without a setting, security.mode is "curve"."""
        monkeypatch.delenv("KVXFERD_SECURITY__MODE", raising=False)
        assert load_sender_settings().security.mode == "curve"
        assert SecuritySettings().mode == "curve"

    @pytest.mark.parametrize(
        "overrides, setting",
        [
            ({"listen": "tcp://10.1.2.3:5555"}, "listen"),
            ({"listen": "tcp://0.0.0.0:5555"}, "listen"),
            ({"listen": "tcp://kvx.example:5555"}, "listen"),
            ({"service": {"advertise_host": "10.1.2.3"}}, "advertise_host"),
            ({"service": {"advertise_interface": "eth0"}}, "advertise_interface"),
        ],
    )
    def test_off_is_refused_on_an_endpoint_that_leaves_the_host(
        self, overrides: dict[str, Any], setting: str
    ) -> None:
        """security.mode "off" with a non-loopback bound or advertised endpoint is a ConfigError naming it."""
        with pytest.raises(ConfigError, match=f'"off".*{setting}|{setting}.*"off"'):
            load_sender_settings(security={"mode": "off"}, **overrides)

    def test_off_is_refused_for_a_receiver_on_a_routable_address(self) -> None:
        """A receiver with security off and a routable result_endpoint is refused."""
        with pytest.raises(ConfigError, match="result_endpoint"):
            load_receiver_settings(security={"mode": "off"}, result_endpoint="tcp://192.0.2.7:5556")

    def test_off_is_accepted_on_loopback_and_ipc(self) -> None:
        """security.mode "off" with loopback and ipc endpoints loads."""
        s = load_sender_settings(
            security={"mode": "off"},
            listen="tcp://127.0.0.1:0",
            service={"engine_socket": "ipc:///tmp/x.sock", "advertise_host": "::1"},
        )
        assert s.security.mode == "off"

    @pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3"])
    def test_a_tcp_engine_socket_needs_curve(self, host: str) -> None:
        """A tcp:// engine socket with security off is refused, loopback or not; with CURVE it loads."""
        with pytest.raises(ConfigError, match="engine_socket.*TCP"):
            load_sender_settings(
                security={"mode": "off"}, service={"engine_socket": f"tcp://{host}:7000"}
            )
        with pytest.raises(ConfigError, match="engine_keys_dir"):
            load_sender_settings(
                security={"mode": "curve"}, service={"engine_socket": f"tcp://{host}:7000"}
            )
        s = load_sender_settings(
            security={"mode": "curve", "engine_keys_dir": "/etc/kvxferd/engines"},
            service={"engine_socket": f"tcp://{host}:7000"},
        )
        assert s.service.engine_socket.startswith("tcp://")

    def test_a_plaintext_dealer_never_dials_off_the_host(self) -> None:
        """With security off, connect_dealer refuses a routable endpoint (a ZMQError, before any socket)."""
        limits = SocketLimits(1 << 20, 100)
        with pytest.raises(zmq.ZMQError, match="not loopback or ipc"):
            connect_dealer("tcp://192.0.2.7:5555", limits, 100)

    def test_curve_without_a_key_file_names_the_setting_and_keygen(self, tmp_path: Path) -> None:
        """A daemon with mode "curve" and no key file exits 2 in one line naming security.key_file and kvxferd keygen."""
        env = {
            **os.environ,
            "KVXFERD_SECURITY__MODE": "curve",
            "KVXFERD_SERVICE__ENGINE_SOCKET": f"ipc://{tmp_path}/e.sock",
            "KVXFERD_SERVICE__PROBE_PORT": "0",
            "KVXFERD_LISTEN": "tcp://127.0.0.1:0",
        }
        out = subprocess.run(
            [sys.executable, "-m", "kvxferd", "sender"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2, out.stderr
        assert len(lines) == 1, lines
        assert "security.key_file" in lines[0] and "kvxferd keygen" in lines[0], lines

    def test_a_sender_key_outside_the_allow_list_is_not_authorized(self, keys: Keyring) -> None:
        """The receiver's key for a sender endpoint comes from the table, else the fetch; outside the allow-list it is refused not_authorized."""
        allowed = keys.allowed("rx", keys.tx)
        sec = SecuritySettings(
            **keys.security(
                keys.rx, allowed, sender_keys={"tcp://10.0.0.1:5555": keys.tx.pair.public}
            )
        )
        t = Transport(sec, "receiver", Stats())
        try:
            assert t.server_key_for("tcp://10.0.0.1:5555", keys.stranger.pair.public) == (
                keys.tx.pair.public
            )
            assert t.server_key_for("tcp://10.0.0.2:5555", keys.tx.pair.public) == (
                keys.tx.pair.public
            )
            for given in (keys.stranger.pair.public, ""):
                with pytest.raises(RejectedError) as e:
                    t.server_key_for("tcp://10.0.0.3:5555", given)
                assert e.value.reason == Reason.NOT_AUTHORIZED
        finally:
            t.close()


# -- CURVE between real daemons ------------------------------------------------------------------


@dataclass
class Pair:
    keys: Keyring
    tx: Sender
    rx: Receiver


@pytest.fixture
def pair(keys: Keyring, request: pytest.FixtureRequest) -> Iterator[Pair]:
    """A CURVE sender and receiver in this process, each allowing only the other.

    Parametrised indirectly with False, the receiver asks for done Results instead of
    NIXL notifications (the other path a done fetch can take)."""
    notifications = getattr(request, "param", True)
    tx = Sender(
        load_sender_settings(
            listen="tcp://127.0.0.1:0",
            num_threads=1,
            pool=POOL,
            deadlines=DEADLINES,
            security=keys.security(keys.tx, keys.allowed("tx", keys.rx)),
        )
    ).start()
    rx: Receiver | None = None
    try:
        rx = Receiver(
            load_receiver_settings(
                pool=POOL,
                deadlines=DEADLINES,
                security=keys.security(
                    keys.rx,
                    keys.allowed("rx", keys.tx),
                    sender_keys={tx.endpoint: keys.tx.pair.public},
                ),
                dataplane={"notifications": notifications},
            )
        ).start()
        yield Pair(keys, tx, rx)
    finally:
        if rx is not None:
            rx.shutdown(3.0)
        tx.shutdown(3.0)


def transfer_ok(p: Pair, request_id: str) -> None:
    """Publish, fetch and compare one request: byte-exact, or the test fails."""
    src = np.arange(4, dtype=np.int64)
    dst = np.arange(8, 12, dtype=np.int64)
    fill_request(p.tx.pool, request_id, src)
    th = p.tx.publish(request_id, src)
    out = p.rx.fetch(request_id, p.tx.endpoint, dst, want_aux=False).wait(WAIT_S)
    assert out is not None and out.ok, out
    assert check_request(p.rx.pool, request_id, dst) == ""
    th.close()


def counted(stats: Stats, name: str, at_least: int = 1) -> None:
    wait_until(lambda: stats.get(name) >= at_least, WAIT_S, f"{name} >= {at_least}")


class TestRefusedAndCounted:
    def test_a_plaintext_peer_is_refused_and_counted(self, pair: Pair) -> None:
        """A plaintext DEALER at the sender's listener and the receiver's result endpoint gets no answer and is counted; a fetch afterwards is byte-exact."""
        for endpoint, stats in (
            (pair.tx.endpoint, pair.tx.stats),
            (pair.rx.result_endpoint, pair.rx.stats),
        ):
            sock = raw_dealer(endpoint, None)
            try:
                assert not answered(sock)
                counted(stats, "handshakes_failed_protocol")
            finally:
                sock.close(linger=0)
        assert pair.tx.stats.get("rejected_malformed") == 0  # no frame got through
        transfer_ok(pair, "after-plaintext")

    def test_a_peer_with_an_unknown_key_is_refused_and_counted(self, pair: Pair) -> None:
        """A CURVE client whose key is not in the allow-list is refused by ZAP (auth_refused_unknown_key) at both daemons; a fetch afterwards is byte-exact."""
        eve = Curve(pair.keys.stranger.pair)
        targets = (
            (pair.tx.endpoint, pair.keys.tx.pair.public, pair.tx.stats),
            (pair.rx.result_endpoint, pair.keys.rx.pair.public, pair.rx.stats),
        )
        for endpoint, server_key, stats in targets:
            sock = raw_dealer(endpoint, eve.client(server_key))
            try:
                assert not answered(sock)
                counted(stats, "auth_refused_unknown_key")
                counted(stats, "handshakes_failed_auth")
            finally:
                sock.close(linger=0)
        assert pair.tx.stats.get("rejected_malformed") == 0
        transfer_ok(pair, "after-unknown-key")

    def test_an_allowed_key_gets_in(self, pair: Pair) -> None:
        """The same raw client with an allowed key is answered (the refusals above are the keys, not the client)."""
        sock = raw_dealer(
            pair.tx.endpoint, Curve(pair.keys.rx.pair).client(pair.keys.tx.pair.public)
        )
        try:
            assert answered(sock, timeout_ms=int(WAIT_S * 1000))
            reply = wire.decode_to_receiver([sock.recv()], 1 << 20)
            assert isinstance(reply, wire.Reject) and reply.reason == Reason.MALFORMED
        finally:
            sock.close(linger=0)
        assert pair.tx.stats.get("auth_refused_unknown_key") == 0

    def test_a_key_removed_from_the_allow_list_is_refused_on_its_open_connection(
        self, pair: Pair, keys: Keyring
    ) -> None:
        """A client admitted at its handshake whose key is then removed (and the list re-read) gets not_authorized for its next message on the same connection, counted; the others are unaffected."""
        allowed = keys.allowed("tx", keys.stranger)  # the sender's own allow-list directory
        assert pair.tx.transport.allow is not None
        pair.tx.transport.allow.reload()  # before the handshake: admitted
        sock = raw_dealer(pair.tx.endpoint, Curve(keys.stranger.pair).client(keys.tx.pair.public))
        try:
            assert answered(sock, timeout_ms=int(WAIT_S * 1000))
            first = wire.decode_to_receiver([sock.recv()], 1 << 20)
            assert isinstance(first, wire.Reject) and first.reason == Reason.MALFORMED
            (allowed / f"{keys.stranger.name}.key").unlink()
            assert pair.tx.transport.allow is not None
            pair.tx.transport.allow.reload()
            assert answered(sock, timeout_ms=int(WAIT_S * 1000))  # the same connection
            second = wire.decode_to_receiver([sock.recv()], 1 << 20)
            assert isinstance(second, wire.Reject) and second.reason == Reason.NOT_AUTHORIZED
            assert pair.tx.stats.get("rejected_not_authorized") == 1
        finally:
            sock.close(linger=0)
        transfer_ok(pair, "after-revocation")

    @pytest.mark.parametrize("pair", [True, False], indirect=True, ids=["notified", "result"])
    def test_a_sender_key_removed_from_the_receivers_allow_list_makes_no_fetch_done(
        self, pair: Pair, keys: Keyring
    ) -> None:
        """A sender whose key the receiver removes (list re-read) after their connection
        opened: its done word (the notification its WRITE carries, or its Result on that
        connection) is refused and counted, and the fetch ends by its deadline, never done."""
        transfer_ok(pair, "warm-up")  # the sender's connection to the result ROUTER is open
        src, dst = np.arange(4, dtype=np.int64), np.arange(8, 12, dtype=np.int64)
        fill_request(pair.tx.pool, "late", src)
        h = pair.rx.fetch("late", pair.tx.endpoint, dst, want_aux=False, timeout_ms=3000)
        wait_until(
            lambda: pair.tx.view().parked_count == 1, WAIT_S, "the fetch parked at the sender"
        )
        (keys.allowed("rx", keys.tx) / f"{keys.tx.name}.key").unlink()
        assert pair.rx.transport.allow is not None
        pair.rx.transport.allow.reload()
        pair.tx.publish("late", src)
        wait_until(
            lambda: pair.rx.stats.get("rejected_not_authorized") >= 1,
            WAIT_S,
            "the revoked sender's Result refused",
        )
        out = h.wait(WAIT_S)
        assert out is not None and out.state is not RxState.DONE, out
        assert pair.rx.stats.get("fetches_done") == 1, "only the warm-up"

    def test_a_server_presenting_another_key_is_refused_and_counted(
        self, pair: Pair, keys: Keyring
    ) -> None:
        """A receiver that expects another key at the sender's endpoint never talks to it: the fetch fails, both sides count the failed handshake, the sender is unaffected."""
        impostor_expect = keys.stranger.pair.public  # allowed, but not the key the sender has
        lied = Receiver(
            load_receiver_settings(
                pool=POOL,
                deadlines={**DEADLINES, "register_timeout_ms": 500},
                security=keys.security(
                    keys.rx,
                    keys.allowed("rx-lied", keys.tx, keys.stranger),
                    sender_keys={pair.tx.endpoint: impostor_expect},
                ),
            )
        ).start()
        try:
            dst = np.arange(4, dtype=np.int64)
            out = lied.fetch("never", pair.tx.endpoint, dst, want_aux=False).wait(WAIT_S)
            assert out is not None and not out.ok
            counted(lied.stats, "handshakes_failed_no_detail")
            counted(pair.tx.stats, "handshakes_failed_protocol")
            assert pair.tx.stats.get("registers_accepted") == 0
        finally:
            lied.shutdown(3.0)
        transfer_ok(pair, "after-wrong-server")


# -- the allow-list reloads ----------------------------------------------------------------------


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def metric(text: str, family: str, label: str) -> float:
    for line in text.splitlines():
        if line.startswith(family + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{family}{{{label}}} not in /metrics")


def test_sighup_admits_a_new_key_and_drops_a_removed_one(keys: Keyring, tmp_path: Path) -> None:
    """A real sender daemon: a client key copied into the allow-list is admitted after SIGHUP, refused again (and counted) after it is removed and SIGHUP; the engine ipc socket is 0600."""
    allowed = keys.allowed("daemon")  # empty: nobody may connect yet
    env = daemon_env(
        KVXFERD_SECURITY__MODE="curve",
        KVXFERD_SECURITY__KEY_FILE=str(keys.tx.secret_file),
        KVXFERD_SECURITY__ALLOWED_KEYS_DIR=str(allowed),
        KVXFERD_SECURITY__ALLOWED_KEYS_POLL_MS=0,  # SIGHUP only: the test shows SIGHUP works
        KVXFERD_LISTEN="tcp://127.0.0.1:0",
    )
    d = DaemonProcess("sender", "tx", str(tmp_path), env, [])
    try:
        info = d.wait_ready()
        sock_path = info["engine_socket"][len("ipc://") :]
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
        client = Curve(keys.rx.pair).client(keys.tx.pair.public)

        def admitted() -> bool:
            sock = raw_dealer(d.endpoint, client)
            try:
                return answered(sock, timeout_ms=500)
            finally:
                sock.close(linger=0)

        assert not admitted()
        refused = metric(
            metrics(d.probe_port), "kvxferd_auth_refused_total", 'reason="unknown_key"'
        )
        assert refused >= 1
        shutil.copy(keys.rx.public_file, allowed / "rx.key")
        d.signal(signal.SIGHUP)
        wait_until(admitted, WAIT_S, "admitted after SIGHUP", poll=0.1)
        (allowed / "rx.key").unlink()
        d.signal(signal.SIGHUP)
        wait_until(lambda: not admitted(), WAIT_S, "refused after removal + SIGHUP", poll=0.1)
        after = metric(metrics(d.probe_port), "kvxferd_auth_refused_total", 'reason="unknown_key"')
        assert after > refused
        assert d.alive()
    finally:
        d.kill()


def test_a_changed_allow_list_directory_is_read_without_a_signal(keys: Keyring) -> None:
    """With allowed_keys_poll_ms set, a key added to the directory is admitted without SIGHUP."""
    allowed = keys.allowed("poll")
    tx = Sender(
        load_sender_settings(
            listen="tcp://127.0.0.1:0",
            num_threads=1,
            pool=POOL,
            deadlines=DEADLINES,
            security=keys.security(keys.tx, allowed, allowed_keys_poll_ms=50),
        )
    ).start()
    try:
        client = Curve(keys.rx.pair).client(keys.tx.pair.public)

        def admitted() -> bool:
            sock = raw_dealer(tx.endpoint, client)
            try:
                return answered(sock, timeout_ms=300)
            finally:
                sock.close(linger=0)

        assert not admitted()
        shutil.copy(keys.rx.public_file, allowed / "rx.key")
        wait_until(admitted, WAIT_S, "admitted after the directory changed", poll=0.1)
    finally:
        tx.shutdown(3.0)


def test_a_tcp_engine_socket_admits_only_an_engine_with_an_allowed_key(
    keys: Keyring, tmp_path: Path
) -> None:
    """A daemon whose engine socket is TCP serves an engine client whose key is in
    engine_keys_dir; a peer's key (allowed as a peer, not as an engine) and a plaintext
    client get nothing, and are counted."""
    from kvxferd.engine.client import Client, EngineUnavailable

    engine = _key(keys.root, "engine")
    env = daemon_env(
        KVXFERD_SECURITY__MODE="curve",
        KVXFERD_SECURITY__KEY_FILE=str(keys.tx.secret_file),
        KVXFERD_SECURITY__ALLOWED_KEYS_DIR=str(keys.allowed("peers", keys.rx)),
        KVXFERD_SECURITY__ENGINE_KEYS_DIR=str(keys.allowed("engines", engine)),
        KVXFERD_LISTEN="tcp://127.0.0.1:0",
        KVXFERD_SERVICE__ENGINE_SOCKET="tcp://127.0.0.1:0",
    )
    d = DaemonProcess("sender", "tx-tcp", str(tmp_path), env, [])
    try:
        endpoint = d.engine_socket
        assert endpoint.startswith("tcp://127.0.0.1:")
        with Client(
            endpoint, timeout_s=WAIT_S, curve=Curve(engine.pair, server_key=keys.tx.pair.public)
        ) as c:
            assert c.describe().role == "sender"
        peer_as_engine = Curve(keys.rx.pair, server_key=keys.tx.pair.public)

        def counted(family: str, label: str) -> bool:
            return metric(metrics(d.probe_port), family, label) >= 1

        # Each client stays open (reconnecting) until its refusal is counted: a short call
        # may end before its first handshake under load.
        with Client(endpoint, timeout_s=0.5, curve=peer_as_engine) as peer:
            with pytest.raises(EngineUnavailable):
                peer.describe()
            wait_until(
                lambda: counted("kvxferd_gateway_auth_refused_total", 'reason="unknown_key"'),
                WAIT_S,
                "the peer key refused on the engine socket",
                poll=0.1,
            )

        def plaintext_refused_and_counted() -> bool:
            # A plaintext DEALER may give up after its first failed handshake (libzmq does
            # not always reconnect it): each try is a new client, none ever answered.
            with Client(endpoint, timeout_s=0.5) as plain:
                with pytest.raises(EngineUnavailable):
                    plain.describe()
                # The auth thread counts the failed handshake from the socket's monitor.
                deadline = time.monotonic() + 1.0
                while time.monotonic() < deadline:
                    if counted("kvxferd_gateway_handshakes_failed_total", 'kind="protocol"'):
                        return True
                    time.sleep(0.1)  # poll the metrics (no event announces the count)
            return False

        wait_until(
            plaintext_refused_and_counted,
            3 * WAIT_S,
            "the plaintext engine's failed handshake counted",
            poll=0.0,
        )
    finally:
        d.kill()


def test_a_fetch_from_a_sender_without_a_known_key_is_not_authorized(keys: Keyring) -> None:
    """A CURVE receiver that knows no allowed key for a sender endpoint refuses the fetch not_authorized (counted) and never dials it."""
    rx = Receiver(
        load_receiver_settings(
            pool=POOL,
            deadlines=DEADLINES,
            security=keys.security(keys.rx, keys.allowed("rx-nokey", keys.tx)),
        )
    ).start()
    try:
        dst = np.arange(4, dtype=np.int64)
        for given in ("", keys.stranger.pair.public):  # none, or one outside the allow-list
            with pytest.raises(RejectedError) as e:
                rx.fetch("r", "tcp://127.0.0.1:9", dst, want_aux=False, sender_key=given)
            assert e.value.reason == Reason.NOT_AUTHORIZED
        assert rx.stats.get("fetch_refused_not_authorized") == 2
        assert rx.stats.get("registers_sent") == 0
        assert rx.public_key == keys.rx.pair.public
    finally:
        rx.shutdown(3.0)


def test_the_key_published_with_the_request_is_the_key_dialled(pair: Pair, keys: Keyring) -> None:
    """A receiver with no sender_keys fetches byte-exact with the sender's key as Publish gives it (Sender.public_key)."""
    rx = Receiver(
        load_receiver_settings(
            pool=POOL,
            deadlines=DEADLINES,
            security=keys.security(keys.rx, keys.allowed("rx-published", keys.tx)),
        )
    ).start()
    try:
        src, dst = np.arange(4, dtype=np.int64), np.arange(20, 24, dtype=np.int64)
        fill_request(pair.tx.pool, "published-key", src)
        th = pair.tx.publish("published-key", src)
        assert pair.tx.public_key == keys.tx.pair.public
        h = rx.fetch(
            "published-key", pair.tx.endpoint, dst, want_aux=False, sender_key=pair.tx.public_key
        )
        out = h.wait(WAIT_S)
        assert out is not None and out.ok, out
        assert check_request(rx.pool, "published-key", dst) == ""
        th.close()
    finally:
        rx.shutdown(3.0)


# -- keys from discovery ------------------------------------------------------------------------
def test_a_discovered_senders_key_is_expected_only_if_allowed(keys: Keyring) -> None:
    """A receiver with no sender_keys learns a sender's key from its discovery record and
    fetches byte-exact; a record carrying a key outside the allow-list is ignored (counted)
    and the fetch is refused not_authorized."""
    from kvxferd.discovery import PeerAdded, PeerRecord

    tx = Sender(
        load_sender_settings(
            listen="tcp://127.0.0.1:0",
            num_threads=1,
            pool=POOL,
            deadlines=DEADLINES,
            security=keys.security(keys.tx, keys.allowed("tx", keys.rx)),
        )
    ).start()
    rx: Receiver | None = None
    try:
        rx = Receiver(
            load_receiver_settings(
                pool=POOL,
                deadlines=DEADLINES,
                security=keys.security(keys.rx, keys.allowed("rx", keys.tx)),
            )
        ).start()

        def discovered(key: str) -> None:
            assert rx is not None
            before = rx.stats.get("discovery_events")
            record = PeerRecord(
                role="sender",
                name="p0",
                incarnation=tx.sender_id,
                endpoints={"listen": tx.endpoint},
                public_key=key,
            )
            rx.on_peer_event(PeerAdded(record))
            wait_until(
                lambda: rx is not None and rx.stats.get("discovery_events") > before,
                WAIT_S,
                "the io thread took the event",
            )

        discovered(keys.stranger.pair.public)  # not in the receiver's allow-list
        assert rx.stats.get("discovery_keys_refused") == 1
        with pytest.raises(RejectedError) as e:
            rx.fetch("r0", tx.endpoint, [8], want_aux=False)
        assert e.value.reason == Reason.NOT_AUTHORIZED
        discovered(keys.tx.pair.public)
        assert rx.stats.get("discovery_keys_learned") == 1
        transfer_ok(Pair(keys, tx, rx), "discovered")
    finally:
        if rx is not None:
            rx.shutdown(3.0)
        tx.shutdown(3.0)


def test_two_daemons_on_one_engine_socket_string_keep_their_own_pools(
    keys: Keyring, tmp_path: Path
) -> None:
    """Two daemons with ``tcp://127.0.0.1:0`` engine sockets (one string, two sockets): each
    has its own pool segment, neither removes the other's, and a write through one
    engine's mapping lands only in its own daemon's pool (issue 23, item 5)."""
    from kvxferd.engine.client import Client, attach_pool

    engine = _key(keys.root, "engine")
    env = daemon_env(
        KVXFERD_SECURITY__MODE="curve",
        KVXFERD_SECURITY__KEY_FILE=str(keys.tx.secret_file),
        KVXFERD_SECURITY__ALLOWED_KEYS_DIR=str(keys.allowed("peers", keys.rx)),
        KVXFERD_SECURITY__ENGINE_KEYS_DIR=str(keys.allowed("engines", engine)),
        KVXFERD_LISTEN="tcp://127.0.0.1:0",
        KVXFERD_SERVICE__ENGINE_SOCKET="tcp://127.0.0.1:0",
    )
    daemons = [DaemonProcess("sender", f"tcp{i}", str(tmp_path), env, []) for i in range(2)]
    clients: list[Client] = []
    try:
        for d in daemons:
            curve = Curve(engine.pair, server_key=keys.tx.pair.public)
            clients.append(Client(d.engine_socket, timeout_s=WAIT_S, curve=curve))
        infos = [c.describe() for c in clients]
        names = [str(i.shm_name) for i in infos]
        assert names[0] != names[1], names
        for name in names:
            assert (Path("/dev/shm") / name).exists(), f"{name} was removed"
        kv = [attach_pool(i) for i in infos]
        kv[0][0, 0, :64] = 0xA5
        kv[1][0, 0, :64] = 0x5A
        assert bool((kv[0][0, 0, :64] == 0xA5).all()), "one engine's write reached the other's pool"
        assert bool((kv[1][0, 0, :64] == 0x5A).all())
        for d in daemons:
            assert d.proc.poll() is None, d.describe()
    finally:
        for c in clients:
            c.close_client()
        for d in daemons:
            d.kill()
