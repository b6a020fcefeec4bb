"""Releases side by side: this release's daemons with the previous release's, byte-exact.

The previous release (CHANGELOG.md) is built from its commit into its own venv once
(tests/support/prev_release.py, cached under .cache/); without its commit in the clone the
mixed-version tests skip and say how to get it. Daemons run as real processes through
kvxferd.launch (real ZMQ, real NIXL over UCX), each driven through its own engine socket:

    old sender  + new receiver   the receiver's Register at 4 is refused by name and it
                                 registers again at 3 (counted); the old release's engine
                                 client drives the new receiver (engine protocol 4), this
                                 release's Client the old sender (falling back to 4)
    new sender  + old receiver   the sender answers the Register at 3 and speaks 3 to it
                                 (peers[].version); the old receiver refuses nothing

The unit tests check the negotiation and the encoder's refusals without daemons.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.engine import engine_protocol as ep
from kvxferd.engine.client import AsyncClient, Client, attach_pool
from kvxferd.engine.dialect import Dialect
from kvxferd.launch import Daemon
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.sender import Sender
from tests.support import engine_driver as drv
from tests.support import prev_release

ROOT = Path(__file__).resolve().parent.parent
STARTUP_S = 60.0  # a daemon imports torch and NIXL and creates its agents
RUN_S = 120.0  # one engine driver's requests
N_REQ = 6


# -- unit: negotiation, the encoder's refusals -----------------------------------------------


def test_a_register_offered_at_any_version_is_answered_in_the_lower_of_the_two() -> None:
    """negotiate(offered) = min(offered, PROTOCOL_VERSION): 3 -> 3, 4 -> 4, a newer offer -> 4."""
    assert wire.PROTOCOL_VERSION == 4 and wire.SUPPORTED_VERSIONS == {3, 4}
    assert [wire.negotiate(v) for v in (3, 4, 5, 9)] == [3, 4, 4, 4]


def test_frames_of_both_versions_decode_and_carry_their_version() -> None:
    """A frame in 3 or in 4 decodes on both sides; its version byte is the one it was sent in."""
    cancel = wire.Cancel(request_id="q", fetch_id=7)
    for v in (3, 4):
        frame = wire.encode(cancel, v)
        assert frame[:3] == b"KX" + bytes([v]) and wire.frame_version(frame) == v
        assert wire.decode_to_sender([frame], 1 << 20) == cancel
        reject = wire.encode(wire.Reject(reason=wire.Reason.MALFORMED), v)
        assert isinstance(wire.decode_to_receiver([reject], 1 << 20), wire.Reject)


def test_a_newer_register_is_read_as_an_offer_and_nothing_else_is() -> None:
    """A sender reads a Register of a newer version (answered in its own); any other message of
    a newer version, and a receiver reading any newer frame, get unsupported_version."""
    reg = wire.Register(
        receiver_id="r",
        result_endpoint="tcp://127.0.0.1:1",
        agent_metadata=b"x",
        layout=wire.WireLayout(
            num_layers=1, num_blocks=1, block_bytes=1, dtype="uint8", aux_slots=1, aux_slot_bytes=64
        ),
        kv_base=0,
        aux_base=0,
    )
    newer = b"KX\x05" + wire.encode(reg)[3:]
    assert wire.decode_to_sender([newer], 1 << 20) == reg
    cancel = b"KX\x05" + wire.encode(wire.Cancel(request_id="q", fetch_id=1))[3:]
    for decode, frame in ((wire.decode_to_sender, cancel), (wire.decode_to_receiver, newer)):
        with pytest.raises(wire.ProtocolError) as e:
            decode([frame], 1 << 20)
        assert e.value.reason is wire.Reason.UNSUPPORTED_VERSION


def test_the_encoder_refuses_a_v4_only_field_or_message_toward_a_version_3_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A field listed in V4_ONLY, set, or a message listed there, is a ValueError in version 3;
    at its default (not sent) it is not; in version 4 both are sent."""
    monkeypatch.setattr(wire, "V4_ONLY", frozenset({"Result.digest", "CancelAck"}))
    done = wire.Result(request_id="q", fetch_id=1, status="done", digest=b"d" * 16)
    with pytest.raises(ValueError, match="Result.digest"):
        wire.encode(done, 3)
    plain = wire.Result(request_id="q", fetch_id=1, status="done")
    assert wire.encode(plain, 3)[:3] == b"KX\x03"
    ack = wire.CancelAck(request_id="q", fetch_id=1)
    with pytest.raises(ValueError, match="CancelAck"):
        wire.encode(ack, 3)
    assert wire.decode_to_receiver([wire.encode(done, 4)], 1 << 20) == done
    assert wire.decode_to_receiver([wire.encode(ack, 4)], 1 << 20) == ack
    with pytest.raises(ValueError):
        wire.encode(plain, 2)


