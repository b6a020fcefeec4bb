"""Real daemons for the fault suite: start them (on loopback or inside network namespaces),
drive them through :mod:`kvxferd.engine.client` as engines do, record every session, kill them all.

A :class:`Cluster` is one sender daemon and R receiver daemons
(``python -m kvxferd sender|receiver`` started by :mod:`kvxferd.launch`; ``ip netns exec
NS ...`` for the partition), with the fault suite's small pool and short deadlines. :class:`Traffic` plays the
engines: per receiver, ``inflight`` threads each publish a request on the sender
(its content written into the sender's pool), fetch it on the receiver, verify
every byte of a ``done`` (and the aux payload), close both handles and reuse
blocks only after a close that answered True. Every call, wait and loop is bounded
in time; every session (publish or fetch) becomes a :class:`Session` record whether
it ended, raised or was never answered. ``Cluster.close`` kills every child it
started, whatever happened.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvxferd.demo import aux_bytes, expected_bytes
from kvxferd.engine.client import Client, EngineError, EngineUnavailable
from kvxferd.engine.engine_protocol import EngineReason
from kvxferd.launch import Daemon as LaunchedDaemon
from kvxferd.launch import LaunchError
from kvxferd.transfer.pool import IdAllocator

FAULT_POOL: dict[str, Any] = dict(
    num_layers=4, num_blocks=1024, block_elems=4096, dtype="float16", aux_slots=256
)
# Short deadlines, so every bound below is a few seconds.
FAULT_DEADLINES: dict[str, int] = dict(
    kv_transfer_timeout_ms=5_000,
    publish_ttl_ms=10_000,
    pending_fetch_ttl_ms=5_000,
    register_timeout_ms=2_000,
    cancel_fence_ms=2_000,
    xfer_stall_timeout_ms=3_000,
    drain_timeout_ms=2_000,
    shutdown_timeout_ms=5_000,
)
CALL_TIMEOUT_S = 2.0  # one engine call to a local daemon
READY_TIMEOUT_S = 60.0
EXIT_BOUND_S = FAULT_DEADLINES["shutdown_timeout_ms"] / 1000 + 1.0  # the daemon's own bound
# A session of a live daemon must end within this long of the fault (or of its start):
# the longest deadline that can end it (publish TTL) plus two engine calls of slack.
TERMINAL_BOUND_S = FAULT_DEADLINES["publish_ttl_ms"] / 1000 + 2 * CALL_TIMEOUT_S
WAIT_SLICE_S = 0.25
MIN_BLOCKS, MAX_BLOCKS = 4, 24


class FaultError(Exception):
    """The suite itself cannot go on (a daemon did not start, a tool is missing)."""


@dataclass
class Session:
    """One publish (on the sender) or fetch (on a receiver), as the engine saw it."""

    kind: str  # "publish" | "fetch"
    daemon: str
    request: str
    started: float
    ended: float | None = None  # when an outcome arrived (None: never)
    state: str = ""
    reason: str = ""
    ok: bool = False
    verified: int = 0  # bytes compared equal (done fetches)
    wrong: bool = False  # a done whose bytes or aux differ
    unanswered: str = ""  # why no outcome: the engine call raised
    safe_close: bool | None = None
    died: bool = False  # its daemon was SIGKILLed (and maybe restarted since): no outcome owed


class Daemon:
    """One named daemon across its incarnations, each a :class:`kvxferd.launch.Daemon`;
    stdout/stderr to files (appended to: a restart keeps the old stderr); signals go to its pid."""

    def __init__(
        self,
        role: str,
        name: str,
        workdir: Path,
        args: Iterable[str] = (),
        env: dict[str, str] | None = None,
        netns: str | None = None,
    ) -> None:
        self.role, self.name, self.netns = role, name, netns
        self.args = list(args)
        self.env = env or {}
        self.workdir = workdir
        self.stdout_path = workdir / f"{name}.out"
        self.stderr_path = workdir / f"{name}.err"
        self.ready: dict[str, Any] = {}
        self.killed = False  # SIGKILLed by the suite: its sessions died with it
        self.stopped = False  # SIGSTOPped now
        self.exit_code: int | None = None
        self.shm_name = ""
        self.pids: list[int] = []  # every incarnation's pid
        self.child = self._spawn()

    def _spawn(self) -> LaunchedDaemon:
        # ip netns exec execs the command: the pid stays the daemon's
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        child = LaunchedDaemon(
            self.role, self.name, self.workdir, self.args, env=self.env, prefix=prefix, append=True
        )
        self.pids.append(child.pid)
        return child

    def restart(self) -> None:
        """A new incarnation with the same arguments (the old one must be gone)."""
        self.stdout_path.write_bytes(b"")
        self.ready, self.killed, self.stopped, self.exit_code = {}, False, False, None
        self.child = self._spawn()

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.child.proc

    @property
    def pid(self) -> int:
        return self.child.pid

    def alive(self) -> bool:
        return self.child.alive()

    def wait_ready(self, deadline: float) -> dict[str, Any]:
        try:
            self.ready = self.child.wait_ready(deadline)
        except LaunchError as e:
            raise FaultError(str(e)) from None
        return self.ready

    def tail(self, lines: int = 8) -> str:
        return self.child.tail(lines)

    def signal(self, sig: int) -> None:
        self.child.signal(sig)
        if sig == signal.SIGKILL:
            self.killed = True
            self.proc.wait(timeout=10)
        elif sig == signal.SIGSTOP:
            self.stopped = True
        elif sig == signal.SIGCONT:
            self.stopped = False

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{series: value}``; empty when unreadable."""
        url = f"http://127.0.0.1:{self.ready.get('probe_port', 0)}/metrics"
        try:
            if self.netns:  # the probe port lives in the daemon's namespace
                code = "import sys,urllib.request as u;print(u.urlopen(sys.argv[1],timeout=3).read().decode())"
                text = subprocess.run(
                    ["ip", "netns", "exec", self.netns, sys.executable, "-c", code, url],
                    capture_output=True,
                    text=True,
                    timeout=10,
                    check=True,
                ).stdout
            else:
                with urllib.request.urlopen(url, timeout=3) as r:
                    text = r.read().decode()
        except (OSError, subprocess.SubprocessError):
            return {}
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                series, _, value = line.rpartition(" ")
                try:
                    out[series] = float(value)
                except ValueError:
                    continue
        return out

    def resources(self) -> tuple[int, int]:
        """(threads, open fds) of the daemon process now; (-1, -1) when it is gone."""
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
            threads = int(
                next(x for x in status.splitlines() if x.startswith("Threads:")).split()[1]
            )
            return threads, len(os.listdir(f"/proc/{self.pid}/fd"))
        except (OSError, StopIteration, ValueError):
            return -1, -1

    def terminate_and_wait(self, bound_s: float) -> int:
        """SIGTERM (SIGCONT first if stopped), the exit code within ``bound_s``; SIGKILL past it (-9)."""
        if self.stopped:
            self.signal(signal.SIGCONT)
        self.exit_code = self.child.stop(time.monotonic() + bound_s)
        return self.exit_code

    def kill(self) -> None:
        """SIGCONT, SIGKILL, reaped (bounded)."""
        self.child.close()


