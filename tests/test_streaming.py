"""Streamed publishes: KV written layer by layer as the engine marks layers ready (issue 25).

A real Sender and Receiver (real NIXL, UCX moving DRAM) in this process; the test plays
the prefill engine (publish with ``streamed=True``, then progress marks, in process or
through the engine gateway) and watches the receiver's pool: each layer lands only after
it was marked, later layers stay untouched, and the fetch is done only once the last
layer landed. One deterministic test uses a controlled data plane (kvxferd.testing) to
decide when each WRITE ends and check the order of a stream's writes. Every wait has a
deadline.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.engine.client import AsyncClient, Client
from kvxferd.engine.engine_protocol import EngineReason
from kvxferd.engine.gateway import Gateway
from kvxferd.errors import Reason, RejectedError
from kvxferd.testing import ControlledDataPlane
from kvxferd.transfer.receiver import Receiver, RxHandle
from kvxferd.transfer.sender import Sender
from kvxferd.transfer.session import RxState, TxState
from tests.support.conditions import wait_until
from tests.test_hetero import Daemons, _pool
from tests.test_topology_reshard import SWEEP, Case, _World

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LAYERS = 4
POOL: dict[str, Any] = dict(
    num_layers=LAYERS, num_blocks=32, block_elems=4096, dtype="uint8", aux_slots=4
)
DEADLINES: dict[str, int] = dict(
    kv_transfer_timeout_ms=20_000,
    cancel_fence_ms=1000,
    drain_timeout_ms=1000,
    shutdown_timeout_ms=4000,
    register_timeout_ms=5000,
)
WAIT_S = 10.0  # bound on any one step
QUIET_S = 0.3  # how long something that must not happen is watched
SRC, DST = [3, 7, 9], [11, 2, 5]


@pytest.fixture(scope="module")
def sender() -> Iterator[Sender]:
    s = Sender(
        load_sender_settings(
            name="stream-tx",
            listen="tcp://127.0.0.1:0",
            pool=POOL,
            deadlines=DEADLINES,
            inline_write_max_bytes=0,  # the worker threads write: lanes and partial writes
        )
    ).start()
    yield s
    s.shutdown(timeout=4.0)


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver(load_receiver_settings(name="stream-rx", pool=POOL, deadlines=DEADLINES)).start()
    yield r
    r.shutdown(timeout=4.0)


def fill(sender: Sender, blocks: list[int], seed: int, layers: range) -> None:
    """What prefill computes: layer l of each block gets bytes derived from (seed, l, block)."""
    kv = sender.pool.kv_bytes_view()
    for layer in layers:
        for b in blocks:
            kv[layer, b] = (seed * 31 + layer * 7 + b) % 251 + 1  # never 0


def landed(receiver: Receiver, layer: int, seed: int) -> bool:
    kv = receiver.pool.kv_bytes_view()
    return all(
        bool(torch.all(kv[layer, d] == (seed * 31 + layer * 7 + s) % 251 + 1))
        for s, d in zip(SRC, DST, strict=True)
    )


def untouched(receiver: Receiver, layers: range) -> bool:
    kv = receiver.pool.kv_bytes_view()
    return all(bool(torch.all(kv[layer, d] == 0)) for layer in layers for d in DST)


def clear(receiver: Receiver) -> None:
    kv = receiver.pool.kv_bytes_view()
    for d in DST:
        kv[:, d] = 0


def parked_fetch(sender: Sender, receiver: Receiver, request_id: str, **kw: Any) -> RxHandle:
    """A fetch sent before its publish, parked at the sender."""
    before = sender.stats.get("fetches_parked")
    h = receiver.fetch(request_id, sender.endpoint, DST, want_aux=False, **kw)
    wait_until(lambda: sender.stats.get("fetches_parked") > before, WAIT_S, "fetch parked")
    return h


def test_a_parked_fetch_is_written_layer_by_layer_and_done_only_after_the_last(
    sender: Sender, receiver: Receiver
) -> None:
    """Each mark writes exactly the layers it made ready: that layer's bytes land while the
    later layers stay untouched and the fetch is not done; after the last mark it is done
    and byte-exact."""
    clear(receiver)
    h = parked_fetch(sender, receiver, "stream-1")
    tx = sender.publish("stream-1", SRC, streamed=True)
    assert tx.session.streaming and tx.session.layers_ready == 0
    assert h.wait(QUIET_S) is None and untouched(receiver, range(LAYERS))
    for layer in range(LAYERS):
        fill(sender, SRC, 1, range(layer, layer + 1))
        tx.progress(layer + 1)
        wait_until(lambda layer=layer: landed(receiver, layer, 1), WAIT_S, f"layer {layer}")
        [view] = [v for v in sender.view().sessions if v.request_id == "stream-1"]
        assert view.layers_ready == layer + 1  # what /debug/state shows
        if layer + 1 < LAYERS:
            assert untouched(receiver, range(layer + 1, LAYERS)), f"after layer {layer}"
            assert not h.session.ended, f"done with layers missing (after layer {layer})"
    out = h.wait(WAIT_S)
    assert out is not None and out.state is RxState.DONE, out
    assert out.nbytes == len(SRC) * LAYERS * sender.pool.layout.block_bytes
    assert all(landed(receiver, layer, 1) for layer in range(LAYERS))
    txo = tx.wait(WAIT_S)
    assert txo is not None and txo.state is TxState.COMPLETE, txo
    assert tx.close(WAIT_S)


def test_a_fetch_arriving_mid_stream_gets_what_is_ready_then_follows(
    sender: Sender, receiver: Receiver
) -> None:
    """A fetch that attaches after two layers were marked gets both at once, then the rest
    as they are marked (and the aux after the last); two fetches (expected_fetches 2) follow
    the same marks."""
    clear(receiver)
    tx = sender.publish("stream-2", SRC, streamed=True, expected_fetches=2, aux=b"stream-aux")
    fill(sender, SRC, 2, range(2))
    sender.progress("stream-2", 2)
    h = receiver.fetch("stream-2", sender.endpoint, DST)  # with the aux, after the last layer
    wait_until(lambda: landed(receiver, 0, 2) and landed(receiver, 1, 2), WAIT_S, "ready layers")
    assert untouched(receiver, range(2, LAYERS)) and not h.session.ended
    other = [20, 21, 22]
    h2 = receiver.fetch("stream-2", sender.endpoint, other, want_aux=False, layers=(1, LAYERS))
    fill(sender, SRC, 2, range(2, LAYERS))
    sender.progress("stream-2", LAYERS)
    for handle in (h, h2):
        out = handle.wait(WAIT_S)
        assert out is not None and out.state is RxState.DONE, out
    assert h.session.outcome is not None and h.session.outcome.aux == b"stream-aux"
    assert all(landed(receiver, layer, 2) for layer in range(LAYERS))
    kv = receiver.pool.kv_bytes_view()
    for s, d in zip(SRC, other, strict=True):
        assert bool(torch.all(kv[0, d] == 0)), "a layer outside the fetch's range was written"
        for layer in range(1, LAYERS):
            assert bool(torch.all(kv[layer, d] == (2 * 31 + layer * 7 + s) % 251 + 1))
    kv[:, other] = 0
    assert tx.close(WAIT_S)


def test_cancel_mid_stream_fails_the_fetch_at_once_and_writes_nothing_after(
    sender: Sender, receiver: Receiver
) -> None:
    """The engine cancels after one layer: the fetch ends failed (cancelled) well before any
    timeout, no byte lands after that, and close releases the blocks."""
    clear(receiver)
    h = parked_fetch(sender, receiver, "stream-3")
    tx = sender.publish("stream-3", SRC, streamed=True)
    fill(sender, SRC, 3, range(LAYERS))  # computed, but only layer 0 is marked
    tx.progress(1)
    wait_until(lambda: landed(receiver, 0, 3), WAIT_S, "layer 0")
    aborted = sender.stats.get("streams_aborted")
    t0 = time.monotonic()
    assert tx.cancel()
    out = h.wait(WAIT_S)
    took = time.monotonic() - t0
    assert out is not None and out.state is RxState.FAILED, out
    assert out.reason is Reason.CANCELLED and took < 2.0, (out, took)
    assert sender.stats.get("streams_aborted") == aborted + 1
    tx.progress(LAYERS)  # a mark on an ended publish is taken and changes nothing
    deadline = time.monotonic() + QUIET_S  # nothing may land after the failed outcome
    while time.monotonic() < deadline:
        assert untouched(receiver, range(1, LAYERS)), "a layer landed after the failed outcome"
        time.sleep(0.01)
    assert tx.close(WAIT_S) and h.close(WAIT_S), "blocks not released by close"
    # close said no write can touch the blocks any more: what is there now is final
    assert untouched(receiver, range(1, LAYERS)), "a layer landed before the close"


def test_bad_marks_are_refused_counted_and_fail_the_publish(sender: Sender) -> None:
    """A mark that decreases, passes num_layers, names no open publish or a publish that is
    not streamed is refused (bad_progress), counted by why, and fails that publish."""
    cases = [("decreasing", [2, 1]), ("past_end", [LAYERS + 1])]
    for why, marks in cases:
        rid = f"stream-bad-{why}"
        tx = sender.publish(rid, [1], streamed=True, expected_fetches=1)
        before = sender.stats.get(f"stream_marks_refused_{why}")
        with pytest.raises(RejectedError) as e:
            for m in marks:
                sender.progress(rid, m)
        assert e.value.reason is Reason.BAD_PROGRESS
        assert sender.stats.get(f"stream_marks_refused_{why}") == before + 1
        out = tx.wait(WAIT_S)
        assert out is not None and out.state is TxState.FAILED, out
        assert out.reason is Reason.BAD_PROGRESS
        assert tx.close(WAIT_S)
    plain = sender.publish("stream-bad-plain", [1])
    with pytest.raises(RejectedError):
        plain.progress(1)
    assert sender.stats.get("stream_marks_refused_not_streamed") >= 1
    assert plain.wait(WAIT_S) is not None and plain.close(WAIT_S)
    with pytest.raises(RejectedError):
        sender.progress("stream-never-published", 1)
    assert sender.stats.get("stream_marks_refused_unknown") >= 1


def test_another_request_to_the_same_receiver_is_written_while_a_stream_waits(
    sender: Sender, receiver: Receiver
) -> None:
    """A stream waiting for its next layer holds no lane: a normal request to the same
    receiver, fetched afterwards, is done while the stream still waits."""
    clear(receiver)
    h = parked_fetch(sender, receiver, "stream-4")
    tx = sender.publish("stream-4", SRC, streamed=True)
    fill(sender, SRC, 4, range(LAYERS))
    tx.progress(1)
    wait_until(lambda: landed(receiver, 0, 4), WAIT_S, "layer 0")
    # A request the stream's worker writes too (lanes are per worker and receiver).
    worker = sender._worker_for("stream-4", receiver.receiver_id)
    rid = next(
        r
        for r in (f"plain-4-{i}" for i in range(1000))
        if sender._worker_for(r, receiver.receiver_id) is worker
    )
    plain = sender.publish(rid, [30])
    other = receiver.fetch(rid, sender.endpoint, [30], want_aux=False)
    out = other.wait(WAIT_S)
    assert out is not None and out.state is RxState.DONE, out
    assert not h.session.ended
    tx.progress(LAYERS)
    done = h.wait(WAIT_S)
    assert done is not None and done.state is RxState.DONE, done
    assert plain.close(WAIT_S) and tx.close(WAIT_S)
    np.testing.assert_array_equal(
        receiver.pool.kv_bytes_view()[:, 30].numpy(), sender.pool.kv_bytes_view()[:, 30].numpy()
    )


# -- through the engine gateway ---------------------------------------------------------------
@pytest.fixture
def gateway(sender: Sender) -> Iterator[Gateway]:
    """The sender's engine gateway on a private ipc:// socket (started: ``endpoint`` set)."""
    d = tempfile.mkdtemp(prefix="kvst-")
    gw = Gateway(sender, f"ipc://{d}/tx.sock")
    try:
        gw.start()
        yield gw
    finally:
        gw.stop(2.0)
        shutil.rmtree(d, ignore_errors=True)


