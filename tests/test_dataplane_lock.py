"""A REGISTER whose NIXL metadata points at a silent peer never delays another receiver's writes.

Toward a peer whose packets go unanswered, NIXL's ``add_remote_agent`` blocks for the whole TCP
connect (UCX over TCP connects blocking: SYN retries, 127 s with the kernel's defaults, about
7 s with ``UCX_TCP_SYN_CNT`` 2). The data plane must make that call with no lock a write needs,
its own or NIXL's agent lock (docs/hosts.md, the locking rule in kvxferd/transfer/peer_loads.py).

A silent peer without root, on loopback: a child makes a NIXL agent over UCX TCP (``lo`` only),
writes its metadata and stops itself (SIGSTOP). The test fills the accept queue of each of its
listening sockets with plain connects (the kernel completes them for the stopped process,
until the queue holds its backlog + 1); Linux then drops every further SYN toward it, so a
connect there waits out its SYN retries. Everything stays on this host's loopback.

The sender (a child running :class:`kvxferd.transfer.sender.Sender` and the test publisher,
``tests.support.peers``) publishes nothing at first; a healthy receiver (``tests.support.peers``) asks for
``FETCHES`` requests, which the sender parks. Once the sender reports them parked, a third
child sends a REGISTER with the silent peer's metadata: the sender's listener loads it and
waits in NIXL. The sender sees its own connect toward the silent port in SYN_SENT, and only
then publishes the requests; each write of a parked fetch reports whether that connect was
still in SYN_SENT when its request ended. Every one must have been: a write that waited for
the load (the data plane's lock or the writers' NIXL agent held) ends only once it failed.
No retries: each step waits for a condition with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.child import ChildProcess
from tests.support.conditions import wait_until
from tests.support.peers import PeerProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

STARTUP_S = 60.0
SYN_CNT = 2  # the sender's connects give up after about 7 s (1 + 2 + 4 s of SYN retries)
BLOCK = 16 << 10
LAYERS = 2
BLOCKS = 2  # x 16 KiB per layer; written by the workers (not inline)
SOMAXCONN = "/proc/sys/net/core/somaxconn"
SYN_ANSWER_S = 0.5
FETCHES = 8  # parked at the sender before the REGISTER; all must end while it blocks
MODULE = "tests.test_dataplane_lock"  # what the children run (``__name__`` is __main__ there)
# Every child speaks UCX over TCP on loopback only.
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
DEADLINES = dict(
    kv_transfer_timeout_ms=60_000,
    register_timeout_ms=int(STARTUP_S * 1000),
    publish_ttl_ms=120_000,
)


def _pool(blocks: int) -> dict[str, Any]:
    return dict(num_layers=LAYERS, num_blocks=blocks, block_elems=BLOCK, dtype="uint8")


# -- the silent peer --------------------------------------------------------------------------


def _socket_inodes(pid: int | str) -> set[str]:
    """The inodes of the sockets process ``pid`` holds open."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            link = os.readlink(fd_dir / fd)
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    return inodes


def _tcp_sockets(pid: int | str) -> list[dict[str, Any]]:
    """Process ``pid``'s IPv4 TCP sockets from /proc: state, ports and the queues' lengths."""
    mine = _socket_inodes(pid)
    found = []
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[9] not in mine:
            continue
        rx_queue = int(f[4].split(":")[1], 16)
        found.append(
            dict(
                state=int(f[3], 16),  # 10: LISTEN, 2: SYN_SENT
                local_port=int(f[1].split(":")[1], 16),
                remote_port=int(f[2].split(":")[1], 16),
                queued=rx_queue,  # for a listening socket: connections waiting to be accepted
            )
        )
    return found


TCP_LISTEN, TCP_SYN_SENT = 10, 2


def syn_sent_to(port: int) -> bool:
    """True while this process has a connect toward ``port`` (on loopback) in SYN_SENT."""
    return any(
        s["state"] == TCP_SYN_SENT and s["remote_port"] == port for s in _tcp_sockets("self")
    )


class _Silent(ChildProcess):
    """This module's ``silent`` child: a NIXL agent over UCX TCP on ``lo``, stopped."""

    def __init__(self, out: Path, log_dir: Path) -> None:
        super().__init__(
            MODULE, ["silent", str(out)], log_dir / "silent.stderr", "silent", env=UCX_ENV
        )
        self.ready = False
        self._start_reader()

    def _take(self, line: str) -> None:
        self.ready = self.ready or line.strip() == "ready"


