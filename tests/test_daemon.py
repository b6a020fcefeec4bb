"""The daemon as operators run it: ``python -m kvxferd sender|receiver`` children, real signals.

Each test spawns real daemon processes (real ZMQ, real NIXL, the engine gateway
on an ipc:// socket in a short private directory), plays the engine with
:class:`~kvxferd.engine.client.Client` / :class:`~kvxferd.engine.client.AsyncClient`, maps the
daemons' pools with :func:`~kvxferd.engine.client.attach_pool`, scrapes the probe port
with urllib and listens on a datagram socket as systemd would. Exit times are
measured from the moment the signal was sent and printed (``pytest -s``).

Every child is SIGCONTed and SIGKILLed in a fixture finalizer; every wait polls a
condition with a deadline.

A frozen receiver only holds up a sender's write when the write needs the
receiver to make progress: UCX's default same-host path (cma) writes into a
stopped process's memory regardless. Tests that need a write to stay in flight
therefore run the data plane over UCX's tcp transport (``UCX_TLS=tcp``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvxferd.config import load_receiver_settings
from kvxferd.engine.client import AsyncClient, Client, Outcome, attach_pool
from kvxferd.launch import LaunchError
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.receiver import Receiver
from tests.support.child import ChildProcess
from tests.support.conditions import wait_until
from tests.support.peers import request_content

pytestmark = pytest.mark.integration

LAYERS = 2
BLOCK_BYTES = 256 << 10
REQ_BLOCKS = 64  # 2 layers x 64 blocks x 256 KiB = 32 MiB per request
N_REQ = 8
DRAIN_S = 1.5
SHUTDOWN_S = 3.0
BOUND_S = SHUTDOWN_S + 1.0  # the daemon's promise, from the signal
MARGIN_S = 1.0  # scheduling slack on a loaded 2-core host, process exit and reaping
STARTUP_S = 60.0  # a child imports torch and NIXL and creates an agent
CALL_S = 10.0


def daemon_env(**extra: str | int) -> dict[str, str]:
    """Settings for a small, fast daemon: 256 MiB pool, short deadlines, one worker."""
    env = {
        "KVXFERD_POOL__NUM_LAYERS": LAYERS,
        "KVXFERD_POOL__NUM_BLOCKS": N_REQ * REQ_BLOCKS,
        "KVXFERD_POOL__BLOCK_ELEMS": BLOCK_BYTES,
        "KVXFERD_POOL__DTYPE": "uint8",
        "KVXFERD_NUM_THREADS": 1,
        "KVXFERD_DEADLINES__DRAIN_TIMEOUT_MS": int(DRAIN_S * 1000),
        "KVXFERD_DEADLINES__SHUTDOWN_TIMEOUT_MS": int(SHUTDOWN_S * 1000),
        "KVXFERD_DEADLINES__KV_TRANSFER_TIMEOUT_MS": 4000,
        "KVXFERD_DEADLINES__WORKER_SEND_TIMEOUT_MS": 500,
        "KVXFERD_DEADLINES__CANCEL_FENCE_MS": 500,
        **extra,
    }
    return {k: str(v) for k, v in env.items()}


TCP_DATA_PLANE = {"KVXFERD_DATAPLANE__UCX_TLS": "tcp"}


# -- a daemon child ------------------------------------------------------------------------


class DaemonProcess(ChildProcess):
    """``python -m kvxferd ROLE``: its ready line, signals, exit code and time, bounded waits."""

    def __init__(
        self, role: str, name: str, sock_dir: str, env: dict[str, str], args: list[str]
    ) -> None:
        daemon_env = {
            "KVXFERD_SERVICE__ENGINE_SOCKET": f"ipc://{sock_dir}/{name}.sock",
            "KVXFERD_SERVICE__PROBE_PORT": "0",
            **env,
        }
        super().__init__(
            "kvxferd", [role, *args], Path(sock_dir) / f"{name}.stderr", name, daemon_env
        )
        self.role = role
        self.lines: list[str] = []
        self.signalled_at: float | None = None  # monotonic time of the first signal we sent
        self._start_reader()

    def _take(self, line: str) -> None:
        self.lines.append(line)

    def wait_ready(self, timeout: float = STARTUP_S) -> dict[str, Any]:
        """The ``{"event": "ready", ...}`` line; AssertionError if it never came."""
        try:
            return self.child.wait_ready(time.monotonic() + timeout)
        except LaunchError:
            raise AssertionError(self.describe()) from None

    @property
    def engine_socket(self) -> str:
        return str(self.wait_ready()["engine_socket"])

    @property
    def endpoint(self) -> str:
        return str(self.wait_ready()["endpoint"])

    @property
    def probe_port(self) -> int:
        return int(self.wait_ready()["probe_port"])

    def signal(self, sig: int) -> float:
        """Send ``sig``; the monotonic time it was sent."""
        assert self.alive(), self.describe()
        t = time.monotonic()
        if sig in (signal.SIGTERM, signal.SIGINT) and self.signalled_at is None:
            self.signalled_at = t
        self.proc.send_signal(sig)
        return t

    def wait_exit(self, timeout: float) -> tuple[int, float]:
        """(exit code, seconds from the first SIGTERM/SIGINT to the exit)."""
        code = self._wait_exit_code(timeout, AssertionError)
        return code, time.monotonic() - (self.signalled_at or time.monotonic())

    def describe(self, lines: int = 25) -> str:
        tail = "\n  ".join(self.stderr_tail(lines))
        return (
            f"[{self.name} pid {self.pid} exit {self.proc.poll()}]\n"
            f"stdout: {self.lines[-5:]}\nstderr tail:\n  {tail}"
        )


Spawn = Callable[..., DaemonProcess]


@pytest.fixture
def sock_dir() -> Iterator[str]:
    # A short private path: an ipc:// path must fit in sockaddr_un (107 bytes).
    d = tempfile.mkdtemp(prefix="kx")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemons(request: pytest.FixtureRequest, sock_dir: str) -> Spawn:
    """Spawn daemon children; every one is SIGCONT+SIGKILLed and reaped in teardown."""
    spawned: list[DaemonProcess] = []

    def kill_all() -> None:
        for d in spawned:
            d.kill()

    request.addfinalizer(kill_all)

    def spawn(role: str, name: str, env: dict[str, str] | None = None) -> DaemonProcess:
        args = ["--listen", "tcp://127.0.0.1:0"] if role == "sender" else []
        d = DaemonProcess(role, name, sock_dir, daemon_env() if env is None else env, args)
        spawned.append(d)
        return d

    return spawn


class Engines:
    """Engine clients and pool mappings of the test; all closed in teardown."""

    def __init__(self) -> None:
        self._clients: list[Client | AsyncClient] = []

    def client(self, d: DaemonProcess) -> tuple[Client, torch.Tensor]:
        c = Client(d.engine_socket, timeout_s=CALL_S)
        self._clients.append(c)
        return c, attach_pool(c.describe())

    def async_client(self, d: DaemonProcess) -> AsyncClient:
        c = AsyncClient(d.engine_socket, timeout_s=CALL_S)
        self._clients.append(c)
        return c

    def close(self) -> None:
        for c in self._clients:
            c.close_client()


@pytest.fixture
def engines() -> Iterator[Engines]:
    e = Engines()
    yield e
    e.close()


@pytest.fixture
def notify_sock(sock_dir: str) -> Iterator[tuple[str, socket.socket]]:
    """A datagram socket standing in for systemd's ``$NOTIFY_SOCKET``."""
    path = f"{sock_dir}/notify"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    yield path, s
    s.close()


