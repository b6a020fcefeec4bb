"""Real processes, real ZMQ on loopback, real NIXL (UCX between processes): no test doubles.

The peers are ``tests/support/peers.py`` children; they report in JSON lines on stdout.
A Sender or Receiver in the test process is used where the test must watch or
steer it closely (kill a peer while its writes are in flight, time a shutdown).
Every child is killed in teardown and every wait has a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zmq

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.errors import Reason
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.drain import ShutdownReport
from kvxferd.transfer.pool import IdAllocator
from kvxferd.transfer.receiver import Receiver, RxHandle
from kvxferd.transfer.sender import Sender
from kvxferd.transfer.session import RxState, TxState
from tests.support.conditions import wait_until
from tests.support.peers import PeerProcess, Publisher, check_request, request_content

pytestmark = pytest.mark.integration

DEADLINES: dict[str, int] = dict(
    kv_transfer_timeout_ms=2000,
    cancel_fence_ms=500,
    drain_timeout_ms=1000,
    shutdown_timeout_ms=3000,
    xfer_stall_timeout_ms=2000,
    register_timeout_ms=2000,
)
KV_TIMEOUT_S = DEADLINES["kv_transfer_timeout_ms"] / 1000
FENCE_S = DEADLINES["cancel_fence_ms"] / 1000
DRAIN_S = DEADLINES["drain_timeout_ms"] / 1000
SHUTDOWN_S = DEADLINES["shutdown_timeout_ms"] / 1000
STALL_S = DEADLINES["xfer_stall_timeout_ms"] / 1000
MARGIN_S = 1.5  # scheduling slack on a loaded 2-core host
STARTUP_S = 60.0  # a child imports torch and NIXL and creates an agent

SMALL_BLOCK = 16 << 10  # 16 KiB blocks: many small requests
BIG_BLOCK = 256 << 10  # 256 KiB blocks x 64 blocks x 2 layers = 32 MiB per request
BIG_BLOCKS = 64


def pool(num_blocks: int, block_bytes: int, num_layers: int = 2) -> dict[str, Any]:
    return dict(
        num_layers=num_layers, num_blocks=num_blocks, block_elems=block_bytes, dtype="uint8"
    )


# -- fixtures -------------------------------------------------------------------------------

Spawn = Callable[..., PeerProcess]


def _peer_args(opts: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for key, value in opts.items():
        if isinstance(value, dict):
            value = json.dumps(value)
        elif isinstance(value, range):
            value = f"{value.start}:{value.stop}:{value.step}"
        elif isinstance(value, tuple):
            value = ":".join(str(v) for v in value)
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


@pytest.fixture
def peers(request: pytest.FixtureRequest, tmp_path: Path) -> Spawn:
    """Spawn peer children; every one is SIGCONT+SIGKILLed and reaped in teardown."""
    spawned: list[PeerProcess] = []

    def kill_all() -> None:
        for p in spawned:
            p.kill()

    request.addfinalizer(kill_all)

    def spawn(role: str, name: str, **opts: Any) -> PeerProcess:
        p = PeerProcess(role, _peer_args(opts), tmp_path, name)
        spawned.append(p)
        return p

    return spawn


class Local:
    """Senders, receivers and publishers in the test process; all stopped in teardown."""

    def __init__(self) -> None:
        self._senders: list[Sender] = []
        self._receivers: list[Receiver] = []
        self._publishers: list[Publisher] = []
        self._down: set[int] = set()

    def sender(self, **overrides: Any) -> Sender:
        settings = load_sender_settings(
            listen="tcp://127.0.0.1:0", deadlines=DEADLINES, **overrides
        )
        s = Sender(settings).start()
        self._senders.append(s)
        return s

    def receiver(self, **overrides: Any) -> Receiver:
        r = Receiver(load_receiver_settings(deadlines=DEADLINES, **overrides)).start()
        self._receivers.append(r)
        return r

    def publisher(self, sender: Sender, **kwargs: Any) -> Publisher:
        p = Publisher(sender, **kwargs).start()
        self._publishers.append(p)
        return p

    def shutdown_sender(self, s: Sender) -> ShutdownReport:
        self._down.add(id(s))
        return s.shutdown()

    def shutdown_receiver(self, r: Receiver) -> bool:
        self._down.add(id(r))  # Receiver.shutdown closes its eventfd: call it once
        return r.shutdown()

    def close(self) -> None:
        for p in self._publishers:
            p.stop()
        for s in self._senders:
            if id(s) not in self._down:
                s.shutdown()
        for r in self._receivers:
            if id(r) not in self._down:
                r.shutdown()


@pytest.fixture
def local() -> Iterator[Local]:
    svc = Local()
    yield svc
    svc.close()


# -- helpers --------------------------------------------------------------------------------


def landed(r: Receiver, dst: np.ndarray, want: torch.Tensor) -> bool:
    """True once the first block of layer 0 holds its expected stamp (a write has begun)."""
    return bool(torch.equal(r.pool.kv_bytes_view()[0, int(dst[0]), :16], want[0, 0, :16]))


def sender_peer(
    peers: Spawn,
    name: str,
    *,
    prefix: str,
    count: int,
    capacity: int,
    blocks: int,
    block_bytes: int,
    num_threads: int = 2,
    aux_bytes: int = 0,
    settings: dict[str, Any] | None = None,
    **opts: Any,
) -> tuple[PeerProcess, str]:
    """A sender child with room for ``capacity`` requests at once; returns it and its endpoint."""
    settings = settings or dict(
        pool=pool(capacity * blocks, block_bytes), num_threads=num_threads, deadlines=DEADLINES
    )
    tx = peers(
        "sender",
        name,
        settings=settings,
        prefix=prefix,
        count=count,
        blocks=blocks,
        aux_bytes=aux_bytes,
        **opts,
    )
    return tx, tx.wait_event("ready", STARTUP_S)["endpoint"]


def stop_sender_peer(tx: PeerProcess) -> dict[str, Any]:
    """SIGTERM the sender child; its shutdown report. It must exit 0 (drained)."""
    tx.signal(signal.SIGTERM)
    report = tx.wait_event("shutdown", SHUTDOWN_S + MARGIN_S + 5)
    assert tx.wait_exit(10) == 0, tx.describe()
    return report


# -- a. many requests, several workers, two receiver processes ------------------------------


@pytest.mark.parametrize("split", ["disjoint_requests", "layer_slices"])
def test_two_receivers_get_every_byte_from_a_multi_worker_sender(peers: Spawn, split: str) -> None:
    """Sixty requests through a 4-worker sender to two receiver processes all end done and byte-exact, on more than one worker."""
    n, blocks, layers = 60, 4, 4
    fetches = 2 if split == "layer_slices" else 1
    tx, ep = sender_peer(
        peers,
        "tx",
        prefix="a",
        count=n,
        capacity=n,
        blocks=blocks,
        block_bytes=SMALL_BLOCK,
        num_threads=4,
        aux_bytes=48,
        expected_fetches=fetches,
        settings=dict(
            pool=pool(n * blocks, SMALL_BLOCK, layers),
            num_threads=4,
            deadlines={**DEADLINES, "kv_transfer_timeout_ms": 10_000},
        ),
    )
    rx_settings = dict(
        pool=pool(n * blocks, SMALL_BLOCK, layers),
        deadlines={**DEADLINES, "kv_transfer_timeout_ms": 10_000},
    )
    if split == "disjoint_requests":
        shares = [dict(ids=range(0, n, 2)), dict(ids=range(1, n, 2))]
    else:
        shares = [dict(ids=range(0, n), layers=(0, 2)), dict(ids=range(0, n), layers=(2, 4))]
    rxs = [
        peers(
            "receiver",
            f"rx{i}",
            settings=rx_settings,
            endpoint=ep,
            prefix="a",
            blocks=blocks,
            window=4,
            aux_bytes=48,
            **share,
        )
        for i, share in enumerate(shares)
    ]
    for rx, share in zip(rxs, shares, strict=True):
        summary = rx.wait_event("summary", 60)
        expected = len(share["ids"])
        assert summary["mismatches"] == 0, rx.describe()
        assert summary["done"] == summary["verified"] == expected, summary
        assert rx.wait_exit(10) == 0, rx.describe()
        fetched = rx.events("fetched")
        assert len(fetched) == expected and all(e["state"] == "done" for e in fetched)
    ended = tx.wait_events("ended", n, 10)
    assert all(e["state"] == "complete" and e["drained"] for e in ended), ended
    report = stop_sender_peer(tx)
    assert report["drained"] and report["threads_joined"]
    assert sum(report["workers"].values()) == n * fetches, report
    assert len(report["workers"]) > 1, f"one worker served everything: {report['workers']}"


# -- pools of different sizes ---------------------------------------------------------------


@pytest.mark.parametrize("rx_blocks", [32, 128])
def test_receiver_pool_of_another_size_gets_every_byte(
    peers: Spawn, local: Local, rx_blocks: int
) -> None:
    """A receiver whose pool has fewer or more blocks than the sender's still gets every request byte-exact."""
    blocks, n = 4, 8
    tx, ep = sender_peer(
        peers, "tx", prefix="p", count=n, capacity=16, blocks=blocks, block_bytes=SMALL_BLOCK
    )
    r = local.receiver(pool=pool(rx_blocks, SMALL_BLOCK))
    alloc = IdAllocator(rx_blocks, shuffle_seed=1)
    for i in range(n):
        dst = alloc.take(blocks)
        out = r.fetch(f"p-{i}", ep, dst).wait(KV_TIMEOUT_S + MARGIN_S)
        assert out is not None and out.state is RxState.DONE, out
        assert check_request(r.pool, f"p-{i}", dst) == ""


