"""The fault scenarios: one fresh cluster each, a baseline, the fault, its end, the figures.

Timeline of every scenario (seconds from :class:`Timing`)::

    start daemons -> traffic -> baseline (base_s) -> FAULT -> hold_s -> resolve
        -> recover_s -> stop traffic (bounded) -> leak check -> SIGTERM all -> shm check

A scenario passes when: no wrong ``done``, nothing lost, no engine thread hung,
every affected session terminal within :data:`~kvxferd.faults.harness.TERMINAL_BOUND_S`,
no session left open in a live daemon, every daemon the suite did not kill exits 0
within its bound, no shared-memory segment left behind (a SIGKILLed daemon's own
segment excepted, and removed), thread and fd growth within :data:`THREAD_SLACK` /
:data:`FD_SLACK`, and, where peer isolation is measured, B's p99 while A is cut off
within 2x its baseline (``max(p99, ISOLATION_FLOOR_S)``) and none of B's fetches failed.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvxferd.demo import demo_keys
from kvxferd.engine.client import Client, attach_pool
from kvxferd.faults.harness import (
    CALL_TIMEOUT_S,
    EXIT_BOUND_S,
    READY_TIMEOUT_S,
    TERMINAL_BOUND_S,
    Daemon,
    Engine,
    FaultError,
    Traffic,
    fault_env,
    p99,
)
from kvxferd.transfer.pool import IdAllocator

THREAD_SLACK = 8  # threads a daemon may have gained over the run (UCX/ZMQ helpers come and go)
FD_SLACK = 64  # open fds likewise (a connection per peer and transport)
ISOLATION_FACTOR = 2.0
ISOLATION_FLOOR_S = 0.05  # below this a p99 is scheduling noise on a shared machine


@dataclass(frozen=True)
class Timing:
    base_s: float = 8.0
    hold_s: float = 8.0
    recover_s: float = 4.0
    soak_s: float = 45.0
    inflight: int = 4

    @classmethod
    def quick(cls) -> Timing:
        return cls(base_s=3.0, hold_s=4.0, recover_s=2.0, soak_s=10.0, inflight=2)


@dataclass
class Result:
    """The figures of one scenario, as docs/reliability.md shows them."""

    name: str
    fault: str
    skipped: str = ""
    affected: int = 0
    terminal_s: float = 0.0  # until every affected session was terminal
    bound_s: float = TERMINAL_BOUND_S
    sessions: int = 0
    done: int = 0
    verified_bytes: int = 0
    wrong_done: int = 0
    lost: int = 0
    died_with_daemon: int = 0
    hung: int = 0
    open_sessions: int = 0  # non-terminal sessions left in live daemons' /metrics
    exit_codes: dict[str, int] = field(default_factory=dict)
    shm_left: int = 0
    thread_growth: int = 0
    fd_growth: int = 0
    blocks_withheld: int = 0  # engine blocks never reused (close did not answer True)
    base_p99_ms: float = float("nan")
    fault_p99_ms: float = float("nan")
    fault_max_ms: float = float("nan")  # B's slowest fetch started while A was cut off
    b_failed: int = -1  # B's fetches that failed while A was cut off (-1: not measured)
    extra: dict[str, Any] = field(default_factory=dict)
    broken: list[str] = field(default_factory=list)  # bounds broken, in words
    pids: list[int] = field(default_factory=list)  # every daemon process the scenario started
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.broken and not self.skipped


def free_port() -> int:
    """A free loopback port below the ephemeral range, so that inside a fresh namespace no
    socket a daemon opens first (UCX listens on ephemeral ports) can already hold it."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(20_000, 30_000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise FaultError("no free port in 20000-29999")


# -- network namespaces --------------------------------------------------------------------