# -- helpers -------------------------------------------------------------------------------


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body) of GET ``path`` on the probe port; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


def metrics(port: int) -> dict[str, Any]:
    status, body = http_get(port, "/metrics")
    assert status == 200, body
    return {f.name: f for f in text_string_to_metric_families(body)}


def gauge(port: int, name: str) -> float:
    return float(sum(s.value for s in metrics(port)[name].samples))


def blocks_of(i: int) -> list[int]:
    return list(range(i * REQ_BLOCKS, (i + 1) * REQ_BLOCKS))


@functools.lru_cache(maxsize=N_REQ)
def content(request_id: str) -> torch.Tensor:
    return request_content(request_id, LAYERS, REQ_BLOCKS, BLOCK_BYTES)


def publish_all(ct: Client, pt: torch.Tensor, ids: list[str]) -> list[int]:
    """Write each request's content into its source blocks, then publish it."""
    handles = []
    for i, rid in enumerate(ids):
        pt[:, blocks_of(i)] = content(rid)
        handles.append(ct.publish(rid, blocks_of(i), aux=rid.encode()))
    return handles


def verify_done(pr: torch.Tensor, ids: list[str], outs: list[Outcome | None]) -> int:
    """Assert every fetch reported done holds its bytes exactly; the number done."""
    done = 0
    for i, (rid, out) in enumerate(zip(ids, outs, strict=True)):
        if out is not None and out.state == "done":
            assert torch.equal(pr[:, blocks_of(i)], content(rid)), f"{rid} done, bytes differ"
            assert out.aux == rid.encode(), (rid, out.aux)
            done += 1
    return done


