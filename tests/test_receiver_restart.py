"""The receiver across sender faults, with real processes and real NIXL: a restart loses no fetch, a thaw resolves doubt.

Senders are ``tests/peers.py`` children (SIGKILLed, restarted on the same
endpoint, SIGSTOPped and resumed); the receiver runs in the test process so the
test can watch each fetch's handle and its blocks.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvxferd.config import load_receiver_settings
from kvxferd.errors import Reason
from kvxferd.pool import IdAllocator
from kvxferd.receiver import Receiver, RxHandle
from kvxferd.session import RxState
from tests.conditions import wait_until
from tests.peers import PeerProcess, check_request, request_content
from tests.test_integration import _peer_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STARTUP_S = 60.0  # a child imports torch and NIXL and creates an agent
BLOCK = 64 << 10
BLOCKS = 16
DEADLINES: dict[str, int] = dict(
    kv_transfer_timeout_ms=2000,
    cancel_fence_ms=500,
    drain_timeout_ms=1000,
    shutdown_timeout_ms=3000,
    xfer_stall_timeout_ms=2000,
    register_timeout_ms=2000,
    in_doubt_retry_ms=200,
    in_doubt_retry_max_ms=1000,
)


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
    r = Receiver(load_receiver_settings(pool=pool(n), deadlines=DEADLINES)).start()
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