class SilentPeer:
    """A stopped NIXL agent whose listening sockets' accept queues are full (SYNs dropped)."""

    def __init__(self, log_dir: Path) -> None:
        self.meta_path = log_dir / "silent.meta"
        self.fillers: list[socket.socket] = []
        self.child = _Silent(self.meta_path, log_dir)
        try:
            self._silence()
        except BaseException:
            self.close()
            raise

    def _silence(self) -> None:
        pid = self.child.pid
        with self.child._cond:
            if not self.child._cond.wait_for(
                lambda: self.child.ready or self.child._eof, STARTUP_S
            ):
                raise AssertionError(f"the silent peer never got ready\n{self.child.describe()}")
        assert self.child.ready, self.child.describe()
        wait_until(
            lambda: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T",
            10,
            "the silent peer stopped itself",
        )
        listening = [s for s in _tcp_sockets(pid) if s["state"] == TCP_LISTEN]
        assert listening, "the silent peer's agent listens on no IPv4 TCP socket"
        self.ports = [s["local_port"] for s in listening]
        # A listener's backlog is at most net.core.somaxconn; its queue is full at backlog + 1.
        need = len(listening) * (int(Path(SOMAXCONN).read_text()) + 2) + 256
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < need:
            if hard != resource.RLIM_INFINITY and hard < need:
                pytest.skip(
                    f"filling the accept queues takes {need} descriptors (hard limit {hard})"
                )
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        for port in self.ports:
            self._fill(port)

    def _fill(self, port: int) -> None:
        """Connect into ``port`` one at a time until a connect is not answered: the kernel
        completes each for the stopped process while its accept queue has room, and drops
        the SYN once it is full. Checked in /proc: the queue holds every completed connect (and
        sometimes the last, unanswered in time, too)."""
        poller = select.poll()
        while True:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            poller.register(s, select.POLLOUT)
            # Loopback answers a SYN in microseconds; a dropped one is retried after 1 s.
            answered = poller.poll(int(SYN_ANSWER_S * 1000))
            poller.unregister(s)
            if not answered:
                s.close()
                break
            err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            assert err == 0, f"a connect into port {port} failed: {os.strerror(err)}"
            self.fillers.append(s)
        [listener] = [
            x
            for x in _tcp_sockets(self.child.pid)
            if x["local_port"] == port and x["state"] == TCP_LISTEN
        ]
        assert listener["queued"] >= len(self.fillers) > 0, (listener, len(self.fillers))

    def metadata(self) -> bytes:
        return self.meta_path.read_bytes()

    def close(self) -> None:
        """Close the fillers, let the child run on to its clean exit; kill it if it does not."""
        for s in self.fillers:
            s.close()
        self.fillers.clear()
        if self.child.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child.pid, signal.SIGCONT)
            with contextlib.suppress(Exception):
                self.child.proc.wait(timeout=20)
        self.child.kill()


@pytest.fixture
def silent_peer(tmp_path: Path) -> Iterator[SilentPeer]:
    peer = SilentPeer(tmp_path)
    try:
        yield peer
    finally:
        peer.close()


class _Child(PeerProcess):
    """This module's own roles (``python -m tests.test_dataplane_lock ROLE ARGS``)."""

    def __init__(self, role: str, args: list[str], log_dir: Path, name: str, env: dict[str, str]):
        ChildProcess.__init__(self, MODULE, [role, *args], log_dir / f"{name}.stderr", name, env)
        self.role = role
        self.noise = []
        self._events = []
        self._start_reader()