def endpoint(gw: Gateway) -> str:
    assert gw.endpoint is not None
    return gw.endpoint


def test_an_engine_streams_through_the_gateway_with_progress_frames(
    sender: Sender, receiver: Receiver, gateway: Gateway
) -> None:
    """Client.publish(streamed=True), then one Progress frame per layer (never answered):
    the parked fetch follows them and is done after the last; the publish completes."""
    clear(receiver)
    h = parked_fetch(sender, receiver, "stream-gw-1")
    with Client(endpoint(gateway), timeout_s=WAIT_S) as engine:
        hid = engine.publish("stream-gw-1", SRC, streamed=True)
        for layer in range(LAYERS):
            fill(sender, SRC, 5, range(layer, layer + 1))
            engine.progress(hid, layer + 1)
            wait_until(lambda layer=layer: landed(receiver, layer, 5), WAIT_S, f"layer {layer}")
            assert layer + 1 == LAYERS or not h.session.ended
        out = h.wait(WAIT_S)
        assert out is not None and out.state is RxState.DONE, out
        txo = engine.wait(hid, WAIT_S, close=True)
        assert txo is not None and txo.state == "complete" and txo.closed, txo
        with pytest.raises(TypeError):  # it takes no streamed: its handle id comes too late
            engine.publish_wait("stream-gw-x", SRC, 1.0, streamed=True)  # type: ignore[call-arg]


