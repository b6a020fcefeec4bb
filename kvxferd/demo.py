"""The synthetic workload behind ``kvxferd demo``: real daemons, engines on the client API, verified bytes.

The demo starts one sender daemon and R receiver daemons
(``python -m kvxferd sender|receiver`` through :mod:`kvxferd.launch`, the demo pool
passed as ``KVXFERD_POOL__*``, ephemeral ports, engine sockets in a private temporary
directory) with CURVE
on, as a deployment runs: each daemon gets its own key pair (``kvxferd
keygen``'s code) in that directory, the sender allows the receivers' keys and
each receiver allows, and expects, the sender's. It then plays the inference
engines itself, through :mod:`kvxferd.engine.client` only:

* the **sender engine** (one thread) writes each request's content into the
  sender daemon's pool through :func:`~kvxferd.engine.client.attach_pool`, publishes
  it, waits for its outcome and closes it; blocks are reused only after
  ``close()`` answered True;
* one **receiver engine** per receiver daemon (``inflight`` threads sharing one
  :class:`~kvxferd.engine.client.Client`) fetches its share of the requests, verifies
  every byte and the aux payload through the attached receiver pool, records
  the latency and closes. The latency runs from the later of the fetch call
  and the publish call to the outcome, so a fetch issued ahead of its publish
  does not count the time the sender engine took to get there.

The bytes cross real processes: engine -> sender daemon's shared memory ->
NIXL -> receiver daemon's shared memory -> engine. Both sides derive the same
plan from the seed: request ``i`` has a random block count and content that is
a random tile per layer, stamped with (request, layer, position) in each
block's first 8 bytes, so a block written to the wrong place or a stale block
cannot pass the check. At the end the daemons get SIGTERM and their exit codes
(0 = drained) are part of the result. The daemons are killed on every error path.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from kvxferd.engine.client import Client, Outcome, attach_pool
from kvxferd.launch import Daemon, LaunchError
from kvxferd.transfer.pool import IdAllocator

DEMO_POOL: dict[str, Any] = dict(
    num_layers=8, num_blocks=2048, block_elems=8192, dtype="float16", aux_slots=256
)
# Modest deadlines: a demo that goes wrong says so in seconds, and drains quickly.
DEMO_DEADLINES: dict[str, int] = dict(
    kv_transfer_timeout_ms=30_000,
    publish_ttl_ms=30_000,
    pending_fetch_ttl_ms=30_000,
    register_timeout_ms=5_000,
    drain_timeout_ms=3_000,
    shutdown_timeout_ms=5_000,
)
READY_TIMEOUT_S = 60.0  # a daemon's start-up: pool, NIXL agent, sockets
EXIT_TIMEOUT_S = DEMO_DEADLINES["shutdown_timeout_ms"] / 1000 + 3.0  # daemon bound + slack
KILL_GRACE_S = (
    2.0  # on an error path: SIGTERM, then SIGKILL (the grace lets a daemon unlink its pool)
)
CALL_TIMEOUT_S = 10.0  # one engine call to a local daemon
WAIT_SLICE_S = 0.5  # waits are sliced so an aborted demo stops promptly


@dataclass(frozen=True)
class Spec:
    """What both sides of the demo agree on."""

    requests: int = 300
    seed: int = 1
    min_blocks: int = 16  # 512 tokens at 32 tokens per block
    max_blocks: int = 192  # 6144 tokens
    inflight: int = 8  # fetches in flight per receiver
    receivers: int = 1
    timeout_s: float = 600.0

    def block_counts(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        return rng.integers(self.min_blocks, self.max_blocks + 1, size=self.requests)


def request_id(i: int) -> str:
    return f"demo-{i}"


def expected_bytes(
    i: int, nblocks: int, num_layers: int, block_bytes: int, seed: int
) -> torch.Tensor:
    """The content of request ``i`` as ``[layer, block, byte]``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    tile = torch.randint(0, 256, (num_layers, 1, block_bytes), dtype=torch.uint8, generator=g)
    out = tile.expand(num_layers, nblocks, block_bytes).clone()
    layer = torch.arange(num_layers, dtype=torch.int64)[:, None]
    pos = torch.arange(nblocks, dtype=torch.int64)[None, :]
    stamp = (i << 32) | (layer << 20) | pos
    out[:, :, :8] = stamp.contiguous().view(torch.uint8).view(num_layers, nblocks, 8)
    return out


def aux_bytes(i: int) -> bytes:
    return f"first-token:{i}".encode()


class DemoError(Exception):
    """The demo cannot go on (a daemon died, an engine call failed, the deadline passed)."""