def wait_all(cr: Client, handles: list[int], timeout: float) -> list[Outcome | None]:
    deadline = time.monotonic() + timeout
    return [cr.wait(h, max(0.0, deadline - time.monotonic())) for h in handles]


def start_pair(
    daemons: Spawn, engines: Engines, env: dict[str, str] | None = None
) -> tuple[DaemonProcess, DaemonProcess, Client, torch.Tensor, Client, torch.Tensor]:
    tx, rx = daemons("sender", "tx", env), daemons("receiver", "rx", env)
    tx.wait_ready(), rx.wait_ready()
    ct, pt = engines.client(tx)
    cr, pr = engines.client(rx)
    return tx, rx, ct, pt, cr, pr


def transfers_in_flight(
    tx: DaemonProcess, ct: Client, pt: torch.Tensor, cr: Client, prefix: str
) -> tuple[list[str], list[int]]:
    """Publish and fetch N_REQ large requests; returns once the first is done and more are open."""
    ids = [f"{prefix}-{i}" for i in range(N_REQ)]
    publish_all(ct, pt, ids)
    gets = [cr.fetch(rid, tx.endpoint, blocks_of(i)) for i, rid in enumerate(ids)]
    first = cr.wait(gets[0], CALL_S)
    assert first is not None and first.state == "done", first
    return ids, gets


def last_daemon_line(d: DaemonProcess) -> str:
    """The daemon's last own log line: what its drain dropped and its exit code."""
    lines = [line for line in d.stderr().splitlines() if "[kvxferd.daemon]" in line]
    assert lines, d.describe()
    return lines[-1]


def report(what: str, code: int, elapsed: float) -> None:
    print(f"\n[exit time] {what}: exit {code} after {elapsed:.3f}s (bound {BOUND_S:.1f}s)")


# -- 1. probe endpoints --------------------------------------------------------------------


def test_probe_endpoints_answer_and_metrics_carry_no_request_ids(
    daemons: Spawn, engines: Engines
) -> None:
    """/healthz and /readyz answer 200 on a ready pair and /metrics has every family, sub-ms buckets and no request id after transfers."""
    tx, rx, ct, pt, cr, pr = start_pair(daemons, engines)
    for d in (tx, rx):
        status, body = http_get(d.probe_port, "/healthz")
        assert status == 200 and body.startswith("ok"), body
        status, body = http_get(d.probe_port, "/readyz")
        assert (status, body) == (200, "ready\n")
        print(f"\n[{d.role}] /healthz -> {status} {http_get(d.probe_port, '/healthz')[1]!r}")
    ids = [f"secret-rid-{i}" for i in range(3)]
    publish_all(ct, pt, ids)
    outs = wait_all(cr, [cr.fetch(r, tx.endpoint, blocks_of(i)) for i, r in enumerate(ids)], 20)
    assert verify_done(pr, ids, outs) == len(ids), outs
    for d, role in ((tx, "sender"), (rx, "receiver")):
        status, body = http_get(d.probe_port, "/metrics")
        assert status == 200
        for rid in ids:
            assert rid not in body, f"request id {rid} in /metrics"
        fams = {f.name: f for f in text_string_to_metric_families(body)}
        for name in (
            "kvxferd_sessions",
            "kvxferd_transfer_duration_seconds",
            "kvxferd_rejections",  # the parser strips the counter's _total
            "kvxferd_queue_depth",
            "kvxferd_peers",
            "kvxferd_writes_in_flight",
            "kvxferd_build_info",
        ):
            assert name in fams, f"{role}: {name} missing from /metrics"
        assert "kvxferd_rejections_total" in body
        hist = fams["kvxferd_transfer_duration_seconds"]
        bounds = [float(s.labels["le"]) for s in hist.samples if s.name.endswith("_bucket")]
        assert sum(1 for b in bounds if b < 0.001) >= 3, bounds  # sub-millisecond buckets
        count = [s.value for s in hist.samples if s.name.endswith("_count")]
        assert count and count[0] >= len(ids), hist.samples
        info = fams["kvxferd_build_info"].samples[0]
        assert info.labels["role"] == role and info.value == 1, info
        assert fams["kvxferd_peers"].samples[0].value == 1, role
        if role == "sender":
            per_worker = sum(s.value for s in fams["kvxferd_worker_slices"].samples)
            assert per_worker == len(ids), fams["kvxferd_worker_slices"].samples
        for fam in fams.values():
            for s in fam.samples:
                for value in s.labels.values():
                    assert "secret" not in value, (s.name, s.labels)
        print(f"[{role}] /readyz -> 200 'ready'; /metrics families: {sorted(fams)}")