def test_an_async_engine_streams_with_progress_from_its_loop(
    sender: Sender, receiver: Receiver, gateway: Gateway
) -> None:
    """AsyncClient.progress is a plain method called on the loop that published."""
    clear(receiver)
    h = parked_fetch(sender, receiver, "stream-gw-2")
    fill(sender, SRC, 6, range(LAYERS))

    async def engine() -> Any:
        client = AsyncClient(endpoint(gateway), timeout_s=WAIT_S)
        try:
            hid = await client.publish("stream-gw-2", SRC, streamed=True)
            for layer in range(LAYERS):
                client.progress(hid, layer + 1)
            return await client.wait(hid, WAIT_S, close=True)
        finally:
            await client.aclose()

    txo = asyncio.run(engine())
    assert txo is not None and txo.state == "complete", txo
    out = h.wait(WAIT_S)
    assert out is not None and out.state is RxState.DONE, out
    assert all(landed(receiver, layer, 6) for layer in range(LAYERS))


def test_an_engine_connection_closed_mid_stream_fails_the_fetch_at_once(
    sender: Sender, receiver: Receiver, gateway: Gateway
) -> None:
    """The engine's connection closes after one layer: the stream is cancelled, the parked
    fetch ends failed (cancelled) at once, and nothing lands after."""
    clear(receiver)
    h = parked_fetch(sender, receiver, "stream-gw-3")
    fill(sender, SRC, 7, range(LAYERS))
    engine = Client(endpoint(gateway), timeout_s=WAIT_S)
    hid = engine.publish("stream-gw-3", SRC, streamed=True)
    engine.progress(hid, 1)
    wait_until(lambda: landed(receiver, 0, 7), WAIT_S, "layer 0")
    t0 = time.monotonic()
    engine.close_client()
    out = h.wait(WAIT_S)
    took = time.monotonic() - t0
    assert out is not None and out.state is RxState.FAILED, out
    assert out.reason is Reason.CANCELLED and "connection closed" in out.detail, out
    assert took < 2.0, took
    assert untouched(receiver, range(1, LAYERS))
    with sender._lock:
        tx = [s for s in sender.published.sessions.values() if s.request_id == "stream-gw-3"]
    assert tx and tx[0].state is TxState.CANCELLED