# -- b. cancel during a transfer ------------------------------------------------------------


def test_cancel_during_transfer_ends_done_and_exact_or_cancelled_and_fenced(
    peers: Spawn, local: Local
) -> None:
    """A fetch cancelled right after it starts ends DONE with exact bytes or CANCELLED, and close() says its blocks are free."""
    n, cap = 13, 4
    tx, ep = sender_peer(
        peers,
        "tx",
        prefix="b",
        count=n,
        capacity=cap,
        blocks=BIG_BLOCKS,
        block_bytes=BIG_BLOCK,
        aux_bytes=32,
    )
    r = local.receiver(pool=pool(cap * BIG_BLOCKS, BIG_BLOCK))
    alloc = IdAllocator(cap * BIG_BLOCKS, shuffle_seed=2)
    states: list[str] = []
    for i in range(n):
        rid = f"b-{i}"
        want = request_content(rid, 2, BIG_BLOCKS, BIG_BLOCK)
        dst = alloc.take(BIG_BLOCKS)
        r.pool.kv_bytes_view()[0, torch.from_numpy(dst), :16] = 0  # no stale stamp
        # A cancel *during* a transfer: its request is published first. (A fetch that came
        # before its publish is parked; cancelled there, the session it was for keeps its
        # blocks until publish_ttl_ms, and this sender's room for `cap` requests runs out.)
        tx.wait_event("published", STARTUP_S, where=lambda e, rid=rid: e["id"] == rid)
        h = r.fetch(rid, ep, dst)
        if i == 0:
            pass  # the first fetch registers with the sender and runs to the end
        elif i % 2:
            h.cancel()  # right after the fetch
        else:  # once its first bytes land (or it ended first)
            wait_until(
                lambda d=dst, w=want, h=h: landed(r, d, w) or h.wait(0) is not None,
                KV_TIMEOUT_S + MARGIN_S,
                "bytes land",
            )
            h.cancel()
        out = h.wait(KV_TIMEOUT_S + MARGIN_S)
        assert out is not None, f"{rid}: no outcome"
        if i == 0:
            assert out.state is RxState.DONE, out
        assert out.state in (RxState.DONE, RxState.CANCELLED), f"{rid}: {out}"
        if out.state is RxState.DONE:
            assert check_request(r.pool, rid, dst, aux=out.aux, aux_bytes=32) == "", rid
        assert h.close(FENCE_S + MARGIN_S), f"{rid}: blocks still fenced after {out}"
        alloc.give_back(dst.tolist())
        states.append(str(out.state))
    assert local.shutdown_receiver(r)
    ended = tx.events("ended")
    assert ended and all(e["drained"] and e["writes_in_flight"] == 0 for e in ended), ended
    stop_sender_peer(tx)
    print("outcomes:", {s: states.count(s) for s in set(states)})