def test_readiness_drops_with_draining_while_liveness_stays_during_a_drain(
    daemons: Spawn, engines: Engines
) -> None:
    """After SIGTERM a receiver with an open fetch answers /readyz 503 naming draining and /healthz 200 until it exits."""
    # The drain is long and the test ends it: how fast a loaded host (3 pytest processes
    # on 2 cores) answers probes does not decide what the test sees. The engine's cancel
    # during the drain cuts the fetch (drain_dropped_cut) and the daemon exits 3 at once.
    drain_s, shutdown_s = 40.0, 45.0
    env = daemon_env(
        KVXFERD_DEADLINES__DRAIN_TIMEOUT_MS=int(drain_s * 1000),
        KVXFERD_DEADLINES__SHUTDOWN_TIMEOUT_MS=int(shutdown_s * 1000),
        KVXFERD_DEADLINES__KV_TRANSFER_TIMEOUT_MS=60_000,  # the fetch outlives the drain
    )
    tx, rx, ct, pt, cr, pr = start_pair(daemons, engines, env)
    # A fetch of a request nobody published stays open: the receiver's drain waits for it.
    g = cr.fetch("never-published", tx.endpoint, blocks_of(0))
    assert cr.poll(g) is None
    port = rx.probe_port
    rx.signal(signal.SIGTERM)
    signalled = time.monotonic()
    seen: list[tuple[float, int, str, int, str]] = []

    def drained_view() -> bool:
        r_status, r_body = http_get(port, "/readyz", timeout=2.0)
        h_status, h_body = http_get(port, "/healthz", timeout=2.0)
        seen.append((round(time.monotonic() - signalled, 2), r_status, r_body, h_status, h_body))
        return r_status == 503 and h_status == 200

    try:
        wait_until(drained_view, 20.0, "readiness 503 with liveness 200 during the drain")
    except AssertionError as e:
        raise AssertionError(
            f"{e}; alive={rx.alive()}; the answers (s after SIGTERM): {seen[:3]} ... {seen[-3:]}"
            f"; {rx.describe()}"
        ) from None
    _, r_status, r_body, h_status, h_body = seen[-1]
    assert "draining" in r_body.splitlines(), r_body
    assert rx.alive()
    # It stays that way while the fetch is open (polled a few times).
    for _ in range(5):
        r_status, r_body = http_get(port, "/readyz", timeout=2.0)
        h_status, _ = http_get(port, "/healthz", timeout=2.0)
        assert rx.alive(), rx.describe()
        assert r_status == 503 and "draining" in r_body and h_status == 200, (r_body, h_status)
    cut_at = time.monotonic()
    cr.cancel(g)
    code, elapsed = rx.wait_exit(shutdown_s + 1.0 + MARGIN_S)
    report("receiver with an open fetch (drain incomplete)", code, elapsed)
    print(
        f"[receiver draining] /readyz -> {r_status} {r_body!r}; /healthz -> {h_status} {h_body!r}"
    )
    assert code == 3, rx.describe()
    assert "drain incomplete: 1 fetch cut, 0 in doubt; exit 3" in last_daemon_line(rx)
    # It exited because the fetch was cut, not at the end of its drain.
    assert time.monotonic() - cut_at < 10.0 + MARGIN_S, elapsed


# -- 2. systemd notify ---------------------------------------------------------------------