def test_bad_progress_frames_are_counted_and_fail_the_publish(
    sender: Sender, receiver: Receiver, gateway: Gateway
) -> None:
    """A Progress for an unknown handle is counted by the gateway; a decreasing one fails the
    publish, whose outcome says bad_progress; neither is answered."""
    with Client(endpoint(gateway), timeout_s=WAIT_S) as engine:
        engine.progress(12345, 1)  # no such handle on this connection
        hid = engine.publish("stream-gw-4", [1], streamed=True)
        engine.progress(hid, 2)
        engine.progress(hid, 1)
        out = engine.wait(hid, WAIT_S, close=True)
        assert out is not None and out.state == "failed", out
        assert out.reason is EngineReason.BAD_PROGRESS and "decreasing" in out.detail, out
    assert sender.stats.get("stream_marks_refused_decreasing") >= 1
    assert gateway.stats.get("stream_marks_refused_unknown") == 1
    assert gateway.stats.get("calls_progress") == 3


# -- heterogeneous TP/PP: each prefill rank streams its own pool -------------------------------
@pytest.mark.parametrize("name", ["PP2->PP1", "2P1D (TP2->TP1)"])
def test_each_prefill_rank_streams_its_own_layers_to_a_resharded_fetch(name: str) -> None:
    """Each prefill rank publishes streamed and marks its own pool's layers; the decode
    rank's pieces follow their rank's marks: only the marked layers land (PP: the stage
    that marked all of its layers lands, the other stays untouched), the fetch is done
    only once every rank marked every layer, byte-exact against the reference."""
    case = SWEEP[name]
    w = _World(Case(**case.__dict__), seed=5)
    d = Daemons()
    try:
        senders = {}
        for t in w.prefill:
            s = d.sender(t, _pool(t, w.num_blocks[("p", t.rank)]))
            w.fill("p", t, s.pool.kv_bytes_view())
            senders[t.rank] = s
        endpoints = [senders[r].endpoint for r in range(len(w.prefill))]
        [dt] = w.decode
        r = d.receiver(dt, _pool(dt, w.num_blocks[("d", dt.rank)]))
        w.fill("d", dt, r.pool.kv_bytes_view())
        before = r.pool.kv_bytes_view().clone()
        txs = {
            t.rank: senders[t.rank].publish("req-s", w.ids[("p", t.rank)].tolist(), streamed=True)
            for t in w.prefill
        }
        h = r.fetch(
            "req-s",
            endpoints[0],
            w.ids[("d", dt.rank)].tolist(),
            sender_endpoints=endpoints,
            want_aux=False,
        )
        want, got = w.want[dt.rank], r.pool.kv_bytes_view()
        if name.startswith("PP2"):  # stage 0 marks all its layers, stage 1 none
            stage0 = w.prefill[0]
            wait_until(lambda: len(senders[0].published.fetches) == 1, WAIT_S, "attached")
            txs[0].progress(stage0.num_stage_layers)
            split = stage0.layer_end
            wait_until(lambda: torch.equal(got[:split], want[:split]), WAIT_S, "stage 0 landed")
            assert torch.equal(got[split:], before[split:]), "stage 1's layers landed unmarked"
            assert h.wait(QUIET_S) is None, "done with stage 1's layers missing"
        for t in w.prefill:  # every rank, layer by layer
            for n in range(txs[t.rank].session.layers_ready + 1, t.num_stage_layers + 1):
                txs[t.rank].progress(n)
                assert n == t.num_stage_layers or not h.session.ended
        out = h.wait(WAIT_S)
        assert out is not None and out.state is RxState.DONE, out
        assert torch.equal(got, want), "the decode pool differs from the reference"
        for rank, tx in txs.items():
            txo = tx.wait(WAIT_S)
            assert txo is not None and txo.state is TxState.COMPLETE, (rank, txo)
            assert senders[rank].stats.get("stream_writes") >= 1
    finally:
        d.close()