class Netns:
    """Namespaces tx, a, b; veth pairs tx<->a (10.77.1.0/24) and tx<->b (10.77.2.0/24).

    ``cut()`` partitions a from tx: nftables drop rules in both namespaces when ``nft``
    exists, else both ends of the veth pair set down (no packet crosses, no connection
    is reset). Nothing leaves the namespaces this object creates.
    """

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns = {k: f"kvxf{tag}{k}" for k in ("tx", "a", "b")}
        self.links = {"a": (f"kx{tag}ta", f"kx{tag}a"), "b": (f"kx{tag}tb", f"kx{tag}b")}
        self.addr = {"a": ("10.77.1.1", "10.77.1.2"), "b": ("10.77.2.1", "10.77.2.2")}
        self.method = "nftables" if shutil.which("nft") else "veth link down"
        self.created: list[str] = []

    @staticmethod
    def probe() -> str | None:
        """Why the partition cannot run here, or None."""
        if os.geteuid() != 0:
            return "needs root (network namespaces)"
        if not shutil.which("ip"):
            return "needs the ip tool (iproute2)"
        name = f"kvxfprobe{os.getpid() % 100000}"
        r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
        if r.returncode != 0:
            return f"ip netns add failed: {r.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        return None

    def _ip(self, *args: str, ns: str | None = None) -> None:
        cmd = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        if r.returncode != 0:
            raise FaultError(f"{' '.join(cmd)}: {r.stderr.strip()}")

    def up(self) -> None:
        for ns in self.ns.values():
            self._ip("netns", "add", ns)
            self.created.append(ns)
            self._ip("ip", "link", "set", "lo", "up", ns=ns)
        for peer in ("a", "b"):
            t, p = self.links[peer]
            ta, pa = self.addr[peer]
            self._ip("link", "add", t, "netns", self.ns["tx"], "type", "veth", "peer", "name", p,
                     "netns", self.ns[peer])  # fmt: skip
            self._ip("ip", "addr", "add", f"{ta}/24", "dev", t, ns=self.ns["tx"])
            self._ip("ip", "addr", "add", f"{pa}/24", "dev", p, ns=self.ns[peer])
            self._ip("ip", "link", "set", t, "up", ns=self.ns["tx"])
            self._ip("ip", "link", "set", p, "up", ns=self.ns[peer])

    def cut(self, peer: str) -> None:
        t, p = self.links[peer]
        if self.method == "nftables":
            # Only the peer's link: in tx's namespace the other receiver's traffic must pass.
            subnet = self.addr[peer][0].rsplit(".", 1)[0] + ".0/24"
            for ns in (self.ns["tx"], self.ns[peer]):
                self._ip("nft", "add", "table", "inet", "kvxf", ns=ns)
                for hook, field in (("input", "saddr"), ("output", "daddr")):
                    self._ip("nft", "add", "chain", "inet", "kvxf", hook,
                             f"{{ type filter hook {hook} priority 0 ; policy accept ; }}", ns=ns)  # fmt: skip
                    self._ip("nft", "add", "rule", "inet", "kvxf", hook, "ip", field,
                             subnet, "drop", ns=ns)  # fmt: skip
        else:
            self._ip("ip", "link", "set", t, "down", ns=self.ns["tx"])
            self._ip("ip", "link", "set", p, "down", ns=self.ns[peer])

    def heal(self, peer: str) -> None:
        t, p = self.links[peer]
        if self.method == "nftables":
            for ns in (self.ns["tx"], self.ns[peer]):
                self._ip("nft", "delete", "table", "inet", "kvxf", ns=ns)
        else:
            self._ip("ip", "link", "set", t, "up", ns=self.ns["tx"])
            self._ip("ip", "link", "set", p, "up", ns=self.ns[peer])

    def down(self) -> None:
        for ns in self.created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self.created.clear()


# -- a cluster ------------------------------------------------------------------------------