@pytest.fixture
def spawn(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    spawned: list[PeerProcess] = []
    request.addfinalizer(lambda: [p.kill() for p in spawned])

    def start(role: str, name: str, *args: str, env: dict[str, str] | None = None) -> PeerProcess:
        p: PeerProcess
        if role == "receiver":
            p = PeerProcess(role, list(args), tmp_path, name)
        else:
            p = _Child(role, list(args), tmp_path, name, env or {})
        spawned.append(p)
        return p

    return start


def test_an_unreachable_register_never_delays_another_receivers_writes(
    silent_peer: SilentPeer, spawn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the sender's NIXL load of a REGISTER toward a silent peer blocks (about 7 s), each
    of the healthy receiver's parked fetches is written: all ``FETCHES`` requests end while the
    sender's connect toward the silent peer is still in SYN_SENT."""
    for k, v in UCX_ENV.items():
        monkeypatch.setenv(k, v)  # every child inherits them
    [port] = silent_peer.ports  # one IPv4 address on lo: one listening socket
    tx_settings = dict(
        num_threads=2,
        inline_write_max_bytes=0,
        pool=_pool(FETCHES * BLOCKS),
        deadlines=DEADLINES,
        dataplane=dict(ucx_tls="tcp"),
    )
    tx = spawn(
        "sender",
        "tx",
        json.dumps(tx_settings),
        str(port),
        env={"UCX_TCP_SYN_CNT": str(SYN_CNT)},
    )
    ready = tx.wait_event("ready", STARTUP_S)
    rx_settings = dict(
        pool=_pool(FETCHES * BLOCKS), deadlines=DEADLINES, dataplane=dict(ucx_tls="tcp")
    )
    rx = spawn(
        "receiver",
        "rx",
        "--settings",
        json.dumps(rx_settings),
        "--endpoint",
        ready["endpoint"],
        "--prefix",
        "ok",
        "--ids",
        f"0:{FETCHES}",
        "--blocks",
        str(BLOCKS),
        "--window",
        str(FETCHES),
    )
    tx.wait_event("parked", STARTUP_S)
    bad = spawn("register", "bad", ready["endpoint"], str(silent_peer.meta_path))
    blocked = tx.wait_event("blocked", STARTUP_S)
    reply = bad.wait_event("reply", STARTUP_S)
    assert not reply["ok"] and reply["reason"] == "incompatible", reply
    ended = tx.wait_events("ended", FETCHES, STARTUP_S)
    late = [e for e in ended if not e["connecting"] or e["state"] != "complete"]
    print(
        f"the load blocked {reply['at'] - blocked['at']:.2f} s after the sender saw its connect"
        f" ({reply['detail']}); requests ended meanwhile at"
        f" {[round(e['at'] - blocked['at'], 3) for e in ended]} s"
    )
    assert not late, (
        f"{len(late)} of {FETCHES} parked fetches were written only after the load toward the"
        f" silent peer gave up: {late}"
    )
    fetched = rx.wait_events("fetched", FETCHES, STARTUP_S)
    assert all(e["verified"] for e in fetched), "a healthy fetch failed"


DEADLINE_S = 2.0  # add_peer_async's, well inside the 7 s the connect waits in NIXL


def test_a_connect_toward_a_silent_peer_leaves_the_caller_and_other_peers_free(
    silent_peer: SilentPeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``add_peer_async`` toward the silent peer returns at once; while its connect thread waits
    in NIXL, another peer is added and written to; at its deadline the future fails with
    ``PeerUnreachable`` (the connect still waiting), and nothing is loaded when NIXL gives up;
    closing the data plane fails a connect still waiting at once."""
    import numpy as np

    from kvxferd.config import DataPlaneSettings, PoolSettings
    from kvxferd.transfer.dataplane import NixlDataPlane, PeerUnreachable, wait_xfer
    from kvxferd.transfer.pool import KvPool

    for k, v in {**UCX_ENV, "UCX_TCP_SYN_CNT": str(SYN_CNT)}.items():
        monkeypatch.setenv(k, v)  # read when each agent is made
    [port] = silent_peer.ports
    pools = [KvPool(PoolSettings(**_pool(4)), owner=f"lock-{r}-{os.getpid()}") for r in "tr"]
    settings = DataPlaneSettings(ucx_tls="tcp")
    tx = NixlDataPlane(f"lock-tx-{os.getpid()}", settings, pools[0])
    rx = NixlDataPlane(f"lock-rx-{os.getpid()}", settings, pools[1])
    try:
        t0 = time.monotonic()
        silent = tx.add_peer_async(silent_peer.metadata(), DEADLINE_S)
        assert time.monotonic() - t0 < 1.0, "add_peer_async waited for the connect"
        wait_until(lambda: syn_sent_to(port), 10, "the connect thread connecting")
        good = tx.add_peer_async(rx.metadata(), STARTUP_S).result(STARTUP_S)
        dst = pools[1]
        assert tx.prepare_peer(good, dst.layout, dst.kv_base, "DRAM", 0)
        blocks = np.arange(2, dtype=np.int64)
        xfer, state = tx.post_blocks(good, blocks, blocks, 0, LAYERS)
        deadline = time.monotonic() + 10
        while state == "PROC" and time.monotonic() < deadline:
            rx.progress()  # the target's agent must progress for the write to connect
            got = wait_xfer(xfer, state, time.monotonic() + 0.001)
            state = xfer.poll() if got == "STALLED" else got
        assert state == "DONE" and xfer.release()
        assert syn_sent_to(port), "the silent connect ended before the healthy write did"
        with pytest.raises(PeerUnreachable, match="no connect within"):
            silent.result(DEADLINE_S + 10)
        assert syn_sent_to(port), "the future waited for NIXL, not for its deadline"
        wait_until(lambda: tx._connects.in_flight() == 0, 30, "the connect thread ended")
        assert tx._peers.names() == {good}, "the silent peer was loaded after its future failed"
        assert tx._connects.counts == {"started": 2, "loaded": 1, "expired": 1}
        pending = tx.add_peer_async(silent_peer.metadata(), STARTUP_S)
        wait_until(lambda: syn_sent_to(port), 10, "another connect toward the silent peer")
        tx.close()  # fails the connects still waiting, at once
        with pytest.raises(PeerUnreachable, match="closed"):
            pending.result(5)
        assert tx._connects.counts["closed"] == 1
    finally:
        tx.close()
        rx.close()
        for pool in pools:
            pool.close()


# -- the children ------------------------------------------------------------------------


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "at": time.monotonic(), **fields}, default=str), flush=True)


def _silent(out: str) -> int:
    """Make a NIXL agent, write its metadata to ``out``, stop; once continued, close and exit."""
    from kvxferd.config import DataPlaneSettings, PoolSettings
    from kvxferd.transfer.dataplane import NixlDataPlane
    from kvxferd.transfer.pool import KvPool

    pool = KvPool(PoolSettings(**_pool(BLOCKS)), owner=f"lock-silent-{os.getpid()}")
    try:
        dp = NixlDataPlane(f"kvxl-silent-{os.getpid()}", DataPlaneSettings(ucx_tls="tcp"), pool)
        Path(out).write_bytes(dp.metadata())
        print("ready", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        dp.close()
    finally:
        pool.close()
    return 0


def _sender(settings: str, silent_port: str) -> int:
    """A sender whose publisher waits: until ``FETCHES`` fetches are parked (reported), then
    until this process connects toward ``silent_port`` (reported); then it publishes them.
    Each ``ended`` request says whether that connect was still in SYN_SENT."""
    from kvxferd.config import load_sender_settings
    from kvxferd.transfer.sender import Sender
    from tests.support.peers import Publisher

    port = int(silent_port)
    overrides = {"listen": "tcp://127.0.0.1:0", **json.loads(settings)}
    sender = Sender(load_sender_settings(**overrides)).start()
    _emit("ready", endpoint=sender.endpoint, pid=os.getpid())

    def emit(event: str, **fields: Any) -> None:
        if event == "ended":
            fields["connecting"] = syn_sent_to(port)
        _emit(event, **fields)

    pub = Publisher(sender, prefix="ok", count=FETCHES, blocks=BLOCKS, emit=emit)
    pub.paused.set()
    wait_until(lambda: sender.view().parked_count >= FETCHES, STARTUP_S, "fetches parked")
    _emit("parked")
    wait_until(lambda: syn_sent_to(port), STARTUP_S, "a connect toward the silent peer", 0.001)
    _emit("blocked")
    pub.paused.clear()
    pub.start()
    wait_until(lambda: pub.finished, STARTUP_S, "every request ended")
    pub.stop()
    sender.shutdown()
    return 0


def _register(endpoint: str, meta_path: str) -> int:
    """Send a REGISTER with the metadata in ``meta_path``; report its ``reply``."""
    import zmq

    from kvxferd.config import PoolSettings
    from kvxferd.transfer import protocol as wire
    from kvxferd.transfer.pool import KvPool

    pool = KvPool(PoolSettings(**_pool(BLOCKS)), owner=f"lock-register-{os.getpid()}")
    ctx = zmq.Context()
    results = ctx.socket(zmq.ROUTER)
    port = results.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send(
        wire.encode(
            wire.Register(
                receiver_id=f"unreachable-{os.getpid()}",
                result_endpoint=f"tcp://127.0.0.1:{port}",
                agent_metadata=Path(meta_path).read_bytes(),
                layout=wire.WireLayout.of(pool.layout),
                kv_base=pool.kv_base,
                aux_base=pool.aux_base,
            )
        )
    )
    if not dealer.poll(int(STARTUP_S * 1000)):
        _emit("no_reply")
        return 1
    msg = wire.decode_to_receiver(dealer.recv_multipart(), 1 << 20)
    assert isinstance(msg, wire.RegisterReply), msg
    _emit("reply", ok=msg.ok, reason=str(msg.reason), detail=msg.detail)
    dealer.close(linger=0)
    results.close(linger=0)
    ctx.term()
    pool.close()
    return 0


def main(argv: list[str]) -> int:
    role, *args = argv
    if role == "silent":
        return _silent(*args)
    if role == "sender":
        return _sender(*args)
    if role == "register":
        return _register(*args)
    raise SystemExit(f"unknown role {role}")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