# -- c. a receiver killed mid-transfer ------------------------------------------------------


def test_receiver_killed_mid_transfer_leaves_the_sender_healthy(peers: Spawn, local: Local) -> None:
    """After a receiver is SIGKILLed mid-transfer its sessions end, close() is True only once drained, a new receiver is served and shutdown is bounded."""
    cap, window = 6, 3
    s = local.sender(pool=pool(cap * BIG_BLOCKS, BIG_BLOCK), num_threads=2)
    pub = local.publisher(s, prefix="c", count=10**6, blocks=BIG_BLOCKS, aux_bytes=32)
    rx_opts = dict(
        settings=dict(pool=pool(cap * BIG_BLOCKS, BIG_BLOCK), deadlines=DEADLINES),
        endpoint=s.endpoint,
        blocks=BIG_BLOCKS,
        window=window,
        aux_bytes=32,
    )
    rx = peers("receiver", "rx", prefix="c", ids=range(0, 10**6), **rx_opts)
    rx.wait_event("fetched", STARTUP_S, where=lambda e: e["verified"])
    wait_until(lambda: s.writes_in_flight() > 0, 10, "a write in flight")
    os.kill(rx.pid, signal.SIGKILL)
    in_flight_at_kill = s.writes_in_flight()
    pub.pause()
    assert rx.wait_exit(10) == -signal.SIGKILL

    def fetched_open() -> list[Any]:
        return [h for h in pub.open_handles() if h.session.slices() and h.wait(0) is None]

    wait_until(
        lambda: not fetched_open(), KV_TIMEOUT_S + STALL_S + MARGIN_S, "fetched sessions end"
    )
    now = time.monotonic()  # listener and workers still turn over (they tick every 50 ms)
    assert now - s.listener_progress < 1.0, "listener stuck"
    assert all(now - t < 1.0 for t in s.worker_progress()), s.worker_progress()
    pub.stop()
    pub.close_all(DRAIN_S)  # the requests nobody fetched
    fetched = [rec for rec in pub.records if rec["slices"]]
    assert fetched, pub.records
    for rec in fetched:
        assert rec["state"] in (TxState.COMPLETE, TxState.FAILED), rec
    for rec in pub.records:
        if rec["drained"]:
            assert rec["writes_in_flight"] == 0, rec
        else:
            assert rec["in_doubt"] or rec["writes_in_flight"] > 0, (
                f"close() False, nothing out: {rec}"
            )
    print(
        f"writes in flight at kill: {in_flight_at_kill}; fetched outcomes:",
        [(r["id"], r["state"], r["reason"]) for r in fetched[-window:]],
    )

    pub2 = local.publisher(
        s, prefix="c2", count=6, blocks=BIG_BLOCKS, aux_bytes=32, alloc=pub.alloc
    )
    rx2 = peers("receiver", "rx2", prefix="c2", ids=range(0, 6), **rx_opts)
    summary = rx2.wait_event("summary", STARTUP_S)
    assert summary["verified"] == 6 and summary["mismatches"] == 0, rx2.describe()
    assert rx2.wait_exit(10) == 0
    wait_until(lambda: pub2.finished, DRAIN_S + MARGIN_S, "second receiver's sessions closed")
    assert all(rec["state"] == TxState.COMPLETE and rec["drained"] for rec in pub2.records)
    pub2.stop()

    t0 = time.monotonic()
    report = local.shutdown_sender(s)
    elapsed = time.monotonic() - t0
    assert elapsed <= SHUTDOWN_S + MARGIN_S, report
    assert report.threads_joined, report
    in_doubt = sum(1 for rec in pub.records if not rec["drained"])
    assert report.drained or in_doubt, report