class Cluster:
    """One sender daemon and two receiver daemons (A, B) with their engines."""

    def __init__(self, name: str, ucx_tls: str | None, netns: Netns | None = None) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=f"kvxf-{name}-"))
        os.chmod(self.workdir, 0o755)
        self.netns = netns
        self.ucx_tls = ucx_tls
        self.port = free_port()
        self.daemons: list[Daemon] = []
        self.engines: list[Engine] = []
        self.clients: list[Client] = []
        self.children: list[subprocess.Popen[bytes]] = []
        self.shm_killed: set[str] = set()
        self.shm_names: list[str] = []  # every segment a daemon of this cluster created

    def _daemon(
        self,
        role: str,
        name: str,
        args: list[str],
        ns: str | None,
        extra: dict[str, str] | None = None,
    ) -> Daemon:
        env = fault_env(self.workdir, name, self.ucx_tls, extra or {})
        d = Daemon(role, name, self.workdir, args, env, ns)
        self.daemons.append(d)
        return d

    def start(self) -> tuple[Daemon, Daemon, Daemon]:
        n = self.netns
        listen = f"tcp://{'0.0.0.0' if n else '127.0.0.1'}:{self.port}"
        # Bound on both links' addresses; it advertises the first (receivers here are told
        # the address of their own link by the scenario, not by the sender).
        adv = {"KVXFERD_SERVICE__ADVERTISE_HOST": n.addr["a"][0]} if n else {}
        # Across namespaces the endpoints are not loopback: CURVE, a key pair per daemon,
        # and receivers may dial the links' networks (security off is loopback only).
        keys = demo_keys(self.workdir / "keys", "tx", ["rx-a", "rx-b"]) if n else {}
        dial = {"KVXFERD_ACCESS__DIAL_ALLOW": '["10.77.0.0/16"]'} if n else {}
        tx = self._daemon(
            "sender", "tx", ["--listen", listen], n.ns["tx"] if n else None,
            {**adv, **keys.get("tx", {})},
        )  # fmt: skip
        rxs = []
        for k in ("a", "b"):
            args = ["--result-endpoint", f"tcp://{n.addr[k][1]}:0"] if n else []
            extra = {**keys.get(f"rx-{k}", {}), **dial}
            rxs.append(self._daemon("receiver", f"rx-{k}", args, n.ns[k] if n else None, extra))
        by = time.monotonic() + READY_TIMEOUT_S
        for d in self.daemons:
            d.wait_ready(by)
        return tx, rxs[0], rxs[1]

    def endpoint_for(self, peer: str) -> str:
        host = self.netns.addr[peer][0] if self.netns else "127.0.0.1"
        return f"tcp://{host}:{self.port}"

    def engine(self, d: Daemon, seed: int) -> Engine:
        client = Client(d.ready["engine_socket"], timeout_s=CALL_TIMEOUT_S)
        self.clients.append(client)
        info = client.describe()
        d.shm_name = info.shm_name
        self.shm_names.append(info.shm_name)
        kv = attach_pool(info)
        eng = Engine(d, client, kv, IdAllocator(kv.shape[1], shuffle_seed=seed))
        self.engines.append(eng)
        return eng

    def close(self) -> None:
        """Every child killed, every client closed, pools unmapped, the workdir removed."""
        for p in self.children:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for c in self.clients:
            c.close_client()
        for d in self.daemons:
            d.kill()
        for e in self.engines:
            try:
                e.kv.kvxferd_mapping.close()  # type: ignore[attr-defined]
            except Exception:  # an engine thread may still hold it: the exit unmaps
                pass
        for name in self.shm_killed:  # a SIGKILLed daemon could not unlink its segment
            try:
                os.unlink(f"/dev/shm/{name}")
            except OSError:
                pass
        shutil.rmtree(self.workdir, ignore_errors=True)


# -- measuring -----------------------------------------------------------------------------


LIVE_STATES = ("published", "transferring", "requested")