# -- the sender's ending of a stream: shutdown, stall -------------------------------------------
def short_sender(name: str, **deadlines: int) -> Sender:
    return Sender(
        load_sender_settings(
            name=name,
            listen="tcp://127.0.0.1:0",
            pool=POOL,
            deadlines={**DEADLINES, "drain_timeout_ms": 300, **deadlines},
            inline_write_max_bytes=0,
        )
    ).start()


def test_a_stream_with_no_mark_for_the_stall_bound_fails_and_its_fetch_at_once(
    receiver: Receiver,
) -> None:
    """No mark for stream_stall_timeout_ms: the publish fails stream_stalled (counted) and
    its fetch ends failed then, long before its own timeout, with only layer 0 written."""
    clear(receiver)
    sx = short_sender("stream-stall", stream_stall_timeout_ms=500)
    try:
        h = parked_fetch(sx, receiver, "stream-stall-1")
        tx = sx.publish("stream-stall-1", SRC, streamed=True)
        fill(sx, SRC, 8, range(LAYERS))
        tx.progress(1)
        out = h.wait(WAIT_S)  # the fetch's own timeout is 20 s
        assert out is not None and out.state is RxState.FAILED, out
        assert out.reason is Reason.SESSION_FAILED and "no progress mark" in out.detail, out
        txo = tx.wait(WAIT_S)
        assert txo is not None and txo.reason is Reason.STREAM_STALLED, txo
        assert sx.stats.get("streams_stalled") == 1 and sx.stats.get("streams_aborted") == 1
        assert landed(receiver, 0, 8) and untouched(receiver, range(1, LAYERS))
        assert tx.close(WAIT_S)
    finally:
        sx.shutdown(timeout=4.0)