def test_notifications_carry_the_peers_version_and_a_receiver_reads_both() -> None:
    """The done notification's magic is b"KN" + the link's version; both versions decode."""
    records = [(5, b"n" * 8, 1024, 0)]
    for v in (3, 4):
        payload = wire.encode_notification(records, v)
        assert payload[:3] == b"KN" + bytes([v])
        assert wire.decode_notification(payload) == records
    assert wire.decode_notification(b"KN\x05" + wire.encode_notification(records)[3:]) is None


def test_the_engine_encoder_answers_in_4_or_5_and_refuses_v5_only_in_4(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Engine frames of version 4 and 5 decode; a V5_ONLY message in a version-4 frame is refused."""
    ok = ep.Ok(call_id=3)
    for v in (4, 5):
        frame = ep.encode(ok, v)
        assert frame[2] == v and ep.decode_to_engine([frame]) == ok
        assert ep.frame_version(frame) == v
    assert ep.frame_version(b"KE\x09") == 5 and ep.frame_version(b"KE\x01") == 4
    monkeypatch.setattr(ep, "V5_ONLY", frozenset({"ok"}))
    with pytest.raises(ValueError, match="ok"):
        ep.encode(ok, 4)


class _Sent:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def resend(self, frames: list[bytes]) -> None:
        self.frames.extend(frames)


def _old_refusal() -> bytes:
    """What a 0.1.0 gateway answers any version-5 frame: Error(unsupported_version), call id 0."""
    err = ep.Error(call_id=0, reason=ep.EngineReason.UNSUPPORTED_VERSION, detail="version 5")
    return ep.encode(err, 4)


def test_a_client_connection_falls_back_to_4_once_and_sends_its_calls_again() -> None:
    """The refusal switches the connection to 4 and resends every call sent in 5, once; a later
    refusal is a plain reply; calls after it go in 4."""
    d, chan = Dialect(), _Sent()
    first = d.encode(ep.Describe(call_id=1))
    d.encode(ep.Poll(call_id=2, handle_id=9))
    assert first[2] == 5
    replies = d.take([_old_refusal()], "ipc://x", chan.resend)
    assert replies == [] and d.version == 4
    assert [f[2] for f in chan.frames] == [4, 4]
    assert [ep.decode_to_gateway([f]).call_id for f in chan.frames] == [1, 2]
    later = d.take([_old_refusal()], "ipc://x", chan.resend)
    assert len(later) == 1 and len(chan.frames) == 2
    assert d.encode(ep.Describe(call_id=3))[2] == 4


def test_a_client_connection_that_got_a_reply_in_5_never_falls_back() -> None:
    """Once the daemon answered in 5 it is not an old one: nothing is kept, nothing resent."""
    d, chan = Dialect(), _Sent()
    d.encode(ep.Describe(call_id=1))
    assert d.take([ep.encode(ep.Ok(call_id=1))], "ipc://x", chan.resend)
    assert d.take([_old_refusal()], "ipc://x", chan.resend)
    assert d.version == 5 and chan.frames == []


def test_the_changelog_names_this_release_its_protocols_and_the_previous_release() -> None:
    """CHANGELOG.md's newest section is this package version with the protocol versions the
    code speaks; the previous release is 0.1.0 at its commit (what prev_release builds)."""
    import kvxferd

    text = prev_release.CHANGELOG.read_text(encoding="utf-8")
    newest = prev_release.releases(text)[0]
    assert newest.version == kvxferd.__version__
    section = text.split("\n## ")[1]
    spoken = ", ".join(str(v) for v in sorted(wire.SUPPORTED_VERSIONS, reverse=True))
    engine = ", ".join(str(v) for v in sorted(ep.ENGINE_VERSIONS, reverse=True))
    assert f"Wire protocol: {spoken}\n" in section and f"Engine protocol: {engine}\n" in section
    assert prev_release.previous(text) == prev_release.Release(
        "0.1.0", "5ca684b8a473009f69052807adeb4b2437390166"
    )


def test_a_release_whose_commit_is_not_in_the_clone_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shallow clone without the release's commit: NotBuildable naming `git fetch --unshallow`
    (the mixed-version tests skip with it), and nothing half-built left behind."""
    monkeypatch.setattr(prev_release, "CACHE", tmp_path)
    with pytest.raises(prev_release.NotBuildable, match="git fetch --unshallow"):
        prev_release.build(prev_release.Release("9.9.9", "f" * 40))
    assert not (tmp_path / "release-9.9.9").exists()


# -- in process: the negotiation against hand-written peers of version 3 -----------------------

POOL = dict(num_layers=1, num_blocks=16, block_elems=256, dtype="uint8")
REPLY_S = 10.0


def _recv(sock: zmq.Socket[bytes]) -> list[bytes]:
    """The next message on ``sock``, or AssertionError at the deadline."""
    assert sock.poll(int(REPLY_S * 1000), zmq.POLLIN), "no message in time"
    return sock.recv_multipart()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_sender_answers_a_version_3_register_in_3_and_records_it() -> None:
    """A Register in version 3 (a 0.1.0 receiver) is answered in 3; the peer is version 3 in
    the sender's view and counted; a Cancel from it is answered in 3 too."""
    sender = Sender(load_sender_settings(listen="tcp://127.0.0.1:0", pool=POOL)).start()
    receiver = Receiver(load_receiver_settings(pool=POOL)).start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(sender.endpoint)
        reg = wire.Register(
            receiver_id="old-receiver",
            result_endpoint="tcp://127.0.0.1:1",
            agent_metadata=receiver.agents.metadata(),
            layout=wire.WireLayout.of(receiver.pool.layout),
            kv_base=receiver.pool.kv_base,
            aux_base=receiver.pool.aux_base,
        )
        sock.send(wire.encode(reg, 3))
        (reply,) = _recv(sock)
        assert reply[:3] == b"KX\x03", reply[:3]
        assert wire.decode_to_receiver([reply], 1 << 20) == wire.RegisterReply(
            ok=True, sender_id=sender.sender_id
        )
        assert [p.version for p in sender.view().peers] == [3]
        assert sender.stats.get("peers_registered_previous_version") == 1
        sock.send(wire.encode(wire.Cancel(request_id="q", fetch_id=1), 3))
        (ack,) = _recv(sock)
        assert ack[:3] == b"KX\x03" and isinstance(
            wire.decode_to_receiver([ack], 1 << 20), wire.CancelAck
        )
    finally:
        sock.close(linger=0)
        receiver.shutdown(timeout=5)
        sender.shutdown(timeout=5)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_receiver_refused_at_4_registers_again_at_3_and_speaks_3_on_that_link() -> None:
    """Toward a sender that refuses version 4 as 0.1.0 does (Reject{unsupported_version} in a
    version-3 frame), the receiver registers again at 3, once, counted; its RequestData on
    that link is in version 3."""
    receiver = Receiver(load_receiver_settings(pool=POOL)).start()
    router = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        router.setsockopt(zmq.LINGER, 0)
        router.bind("tcp://127.0.0.1:*")
        endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        handle = receiver.fetch("q-1", endpoint, [1, 2], timeout_ms=5000)
        rid, first = _recv(router)
        assert first[:3] == b"KX\x04" and isinstance(
            wire.decode_to_sender([first], 1 << 22), wire.Register
        )
        refusal = wire.Reject(
            reason=wire.Reason.UNSUPPORTED_VERSION, detail="version 4, this side speaks 3"
        )
        router.send_multipart([rid, wire.encode(refusal, 3)])
        rid, again = _recv(router)
        assert again[:3] == b"KX\x03" and isinstance(
            wire.decode_to_sender([again], 1 << 22), wire.Register
        )
        reply = wire.RegisterReply(ok=True, sender_id="old-sender")
        router.send_multipart([rid, wire.encode(reply, 3)])
        rid, request = _recv(router)
        msg = wire.decode_to_sender([request], 1 << 22)
        assert request[:3] == b"KX\x03" and isinstance(msg, wire.RequestData), request[:3]
        assert [x.version for x in receiver.view().links] == [3]
        assert receiver.stats.get("register_version_fallbacks") == 1
        failed = wire.Result(
            request_id=msg.request_id,
            fetch_id=msg.fetch_id,
            status="failed",
            reason=wire.Reason.BUSY,
        )
        router.send_multipart([rid, wire.encode(failed, 3)])
        outcome = handle.wait(REPLY_S)
        assert outcome is not None and outcome.reason is wire.Reason.BUSY, outcome
    finally:
        router.close(linger=0)
        receiver.shutdown(timeout=5)


# -- the previous release, and daemons of both -------------------------------------------------


@pytest.fixture(scope="module")
def old() -> prev_release.Built:
    """The previous release in its venv (built once, cached on disk under .cache/)."""
    try:
        return prev_release.build()
    except prev_release.NotBuildable as e:
        pytest.skip(f"previous release not available: {e}")


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kxv"))  # short: ipc paths fit in sockaddr_un
    yield d
    shutil.rmtree(d, ignore_errors=True)


def daemon_env(old: bool) -> dict[str, str]:
    """A small pool (16 requests of the driver's shape), short deadlines; the old release
    without this tree on its path."""
    settings = {
        "KVXFERD_POOL__NUM_LAYERS": drv.LAYERS,
        "KVXFERD_POOL__NUM_BLOCKS": drv.NUM_BLOCKS,
        "KVXFERD_POOL__BLOCK_ELEMS": drv.BLOCK_BYTES,
        "KVXFERD_POOL__DTYPE": "uint8",
        "KVXFERD_NUM_THREADS": 1,
        "KVXFERD_SERVICE__PROBE_PORT": 0,
        "KVXFERD_DEADLINES__DRAIN_TIMEOUT_MS": 2000,
        "KVXFERD_DEADLINES__SHUTDOWN_TIMEOUT_MS": 4000,
        "PYTHONUNBUFFERED": 1,
    }
    base = prev_release.clean_env() if old else dict(os.environ)
    return {**base, **{k: str(v) for k, v in settings.items()}}


Spawn = Callable[..., Daemon]


@pytest.fixture(scope="module")
def spawn(old: prev_release.Built, workdir: Path) -> Iterator[Spawn]:
    """Start a daemon of this release or (``old=True``) the previous one; all closed at the end."""
    started: list[Daemon] = []

    def start(role: str, name: str, *, old_release: bool, **extra: str) -> Daemon:
        args = ["--listen", "tcp://127.0.0.1:0"] if role == "sender" else []
        env = {
            **daemon_env(old_release),
            "KVXFERD_SERVICE__ENGINE_SOCKET": f"ipc://{workdir}/{name}.sock",
            **extra,
        }
        d = Daemon(
            role,
            name,
            workdir,
            args,
            env=env,
            cwd=workdir,  # not the repository: `python -m` puts the working directory first
            python=str(old.python) if old_release else sys.executable,
            new_session=False,
        )
        started.append(d)
        d.wait_ready(time.monotonic() + STARTUP_S)
        return d

    yield start
    for d in started:
        d.close()


def run_driver(python: str, *args: str, old_release: bool, cwd: Path) -> list[dict[str, Any]]:
    """The engine driver under ``python``; its JSON lines (AssertionError unless it ended well)."""
    env = prev_release.clean_env() if old_release else dict(os.environ)
    script = ROOT / "tests" / "support" / "engine_driver.py"
    run = subprocess.run(
        [python, str(script), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=RUN_S,
        check=False,
    )
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and lines and lines[-1]["event"] == "end", run.stderr[-3000:]
    return lines


def debug_state(d: Daemon) -> dict[str, Any]:
    url = f"http://127.0.0.1:{d.ready['probe_port']}/debug/state"
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def publish(c: Client, pool: torch.Tensor, ids: list[str]) -> None:
    """This release's engine: each id's content into its blocks, then published."""
    for i, rid in enumerate(ids):
        data = torch.frombuffer(bytearray(drv.content(rid)), dtype=torch.uint8)
        pool[:, drv.blocks(i)] = data.reshape(drv.LAYERS, drv.BLOCKS, drv.BLOCK_BYTES)
        c.publish(rid, drv.blocks(i), aux=rid.encode())


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_old_sender_new_receiver_fetch_byte_exact_at_version_3(
    old: prev_release.Built, spawn: Spawn, workdir: Path
) -> None:
    """The new receiver registers at 4, is refused by the 0.1.0 sender, registers again at 3
    (once, counted) and fetches every request byte-exact. This release's Client (and an
    AsyncClient) drive the old sender, falling back to engine protocol 4; the old release's
    client drives the new receiver (the gateway answers it in 4)."""
    tx = spawn("sender", "old-tx", old_release=True)
    rx = spawn("receiver", "new-rx", old_release=False)
    ids = [f"o2n-{i}" for i in range(N_REQ)]
    with Client(tx.ready["engine_socket"], timeout_s=20) as c:
        publish(c, attach_pool(c.describe()), ids)
        assert c._dialect.version == 4  # the old daemon refused 5 once; the connection speaks 4

    async def describe_async() -> tuple[str, int]:  # the vLLM connector's client
        ac = AsyncClient(tx.ready["engine_socket"], timeout_s=20)
        try:
            info = await ac.describe()
            return info.role, ac._conn().dialect.version
        finally:
            await ac.aclose()

    assert asyncio.run(describe_async()) == ("sender", 4)
    lines = run_driver(
        str(old.python), "fetch", rx.ready["engine_socket"], tx.ready["endpoint"], *ids,
        old_release=True, cwd=workdir,
    )  # fmt: skip
    fetched = [x for x in lines if x["event"] == "fetched"]
    assert [(x["id"], x["state"], x["exact"]) for x in fetched] == [(i, "done", True) for i in ids]
    assert lines[-1]["version"] == old.version  # the old release's client, not this one's
    state = debug_state(rx)
    assert [(x["endpoint"], x["version"]) for x in state["links"]] == [(tx.ready["endpoint"], 3)]
    assert state["stats"]["register_version_fallbacks"] == 1
    assert state["stats"]["fetches_done"] == N_REQ


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_new_sender_old_receiver_fetch_byte_exact_and_nothing_newer_reaches_it(
    old: prev_release.Built, spawn: Spawn, workdir: Path
) -> None:
    """The 0.1.0 receiver registers at 3 and the new sender speaks 3 to it (peers[].version,
    counted); every request arrives byte-exact through NIXL notifications of version 3, and
    the old receiver refuses nothing it was sent (no rejected_* counter moves)."""
    tx = spawn("sender", "new-tx", old_release=False)
    rx = spawn("receiver", "old-rx", old_release=True)
    ids = [f"n2o-{i}" for i in range(N_REQ)]
    with Client(tx.ready["engine_socket"], timeout_s=20) as c:
        publish(c, attach_pool(c.describe()), ids)
        assert c._dialect.version == 5
    lines = run_driver(
        str(old.python), "fetch", rx.ready["engine_socket"], tx.ready["endpoint"], *ids,
        old_release=True, cwd=workdir,
    )  # fmt: skip
    fetched = [x for x in lines if x["event"] == "fetched"]
    assert [(x["id"], x["state"], x["exact"]) for x in fetched] == [(i, "done", True) for i in ids]
    sender = debug_state(tx)
    assert [p["version"] for p in sender["peers"]] == [3]
    assert sender["stats"]["peers_registered_previous_version"] == 1
    # It advertised no scratch region (a version-4 field): its link is never probed.
    probes = {k: v for k, v in sender["stats"].items() if k.startswith("link_probes_") and v}
    assert probes == {} and all(x.get("gbps") is None for x in sender["links"]), sender["links"]
    receiver = debug_state(rx)
    refused = {k: v for k, v in receiver["stats"].items() if k.startswith("rejected_") and v}
    assert refused == {}
    assert receiver["stats"]["fetches_done"] == N_REQ
    assert receiver["stats"].get("notifications", 0) >= 1  # done by KN\x03 notifications


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_draining_sender_hands_nothing_to_an_old_sender_and_says_so(
    old: prev_release.Built, spawn: Spawn
) -> None:
    """A 0.2.0 sender whose handover target is a 0.1.0 sender: the old one refuses the
    Handover (a version-4 message) by name and goes on unharmed; the draining sender logs the
    refusal (``rejected it: unsupported_version``), drops its unfetched requests at drain_timeout_ms as
    before, and exits 3."""
    t = spawn("sender", "old-t", old_release=True)
    d = spawn(
        "sender",
        "new-d",
        old_release=False,
        KVXFERD_HANDOVER__TARGETS=f'["{t.ready["endpoint"]}"]',
    )
    ids = ["kept-0", "kept-1"]
    with Client(d.ready["engine_socket"], timeout_s=20) as c:
        publish(c, attach_pool(c.describe()), ids)
    d.terminate()
    assert d.wait(time.monotonic() + 30) == 3, d.tail(40)
    said = "\n".join(d.stderr_lines(400))
    assert re.search(r"handover: \S+ rejected it: unsupported_version", said), said
    assert "drain incomplete: 2 published requests never fetched" in said, said
    stats = debug_state(t)["stats"]
    assert stats["rejected_unsupported_version"] == 1, stats
    assert t.alive() and stats.get("thread_errors", 0) == 0