def _open_sessions(m: dict[str, float]) -> dict[str, int]:
    """Sessions in a non-terminal state, by state, from a daemon's /metrics."""
    out: dict[str, int] = {}
    for k, v in m.items():
        if k.startswith("kvxferd_sessions{") and v:
            state = next((s for s in LIVE_STATES if f'"{s}"' in k), None)
            if state is not None:
                out[state] = out.get(state, 0) + int(v)
    return out


@dataclass
class Run:
    """What a scenario's fault function gets: the cluster and its traffic."""

    cluster: Cluster
    tx: Daemon
    a: Daemon
    b: Daemon
    traffic: Traffic
    timing: Timing
    result: Result
    seed: int


Step = Callable[[Run], None]


def run_scenario(
    name: str,
    fault_text: str,
    *,
    timing: Timing,
    seed: int,
    fault: Step | None,
    resolve: Step | None = None,
    isolation: bool = False,
    ucx_tls: str | None = "tcp",
    netns: Netns | None = None,
    after: Step | None = None,
    hold_s: float | None = None,
    recover_s: float | None = None,
) -> Result:
    res = Result(name, fault_text)
    t_begin = time.monotonic()
    cluster = Cluster(name, ucx_tls, netns)
    traffic: Traffic | None = None
    try:
        tx, a, b = cluster.start()
        eng_tx = cluster.engine(tx, seed)
        rx_engines = [cluster.engine(a, seed + 1), cluster.engine(b, seed + 2)]
        endpoints = [cluster.endpoint_for("a"), cluster.endpoint_for("b")]
        traffic = Traffic(
            eng_tx, rx_engines, endpoints, inflight=timing.inflight, seed=seed, prefix=name
        ).start()
        run = Run(cluster, tx, a, b, traffic, timing, res, seed)
        traffic.stop.wait(timing.base_s)
        base = {d.name: d.resources() for d in cluster.daemons}
        t_fault = time.monotonic()
        if fault is not None:
            fault(run)
        traffic.stop.wait(timing.hold_s if hold_s is None else hold_s)
        t_resolve = time.monotonic()
        if resolve is not None:
            resolve(run)
        traffic.stop.wait(timing.recover_s if recover_s is None else recover_s)
        stuck = traffic.finish(TERMINAL_BOUND_S + 4 * CALL_TIMEOUT_S)
        res.hung = len(stuck)
        if after is not None:
            after(run)

        # sessions and bytes
        with traffic.lock:
            sessions = list(traffic.sessions)
        killed = {d.name for d in cluster.daemons if d.killed}
        res.sessions = len(sessions)
        res.done = sum(1 for s in sessions if s.kind == "fetch" and s.ok)
        res.verified_bytes = sum(s.verified for s in sessions)
        res.wrong_done = sum(1 for s in sessions if s.wrong)
        wrong = [e for e in traffic.call_errors if "WRONG" in e]
        if wrong:
            res.extra["wrong"] = "; ".join(wrong[:3])
        gone = [s for s in sessions if s.ended is None and (s.died or s.daemon in killed)]
        lost = [s for s in sessions if s.ended is None and not (s.died or s.daemon in killed)]
        res.died_with_daemon, res.lost = len(gone), len(lost)
        if lost:
            res.extra["lost"] = "; ".join(
                f"{s.kind} {s.request} on {s.daemon} ({s.unanswered or 'no outcome'})"
                for s in lost[:4]
            )
        affected = [
            s
            for s in sessions
            if s.daemon not in killed
            and not s.died
            and s.started <= t_resolve
            and (s.ended is None or s.ended >= t_fault)
        ]
        res.affected = len(affected) if fault is not None else 0
        worst = 0.0
        for s in affected if fault is not None else []:
            if s.ended is None:
                worst = math.inf
                continue
            frm = max(t_fault, s.started)
            worst = max(worst, s.ended - frm)
        res.terminal_s = worst
        res.blocks_withheld = sum(e.withheld for e in cluster.engines)

        # isolation: B's fetches that started while A was cut off, against B's baseline
        if isolation:
            # B's fetches, failed ones included (their latency is how long B waited for the
            # failure; one never answered counts as infinitely slow).
            fb = [x for x in sessions if x.kind == "fetch" and x.daemon == b.name]
            first = min((x.ended for x in fb if x.ended is not None), default=t_fault)
            # Baseline: the second half of it, from B's first second of answers on (connections
            # up), fetches that also ENDED before the fault (else the fault slows the baseline).
            lo = max(t_fault - timing.base_s / 2, first + 1.0)
            base_lat = [
                x.ended - x.started
                for x in fb
                if x.ended is not None and lo <= x.started and x.ended < t_fault
            ]
            during = [
                (x.ended - x.started) if x.ended is not None else math.inf
                for x in fb
                if t_fault <= x.started < t_resolve
            ]
            res.base_p99_ms = p99(base_lat) * 1000
            res.fault_p99_ms = p99(during) * 1000
            res.fault_max_ms = max(during) * 1000 if during else float("nan")
            b_failed = [x for x in fb if t_fault <= x.started < t_resolve and not x.ok]
            res.b_failed = len(b_failed)
            if b_failed:
                res.extra["B failed"] = ", ".join(
                    sorted({f"{x.state or x.unanswered} {x.reason}".strip() for x in b_failed})
                )
            res.extra["b_fetches"] = f"{len(base_lat)} baseline / {len(during)} during the fault"

        # leaks in the daemons that are still alive
        for d in cluster.daemons:
            if not d.alive():
                continue
            if d.stopped:
                d.signal(signal.SIGCONT)
            m = d.metrics()
            if not m:
                res.broken.append(f"{d.name}: /metrics not readable")
            for state, n in _open_sessions(m).items():
                res.open_sessions += n
                res.extra[f"open in {d.name}"] = f"{n} {state}"
            th, fd = d.resources()
            th0, fd0 = base.get(d.name, (th, fd))
            if th0 >= 0 and th >= 0:
                res.thread_growth = max(res.thread_growth, th - th0)
                res.fd_growth = max(res.fd_growth, fd - fd0)
        for c in cluster.clients:
            c.close_client()
        for d in cluster.daemons:
            if d.killed:
                res.exit_codes[d.name] = -9
                cluster.shm_killed.add(d.shm_name)
            elif d.exit_code is not None:
                res.exit_codes[d.name] = d.exit_code
            else:
                res.exit_codes[d.name] = d.terminate_and_wait(EXIT_BOUND_S + 1.0)
        left = [x for x in cluster.shm_names if x not in cluster.shm_killed]
        left = [x for x in left if os.path.exists(f"/dev/shm/{x}")]
        res.shm_left = len(left)
        if left:
            res.extra["shm left"] = ", ".join(left)
            cluster.shm_killed.update(left)  # removed by close(): do not fill /dev/shm
    except Exception as e:  # the scenario cannot go on: say why, clean up, run the next one
        why = str(e) if isinstance(e, FaultError) else f"{type(e).__name__}: {e}"
        res.broken.append(f"suite error: {why}")
    finally:
        if traffic is not None:
            traffic.finish(1.0)
        cluster.close()
        res.pids = [pid for d in cluster.daemons for pid in d.pids]
        if netns is not None:
            netns.down()
    _judge(res, killed_ok={d.name for d in cluster.daemons if d.killed})
    res.seconds = time.monotonic() - t_begin
    return res