def test_the_senders_shutdown_mid_stream_fails_the_fetch_at_its_drain_not_its_timeout(
    receiver: Receiver,
) -> None:
    """A sender shutting down with a stream open ends it at the drain's deadline: the fetch
    fails shutting_down then (its own timeout is 20 s) and nothing lands after layer 0."""
    clear(receiver)
    sx = short_sender("stream-shut")
    stopped = False
    try:
        h = parked_fetch(sx, receiver, "stream-shut-1")
        tx = sx.publish("stream-shut-1", SRC, streamed=True)
        fill(sx, SRC, 9, range(LAYERS))
        tx.progress(1)
        wait_until(lambda: landed(receiver, 0, 9), WAIT_S, "layer 0")
        t0 = time.monotonic()
        report = sx.shutdown(timeout=4.0)
        stopped = True
        out = h.wait(WAIT_S)
        assert out is not None and out.state is RxState.FAILED, out
        assert out.reason is Reason.SHUTTING_DOWN, out
        assert time.monotonic() - t0 < 4.0
        assert report.writes_in_doubt == 0 and untouched(receiver, range(1, LAYERS))
    finally:
        if not stopped:
            sx.shutdown(timeout=4.0)


# -- the order of a stream's writes (a controlled data plane decides when each WRITE ends) -------
Controlled = tuple[Sender, ControlledDataPlane, Receiver]


@pytest.fixture
def controlled(request: pytest.FixtureRequest) -> Iterator[Controlled]:
    """A Sender whose WRITEs end when the test says (prepared lists) and its Receiver;
    parametrized indirectly, the param overrides the sender's deadlines."""
    pool = dict(num_layers=LAYERS, num_blocks=16, block_elems=16, dtype="uint8", aux_slots=4)
    dp = ControlledDataPlane("order-tx", prepped=True)
    sx = Sender(
        load_sender_settings(
            name="order-tx",
            listen="tcp://127.0.0.1:0",
            pool=pool,
            deadlines={**DEADLINES, **getattr(request, "param", {})},
            inline_write_max_bytes=0,
        ),
        dataplane=dp,
    ).start()
    dp.notify_as = sx.sender_id
    rx = Receiver(
        load_receiver_settings(name="order-rx", pool=pool, deadlines=DEADLINES),
        dataplane=ControlledDataPlane("order-rx"),
    ).start()
    try:
        yield sx, dp, rx
    finally:
        for x in dp.xfers:
            x.finish(True)
        rx.shutdown(timeout=4.0)
        sx.shutdown(timeout=4.0)