def fault_env(
    workdir: Path, name: str, ucx_tls: str | None, extra: dict[str, str]
) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "KVXFERD_POOL__SHM_NAME"):
        env.pop(key, None)
    for key, value in FAULT_POOL.items():
        env[f"KVXFERD_POOL__{key.upper()}"] = str(value)
    env["KVXFERD_POOL__DEVICE"] = "cpu"
    for key, value in FAULT_DEADLINES.items():
        env[f"KVXFERD_DEADLINES__{key.upper()}"] = str(value)
    env["KVXFERD_SERVICE__ENGINE_SOCKET"] = f"ipc://{workdir}/{name}.sock"
    env["KVXFERD_SERVICE__PROBE_HOST"] = "127.0.0.1"
    env["KVXFERD_SERVICE__PROBE_PORT"] = "0"
    if ucx_tls:
        env["KVXFERD_DATAPLANE__UCX_TLS"] = ucx_tls
    # Loopback and ipc only: plaintext is accepted there (a caller across hosts passes keys).
    env["KVXFERD_SECURITY__MODE"] = "off"
    env.update(extra)
    return env


@dataclass
class Engine:
    """The engine side of one daemon: its client, its mapped pool, its block allocator."""

    daemon: Daemon
    client: Client
    kv: torch.Tensor
    alloc: IdAllocator
    cond: threading.Condition = field(default_factory=threading.Condition)
    withheld: int = 0  # blocks never given back (their close did not answer True)

    def take(self, n: int, stop: threading.Event, deadline: float) -> np.ndarray | None:
        with self.cond:
            while self.alloc.free < n:
                if stop.is_set() or time.monotonic() > deadline:
                    return None
                self.cond.wait(WAIT_SLICE_S)
            return self.alloc.take(n)

    def give_back(self, blocks: np.ndarray, safe: bool) -> None:
        with self.cond:
            if safe:
                self.alloc.give_back(blocks.tolist())
                self.cond.notify_all()
            else:
                self.withheld += int(blocks.size)


