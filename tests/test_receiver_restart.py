"""The receiver across sender faults, with real processes and real NIXL: a restart loses no fetch, a thaw resolves doubt.

Senders are ``tests/support/peers.py`` children (SIGKILLed, restarted on the same
endpoint, SIGSTOPped and resumed); the receiver runs in the test process so the
test can watch each fetch's handle and its blocks.
"""

from __future__ import annotations

import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvxferd.config import load_receiver_settings
from kvxferd.errors import Reason
from kvxferd.transfer.pool import IdAllocator
from kvxferd.transfer.receiver import Receiver, RxHandle
from kvxferd.transfer.session import RxState
from tests.support.conditions import wait_until
from tests.support.peers import PeerProcess, check_request, request_content
from tests.test_daemon import DaemonProcess, Engines, daemon_env, gauge
from tests.test_integration import DEADLINES as INTEGRATION_DEADLINES
from tests.test_integration import _peer_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STARTUP_S = 60.0  # a child imports torch and NIXL and creates an agent
BLOCK = 64 << 10
BLOCKS = 16
# The integration tests' deadlines, with in-doubt fetches asked about again quickly.
DEADLINES: dict[str, int] = {
    **INTEGRATION_DEADLINES,
    "in_doubt_retry_ms": 200,
    "in_doubt_retry_max_ms": 1000,
}