def test_notify_socket_gets_ready_watchdog_then_stopping(
    daemons: Spawn, notify_sock: tuple[str, socket.socket]
) -> None:
    """$NOTIFY_SOCKET receives READY=1, then WATCHDOG=1 at half of WATCHDOG_USEC, then STOPPING=1 after SIGTERM, with STATUS= lines."""
    path, sock = notify_sock
    tx = daemons("sender", "tx", daemon_env(NOTIFY_SOCKET=path, WATCHDOG_USEC=1_000_000))
    messages: list[tuple[float, str]] = []

    def receive_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            left = deadline - time.monotonic()
            assert left > 0, f"not within {timeout}s: {what}; got {messages}"
            sock.settimeout(min(left, 0.2))
            with contextlib.suppress(TimeoutError):
                messages.append((time.monotonic(), sock.recv(4096).decode()))

    def has(key: str) -> bool:
        return any(key in m.splitlines() for _, m in messages)

    receive_until(lambda: has("READY=1"), STARTUP_S, "READY=1")
    tx.wait_ready()
    receive_until(lambda: sum(m == "WATCHDOG=1" for _, m in messages) >= 2, 3.0, "two WATCHDOG=1")
    assert not has("STOPPING=1")
    tx.signal(signal.SIGTERM)
    receive_until(lambda: has("STOPPING=1"), BOUND_S, "STOPPING=1")
    code, elapsed = tx.wait_exit(BOUND_S + MARGIN_S)
    kinds = [m.splitlines()[0].split("=")[0] for _, m in messages]
    first = {k: kinds.index(k) for k in ("READY", "WATCHDOG", "STOPPING")}
    assert first["READY"] < first["WATCHDOG"] < first["STOPPING"], messages
    assert kinds[0] == "READY" and kinds.count("READY") == 1, kinds
    assert kinds.count("STOPPING") == 1, kinds
    ready = next(m for _, m in messages if "READY=1" in m.splitlines())
    stopping = next(m for _, m in messages if "STOPPING=1" in m.splitlines())
    assert any(line.startswith("STATUS=ready") for line in ready.splitlines()), ready
    assert any(line.startswith("STATUS=draining") for line in stopping.splitlines()), stopping
    assert any(m.startswith("STATUS=serving") for _, m in messages), messages
    # Half of WATCHDOG_USEC: the pings come about every 0.5 s.
    pings = [t for t, m in messages if m == "WATCHDOG=1"]
    assert all(0.2 < b - a < 0.9 for a, b in zip(pings, pings[1:], strict=False)), pings
    report("idle sender with notify", code, elapsed)
    print("[notify] " + " | ".join(m.replace("\n", "\\n") for _, m in messages))
    assert code == 0 and elapsed < 1.0 + MARGIN_S, (code, elapsed)


# -- 3. SIGTERM during transfers -----------------------------------------------------------


def test_idle_daemons_exit_0_within_a_second(daemons: Spawn, engines: Engines) -> None:
    """An idle sender and receiver, after a verified transfer, exit 0 within a second of SIGTERM."""
    tx, rx, ct, pt, cr, pr = start_pair(daemons, engines)
    ids = ["idle-0"]
    publish_all(ct, pt, ids)
    out = cr.wait(cr.fetch("idle-0", tx.endpoint, blocks_of(0)), CALL_S)
    assert verify_done(pr, ids, [out]) == 1, out
    for d in (tx, rx):
        d.signal(signal.SIGTERM)
    for d in (tx, rx):
        code, elapsed = d.wait_exit(BOUND_S + MARGIN_S)
        report(f"idle {d.role}", code, elapsed)
        assert code == 0, d.describe()
        assert elapsed < 1.0 + MARGIN_S, elapsed


def test_sigterm_during_transfers_drains_them_byte_exact_and_exits_0(
    daemons: Spawn, engines: Engines
) -> None:
    """SIGTERM while large transfers run: the sender finishes its attached writes, exits 0 in bound, and every done fetch is byte-exact."""
    tx, rx, ct, pt, cr, pr = start_pair(daemons, engines)
    ids, gets = transfers_in_flight(tx, ct, pt, cr, "drain")
    tx.signal(signal.SIGTERM)
    code, elapsed = tx.wait_exit(BOUND_S + MARGIN_S)
    report("sender draining large transfers", code, elapsed)
    outs = wait_all(cr, gets, 6.0)
    done = verify_done(pr, ids, outs)
    print(
        f"[drain] {done}/{len(ids)} fetches done and byte-exact; others: "
        f"{[(o.state, o.reason) for o in outs if o is not None and o.state != 'done']}"
    )
    assert code == 0, tx.describe()
    assert (
        "drain complete: 0 published requests never fetched, 0 transfers cut, 0 in doubt; exit 0"
        in last_daemon_line(tx)
    )
    assert elapsed <= BOUND_S + MARGIN_S
    assert done == len(ids), outs  # a completed drain finished every attached transfer