class Traffic:
    """Engines publishing on the sender and fetching on each receiver, every done verified."""

    def __init__(
        self,
        tx: Engine,
        rxs: list[Engine],
        endpoints: list[str],
        *,
        inflight: int,
        seed: int,
        prefix: str,
    ) -> None:
        self.tx, self.rxs, self.endpoints = tx, rxs, endpoints
        self.inflight, self.seed, self.prefix = inflight, seed, prefix
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sessions: list[Session] = []
        self.call_errors: list[str] = []
        self._next = 0
        self._threads: list[threading.Thread] = []
        self._counts = np.random.default_rng(seed).integers(MIN_BLOCKS, MAX_BLOCKS + 1, 1 << 16)
        self.paused = [threading.Event() for _ in rxs]  # set: that receiver's engine holds off

    def start(self) -> Traffic:
        for k in range(len(self.rxs)):
            for t in range(self.inflight):
                th = threading.Thread(
                    target=self._run, args=(k,), name=f"faults-engine-{k}-{t}", daemon=True
                )
                self._threads.append(th)
                th.start()
        return self

    def finish(self, bound_s: float) -> list[str]:
        """Stop starting requests; wait (bounded) for the threads; names of those still running."""
        self.stop.set()
        by = time.monotonic() + bound_s
        for th in self._threads:
            th.join(max(0.0, by - time.monotonic()))
        return [th.name for th in self._threads if th.is_alive()]

    def _take_index(self) -> int:
        with self.lock:
            i, self._next = self._next, self._next + 1
            return i

    def _note(self, what: str) -> None:
        with self.lock:
            if len(self.call_errors) < 200:
                self.call_errors.append(what)

    def _add(self, s: Session) -> Session:
        with self.lock:
            self.sessions.append(s)
        return s

    def _wait(self, eng: Engine, handle: int, s: Session, deadline: float) -> Any:
        """The outcome, or None (``s.unanswered`` says why) by ``deadline``."""
        while time.monotonic() < deadline:
            try:
                out = eng.client.wait(
                    handle, min(WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))
                )
            except EngineError as e:
                s.unanswered = f"wait raised {e.reason}"
                if isinstance(e, EngineUnavailable) and not eng.daemon.alive():
                    return None
                if e.reason is not EngineReason.TIMEOUT:
                    return None
                continue  # a stopped daemon answers late: keep asking until the deadline
            if out is not None:
                s.unanswered = ""
                s.ended, s.state = time.monotonic(), out.state
                s.reason, s.ok = str(out.reason or ""), out.ok
                return out
        if not s.unanswered:
            s.unanswered = "no outcome before its deadline"
        return None

    def _close(self, eng: Engine, handle: int, s: Session) -> bool:
        try:
            safe = eng.client.close(handle, timeout=CALL_TIMEOUT_S)
        except EngineError as e:
            self._note(f"{s.daemon}: close {s.request}: {e}")
            safe = False
        s.safe_close = safe
        return safe

    def _run(self, k: int) -> None:
        while not self.stop.is_set():
            tx, rx = self.tx, self.rxs[k]  # the sender's engine changes when it restarts
            num_layers, _, block_bytes = tx.kv.shape
            if self.paused[k].is_set():
                self.stop.wait(WAIT_SLICE_S)
                continue
            i = self._take_index()
            rid = f"{self.prefix}-{i}"
            n = int(self._counts[i % self._counts.size])
            horizon = time.monotonic() + TERMINAL_BOUND_S
            src = tx.take(n, self.stop, horizon)
            if src is None:
                continue
            want = expected_bytes(i, n, num_layers, block_bytes, self.seed)
            tx.kv[:, torch.from_numpy(src)] = want
            pub = Session("publish", tx.daemon.name, rid, time.monotonic())
            try:
                ph = tx.client.publish(rid, src, aux=aux_bytes(i))
            except EngineError as e:
                # The call may still have been executed: these blocks are not reused.
                self._note(f"{tx.daemon.name}: publish {rid}: {e}")
                tx.give_back(src, safe=False)
                self.stop.wait(0.2)
                continue
            self._add(pub)
            dst = rx.take(n, self.stop, horizon)
            fh: int | None = None
            f = Session("fetch", rx.daemon.name, rid, time.monotonic())
            if dst is not None:
                try:
                    fh = rx.client.fetch(rid, self.endpoints[k], dst)
                except EngineError as e:
                    self._note(f"{rx.daemon.name}: fetch {rid}: {e}")
                    rx.give_back(dst, safe=False)
            if fh is not None and dst is not None:
                self._add(f)
                out = self._wait(rx, fh, f, f.started + TERMINAL_BOUND_S)
                if out is not None and out.ok:
                    got = rx.kv[:, torch.from_numpy(dst)]
                    bad = int((got != want).flatten(2).any(dim=2).any(dim=0).sum())
                    f.wrong = bad > 0 or out.aux != aux_bytes(i)
                    if f.wrong:
                        self._note(
                            f"{rx.daemon.name}: WRONG done {rid}: {bad}/{n} blocks differ, aux {'ok' if out.aux == aux_bytes(i) else 'differs'}"
                        )
                    if not f.wrong:
                        f.verified = int(want.numel()) + len(aux_bytes(i))
                rx.give_back(dst, self._close(rx, fh, f) if rx.daemon.alive() else False)
            else:
                try:
                    tx.client.cancel(ph)
                except EngineError:
                    pass
            self._wait(tx, ph, pub, pub.started + TERMINAL_BOUND_S)
            tx.give_back(src, self._close(tx, ph, pub) if tx.daemon.alive() else False)


def p99(samples: list[float]) -> float:
    """The 99th percentile (nearest rank, so an infinite sample stays infinite); nan if empty."""
    if not samples:
        return float("nan")
    xs = sorted(samples)
    return float(xs[min(len(xs) - 1, max(0, math.ceil(0.99 * len(xs)) - 1))])