def _judge(res: Result, killed_ok: set[str]) -> None:
    b = res.broken
    if res.wrong_done:
        b.append(f"{res.wrong_done} wrong done")
    if res.lost:
        b.append(f"{res.lost} lost")
    if res.hung:
        b.append(f"{res.hung} engine threads hung")
    if res.terminal_s > res.bound_s:
        b.append(f"terminal after {res.terminal_s:.1f} s > {res.bound_s:.0f} s")
    if res.open_sessions:
        b.append(f"{res.open_sessions} sessions left open")
    bad_exit = {k: v for k, v in res.exit_codes.items() if v != 0 and k not in killed_ok}
    if bad_exit:
        b.append(f"exit codes {bad_exit}")
    if res.shm_left:
        b.append(f"{res.shm_left} shm segments left")
    if res.thread_growth > THREAD_SLACK:
        b.append(f"+{res.thread_growth} threads")
    if res.fd_growth > FD_SLACK:
        b.append(f"+{res.fd_growth} fds")
    if res.b_failed > 0:
        b.append(f"{res.b_failed} of B's fetches failed while A was cut off")
    if res.b_failed >= 0 and not math.isnan(res.fault_p99_ms):
        limit = ISOLATION_FACTOR * max(res.base_p99_ms, ISOLATION_FLOOR_S * 1000)
        if res.fault_p99_ms > limit:
            b.append(f"B p99 {res.fault_p99_ms:.0f} ms > {limit:.0f} ms (2x baseline)")


