"""Streamed publishes: KV written layer by layer as the engine marks layers ready (issue 25).

A real Sender and Receiver (real NIXL, UCX moving DRAM) in this process; the test plays
the prefill engine (publish with ``streamed=True``, then progress marks) and watches the
receiver's pool: each layer lands only after it was marked, later layers stay untouched,
and the fetch is done only once the last layer landed. Every wait has a deadline.
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
from kvxferd.transfer.receiver import Receiver, RxHandle
from kvxferd.transfer.sender import Sender
from kvxferd.transfer.session import RxState, TxState
from tests.support.conditions import wait_until

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
    as they are marked; two fetches (expected_fetches 2) follow the same marks."""
    clear(receiver)
    tx = sender.publish("stream-2", SRC, streamed=True, expected_fetches=2)
    fill(sender, SRC, 2, range(2))
    sender.progress("stream-2", 2)
    h = receiver.fetch("stream-2", sender.endpoint, DST, want_aux=False)
    wait_until(lambda: landed(receiver, 0, 2) and landed(receiver, 1, 2), WAIT_S, "ready layers")
    assert untouched(receiver, range(2, LAYERS)) and not h.session.ended
    other = [20, 21, 22]
    h2 = receiver.fetch("stream-2", sender.endpoint, other, want_aux=False, layers=(1, LAYERS))
    fill(sender, SRC, 2, range(2, LAYERS))
    sender.progress("stream-2", LAYERS)
    for handle in (h, h2):
        out = handle.wait(WAIT_S)
        assert out is not None and out.state is RxState.DONE, out
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
    assert tx.close(WAIT_S)


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
    plain = sender.publish("plain-4", [30])
    other = receiver.fetch("plain-4", sender.endpoint, [30], want_aux=False)
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
def gateway(sender: Sender) -> Iterator[str]:
    """The sender's engine gateway on a private ipc:// socket; its endpoint."""
    d = tempfile.mkdtemp(prefix="kvst-")
    gw = Gateway(sender, f"ipc://{d}/tx.sock")
    try:
        yield gw.start()
    finally:
        gw.stop(2.0)
        shutil.rmtree(d, ignore_errors=True)


def test_an_engine_streams_through_the_gateway_with_progress_frames(
    sender: Sender, receiver: Receiver, gateway: str
) -> None:
    """Client.publish(streamed=True), then one Progress frame per layer (never answered):
    the parked fetch follows them and is done after the last; the publish completes."""
    clear(receiver)
    h = parked_fetch(sender, receiver, "stream-gw-1")
    with Client(gateway, timeout_s=WAIT_S) as engine:
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
        with pytest.raises(ValueError):
            engine.publish_wait("stream-gw-x", SRC, 1.0, streamed=True)


def test_an_async_engine_streams_with_progress_from_its_loop(
    sender: Sender, receiver: Receiver, gateway: str
) -> None:
    """AsyncClient.progress is a plain method called on the loop that published."""
    clear(receiver)
    h = parked_fetch(sender, receiver, "stream-gw-2")
    fill(sender, SRC, 6, range(LAYERS))

    async def engine() -> Any:
        client = AsyncClient(gateway, timeout_s=WAIT_S)
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
    sender: Sender, receiver: Receiver, gateway: str
) -> None:
    """The engine's connection closes after one layer: the stream is cancelled, the parked
    fetch ends failed (cancelled) at once, and nothing lands after."""
    clear(receiver)
    h = parked_fetch(sender, receiver, "stream-gw-3")
    fill(sender, SRC, 7, range(LAYERS))
    engine = Client(gateway, timeout_s=WAIT_S)
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
    sender: Sender, receiver: Receiver, gateway: str
) -> None:
    """A Progress for an unknown handle is counted by the gateway; a decreasing one fails the
    publish, whose outcome says bad_progress; neither is answered."""
    with Client(gateway, timeout_s=WAIT_S) as engine:
        engine.progress(12345, 1)  # no such handle on this connection
        hid = engine.publish("stream-gw-4", [1], streamed=True)
        engine.progress(hid, 2)
        engine.progress(hid, 1)
        out = engine.wait(hid, WAIT_S, close=True)
        assert out is not None and out.state == "failed", out
        assert out.reason is EngineReason.BAD_PROGRESS and "decreasing" in out.detail, out
    assert sender.stats.get("stream_marks_refused_decreasing") >= 1