def test_a_streams_writes_go_one_range_at_a_time_in_layer_order(controlled: Controlled) -> None:
    """Deterministic: a mark that comes while a range is in flight posts nothing until that
    WRITE ended; then one WRITE of exactly the layers not yet written; only the WRITE of the
    last layer carries the done notification, and the fetch is done only when it ends."""
    sx, dp, rx = controlled
    h = parked_fetch(sx, rx, "order-1")
    tx = sx.publish("order-1", SRC, streamed=True)
    tx.progress(1)
    x0 = dp.wait_posted(1)
    assert x0.layers == (0, 1) and not x0.notif
    tx.progress(3)  # while [0, 1) is in flight
    with dp.posted:  # watched for QUIET_S: nothing may be posted while [0, 1) runs
        more = dp.posted.wait_for(lambda: len(dp.xfers) > 1, QUIET_S)
    assert not more, "a second range was posted while the first was in flight"
    x0.finish(True)
    x1 = dp.wait_posted(2)
    assert x1.layers == (1, 3) and not x1.notif
    tx.progress(LAYERS)
    x1.finish(True)
    x2 = dp.wait_posted(3)
    assert x2.layers == (3, LAYERS) and x2.notif, x2
    assert h.wait(QUIET_S) is None, "done before the last layer's WRITE ended"
    x2.finish(True)
    out = h.wait(WAIT_S)
    assert out is not None and out.state is RxState.DONE, out
    assert out.nbytes == len(SRC) * LAYERS * sx.pool.layout.block_bytes
    assert sx.stats.get("stream_writes") == 3


def test_a_stream_cancelled_with_a_range_in_flight_fails_its_fetch_when_that_write_ends(
    controlled: Controlled,
) -> None:
    """Deterministic: cancelled while a range's WRITE is in flight, the fetch does not end
    before that WRITE ended (its blocks could still change), then fails at once, and no
    further range is posted."""
    sx, dp, rx = controlled
    h = parked_fetch(sx, rx, "order-2")
    tx = sx.publish("order-2", SRC, streamed=True)
    tx.progress(1)
    x0 = dp.wait_posted(1)
    tx.progress(2)
    assert tx.cancel()
    assert h.wait(QUIET_S) is None, "the fetch ended while its range's WRITE was in flight"
    x0.finish(True)
    out = h.wait(WAIT_S)
    assert out is not None and out.state is RxState.FAILED, out
    assert out.reason is Reason.CANCELLED, out
    with dp.posted:
        assert not dp.posted.wait_for(lambda: len(dp.xfers) > 1, QUIET_S), "written after"
    assert tx.close(WAIT_S) and h.close(WAIT_S)


@pytest.mark.parametrize("controlled", [{"xfer_stall_timeout_ms": 300}], indirect=True)
def test_a_stalled_range_leaves_its_fetch_in_doubt_like_any_write(controlled: Controlled) -> None:
    """Deterministic: a range whose WRITE stalls makes the fetch in doubt (its blocks held),
    the stream ends, no later mark posts anything, and the WRITE's late end resolves the
    doubt (CancelAck in_doubt=false): the receiver's blocks become reusable."""
    sx, dp, rx = controlled
    h = parked_fetch(sx, rx, "order-3")
    tx = sx.publish("order-3", SRC, streamed=True)
    tx.progress(1)
    x0 = dp.wait_posted(1)
    out = h.wait(WAIT_S)
    assert out is not None and out.state is RxState.FAILED, out
    assert out.reason is Reason.STALLED, out
    assert not h.session.reusable.is_set(), "blocks reusable with a WRITE in flight"
    txo = tx.wait(WAIT_S)
    assert txo is not None and txo.in_doubt, txo
    tx.progress(LAYERS)  # taken by the ended publish: nothing more is written
    with dp.posted:
        assert not dp.posted.wait_for(lambda: len(dp.xfers) > 1, QUIET_S), "written after"
    x0.finish(True)
    assert h.session.reusable.wait(WAIT_S), "the late end did not resolve the doubt"
    assert tx.close(WAIT_S) and h.close(WAIT_S)