# -- the scenarios -------------------------------------------------------------------------


def _kill_receiver(r: Run) -> None:
    r.traffic.paused[0].set()  # A's engine is gone with it
    r.a.signal(signal.SIGKILL)


def _kill_sender(r: Run) -> None:
    r.tx.signal(signal.SIGKILL)
    # Its open publishes died with it; the restarted daemon (same name) owes them nothing.
    with r.traffic.lock:
        for s in r.traffic.sessions:
            if s.daemon == r.tx.name and s.ended is None:
                s.died = True


def _restart_sender(r: Run) -> None:
    # The old client would reconnect to the new daemon at the same socket path, and
    # publish blocks of the dead daemon's pool by id into the new one: close it first.
    r.traffic.tx.client.close_client()
    r.cluster.shm_killed.add(r.tx.shm_name)
    r.tx.restart()
    r.tx.wait_ready(time.monotonic() + READY_TIMEOUT_S)
    r.traffic.tx = r.cluster.engine(r.tx, r.seed + 7)
    r.result.extra["restarted_at"] = time.monotonic()


def _after_restart(r: Run) -> None:
    t = r.result.extra.pop("restarted_at", None)
    if t is None:
        return
    with r.traffic.lock:
        n = sum(1 for s in r.traffic.sessions if s.kind == "fetch" and s.ok and s.started >= t)
    r.result.extra["done after restart"] = n
    if n == 0:
        r.result.broken.append("no fetch done after the sender restarted")


def _stop(which: str) -> Step:
    return lambda r: getattr(r, which).signal(signal.SIGSTOP)


def _cont(which: str) -> Step:
    return lambda r: getattr(r, which).signal(signal.SIGCONT)


def _sigterm_sender(r: Run) -> None:
    t0 = time.monotonic()
    code = r.tx.terminate_and_wait(EXIT_BOUND_S + 1.0)
    r.result.extra["sender exit under load"] = f"{code} after {time.monotonic() - t0:.1f} s"
    if time.monotonic() - t0 > EXIT_BOUND_S:
        r.result.broken.append("sender exit past its bound")