# -- d. a sender killed mid-transfer --------------------------------------------------------


def test_sender_killed_mid_transfer_fails_open_fetches_within_the_timeout(
    peers: Spawn, local: Local
) -> None:
    """When the sender process is SIGKILLed mid-transfer every open fetch fails with timeout or peer_lost within kv_transfer_timeout plus a margin."""
    n = 8
    tx, ep = sender_peer(
        peers, "tx", prefix="d", count=n, capacity=n, blocks=BIG_BLOCKS, block_bytes=BIG_BLOCK
    )
    tx.wait_events("published", n, 30)
    r = local.receiver(pool=pool(n * BIG_BLOCKS, BIG_BLOCK))
    alloc = IdAllocator(n * BIG_BLOCKS, shuffle_seed=4)
    wants = [request_content(f"d-{i}", 2, BIG_BLOCKS, BIG_BLOCK) for i in range(n)]
    dsts = [alloc.take(BIG_BLOCKS) for _ in range(n)]
    t_fetch = time.monotonic()
    handles = [r.fetch(f"d-{i}", ep, dst) for i, dst in enumerate(dsts)]
    wait_until(
        lambda: any(landed(r, d, w) for d, w in zip(dsts, wants, strict=True)),
        KV_TIMEOUT_S + MARGIN_S,
        "first bytes land",
    )
    os.kill(tx.pid, signal.SIGKILL)
    open_at_kill = [h for h in handles if h.wait(0) is None]
    assert open_at_kill, "every fetch finished before the kill: nothing was mid-transfer"
    failed = 0
    for i, h in enumerate(handles):
        out = h.wait(max(0.0, t_fetch + KV_TIMEOUT_S + MARGIN_S - time.monotonic()))
        assert out is not None, f"d-{i} still open {time.monotonic() - t_fetch:.2f}s after fetch"
        if out.state is RxState.DONE:
            assert check_request(r.pool, f"d-{i}", dsts[i]) == "", f"d-{i}"
        else:
            failed += 1
            assert out.state in (RxState.TIMED_OUT, RxState.FAILED), out
            assert out.reason in (Reason.TIMEOUT, Reason.PEER_LOST), out
    assert failed >= 1
    t0 = time.monotonic()
    local.shutdown_receiver(r)
    assert time.monotonic() - t0 <= SHUTDOWN_S + MARGIN_S