def test_sigterm_with_a_frozen_receiver_exits_3_in_bound(daemons: Spawn, engines: Engines) -> None:
    """A receiver SIGSTOPped with writes in flight leaves the drain incomplete: exit 3 within shutdown_timeout + 1 s, readiness down meanwhile."""
    tx, rx, ct, pt, cr, pr = start_pair(daemons, engines, daemon_env(**TCP_DATA_PLANE))
    ids, gets = transfers_in_flight(tx, ct, pt, cr, "frozen")
    rx.signal(signal.SIGSTOP)
    wait_until(
        lambda: gauge(tx.probe_port, "kvxferd_writes_in_flight") >= 1, 5, "a write in flight"
    )
    tx.signal(signal.SIGTERM)
    r_status, r_body = http_get(tx.probe_port, "/readyz", timeout=1.0)
    h_status, h_body = http_get(tx.probe_port, "/healthz", timeout=1.0)
    code, elapsed = tx.wait_exit(BOUND_S + MARGIN_S)
    report("sender with a frozen (SIGSTOP) receiver", code, elapsed)
    print(f"[sender draining] /readyz -> {r_status} {r_body!r}; /healthz -> {h_status} {h_body!r}")
    assert (r_status, h_status) == (503, 200) and "draining" in r_body, (r_body, h_body)
    assert code == 3, tx.describe()
    last = last_daemon_line(tx)
    print(f"[frozen] sender's last line: {last}")
    counts = re.search(
        r"drain incomplete: 0 published requests never fetched, (\d+) transfers? cut, (\d+) in doubt; exit 3",
        last,
    )
    assert counts is not None and int(counts[1]) + int(counts[2]) >= 1, last
    assert elapsed <= BOUND_S + MARGIN_S
    rx.signal(signal.SIGCONT)
    # Fetches end by kv_transfer_timeout at the latest; a done one must hold its bytes.
    outs = wait_all(cr, gets, 10.0)
    done = verify_done(pr, ids, outs)
    print(
        f"[frozen] after SIGCONT: {done} done (byte-exact), others "
        f"{[(o.state, o.reason) for o in outs if o is not None and o.state != 'done']}"
    )
    assert all(o is not None for o in outs), outs
    assert done < len(ids), "every fetch finished: nothing was held up by the freeze"


# -- 4. the bound under peer faults --------------------------------------------------------


def test_sigterm_with_a_killed_receiver_exits_in_bound(daemons: Spawn, engines: Engines) -> None:
    """A receiver SIGKILLed with writes in flight cannot hold the sender past shutdown_timeout + 1 s."""
    tx, rx, ct, pt, cr, pr = start_pair(daemons, engines, daemon_env(**TCP_DATA_PLANE))
    transfers_in_flight(tx, ct, pt, cr, "killed")
    rx.signal(signal.SIGKILL)
    rx.wait_exit(5)
    tx.signal(signal.SIGTERM)
    code, elapsed = tx.wait_exit(BOUND_S + MARGIN_S)
    report("sender with a killed (SIGKILL) receiver", code, elapsed)
    assert code in (0, 3), tx.describe()
    assert elapsed <= BOUND_S + MARGIN_S