# -- the daemons -------------------------------------------------------------------------
def daemon_env(sock_dir: str, name: str, security: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one demo daemon: the demo pool, modest deadlines, its own sockets.

    ``security``: ``KVXFERD_SECURITY__*`` variables (:func:`demo_keys`); without, the
    daemon runs with security off, which its loopback and ipc endpoints allow.
    """
    env = dict(os.environ)
    # Not the unit's daemons: never talk to a systemd notify socket the demo inherited.
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        env.pop(key, None)
    env.pop("KVXFERD_POOL__SHM_NAME", None)  # every daemon needs its own segment
    for key, value in DEMO_POOL.items():
        env[f"KVXFERD_POOL__{key.upper()}"] = str(value)
    env["KVXFERD_POOL__DEVICE"] = "cpu"
    for key, value in DEMO_DEADLINES.items():
        env[f"KVXFERD_DEADLINES__{key.upper()}"] = str(value)
    env["KVXFERD_SERVICE__ENGINE_SOCKET"] = f"ipc://{sock_dir}/{name}.sock"
    env["KVXFERD_SERVICE__PROBE_HOST"] = "127.0.0.1"
    env["KVXFERD_SERVICE__PROBE_PORT"] = "0"
    env.update(security or {"KVXFERD_SECURITY__MODE": "off"})
    return env


def demo_keys(key_dir: Path, sender: str, receivers: list[str]) -> dict[str, dict[str, str]]:
    """A key pair per daemon in ``key_dir``; each daemon's ``KVXFERD_SECURITY__*`` variables.

    The sender allows every receiver's key; each receiver allows the sender's and expects
    it at every sender endpoint (``security.sender_keys = {"*": ...}``).
    """
    from kvxferd.auth import keygen, load_public_key

    pub: dict[str, Path] = {}
    for name in (sender, *receivers):
        pub[name], _ = keygen(key_dir / "own", name)

    def allowed(owner: str, names: list[str]) -> str:
        d = key_dir / f"allowed-{owner}"
        d.mkdir(mode=0o700)
        for n in names:
            shutil.copy(pub[n], d / f"{n}.key")
        return str(d)

    def env(name: str, allow: list[str]) -> dict[str, str]:
        return {
            "KVXFERD_SECURITY__MODE": "curve",
            "KVXFERD_SECURITY__KEY_FILE": str(key_dir / "own" / f"{name}.key_secret"),
            "KVXFERD_SECURITY__ALLOWED_KEYS_DIR": allowed(name, allow),
        }

    out = {sender: env(sender, receivers)}
    sender_key = json.dumps({"*": load_public_key(pub[sender])})
    for r in receivers:
        out[r] = {**env(r, [sender]), "KVXFERD_SECURITY__SENDER_KEYS": sender_key}
    return out


def start_daemon(
    role: str, name: str, sock_dir: str, *args: str, security: dict[str, str] | None = None
) -> Daemon:
    """One demo daemon: stdout and stderr to files in the demo's directory, its own session
    (a Ctrl-C reaches the demo, which stops its daemons)."""
    return Daemon(role, name, sock_dir, args, env=daemon_env(sock_dir, name, security))


def scrape_metrics(probe_port: int, timeout: float = 5.0) -> dict[str, float]:
    """``GET /metrics`` of a daemon as ``{series: value}`` (series with their labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{probe_port}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        try:
            out[series] = float(value)
        except ValueError:
            continue
    return out


# -- the engines -------------------------------------------------------------------------
@dataclass
class Shared:
    """What the engine threads report to the demo's main thread."""

    spec: Spec
    abort: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    errors: list[str] = field(default_factory=list)
    done: int = 0  # fetches finished (ok or not)
    moved: int = 0  # bytes received (KV + aux)
    latencies: list[float] = field(default_factory=list)
    published: dict[int, float] = field(default_factory=dict)  # request -> publish call
    failures: int = 0
    mismatches: int = 0
    sender_failures: int = 0
    unsafe_closes: int = 0  # close() that did not answer True: those blocks are never reused
    first_failures: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        with self.lock:
            self.errors.append(what)
        self.abort.set()

    def note(self, what: str) -> None:
        with self.lock:
            if len(self.first_failures) < 5:
                self.first_failures.append(what)


def _wait(client: Client, handle: int, shared: Shared, deadline: float, what: str) -> Outcome:
    """The handle's outcome; raises DemoError on abort or past the deadline."""
    while True:
        if shared.abort.is_set():
            raise DemoError("aborted")
        left = deadline - time.monotonic()
        if left <= 0:
            raise DemoError(f"{what}: no outcome before the demo's deadline")
        out = client.wait(handle, min(WAIT_SLICE_S, left))
        if out is not None:
            return out


def _guard(shared: Shared, name: str, fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            fn()
        except Exception as e:  # any engine error ends the demo; the daemons get killed
            if not shared.abort.is_set():  # after an abort, errors are its echoes
                why = str(e) if isinstance(e, DemoError) else f"{type(e).__name__}: {e}"
                shared.fail(f"{name}: {why}")

    return run


def sender_engine(client: Client, kv: torch.Tensor, shared: Shared, deadline: float) -> None:
    """Write, publish, wait, close every request; reuse blocks only after a safe close."""
    spec = shared.spec
    num_layers, num_blocks, block_bytes = kv.shape
    aux_slots = kv.kvxferd_mapping.info.layout.aux_slots  # type: ignore[attr-defined]
    alloc = IdAllocator(num_blocks, shuffle_seed=spec.seed)  # scattered, like a real allocator
    resident: deque[tuple[int, int, np.ndarray]] = deque()

    def retire_oldest() -> None:
        i, handle, blocks = resident.popleft()
        out = _wait(client, handle, shared, deadline, f"publish {i}")
        if not out.ok:
            with shared.lock:
                shared.sender_failures += 1
            shared.note(f"publish {i}: {out.state} {out.reason} {out.detail}")
        if client.close(handle, timeout=CALL_TIMEOUT_S):
            alloc.give_back(blocks.tolist())
        else:
            with shared.lock:
                shared.unsafe_closes += 1

    for i, n in enumerate(spec.block_counts().tolist()):
        while alloc.free < n or len(resident) >= aux_slots // 2:
            retire_oldest()
        if shared.abort.is_set():
            return
        blocks = alloc.take(n)
        kv[:, torch.from_numpy(blocks)] = expected_bytes(i, n, num_layers, block_bytes, spec.seed)
        with shared.lock:  # before the call: the fetch may end before publish() returns
            shared.published[i] = time.monotonic()
        handle = client.publish(request_id(i), blocks, aux=aux_bytes(i))
        resident.append((i, handle, blocks))
    while resident:
        retire_oldest()


class ReceiverEngine:
    """One receiver daemon's engine: ``inflight`` threads fetch its share in order, verify, close."""

    def __init__(
        self,
        index: int,
        client: Client,
        kv: torch.Tensor,
        sender_endpoint: str,
        shared: Shared,
        deadline: float,
    ) -> None:
        spec = shared.spec
        self.index = index
        self.client = client
        self.kv = kv
        self.sender_endpoint = sender_endpoint
        self.shared = shared
        self.deadline = deadline
        self.counts = spec.block_counts()
        self.todo = deque(i for i in range(spec.requests) if i % spec.receivers == index)
        self.alloc = IdAllocator(kv.shape[1], shuffle_seed=spec.seed + 1 + index)
        self.cond = threading.Condition()

    def _next(self) -> tuple[int, np.ndarray] | None:
        """The next request and its blocks, strictly in order (no later request jumps the queue)."""
        with self.cond:
            while True:
                if not self.todo or self.shared.abort.is_set():
                    return None
                i = self.todo[0]
                n = int(self.counts[i])
                if self.alloc.free >= n:
                    self.todo.popleft()
                    return i, self.alloc.take(n)
                self.cond.wait(WAIT_SLICE_S)
                if time.monotonic() > self.deadline:
                    raise DemoError(f"request {i}: no free blocks before the demo's deadline")

    def run_one_thread(self) -> None:
        shared, client = self.shared, self.client
        num_layers, _, block_bytes = self.kv.shape
        while (item := self._next()) is not None:
            i, dst = item
            started = time.monotonic()
            handle = client.fetch(request_id(i), self.sender_endpoint, dst)
            out = _wait(client, handle, shared, self.deadline, f"fetch {i}")
            with shared.lock:  # from when both sides were ready: a fetch may precede its publish
                latency = time.monotonic() - max(started, shared.published.get(i, started))
            ok = out.ok
            mismatch = False
            if ok:
                want = expected_bytes(i, dst.size, num_layers, block_bytes, shared.spec.seed)
                got = self.kv[:, torch.from_numpy(dst)]
                mismatch = not torch.equal(got, want) or out.aux != aux_bytes(i)
            else:
                shared.note(f"fetch {i}: {out.state} {out.reason} {out.detail}")
            if mismatch:
                shared.note(f"request {i}: content or aux differs")
            safe = client.close(handle, timeout=CALL_TIMEOUT_S)
            with shared.lock:
                shared.done += 1
                if ok:
                    shared.latencies.append(latency)
                    shared.moved += out.nbytes
                else:
                    shared.failures += 1
                shared.mismatches += mismatch
                shared.unsafe_closes += not safe
            if safe:
                with self.cond:
                    self.alloc.give_back(dst.tolist())
                    self.cond.notify_all()


# -- the demo ----------------------------------------------------------------------------
class Demo:
    """The daemons, the clients, the engine threads; ``stop()`` always leaves no daemon behind."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.shared = Shared(spec)
        self.dir = tempfile.mkdtemp(prefix="kvxd-", dir="/tmp" if os.path.isdir("/tmp") else None)
        self.daemons: list[Daemon] = []
        self.clients: list[Client] = []
        self.pools: list[torch.Tensor] = []
        self.threads: list[threading.Thread] = []

    def start(self) -> tuple[Daemon, list[Daemon]]:
        ready_by = time.monotonic() + READY_TIMEOUT_S
        rx_names = [f"demo-rx-{k}" for k in range(self.spec.receivers)]
        keys = demo_keys(Path(self.dir) / "keys", "demo-tx", rx_names)
        sender = start_daemon(
            "sender",
            "demo-tx",
            self.dir,
            "--listen",
            "tcp://127.0.0.1:0",
            security=keys["demo-tx"],
        )
        self.daemons.append(sender)
        receivers = [
            start_daemon("receiver", name, self.dir, security=keys[name]) for name in rx_names
        ]
        self.daemons += receivers
        try:
            for d in self.daemons:
                d.wait_ready(ready_by)
        except LaunchError as e:
            raise DemoError(str(e)) from None
        return sender, receivers

    def connect(self, d: Daemon) -> tuple[Client, torch.Tensor]:
        client = Client(d.ready["engine_socket"], timeout_s=CALL_TIMEOUT_S)
        self.clients.append(client)
        info = client.describe()
        if info.role != d.role:
            raise DemoError(f"{d.name} describes itself as {info.role}, not {d.role}")
        kv = attach_pool(info)
        self.pools.append(kv)
        return client, kv

    def spawn(self, name: str, fn: Callable[[], None]) -> None:
        t = threading.Thread(target=_guard(self.shared, name, fn), name=name, daemon=True)
        self.threads.append(t)
        t.start()

    def watch(self, deadline: float) -> None:
        """Show progress on stderr until the engines finished; raise if anything went wrong."""
        spec, shared = self.spec, self.shared
        tty = sys.stderr.isatty()
        every = 0.25 if tty else 2.0
        last = 0.0
        while any(t.is_alive() for t in self.threads):
            for d in self.daemons:
                if d.proc.poll() is not None:
                    shared.fail(f"{d.name} exited with {d.proc.returncode}{d.tail()}")
            if shared.abort.is_set():
                break
            if time.monotonic() > deadline:
                shared.fail(f"not finished within {spec.timeout_s:g} s")
                break
            now = time.monotonic()
            if now - last >= every:
                last = now
                with shared.lock:
                    done, moved = shared.done, shared.moved
                text = f"demo: {done}/{spec.requests} requests, {moved / 1e9:.2f} GB"
                sys.stderr.write(("\r" + text) if tty else text + "\n")
                sys.stderr.flush()
            time.sleep(0.05)
        if tty:
            sys.stderr.write("\n")
        if shared.abort.is_set():
            for c in self.clients:  # fails the calls in flight now, not at their bound
                c.close_client()
        for t in self.threads:
            t.join(timeout=CALL_TIMEOUT_S)
        if shared.errors:
            raise DemoError("; ".join(shared.errors[:3]))

    def release_engines(self) -> None:
        """Close the engine connections; unmap the pools once no engine thread can touch them."""
        for c in self.clients:
            c.close_client()
        self.clients.clear()
        if any(t.is_alive() for t in self.threads):
            return  # unmapping under a running thread would crash it: the exit unmaps
        for kv in self.pools:
            kv.kvxferd_mapping.close()  # type: ignore[attr-defined]
        self.pools.clear()

    def stop(self) -> list[int]:
        """SIGTERM every daemon at once, then collect each exit code within its bound."""
        for d in self.daemons:
            d.terminate()
        exit_by = time.monotonic() + EXIT_TIMEOUT_S
        return [d.reap(exit_by) for d in self.daemons]

    def cleanup(self) -> None:
        """Whatever happened: engines stopped, daemons gone, the temporary directory removed.

        A second Ctrl-C must not cut this short, so SIGINT is ignored meanwhile.
        """
        self.shared.abort.set()
        main = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            for c in self.clients:  # fail the engines' calls in flight
                c.close_client()
            for d in self.daemons:
                d.terminate()
            kill_by = time.monotonic() + KILL_GRACE_S
            for d in self.daemons:
                d.reap(kill_by)  # SIGKILL past the grace
            for t in self.threads:
                t.join(timeout=max(0.0, kill_by - time.monotonic()) + 0.5)
            self.release_engines()
            shutil.rmtree(self.dir, ignore_errors=True)
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(spec: Spec, json_path: str | None = None, out: IO[str] = sys.stdout) -> int:
    """Start the daemons, play the engines, print (and optionally write) the summary."""
    demo = Demo(spec)
    shared = demo.shared
    # SIGTERM ends the demo like Ctrl-C: through cleanup(), which stops its daemons (the
    # default action would kill this process alone and leave them running).
    main = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, _interrupt) if main else None
    try:
        sender, receivers = demo.start()
        tx, tx_kv = demo.connect(sender)
        endpoint = sender.ready["endpoint"]
        deadline = time.monotonic() + spec.timeout_s
        first = time.monotonic()
        demo.spawn("demo-tx-engine", lambda: sender_engine(tx, tx_kv, shared, deadline))
        for k, d in enumerate(receivers):
            client, kv = demo.connect(d)
            engine = ReceiverEngine(k, client, kv, endpoint, shared, deadline)
            for t in range(spec.inflight):
                demo.spawn(f"demo-rx-{k}-engine-{t}", engine.run_one_thread)
        demo.watch(deadline)
        elapsed = time.monotonic() - first
        try:
            metrics = scrape_metrics(sender.ready["probe_port"])
        except OSError as e:
            sys.stderr.write(f"demo: sender /metrics not read: {e}\n")
            metrics = {}
        demo.release_engines()
        codes = demo.stop()
        for d in demo.daemons:  # while their logs are still there
            if d.exit_code:
                sys.stderr.write(f"demo: {d.name} exited with {d.exit_code}{d.tail()}\n")
    except KeyboardInterrupt:
        out.write("demo: interrupted\n")
        return 130
    except Exception as e:  # DemoError, an engine call that failed, an OSError: say so, exit 1
        why = str(e) if isinstance(e, DemoError) else f"{type(e).__name__}: {e}"
        out.write(f"demo: failed: {why}\n")
        for what in shared.first_failures:
            out.write(f"  {what}\n")
        return 1
    finally:
        demo.cleanup()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)

    lat_ms = np.array(shared.latencies) * 1000 if shared.latencies else np.zeros(1)
    workers = sum(1 for k in metrics if k.startswith("kvxferd_queue_depth{"))
    summary = {
        "requests": shared.done,
        "bytes": shared.moved,
        "elapsed_s": round(elapsed, 3),
        "gbps": round(shared.moved / elapsed / 1e9, 3) if elapsed > 0 else 0.0,
        "p50_ms": round(float(np.percentile(lat_ms, 50)), 3),
        "p99_ms": round(float(np.percentile(lat_ms, 99)), 3),
        "failures": shared.failures + shared.sender_failures + shared.unsafe_closes,
        "mismatches": shared.mismatches,
        "receivers": spec.receivers,
        "inflight": spec.inflight,
        "sender_threads": workers,
        "workers_used": sum(
            1 for k, v in metrics.items() if k.startswith("kvxferd_worker_slices_total{") and v > 0
        ),
        "sender_slices_done": int(metrics.get('kvxferd_outcomes_total{outcome="done"}', -1)),
        "sender_bytes_written": int(metrics.get("kvxferd_bytes_total", -1)),
        "exit_codes": codes,
        "security": "curve",
    }
    out.write(
        f"demo: {summary['requests']} requests, {shared.moved / 1e9:.2f} GB in {elapsed:.2f} s "
        f"({summary['gbps']:.2f} GB/s), p50 {summary['p50_ms']:.2f} ms, p99 {summary['p99_ms']:.2f} ms, "
        f"{summary['failures']} failures, {summary['mismatches']} mismatches, "
        f"{spec.receivers} receiver daemon(s), control plane CURVE (a key pair per daemon), "
        f"daemon exit codes {codes}\n"
    )
    for what in shared.first_failures:
        out.write(f"  {what}\n")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=2)
    ok = summary["failures"] == 0 and summary["mismatches"] == 0 and not any(codes)
    ok = ok and summary["requests"] == spec.requests
    return 0 if ok else 1