# -- e. a receiver that stops reading -------------------------------------------------------


def test_sender_shuts_down_in_bound_while_a_receiver_is_stopped(peers: Spawn, local: Local) -> None:
    """With a SIGSTOPped receiver mid-transfer the sender still shuts down within shutdown_timeout plus a margin."""
    cap, window = 6, 3
    s = local.sender(pool=pool(cap * BIG_BLOCKS, BIG_BLOCK), num_threads=2)
    pub = local.publisher(s, prefix="e", count=10**6, blocks=BIG_BLOCKS, aux_bytes=32)
    rx = peers(
        "receiver",
        "rx",
        prefix="e",
        ids=range(0, 10**6),
        settings=dict(pool=pool(cap * BIG_BLOCKS, BIG_BLOCK), deadlines=DEADLINES),
        endpoint=s.endpoint,
        blocks=BIG_BLOCKS,
        window=window,
        aux_bytes=32,
    )
    rx.wait_event("fetched", STARTUP_S, where=lambda e: e["verified"])
    wait_until(lambda: s.writes_in_flight() > 0, 10, "a write in flight")
    rx.signal(signal.SIGSTOP)
    pub.pause()  # the engine stops writing into the pool before the sender unmaps it
    t0 = time.monotonic()
    report = local.shutdown_sender(s)
    elapsed = time.monotonic() - t0
    assert elapsed <= SHUTDOWN_S + MARGIN_S, (elapsed, report)
    assert rx.alive(), "the stopped receiver died: the test measured nothing"
    print(f"shutdown with a stopped receiver: {report}")