def pool(requests: int, block_bytes: int = BLOCK) -> dict[str, Any]:
    return dict(num_layers=2, num_blocks=requests * BLOCKS, block_elems=block_bytes, dtype="uint8")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Spawn = Callable[..., PeerProcess]


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Start peer children; each is SIGCONT+SIGKILLed and reaped in teardown."""
    spawned: list[PeerProcess] = []

    def start(role: str, name: str, **opts: Any) -> PeerProcess:
        p = PeerProcess(role, _peer_args(opts), tmp_path, name)
        spawned.append(p)
        return p

    yield start
    for p in spawned:
        p.kill()


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for r in made:
        if not r._draining.is_set():
            r.shutdown()


def test_a_sender_restart_resends_every_parked_fetch_to_the_new_incarnation(
    spawn: Spawn, receivers: list[Receiver]
) -> None:
    """8 fetches parked on a sender that is SIGKILLed and restarted on the same endpoint all complete byte-exact (or fail peer_restarted), none by timeout."""
    n, fetch_timeout_ms = 8, 120_000
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    settings = dict(listen=endpoint, pool=pool(n), num_threads=2, deadlines=DEADLINES)
    first = spawn("sender", "tx-first", settings=settings, prefix="g", count=0, blocks=BLOCKS)
    first.wait_event("ready", STARTUP_S)
    # A receiver that waits out a restart: its link is not declared down (which would end
    # the parked fetches peer_lost within a second, test_dead_peer.py) while the sender is away.
    waits = {**DEADLINES, "peer_down_ms": fetch_timeout_ms}
    r = Receiver(load_receiver_settings(pool=pool(n), deadlines=waits)).start()
    receivers.append(r)
    alloc = IdAllocator(n * BLOCKS, shuffle_seed=9)
    dsts = [alloc.take(BLOCKS) for _ in range(n)]
    handles = [
        r.fetch(f"g-{i}", endpoint, d, timeout_ms=fetch_timeout_ms) for i, d in enumerate(dsts)
    ]
    wait_until(lambda: all(h.session.sent for h in handles), 10, "every RequestData sent")
    first.signal(signal.SIGKILL)
    first.wait_exit(10)
    second = spawn("sender", "tx-second", settings=settings, prefix="g", count=n, blocks=BLOCKS)
    second.wait_event("ready", STARTUP_S)
    t_ready = time.monotonic()
    for i, h in enumerate(handles):
        out = h.wait(max(0.0, t_ready + 30 - time.monotonic()))
        assert out is not None, f"g-{i} still open 30 s after the new sender was ready"
        if out.state is RxState.DONE:
            assert check_request(r.pool, f"g-{i}", dsts[i]) == "", f"g-{i}"
        else:
            assert out.reason is Reason.PEER_RESTARTED, out
    done = sum(1 for h in handles if h.wait(0) is not None and h.wait(0).ok)  # type: ignore[union-attr]
    print(f"after the restart: {done}/{n} done, stats {r.stats.snapshot()}")
    assert done == n
    assert r.stats.get("sender_restarts") == 1
    assert r.shutdown() is True


def test_a_thawed_sender_resolves_every_in_doubt_fetch_and_shutdown_is_safe(
    spawn: Spawn, receivers: list[Receiver]
) -> None:
    """Fetches that timed out in doubt while the sender was frozen become reusable once it resumes; shutdown is safe."""
    n = 6
    tx = spawn(
        "sender",
        "tx",
        settings=dict(pool=pool(n, 256 << 10), num_threads=2, deadlines=DEADLINES),
        prefix="h",
        count=n,
        blocks=BLOCKS,
    )
    ep = tx.wait_event("ready", STARTUP_S)["endpoint"]
    tx.wait_events("published", n, 30)
    r = Receiver(load_receiver_settings(pool=pool(n, 256 << 10), deadlines=DEADLINES)).start()
    receivers.append(r)
    alloc = IdAllocator(n * BLOCKS, shuffle_seed=3)
    dsts = [alloc.take(BLOCKS) for _ in range(n)]
    wants = [request_content(f"h-{i}", 2, BLOCKS, 256 << 10) for i in range(n)]
    handles: list[RxHandle] = [r.fetch(f"h-{i}", ep, d) for i, d in enumerate(dsts)]

    def landed(dst: np.ndarray, want: torch.Tensor) -> bool:
        return bool(torch.equal(r.pool.kv_bytes_view()[0, int(dst[0]), :16], want[0, 0, :16]))

    wait_until(
        lambda: any(landed(d, w) for d, w in zip(dsts, wants, strict=True)), 10, "bytes land"
    )
    tx.signal(signal.SIGSTOP)
    for h in handles:
        assert h.wait(10) is not None
    stuck = [h for h in handles if not h.close(1.0)]
    if not stuck:
        pytest.skip("every fetch finished before the freeze: nothing was in doubt")
    assert r.in_doubt() == len(stuck)
    tx.signal(signal.SIGCONT)
    wait_until(lambda: all(h.close(0) for h in stuck), 20, "every in-doubt fetch resolved")
    assert r.in_doubt() == 0
    assert r.aux_slots.free == r.pool.layout.aux_slots
    print(f"{len(stuck)} in doubt resolved after the thaw; stats {r.stats.snapshot()}")
    assert r.shutdown() is True


@pytest.fixture
def daemon_pair() -> Iterator[tuple[DaemonProcess, DaemonProcess, Engines]]:
    """A sender and a receiver daemon (TCP data plane: slow enough to freeze mid-transfer)."""
    sock_dir = tempfile.mkdtemp(prefix="kx")
    env = daemon_env(KVXFERD_DATAPLANE__UCX_TLS="tcp", KVXFERD_DEADLINES__IN_DOUBT_RETRY_MS=200)
    tx = DaemonProcess("sender", "tx", sock_dir, env, ["--listen", "tcp://127.0.0.1:0"])
    rx = DaemonProcess("receiver", "rx", sock_dir, env, [])
    engines = Engines()
    try:
        tx.wait_ready(), rx.wait_ready()
        yield tx, rx, engines
    finally:
        engines.close()
        tx.kill(), rx.kill()
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_a_receiver_daemon_exits_0_once_a_frozen_sender_resumed_and_answered(
    daemon_pair: tuple[DaemonProcess, DaemonProcess, Engines],
) -> None:
    """Fetches in doubt while the sender was SIGSTOPped are resolved after SIGCONT, so SIGTERM exits 0, not 3."""
    tx, rx, engines = daemon_pair
    ct, pt = engines.client(tx)
    cr, _ = engines.client(rx)
    n, blocks = 8, 64
    for i in range(n):
        pt[:, i * blocks : (i + 1) * blocks] = request_content(f"p-{i}", 2, blocks, 256 << 10)
        ct.publish(f"p-{i}", list(range(i * blocks, (i + 1) * blocks)))
    gets = [
        cr.fetch(f"p-{i}", tx.endpoint, list(range(i * blocks, (i + 1) * blocks))) for i in range(n)
    ]
    first = cr.wait(gets[0], 10)
    assert first is not None and first.state == "done", first
    tx.signal(signal.SIGSTOP)
    outs = [cr.wait(h, 10) for h in gets]
    assert all(o is not None for o in outs), outs
    if all(o is not None and o.state == "done" for o in outs):
        pytest.skip("every fetch finished before the freeze: nothing was in doubt")
    # kv_transfer_timeout passed; the fence (0.5 s) passes unanswered: those fetches are in doubt.
    open_ones = [h for h, o in zip(gets, outs, strict=True) if o is not None and o.state != "done"]

    def in_doubt() -> list[bool]:
        return [bool(o is not None and o.in_doubt) for o in map(cr.poll, open_ones)]

    wait_until(lambda: all(in_doubt()), 5, "fetches in doubt")
    tx.signal(signal.SIGCONT)
    wait_until(
        lambda: all(o is not None and o.reusable for o in map(cr.poll, open_ones)),
        20,
        "every in-doubt fetch resolved after the thaw",
    )
    assert gauge(rx.probe_port, "kvxferd_writes_in_flight") == 0
    rx.signal(signal.SIGTERM)
    code, elapsed = rx.wait_exit(10)
    print(f"receiver daemon after the thaw: exit {code} in {elapsed:.3f}s")
    assert code == 0, rx.describe()
