"""A REGISTER whose NIXL metadata points at an unreachable address never delays another receiver's writes.

Toward an address whose packets vanish, NIXL's ``add_remote_agent`` blocks for the whole TCP
connect (UCX over TCP connects blocking: SYN retries, 127 s with the kernel's defaults,
about 7 s with ``tcp_syn_retries`` 2). The data plane must make that call with no lock a
write needs, its own or NIXL's agent lock (docs/hosts.md, the data plane's docstring).

Set-up, as root, in two network namespaces this module creates (nothing in the machine's
own): namespace A runs a sender and a healthy receiver (children, ``tests.peers``) over
UCX TCP on its loopback; namespace B holds a veth peer 10.79.7.2, where a NIXL agent is
made only to take its metadata (its one address is B's veth). In A an nftables rule drops
every packet toward 10.79.7.2, and ``tcp_syn_retries`` is 2. A third child in A then sends
the sender a REGISTER carrying B's metadata: the sender's listener loads it and waits in
NIXL until the connect times out. The listener reads nothing meanwhile, so the healthy
receiver's fetches that keep flowing are those it asked for ahead (``WINDOW``): the sender
parked them, and its publisher hands each to a worker as it publishes the request.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.child import ChildProcess
from tests.peers import PeerProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

STARTUP_S = 60.0
CMD_TIMEOUT_S = 10.0
SUBNET = "10.79.7"  # exists only inside this module's namespaces (tests/hosts.py uses 10.79.0)
SYN_RETRIES = 2  # connects give up after about 7 s in namespace A (1 + 2 + 4 s)
BLOCKED_MIN_S = 3.0  # the REGISTER's load must have blocked at least this long to prove anything
BLOCK = 64 << 10
LAYERS = 8
BLOCKS = 4  # x 64 KiB: 256 KiB per layer; written by the workers (not inline)
# The receiver reads one layer of each request: it mostly verifies faster than the sender fills
# and writes, so the fetches it asked ahead wait at the sender, not in the receiver.
READ_LAYERS = "0:1"
CAPACITY = 1  # requests the sender publishes at once: it, not the receiver, sets the pace
WINDOW = 48
# Healthy fetches that must end while the bad REGISTER's load blocks: the sender holds up to
# WINDOW of them (those the receiver asked ahead); with writes waiting for the load, only the
# CAPACITY already under way could end. When the receiver happened to be behind (few asked
# ahead), the attempt measured little: another REGISTER is sent, at most ATTEMPTS in all.
MIN_DURING = 8
ATTEMPTS = 3
MODULE = "tests.test_dataplane_lock"  # what the children run (``__name__`` is __main__ there)
DEADLINES = dict(
    kv_transfer_timeout_ms=60_000,
    register_timeout_ms=int(STARTUP_S * 1000),
    publish_ttl_ms=120_000,
)


def _pool(blocks: int) -> dict[str, Any]:
    return dict(num_layers=LAYERS, num_blocks=blocks, block_elems=BLOCK, dtype="uint8")


def why_no_netns() -> str | None:
    """Why the namespaces cannot be built here (a skip message), or None."""
    how = "run the tests as root (sudo make test) on Linux with iproute2 and nftables"
    if os.geteuid() != 0:
        return f"network namespaces and nftables need root: {how}"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed: {how}"
    return None


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, timeout=CMD_TIMEOUT_S, capture_output=True)


class _Namespaces:
    """Namespaces A and B joined by a veth pair; in A, packets toward B's address vanish.

    Named ``kvxl{pid}-a|b``; those a SIGKILLed run left (their pid is gone) are deleted first.
    """

    def __init__(self) -> None:
        _sweep()
        tag = f"kvxl{os.getpid()}"
        self.a, self.b = f"{tag}-a", f"{tag}-b"
        try:
            for ns in (self.a, self.b):
                _run("ip", "netns", "add", ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run(
                "ip",
                "-n",
                self.a,
                "link",
                "add",
                "va",
                "type",
                "veth",
                "peer",
                "vb",
                "netns",
                self.b,
            )
            _run("ip", "-n", self.a, "addr", "add", f"{SUBNET}.1/24", "dev", "va")
            _run("ip", "-n", self.b, "addr", "add", f"{SUBNET}.2/24", "dev", "vb")
            _run("ip", "-n", self.a, "link", "set", "va", "up")
            _run("ip", "-n", self.b, "link", "set", "vb", "up")
            ns_a = ("ip", "netns", "exec", self.a)
            _run(*ns_a, "sysctl", "-qw", f"net.ipv4.tcp_syn_retries={SYN_RETRIES}")
            _run(*ns_a, "nft", "add", "table", "ip", "kvxl")
            _run(*ns_a, "nft", "add chain ip kvxl out { type filter hook output priority 0 ; }")
            _run(
                *ns_a,
                "nft",
                "add",
                "rule",
                "ip",
                "kvxl",
                "out",
                "ip",
                "daddr",
                f"{SUBNET}.2",
                "drop",
            )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Delete both namespaces (their veth, sysctl and nftables go with them)."""
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], timeout=CMD_TIMEOUT_S, capture_output=True)


