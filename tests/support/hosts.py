"""Test hosts: network namespaces joined by veth pairs to a bridge, each running its own daemons.

:class:`HostNet` (as root) builds, for ``n`` hosts::

    namespace kvxh{pid}-sw     bridge "br0" (the switch), no address
    namespace kvxh{pid}-h{i}   veth kx{pid}h{i}  10.79.0.{i+1}/24  <-->  kx{pid}s{i} in br0

Every address lives only inside namespaces this object created, so no packet of a test
reaches the machine's own network. Each host runs its own daemons
(``ip netns exec NS python -m kvxferd ...``, a :class:`kvxferd.faults.harness.Daemon`) bound
to its own address, with NIXL over UCX TCP on its veth (``UCX_TLS=tcp``,
``UCX_NET_DEVICES`` = the veth; :data:`UCX_ENV`). The engine socket is an ipc path on the
shared filesystem and the pool is POSIX shared memory, so the test process itself can be the
engine of every daemon (:mod:`kvxferd.engine.client`).

``cut(a, b)`` drops every frame between two hosts at the switch (an nftables ``bridge``
table; no connection is reset and the hosts see only silence, as when a cable or a switch
port fails; ``both=False``: one way); ``heal(a, b)`` deletes it. The hosts' TCP can be tuned
per namespace (``tcp_rto_max_ms``, ``tcp_retries2``). :class:`PairTraffic` plays the engines
of one (prefill, decode) pair.

Cleanup is certain: ``close()`` (also on ``__exit__``, whatever happened) stops the engine
loops, stops every daemon it started (SIGTERM, then SIGKILL), kills every process left in
its namespaces, then deletes the namespaces, which takes their veths, bridge and nftables
tables with them; nothing is created in the root namespace. Namespaces, work directories
and pool segments left by a run that was SIGKILLed (their creator's pid is gone) are swept
at the next start. Every command and wait has a deadline.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from kvxferd.auth import keygen, load_public_key
from kvxferd.demo import aux_bytes, expected_bytes
from kvxferd.engine.client import Client, EngineError, attach_pool
from kvxferd.engine.engine_protocol import EngineReason
from kvxferd.faults.harness import (
    CALL_TIMEOUT_S,
    EXIT_BOUND_S,
    FAULT_DEADLINES,
    MAX_BLOCKS,
    MIN_BLOCKS,
    READY_TIMEOUT_S,
    WAIT_SLICE_S,
    Daemon,
    Engine,
    fault_env,
)
from kvxferd.transfer.pool import IdAllocator

SUBNET = "10.79.0"  # /24, private, exists only inside the namespaces a HostNet builds
PREFIX = "kvxh"  # namespace names: kvxh{pid}-sw, kvxh{pid}-h{i}
WORKDIR_PREFIX = "kvxf-hosts-"  # {tmp}/kvxf-hosts-{pid}-XXXX: sockets, daemon logs, segments
CMD_TIMEOUT_S = 10.0
CutAt = Literal["switch", "hosts"]
# UCX over TCP between hosts: only the TCP transport, only the host's veth (see docs/hosts.md).
UCX_ENV = {"UCX_TLS": "tcp", "KVXFERD_DATAPLANE__UCX_TLS": "tcp"}


def why_no_hosts() -> str | None:
    """Why namespace hosts cannot be built here (a skip message), or None."""
    how = "run the tests as root (sudo make test) on Linux with iproute2 and nftables"
    if os.geteuid() != 0:
        return f"namespace hosts need root (network namespaces, veth, nftables): {how}"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"namespace hosts need the '{tool}' tool: {how}"
    probe = f"{PREFIX}{os.getpid()}-probe"
    r = _run(["ip", "netns", "add", probe], check=False)
    if r.returncode != 0:
        return f"'ip netns add' failed here ({r.stderr.strip()}): {how}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process inside ``ns`` (bounded), then delete it."""
    r = _run(["ip", "netns", "pids", ns], check=False)
    for pid in r.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run(["ip", "netns", "del", ns], check=False)