def test_sender_shuts_down_in_bound_with_a_peer_that_never_reads(local: Local) -> None:
    """A DEALER that floods the sender with CANCELs and never reads the replies cannot hold up its shutdown."""
    s = local.sender(pool=pool(64, SMALL_BLOCK), limits=dict(sndhwm=100))
    # Well-formed CANCELs before any REGISTER: each one earns a Reject on the listener's ROUTER.
    frame = wire.encode(wire.Cancel(request_id="never-published", fetch_id=1))
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.setsockopt(zmq.RCVBUF, 4096)
    dealer.setsockopt(zmq.SNDTIMEO, 1000)
    dealer.connect(s.endpoint)
    try:
        # Flood until whole batches of replies are dropped: the path to this peer is full.
        sent, dropped_in_batch, deadline = 0, 0, time.monotonic() + 20
        while dropped_in_batch < 900 and time.monotonic() < deadline:
            before = s.stats.get("reply_dropped")
            for _ in range(1000):
                dealer.send(frame)
            sent += 1000
            wait_until(
                lambda n=sent: s.stats.get(f"rejected_{Reason.UNKNOWN_PEER}") >= n,
                10,
                "the listener takes every frame",
            )
            dropped_in_batch = s.stats.get("reply_dropped") - before
        assert dropped_in_batch >= 900, f"{sent} frames sent, replies still flowing"
        t0 = time.monotonic()
        report = local.shutdown_sender(s)
        elapsed = time.monotonic() - t0
    finally:
        dealer.close(linger=0)
    assert elapsed <= SHUTDOWN_S + MARGIN_S, (elapsed, report)
    assert report.drained and report.threads_joined, report
    print(f"{sent} CANCELs, {s.stats.get('reply_dropped')} replies dropped; {report}")


# -- f. a frozen sender ---------------------------------------------------------------------


def test_frozen_sender_times_out_fetches_and_keeps_their_blocks_in_doubt(
    peers: Spawn, local: Local
) -> None:
    """With the sender SIGSTOPped mid-transfer an open fetch times out with reason timeout and close() keeps its blocks (False)."""
    n = 7
    tx, ep = sender_peer(
        peers, "tx", prefix="f", count=n, capacity=n, blocks=BIG_BLOCKS, block_bytes=BIG_BLOCK
    )
    tx.wait_events("published", n, 30)
    r = local.receiver(pool=pool(n * BIG_BLOCKS, BIG_BLOCK))
    alloc = IdAllocator(n * BIG_BLOCKS, shuffle_seed=6)
    warm = alloc.take(BIG_BLOCKS)
    out = r.fetch("f-0", ep, warm).wait(KV_TIMEOUT_S + MARGIN_S)
    assert out is not None and out.state is RxState.DONE, out
    assert check_request(r.pool, "f-0", warm) == ""
    wants = [request_content(f"f-{i}", 2, BIG_BLOCKS, BIG_BLOCK) for i in range(1, n)]
    dsts = [alloc.take(BIG_BLOCKS) for _ in range(1, n)]
    t_fetch = time.monotonic()
    handles: list[RxHandle] = [r.fetch(f"f-{i}", ep, d) for i, d in enumerate(dsts, start=1)]
    wait_until(
        lambda: any(landed(r, d, w) for d, w in zip(dsts, wants, strict=True)),
        KV_TIMEOUT_S + MARGIN_S,
        "first bytes land",
    )
    tx.signal(signal.SIGSTOP)
    timed_out = 0
    for i, (h, dst) in enumerate(zip(handles, dsts, strict=True), start=1):
        out = h.wait(max(0.0, t_fetch + KV_TIMEOUT_S + MARGIN_S - time.monotonic()))
        assert out is not None, f"f-{i} still open {time.monotonic() - t_fetch:.2f}s after fetch"
        if out.state is RxState.DONE:
            assert check_request(r.pool, f"f-{i}", dst) == "", f"f-{i}"
            assert h.close(FENCE_S)
            continue
        timed_out += 1
        assert out.state is RxState.TIMED_OUT and out.reason is Reason.TIMEOUT, out
        assert h.close(FENCE_S + MARGIN_S) is False, f"f-{i}: blocks released without an ack"
    assert timed_out >= 1, "every fetch finished before the freeze: nothing was mid-transfer"
    t0 = time.monotonic()
    assert local.shutdown_receiver(r) is False  # blocks in doubt are never reported safe
    assert time.monotonic() - t0 <= SHUTDOWN_S + MARGIN_S