class _NonReadingPeer:
    """A raw DEALER registered with real NIXL metadata that never reads its socket again."""

    def __init__(self, sender_endpoint: str) -> None:
        pool = dict(
            num_layers=LAYERS, num_blocks=N_REQ * REQ_BLOCKS, block_elems=BLOCK_BYTES, dtype="uint8"
        )
        # Only for its NIXL agent and registered memory: its sockets are never involved.
        self.memory = Receiver(load_receiver_settings(pool=pool)).start()
        ctx = zmq.Context.instance()
        self.results = ctx.socket(zmq.ROUTER)  # bound, never read
        self.results.setsockopt(zmq.LINGER, 0)
        self.results.setsockopt(zmq.RCVHWM, 1)
        self.results.setsockopt(zmq.RCVBUF, 4096)
        self.results.bind("tcp://127.0.0.1:*")
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.RCVHWM, 1)
        self.dealer.setsockopt(zmq.RCVBUF, 4096)
        self.dealer.setsockopt(zmq.SNDTIMEO, 1000)
        self.dealer.setsockopt(zmq.RCVTIMEO, int(CALL_S * 1000))
        self.dealer.connect(sender_endpoint)

    def register(self) -> None:
        r = self.memory
        self.dealer.send(
            wire.encode(
                wire.Register(
                    receiver_id="never-reads",
                    result_endpoint=self.results.getsockopt(zmq.LAST_ENDPOINT).decode(),
                    agent_metadata=r.agents.metadata(),
                    layout=wire.WireLayout.of(r.pool.layout),
                    kv_base=r.pool.kv_base,
                    aux_base=r.pool.aux_base,
                )
            )
        )
        reply = wire.decode_to_receiver([self.dealer.recv()], 1 << 20)  # the last read
        assert isinstance(reply, wire.RegisterReply) and reply.ok, reply

    def send(self, msg: wire._Msg) -> None:
        self.dealer.send(wire.encode(msg))

    def close(self) -> None:
        self.dealer.close(linger=0)
        self.results.close(linger=0)
        self.memory.shutdown(timeout=3.0)


def test_sigterm_with_a_peer_that_never_reads_exits_in_bound(
    daemons: Spawn, engines: Engines
) -> None:
    """A registered DEALER that requests data, floods CANCELs and never reads cannot hold the sender past shutdown_timeout + 1 s."""
    tx = daemons("sender", "tx")
    ct, pt = engines.client(tx)
    ids = [f"nr-{i}" for i in range(N_REQ)]
    publish_all(ct, pt, ids)
    peer = _NonReadingPeer(tx.endpoint)
    try:
        peer.register()
        for i, rid in enumerate(ids):
            peer.send(wire.RequestData(request_id=rid, fetch_id=i + 1, dst_blocks=blocks_of(i)))
        # Every CANCEL of an unknown fetch earns a CancelAck nobody reads: the path fills up.
        sent = 0
        with contextlib.suppress(zmq.Again):
            for n in range(20_000):
                peer.send(wire.Cancel(request_id="nr-x", fetch_id=10_000 + n))
                sent += 1
        wait_until(
            lambda: (
                gauge(tx.probe_port, "kvxferd_writes_in_flight") == 0
                and metrics(tx.probe_port)["kvxferd_outcomes"].samples[0].value >= 1
            ),
            CALL_S,
            "the peer's writes went through",
        )
        tx.signal(signal.SIGTERM)
        code, elapsed = tx.wait_exit(BOUND_S + MARGIN_S)
    finally:
        peer.close()
    report(f"sender with a registered peer that never reads ({sent} CANCELs)", code, elapsed)
    assert code in (0, 3), tx.describe()
    assert elapsed <= BOUND_S + MARGIN_S


# -- 5. a second signal --------------------------------------------------------------------


def test_second_sigterm_forces_exit_3_before_the_drain_deadline(
    daemons: Spawn, engines: Engines
) -> None:
    """A second SIGTERM during a long drain (frozen receiver) ends the sender with exit 3 well before drain_timeout."""
    drain_s, shutdown_s = 8.0, 10.0
    env = daemon_env(
        **TCP_DATA_PLANE,
        KVXFERD_DEADLINES__DRAIN_TIMEOUT_MS=int(drain_s * 1000),
        KVXFERD_DEADLINES__SHUTDOWN_TIMEOUT_MS=int(shutdown_s * 1000),
    )
    tx, rx, ct, pt, cr, pr = start_pair(daemons, engines, env)
    transfers_in_flight(tx, ct, pt, cr, "forced")
    rx.signal(signal.SIGSTOP)
    wait_until(
        lambda: gauge(tx.probe_port, "kvxferd_writes_in_flight") >= 1, 5, "a write in flight"
    )
    t1 = tx.signal(signal.SIGTERM)
    # The drain is under way (readiness names it) and has lasted a while: a long drain.
    wait_until(
        lambda: (
            time.monotonic() - t1 >= 1.0
            and "draining" in http_get(tx.probe_port, "/readyz", timeout=1.0)[1]
        ),
        3.0,
        "a drain that has run for a second",
    )
    assert tx.alive(), tx.describe()
    t2 = tx.signal(signal.SIGTERM)
    code, elapsed = tx.wait_exit(shutdown_s + 1.0 + MARGIN_S)
    after_second = time.monotonic() - t2
    report(f"sender, second SIGTERM ({after_second:.3f}s after it)", code, elapsed)
    assert code == 3, tx.describe()
    last = last_daemon_line(tx)
    print(f"[forced] sender's last line: {last}")
    assert "drain incomplete: " in last and "; forced exit before the drain ended" in last, last
    assert elapsed < drain_s / 2, f"forced exit took {elapsed:.2f}s (drain_timeout {drain_s}s)"
    assert after_second < 1.0 + MARGIN_S, after_second