def sweep_stale() -> list[str]:
    """Delete namespaces left by HostNets whose process is gone; their names."""
    r = _run(["ip", "netns", "list"], check=False)
    gone = []
    for line in r.stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)-\w+", ns)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _kill_namespace(ns)
            gone.append(ns)
    for d in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*"):
        m = re.match(rf"{WORKDIR_PREFIX}(\d+)-", d.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _unlink_segments(d)
            shutil.rmtree(d, ignore_errors=True)
            gone.append(str(d))
    return gone


def _unlink_segments(workdir: Path) -> None:
    """Unlink the pool segments a HostNet recorded in ``workdir`` (daemons that were killed)."""
    try:
        names = (workdir / "segments").read_text().split()
    except OSError:
        return
    for name in names:
        if re.fullmatch(r"[A-Za-z0-9_.-]{1,200}", name):
            Path(f"/dev/shm/{name}").unlink(missing_ok=True)


def report(name: str, figures: dict[str, object]) -> None:
    """Print a run's figures; with ``KVXFERD_HOSTS_FIGURES=FILE`` also append them as a JSON line."""
    print(f"\n{name}: {json.dumps(figures, sort_keys=True)}")
    path = os.environ.get("KVXFERD_HOSTS_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, **figures}, sort_keys=True) + "\n")


@dataclass
class Host:
    """One namespace host: its name, namespace, address and veth."""

    index: int
    ns: str
    ip: str
    dev: str  # its veth (UCX_NET_DEVICES)
    port: str  # the veth's other end, a port of the switch's bridge


@dataclass
class HostNet:
    """``n`` namespace hosts on one bridge; their daemons; link cuts. Use as a context manager."""

    n: int
    # Per-namespace TCP sysctls of every host (docs/hosts.md); None keeps the kernel's value.
    # tcp_rto_max_ms (Linux >= 6.15) caps the retransmission backoff (default 120 s);
    # tcp_retries2 bounds the retransmissions before a connection is dropped (default 15).
    tcp_rto_max_ms: int | None = None
    tcp_retries2: int | None = None
    workdir: Path = field(
        default_factory=lambda: Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-"))
    )
    hosts: list[Host] = field(default_factory=list)
    daemons: list[Daemon] = field(default_factory=list)
    engines: list[Engine] = field(default_factory=list)
    traffics: list[PairTraffic] = field(default_factory=list)
    cuts: dict[tuple[int, int], CutAt] = field(default_factory=dict)
    _created: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.n <= 200:
            raise ValueError("1 to 200 hosts")
        self.tag = f"{PREFIX}{os.getpid()}"
        os.chmod(self.workdir, 0o755)

    def __enter__(self) -> HostNet:
        try:
            self.up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- building --------------------------------------------------------------------------
    def _ns(self, ns: str, *args: str) -> None:
        _run(["ip", "netns", "exec", ns, *args])

    def _add_ns(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._created.append(ns)
        self._ns(ns, "ip", "link", "set", "lo", "up")

    def up(self) -> None:
        sweep_stale()
        sw = f"{self.tag}-sw"
        self._add_ns(sw)
        self._ns(sw, "ip", "link", "add", "br0", "type", "bridge")
        self._ns(sw, "ip", "link", "set", "br0", "up")
        pid = os.getpid() % 100_000
        for i in range(self.n):
            ns, dev, port = f"{self.tag}-h{i}", f"kx{pid}h{i}", f"kx{pid}s{i}"
            self._add_ns(ns)
            # Both ends are created straight into their namespaces: none in the root one.
            _run(["ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port,
                  "netns", sw])  # fmt: skip
            self._ns(sw, "ip", "link", "set", port, "master", "br0")
            self._ns(sw, "ip", "link", "set", port, "up")
            ip = f"{SUBNET}.{i + 1}"
            self._ns(ns, "ip", "addr", "add", f"{ip}/24", "dev", dev)
            self._ns(ns, "ip", "link", "set", dev, "up")
            for key, value in (
                ("tcp_rto_max_ms", self.tcp_rto_max_ms),
                ("tcp_retries2", self.tcp_retries2),
            ):
                if value is not None:
                    self._ns(ns, "sysctl", "-qw", f"net.ipv4.{key}={value}")
            self.hosts.append(Host(i, ns, ip, dev, port))

    # -- daemons ---------------------------------------------------------------------------
    def env(self, host: Host, name: str) -> dict[str, str]:
        """A daemon's environment on ``host``: the fault suite's small pool and short
        deadlines, its own engine socket, UCX over TCP on the host's veth only, and CURVE
        (the hosts' addresses are not loopback, so plaintext is refused)."""
        extra = {
            **UCX_ENV,
            "UCX_NET_DEVICES": host.dev,
            **self.security_env(),
            # Receivers dial the senders of a fetch only on the hosts' network.
            "KVXFERD_ACCESS__DIAL_ALLOW": json.dumps([f"{SUBNET}.0/24"]),
        }
        return fault_env(self.workdir, name, "tcp", extra)

    def security_env(self) -> dict[str, str]:
        """CURVE for every daemon of this net: one key pair (``kvxferd keygen``'s code) that
        every daemon holds and allows, so each sender presents the key receivers expect."""
        keys = self.workdir / "keys"
        if not (keys / "hosts.key_secret").exists():
            public, _ = keygen(keys, "hosts")
            (keys / "allowed").mkdir(mode=0o700)
            shutil.copy(public, keys / "allowed" / "hosts.key")
        return {
            "KVXFERD_SECURITY__MODE": "curve",
            "KVXFERD_SECURITY__KEY_FILE": str(keys / "hosts.key_secret"),
            "KVXFERD_SECURITY__ALLOWED_KEYS_DIR": str(keys / "allowed"),
            "KVXFERD_SECURITY__SENDER_KEYS": json.dumps({"*": load_public_key(keys / "hosts.key")}),
        }

    def sender(self, host: Host, name: str, port: int) -> Daemon:
        """A sender daemon on ``host``, listening on the host's own address."""
        args = ["--listen", f"tcp://{host.ip}:{port}"]
        return self._daemon(
            Daemon("sender", name, self.workdir, args, self.env(host, name), host.ns)
        )

    def receiver(self, host: Host, name: str) -> Daemon:
        """A receiver daemon on ``host``; its result endpoint bound to the host's address."""
        args = ["--result-endpoint", f"tcp://{host.ip}:0"]
        return self._daemon(
            Daemon("receiver", name, self.workdir, args, self.env(host, name), host.ns)
        )

    def _daemon(self, d: Daemon) -> Daemon:
        self.daemons.append(d)
        return d

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        by = time.monotonic() + timeout_s
        for d in self.daemons:
            d.wait_ready(by)

    def engine(self, d: Daemon, seed: int) -> Engine:
        """This process as ``d``'s engine: a client on its ipc socket, its pool mapped here."""
        client = Client(d.ready["engine_socket"], timeout_s=CALL_TIMEOUT_S)
        info = client.describe()
        d.shm_name = info.shm_name
        with open(self.workdir / "segments", "a") as f:  # swept if this process dies
            f.write(info.shm_name + "\n")
        kv = attach_pool(info)
        eng = Engine(d, client, kv, IdAllocator(kv.shape[1], shuffle_seed=seed))
        self.engines.append(eng)
        return eng

    def pair(
        self, name: str, tx: Engine, rx: Engine, endpoint: str, *, threads: int, seed: int
    ) -> PairTraffic:
        """Engine loops on one pair, started; ``close`` stops them before unmapping pools."""
        t = PairTraffic(name, tx, rx, endpoint, threads=threads, seed=seed)
        self.traffics.append(t)
        return t.start()

    # -- faults ----------------------------------------------------------------------------
    def cut(self, a: Host, b: Host, at: CutAt = "switch", both: bool = True) -> float:
        """Drop every packet between ``a`` and ``b``; the monotonic time. ``both=False``: only
        from ``a`` to ``b`` (at the switch), a link that fails one way.

        ``switch``: the bridge drops the frames between the two hosts' ports (an nftables
        ``bridge`` table in the switch namespace). The hosts see nothing but silence, as when
        a link or a switch fails: TCP retransmits on its doubling backoff. ``hosts``: each
        host's own input/output hooks drop the packets; a local drop is reported to the
        sending socket at once, so TCP retries on its short local-drop timer instead.
        """
        if at == "switch":
            sw, table = f"{self.tag}-sw", f"kvxcut{a.index}x{b.index}"
            self._ns(sw, "nft", "add", "table", "bridge", table)
            self._ns(sw, "nft", "add", "chain", "bridge", table, "forward",
                     "{ type filter hook forward priority 0 ; policy accept ; }")  # fmt: skip
            for src, dst in ((a, b), (b, a)) if both else ((a, b),):
                self._ns(sw, "nft", "add", "rule", "bridge", table, "forward",
                         "iifname", src.port, "oifname", dst.port, "drop")  # fmt: skip
        else:
            for me, other in ((a, b), (b, a)):
                table = f"kvxcut{other.index}"
                self._ns(me.ns, "nft", "add", "table", "inet", table)
                for hook, fld in (("input", "saddr"), ("output", "daddr")):
                    self._ns(me.ns, "nft", "add", "chain", "inet", table, hook,
                             f"{{ type filter hook {hook} priority 0 ; policy accept ; }}")  # fmt: skip
                    self._ns(me.ns, "nft", "add", "rule", "inet", table, hook, "ip", fld,
                             other.ip, "drop")  # fmt: skip
        self.cuts[(a.index, b.index)] = at
        return time.monotonic()

    def heal(self, a: Host, b: Host) -> float:
        """Undo ``cut(a, b)``; the monotonic time."""
        at = self.cuts.pop((a.index, b.index))
        if at == "switch":
            self._ns(f"{self.tag}-sw", "nft", "delete", "table", "bridge",
                     f"kvxcut{a.index}x{b.index}")  # fmt: skip
        else:
            for me, other in ((a, b), (b, a)):
                self._ns(me.ns, "nft", "delete", "table", "inet", f"kvxcut{other.index}")
        return time.monotonic()

    # -- cleanup ---------------------------------------------------------------------------
    def close(self) -> None:
        """Every daemon stopped (SIGTERM, SIGKILL past its bound), every namespace (with its
        links and tables) deleted, every pool segment unlinked."""
        for t in self.traffics:
            t.stop.set()
        loops_left = [
            n for t in self.traffics for n in t.finish(FETCH_BOUND_S + 3 * CALL_TIMEOUT_S)
        ]
        for e in self.engines:
            e.client.close_client()
        for d in self.daemons:  # all at once: the bounds run in parallel
            if d.alive():
                try:
                    os.kill(d.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        by = time.monotonic() + EXIT_BOUND_S
        for d in self.daemons:
            try:
                d.proc.wait(timeout=max(0.1, by - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                d.kill()
            except Exception:  # a kill that failed: the namespace sweep below kills it
                pass
        for e in self.engines if not loops_left else ():  # a loop still running: exit unmaps
            try:
                e.kv.kvxferd_mapping.close()  # type: ignore[attr-defined]
            except Exception:
                pass
        for d in self.daemons:  # a killed daemon could not unlink its segment
            if d.shm_name and d.proc.returncode != 0:
                Path(f"/dev/shm/{d.shm_name}").unlink(missing_ok=True)
        for ns in reversed(self._created):
            _kill_namespace(ns)
        self._created.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Namespaces of this HostNet that still exist (empty after ``close``)."""
        out = _run(["ip", "netns", "list"], check=False).stdout
        return [ln.split()[0] for ln in out.splitlines() if ln.startswith(f"{self.tag}-")]


# -- engines on one (prefill, decode) pair -------------------------------------------------

# A fetch must be answered within its kv_transfer deadline; past this the engine gives up
# asking and records it unanswered (a defect: the receiver owes every fetch an outcome).
FETCH_BOUND_S = FAULT_DEADLINES["kv_transfer_timeout_ms"] / 1000 + 2 * CALL_TIMEOUT_S + 1.0
CLOSE_TRY_S = 0.05  # a close that does not answer True this fast is asked again later


@dataclass
class Fetch:
    """One request on one pair, as the decode engine saw it."""

    request: str
    started: float  # monotonic, just before the fetch call
    ended: float | None = None  # when its outcome arrived (None: never)
    ok: bool = False
    state: str = ""
    reason: str = ""
    wrong: bool = False  # done, but some byte (or the aux payload) differs
    verified: int = 0  # bytes compared equal

    @property
    def seconds(self) -> float:
        return self.ended - self.started if self.ended is not None else float("inf")


class PairTraffic:
    """``threads`` engine loops on one pair: publish on the prefill engine, fetch on the decode
    engine, verify every byte of a done, close both (blocks reused only after a close that
    answered True). A failed fetch's publish is cancelled at once, and a handle whose close
    does not answer True at once (a write in doubt) is handed to a closer thread that asks
    again until it does, so a loop starts its next fetch as soon as the last one ended: a
    cut link is tried all the time, not once per publish TTL or close timeout. Every call
    and wait is bounded."""

    def __init__(
        self, name: str, tx: Engine, rx: Engine, endpoint: str, *, threads: int, seed: int
    ) -> None:
        self.name, self.tx, self.rx, self.endpoint = name, tx, rx, endpoint
        self.seed = seed
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.fetches: list[Fetch] = []
        self.errors: list[str] = []
        self._ids = count()
        self._sizes = np.random.default_rng(seed).integers(MIN_BLOCKS, MAX_BLOCKS + 1, 1 << 12)
        self._threads = [
            threading.Thread(target=self._run, name=f"hosts-{name}-{k}", daemon=True)
            for k in range(threads)
        ]
        self._threads.append(
            threading.Thread(target=self._closer, name=f"hosts-{name}-closer", daemon=True)
        )
        # (engine, handle, blocks) whose close has not answered True yet; guarded by lock
        self._unclosed: list[tuple[Engine, int, np.ndarray]] = []

    def start(self) -> PairTraffic:
        for th in self._threads:
            th.start()
        return self

    def finish(self, bound_s: float) -> list[str]:
        """Stop starting requests; wait (bounded) for the loops; names of those still running."""
        self.stop.set()
        by = time.monotonic() + bound_s
        for th in self._threads:
            th.join(max(0.0, by - time.monotonic()))
        return [th.name for th in self._threads if th.is_alive()]

    def snapshot(self) -> list[Fetch]:
        with self.lock:
            return list(self.fetches)

    def _note(self, what: str) -> None:
        with self.lock:
            if len(self.errors) < 100:
                self.errors.append(what)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self._one()
            except Exception as e:  # a loop never dies silently: the test sees it
                self._note(f"loop raised {type(e).__name__}: {e}")
                self.stop.wait(0.2)

    def _one(self) -> None:
        tx, rx = self.tx, self.rx
        with self.lock:
            i = next(self._ids)
        rid = f"{self.name}-{i}"
        n = int(self._sizes[i % self._sizes.size])
        horizon = time.monotonic() + FETCH_BOUND_S
        src = tx.take(n, self.stop, horizon)
        if src is None:
            return
        layers, _, block_bytes = tx.kv.shape
        want = expected_bytes(i, n, layers, block_bytes, self.seed)
        tx.kv[:, torch.from_numpy(src)] = want
        try:
            ph = tx.client.publish(rid, src, aux=aux_bytes(i))
        except EngineError as e:  # it may have been executed: the blocks are not reused
            self._note(f"publish {rid}: {e}")
            tx.give_back(src, safe=False)
            self.stop.wait(0.2)
            return
        ok = False
        dst = rx.take(n, self.stop, horizon)
        if dst is not None:
            ok = self._fetch(rid, i, dst, want)
        if not ok:
            try:
                tx.client.cancel(ph)
            except EngineError:
                pass
        self._close(tx, ph, src)

    def _close(self, eng: Engine, handle: int, blocks: np.ndarray) -> None:
        """Close now if that answers True at once, else leave it to the closer thread."""
        try:
            if eng.client.close(handle, timeout=CLOSE_TRY_S):
                eng.give_back(blocks, safe=True)
                return
        except EngineError as e:
            self._note(f"close {eng.daemon.name}: {e}")
            eng.give_back(blocks, safe=False)
            return
        with self.lock:
            self._unclosed.append((eng, handle, blocks))

    def _closer(self) -> None:
        """Ask again for every unclosed handle until it closes; at stop, one last round."""
        last = False
        while not last:
            last = self.stop.wait(0.25)
            with self.lock:
                pending, self._unclosed = self._unclosed, []
            for eng, handle, blocks in pending:
                try:
                    done = eng.client.close(handle, timeout=CLOSE_TRY_S)
                except EngineError:
                    eng.give_back(blocks, safe=False)
                    continue
                if done:
                    eng.give_back(blocks, safe=True)
                elif last:
                    eng.give_back(blocks, safe=False)  # withheld: never reused
                else:
                    with self.lock:
                        self._unclosed.append((eng, handle, blocks))

    def _fetch(self, rid: str, i: int, dst: np.ndarray, want: torch.Tensor) -> bool:
        rx = self.rx
        f = Fetch(rid, time.monotonic())
        with self.lock:
            self.fetches.append(f)
        try:
            fh = rx.client.fetch(rid, self.endpoint, dst)
        except EngineError as e:
            f.ended, f.state, f.reason = time.monotonic(), "refused", str(e.reason)
            rx.give_back(dst, safe=False)
            return False
        out = None
        by = f.started + FETCH_BOUND_S
        while out is None and time.monotonic() < by:
            try:
                out = rx.client.wait(fh, min(WAIT_SLICE_S, max(0.0, by - time.monotonic())))
            except EngineError as e:
                if e.reason is not EngineReason.TIMEOUT:
                    f.reason = f"wait raised {e.reason}"
                    break
        if out is not None:
            f.ended, f.state, f.reason, f.ok = (
                time.monotonic(),
                out.state,
                str(out.reason or ""),
                out.ok,
            )
            if out.ok:
                got = rx.kv[:, torch.from_numpy(dst)]
                f.wrong = not torch.equal(got, want) or out.aux != aux_bytes(i)
                f.verified = 0 if f.wrong else int(want.numel()) + len(aux_bytes(i))
        self._close(rx, fh, dst)
        return f.ok and not f.wrong