def _nonreader(r: Run) -> None:
    """Publish requests for a peer that never reads, start it, and let it fetch them."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(64)
    r.result.extra["_blackhole"] = lsock
    tx = r.traffic.tx
    count = 64
    blocks = tx.alloc.take(4 * count)
    handles = [tx.client.publish(f"nr-{i}", blocks[4 * i : 4 * i + 4]) for i in range(count)]
    # They must end within the bound of every session, counted from now.
    r.result.extra["_nr"] = (handles, blocks, time.monotonic() + TERMINAL_BOUND_S)
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvxferd.faults.nonreader",
            r.cluster.endpoint_for("a"),
            f"tcp://127.0.0.1:{lsock.getsockname()[1]}",
            "nr",
            str(count),
            "120",
            r.cluster.ucx_tls or "-",
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=fault_env(r.cluster.workdir, "nonreader", r.cluster.ucx_tls, {}),
        start_new_session=True,
    )
    r.cluster.children.append(p)


def _nonreader_end(r: Run) -> None:
    for p in r.cluster.children:
        p.kill()
        p.wait(timeout=10)
    lsock = r.result.extra.pop("_blackhole", None)
    if lsock is not None:
        lsock.close()


def _nonreader_after(r: Run) -> None:
    """The sender's sessions for the peer that never read must still end."""
    handles, blocks, bound_at = r.result.extra.pop("_nr", ([], np.zeros(0), 0.0))
    tx = r.traffic.tx
    unended = 0
    for h in handles:
        try:  # --quick gets here before the bound: wait out what is left of it
            out = tx.client.wait(h, max(0.05, bound_at - time.monotonic()))
            if out is None:
                unended += 1
            tx.client.close(h, timeout=CALL_TIMEOUT_S)
        except Exception:
            unended += 1
    r.result.extra["non-reader publishes not ended"] = unended
    if unended:
        r.result.broken.append(f"{unended} publishes for the non-reading peer never ended")


def _partition_cut(r: Run) -> None:
    assert r.cluster.netns is not None
    r.cluster.netns.cut("a")


def _partition_heal(r: Run) -> None:
    assert r.cluster.netns is not None
    r.cluster.netns.heal("a")


NAMES = (
    "kill-receiver",
    "kill-sender",
    "stop-receiver",
    "stop-sender",
    "non-reading-peer",
    "partition",
    "sigterm-under-load",
    "soak",
)


def run_one(name: str, timing: Timing, seed: int, ucx_tls: str | None) -> Result:
    common: dict[str, Any] = dict(timing=timing, seed=seed, ucx_tls=ucx_tls)
    if name == "kill-receiver":
        return run_scenario(name, "SIGKILL receiver A mid-transfer (B goes on)",
                            fault=_kill_receiver, isolation=True, **common)  # fmt: skip
    if name == "kill-sender":
        return run_scenario(name, "SIGKILL the sender mid-transfer, restart it on the same port",
                            fault=_kill_sender, resolve=_restart_sender, after=_after_restart,
                            recover_s=TERMINAL_BOUND_S + timing.recover_s, **common)  # fmt: skip
    if name == "stop-receiver":
        return run_scenario(name, "SIGSTOP receiver A mid-transfer, SIGCONT after the hold",
                            fault=_stop("a"), resolve=_cont("a"), isolation=True, **common)  # fmt: skip
    if name == "stop-sender":
        return run_scenario(name, "SIGSTOP the sender mid-transfer, SIGCONT after the hold",
                            fault=_stop("tx"), resolve=_cont("tx"), **common)  # fmt: skip
    if name == "non-reading-peer":
        return run_scenario(name, "a receiver whose Results go to a port that never reads",
                            fault=_nonreader, resolve=_nonreader_end, after=_nonreader_after,
                            isolation=True, **common)  # fmt: skip
    if name == "partition":
        why = Netns.probe()
        if why is not None:
            return Result(name, "partition receiver A from the sender", skipped=why)
        ns = Netns()
        try:
            ns.up()
        except (FaultError, subprocess.SubprocessError) as e:
            ns.down()
            return Result(name, "partition receiver A from the sender", skipped=str(e))
        return run_scenario(name, f"partition receiver A from the sender ({ns.method})",
                            fault=_partition_cut, resolve=_partition_heal, isolation=True,
                            netns=ns, **common)  # fmt: skip
    if name == "sigterm-under-load":
        return run_scenario(name, "SIGTERM the sender under load", fault=_sigterm_sender,
                            hold_s=1.0, **common)  # fmt: skip
    if name == "soak":
        return run_scenario(name, f"no fault: {timing.soak_s:g} s of traffic", fault=None,
                            hold_s=timing.soak_s, **common)  # fmt: skip
    raise ValueError(f"unknown scenario {name!r}; known: {', '.join(NAMES)}")