# -- 6. async clients on several loops -----------------------------------------------------


def test_async_clients_on_several_loops_each_wake_on_their_own_loop(
    daemons: Spawn, engines: Engines
) -> None:
    """One AsyncClient per daemon used from four event loops in four threads at once: each waiter wakes on its own loop and thread, bytes exact."""
    tx, rx, ct, pt, cr, pr = start_pair(daemons, engines)
    atx, arx = engines.async_client(tx), engines.async_client(rx)
    n = 4
    ids = [f"loop-{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        pt[:, blocks_of(i)] = content(rid)
    waiting = threading.Barrier(n + 1, timeout=CALL_S)
    woke: dict[str, dict[str, Any]] = {}
    errors: list[BaseException] = []

    async def one(i: int) -> None:
        loop, thread = asyncio.get_running_loop(), threading.current_thread()
        rid = ids[i]
        h = await arx.fetch(rid, tx.endpoint, blocks_of(i))
        waiter = asyncio.ensure_future(arx.wait(h, CALL_S))
        await asyncio.sleep(0)  # the Wait is on the wire before the barrier
        await loop.run_in_executor(None, waiting.wait)  # every loop is waiting now
        out = await waiter
        woke[rid] = {
            "loop": asyncio.get_running_loop(),
            "thread": threading.current_thread(),
            "own_loop": loop,
            "own_thread": thread,
            "out": out,
        }
        # The sender side from the same loop: its own connection, its own handle.
        th = await atx.publish(f"{rid}-again", blocks_of(i))
        assert await atx.close(th, CALL_S)
        await arx.aclose()
        await atx.aclose()

    def run(i: int) -> None:
        try:
            asyncio.run(one(i))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), name=f"engine-loop-{i}") for i in range(n)]
    for t in threads:
        t.start()
    waiting.wait()  # all four fetches are parked at the sender, every loop awaits its Wait
    publish_all(ct, pt, ids)
    for t in threads:
        t.join(CALL_S * 2)
    assert not any(t.is_alive() for t in threads), "a loop thread is still running"
    assert not errors, errors
    outs: list[Outcome | None] = [woke[rid]["out"] for rid in ids]
    assert verify_done(pr, ids, outs) == n, outs
    for rid in ids:
        w = woke[rid]
        assert w["loop"] is w["own_loop"] and w["thread"] is w["own_thread"], (rid, w)
    assert len({id(woke[r]["loop"]) for r in ids}) == n
    print("\n[loops] " + ", ".join(f"{r} woke on {woke[r]['thread'].name}" for r in ids))


# -- 7. configuration errors -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("role", "env", "names"),
    [
        ("sender", {"KVXFERD_DEADLINES__DRAIN_TIMEOUT_MS": "5000"}, ["drain_timeout_ms"]),
        ("receiver", {"KVXFERD_POOL__NUM_BLOCKS": "0"}, ["pool.num_blocks"]),
        ("sender", {"KVXFERD_NUM_THREADS": "zero"}, ["KVXFERD_NUM_THREADS"]),
    ],
    ids=["drain-over-shutdown", "pool-blocks", "threads-env"],
)
def test_configuration_error_exits_2_naming_the_setting(
    daemons: Spawn, role: str, env: dict[str, str], names: list[str]
) -> None:
    """A bad setting stops the daemon before it starts: exit 2, one message naming the setting, no traceback."""
    d = daemons(role, f"bad-{role}", {**daemon_env(), **env})
    code, _ = d.wait_exit(STARTUP_S)
    err = d.stderr()
    print(f"\n[config] {role} {env}: exit {code}: {err.strip()!r}")
    assert code == 2, d.describe()
    assert "configuration error" in err and all(n in err for n in names), err
    assert "Traceback" not in err, err
    assert not any(line.startswith("{") for line in d.lines), d.lines