def _sweep() -> None:
    listed = subprocess.run(
        ["ip", "netns", "list"], timeout=CMD_TIMEOUT_S, capture_output=True, text=True
    )
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(r"kvxl(\d+)-[ab]", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            subprocess.run(["ip", "netns", "del", name], timeout=CMD_TIMEOUT_S, capture_output=True)


class _InNs(PeerProcess):
    """A child run inside a namespace: ``python -m tests.test_dataplane_lock NS ROLE ARGS``,
    which execs ``ROLE`` there (a ``tests.peers`` role, or this module's ``register``)."""

    def __init__(self, ns: str, role: str, args: list[str], log_dir: Path, name: str) -> None:
        ChildProcess.__init__(
            self, MODULE, [ns, role, *args], log_dir / f"{name}.stderr", name, env={}
        )
        self.role = role
        self.noise = []
        self._events = []
        self._start_reader()


@pytest.fixture
def namespaces() -> Iterator[_Namespaces]:
    why = why_no_netns()
    if why:
        pytest.skip(why)
    ns = _Namespaces()
    try:
        yield ns
    finally:
        ns.close()


@pytest.fixture
def spawn(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    spawned: list[_InNs] = []
    request.addfinalizer(lambda: [p.kill() for p in spawned])

    def start(ns: str, role: str, name: str, *args: str) -> _InNs:
        p = _InNs(ns, role, list(args), tmp_path, name)
        spawned.append(p)
        return p

    return start


def _metadata_of_b(ns: _Namespaces, out: Path) -> None:
    """NIXL metadata of an agent in B whose only address is B's veth (written to ``out``)."""
    env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "vb"}
    cmd = ["ip", "netns", "exec", ns.b, sys.executable, "-m", MODULE, "-", "agent", str(out)]
    done = subprocess.run(cmd, env=env, timeout=STARTUP_S, capture_output=True, text=True)
    assert done.returncode == 0 and out.exists(), done.stderr[-2000:]


def test_an_unreachable_register_never_delays_another_receivers_writes(
    namespaces: _Namespaces, spawn: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the sender's NIXL load of a REGISTER toward a silent address blocks (about 7 s), the
    healthy receiver's fetches the sender already holds keep being written: 8 or more end
    (at most 3 attempts)."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # every child inherits it
    meta = tmp_path / "unreachable.meta"
    _metadata_of_b(namespaces, meta)
    a = namespaces.a
    tx_settings = dict(
        num_threads=2,
        inline_write_max_bytes=0,
        pool=_pool(CAPACITY * BLOCKS),
        deadlines=DEADLINES,
        dataplane=dict(ucx_tls="tcp"),
    )
    tx = spawn(
        a,
        "sender",
        "tx",
        "--settings",
        json.dumps(tx_settings),
        "--prefix",
        "ok",
        "--count",
        "1000000",
        "--blocks",
        str(BLOCKS),
    )
    ready = tx.wait_event("ready", STARTUP_S)
    assert ready["pid"] == tx.pid, "the child did not exec in place"
    rx_settings = dict(
        pool=_pool(WINDOW * BLOCKS), deadlines=DEADLINES, dataplane=dict(ucx_tls="tcp")
    )
    rx = spawn(
        a,
        "receiver",
        "rx",
        "--settings",
        json.dumps(rx_settings),
        "--endpoint",
        ready["endpoint"],
        "--prefix",
        "ok",
        "--ids",
        "0:1000000",
        "--blocks",
        str(BLOCKS),
        "--layers",
        READ_LAYERS,
        "--window",
        str(WINDOW),
    )
    rx.wait_events("fetched", 3 * WINDOW, STARTUP_S, where=lambda e: e["verified"])

    seen: list[int] = []
    for attempt in range(ATTEMPTS):
        bad = spawn(a, "register", f"bad{attempt}", ready["endpoint"], str(meta))
        assert bad.wait_event("connected", STARTUP_S)["ok"], "the first REGISTER was not refused"
        sent = bad.wait_event("sent", STARTUP_S)["t"]
        reply = bad.wait_event("reply", STARTUP_S)
        blocked_s = reply["t"] - sent
        # Counted at the sender (its publisher reports each request it closed): the
        # receiver's own reports trail what landed.
        during = [
            e["t"] - sent
            for e in tx.events("ended")
            if sent < e["t"] < reply["t"] and e["state"] == "complete"
        ]
        seen.append(len(during))
        print(
            f"attempt {attempt}: the load blocked {blocked_s:.2f} s ({reply['detail']}); the"
            f" sender ended {len(during)} healthy fetches meanwhile, the last at"
            f" {max(during, default=0):.3f} s"
        )
        assert not reply["ok"] and reply["reason"] == "incompatible", reply
        assert blocked_s >= BLOCKED_MIN_S, f"the load blocked only {blocked_s:.2f} s"
        if len(during) >= MIN_DURING:
            break
        # Too few fetches waited at the sender when the load began (the receiver was
        # behind): measure again once the stream flows again.
        rx.wait_events("fetched", len(rx.events("fetched")) + 2 * WINDOW, STARTUP_S)
    else:
        pytest.fail(
            f"healthy fetches ended during the blocked load, per attempt: {seen}; with writes"
            f" free of the load, {MIN_DURING} or more of the {WINDOW} asked ahead would"
        )
    rx.wait_events("fetched", len(rx.events("fetched")) + 1, STARTUP_S)  # it goes on after
    assert all(e["verified"] for e in rx.events("fetched")), "a healthy fetch failed"


# -- the children ------------------------------------------------------------------------


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _agent(out: str) -> int:
    """Make a NIXL agent here and write its metadata to ``out``; then exit."""
    from kvxferd.config import DataPlaneSettings, PoolSettings
    from kvxferd.transfer.dataplane import NixlDataPlane
    from kvxferd.transfer.pool import KvPool

    pool = KvPool(PoolSettings(**_pool(BLOCKS)), owner="lock-agent")
    try:
        dp = NixlDataPlane(f"kvxl-unreachable-{os.getpid()}", DataPlaneSettings(), pool)
        Path(out).write_bytes(dp.metadata())
        dp.close()
    finally:
        pool.close()
    return 0


def _register(endpoint: str, meta_path: str) -> int:
    """Send a REGISTER with the metadata in ``meta_path``; report ``sent`` and its ``reply``."""
    import zmq
    from msgspec.structs import replace

    from kvxferd.config import PoolSettings
    from kvxferd.transfer import protocol as wire
    from kvxferd.transfer.pool import KvPool

    pool = KvPool(PoolSettings(**_pool(BLOCKS)), owner="lock-register")  # a layout like A's
    ctx = zmq.Context()
    results = ctx.socket(zmq.ROUTER)
    port = results.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    reg = wire.Register(
        receiver_id=f"unreachable-{os.getpid()}",
        result_endpoint=f"tcp://127.0.0.1:{port}",
        agent_metadata=Path(meta_path).read_bytes(),
        layout=wire.WireLayout.of(pool.layout),
        kv_base=pool.kv_base,
        aux_base=pool.aux_base,
    )

    def ask(reg: wire.Register) -> wire.RegisterReply | None:
        dealer.send(wire.encode(reg))
        if not dealer.poll(int(STARTUP_S * 1000)):
            return None
        msg = wire.decode_to_receiver(dealer.recv_multipart(), 1 << 20)
        assert isinstance(msg, wire.RegisterReply), msg
        return msg

    # First a REGISTER the sender refuses before NIXL sees it (another pool shape): once it
    # is answered, the connection is up and "sent" below is when the listener reads ours.
    other = replace(reg.layout, num_layers=reg.layout.num_layers + 1)
    first = ask(replace(reg, layout=other))
    _emit("connected", ok=first is not None and not first.ok)
    _emit("sent")
    msg = ask(reg)
    if msg is None:
        _emit("no_reply")
        return 1
    _emit("reply", ok=msg.ok, reason=str(msg.reason), detail=msg.detail)
    dealer.close(linger=0)
    results.close(linger=0)
    ctx.term()
    pool.close()
    return 0


def main(argv: list[str]) -> int:
    """``NS ROLE ARGS``: run ROLE inside namespace NS (``-``: where we are)."""
    ns, role, *args = argv
    if ns != "-":
        cmd = [sys.executable, "-m", MODULE, "-", role, *args]
        if role in ("sender", "receiver"):
            cmd = [sys.executable, "-m", "tests.peers", role, *args]
        os.execvp("ip", ["ip", "netns", "exec", ns, *cmd])  # the same pid, inside NS
    if role == "agent":
        return _agent(*args)
    if role == "register":
        return _register(*args)
    raise SystemExit(f"unknown role {role}")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
