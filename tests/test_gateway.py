"""The engine gateway and its clients: a real Sender and Receiver (real NIXL) behind Gateways.

Each Gateway is served by its service's io thread, bound at an ipc:// (unix stream)
socket in a private temporary directory; the test plays the engine with Client /
AsyncClient (and a raw socket speaking the framing) and maps the daemons' pools with
attach_pool. Every wait has a deadline; gateways, loops, clients, senders and
receivers are stopped in fixture finalizers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from multiprocessing import resource_tracker
from typing import Any, TypeVar

import msgspec
import pytest
import torch

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.engine import engine_protocol as ep
from kvxferd.engine.channel import LENGTH, FrameReader, ipc_address
from kvxferd.engine.client import (
    AsyncClient,
    Client,
    EngineRejected,
    EngineUnavailable,
    attach_pool,
)
from kvxferd.engine.engine_protocol import EngineReason
from kvxferd.engine.gateway import Gateway
from kvxferd.errors import Reason
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.sender import Sender
from tests.support.conditions import wait_until

pytestmark = pytest.mark.integration

POOL: dict[str, Any] = dict(num_layers=2, num_blocks=64, block_elems=1024, dtype="uint8")
DEADLINES: dict[str, int] = dict(
    kv_transfer_timeout_ms=5000,
    cancel_fence_ms=500,
    drain_timeout_ms=1000,
    shutdown_timeout_ms=3000,
    register_timeout_ms=2000,
)
CALL_S = 5.0  # bound on any one step of a test
T = TypeVar("T")


class LoopThread:
    """An asyncio loop running in its own thread; ``run`` submits a coroutine and waits, bounded."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = CALL_S) -> T:
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(CALL_S)
        if not self.thread.is_alive() and not self.loop.is_closed():
            self.loop.close()


# -- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sender() -> Iterator[Sender]:
    s = Sender(
        load_sender_settings(listen="tcp://127.0.0.1:0", pool=POOL, deadlines=DEADLINES)
    ).start()
    yield s
    s.shutdown(timeout=3.0)


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver(load_receiver_settings(pool=POOL, deadlines=DEADLINES)).start()
    yield r
    r.shutdown(timeout=3.0)


@pytest.fixture
def sock_dir() -> Iterator[str]:
    # A short private path: an ipc:// path must fit in sockaddr_un (107 bytes).
    d = tempfile.mkdtemp(prefix="kvgw-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


Started = tuple[Gateway, None, str]  # (gateway, unused, its endpoint)


@pytest.fixture
def start_gateway(sock_dir: str) -> Iterator[Callable[..., Started]]:
    """Start a Gateway on its service's io thread; every one is stopped at teardown."""
    started: list[Gateway] = []

    def start(service: Sender | Receiver, name: str, **kw: Any) -> Started:
        gw = Gateway(service, f"ipc://{sock_dir}/run/{name}.sock", **kw)
        started.append(gw)
        endpoint = gw.start()
        return gw, None, endpoint

    yield start
    for gw in started:
        gw.stop(2.0)


@pytest.fixture
def gateways(
    sender: Sender, receiver: Receiver, start_gateway: Callable[..., Started]
) -> tuple[Started, Started]:
    return start_gateway(sender, "tx"), start_gateway(receiver, "rx")


@pytest.fixture
def clients(gateways: tuple[Started, Started]) -> Iterator[tuple[Client, Client]]:
    (_, _, tx_ep), (_, _, rx_ep) = gateways
    tx, rx = Client(tx_ep, timeout_s=CALL_S), Client(rx_ep, timeout_s=CALL_S)
    yield tx, rx
    tx.close_client()
    rx.close_client()


def _fill(kv: torch.Tensor, blocks: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (kv.shape[0], len(blocks), kv.shape[2]), generator=g).to(
        torch.uint8
    )
    kv[:, blocks, :] = data
    return data


def _attach(info: ep.PoolInfo) -> torch.Tensor:
    """attach_pool, in the process that also runs the daemon (a real engine is another process).

    attach_pool takes the segment's name off this process's resource tracker, but
    here the daemon's own KvPool registered it: put it back, so the pool's unlink
    at teardown finds it there.
    """
    kv = attach_pool(info)
    resource_tracker.register(f"/{info.shm_name}", "shared_memory")
    return kv


class RawEngine:
    """A bare unix stream connection speaking the engine protocol frame by frame (replies
    bounded by CALL_S)."""

    def __init__(self, endpoint: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(CALL_S)
        self.sock.connect(ipc_address(endpoint))
        self.reader = FrameReader(ep.MAX_FRAME_BYTES)
        self.frames: list[bytes] = []

    def __enter__(self) -> RawEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send_frame(self, frame: bytes) -> None:
        self.sock.sendall(LENGTH.pack(len(frame)) + frame)

    def send(self, msg: ep._Msg) -> None:
        self.send_frame(ep.encode(msg))

    def recv_frame(self) -> bytes:
        while not self.frames:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed by the gateway")
            self.frames += self.reader.feed(data)
        return self.frames.pop(0)

    def recv(self) -> Any:
        return ep.decode_to_engine([self.recv_frame()])

    def call(self, msg: ep._Msg) -> Any:
        self.send(msg)
        return self.recv()


# -- the socket and Describe ----------------------------------------------------------------
def test_socket_file_is_private(gateways: tuple[Started, Started], sock_dir: str) -> None:
    """The ipc socket's parent directory is created and the socket file has mode 0600."""
    for (_, _, endpoint), name in zip(gateways, ("tx", "rx"), strict=True):
        path = f"{sock_dir}/run/{name}.sock"
        assert endpoint == f"ipc://{path}"
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600


def test_describe_reports_role_pool_and_endpoint(
    clients: tuple[Client, Client], sender: Sender, receiver: Receiver
) -> None:
    """Describe gives each daemon's role, shared-memory name, layout, device and endpoint."""
    tx, rx = clients
    ti, ri = tx.describe(), rx.describe()
    assert (ti.role, ri.role) == ("sender", "receiver")
    assert ti.shm_name == sender.pool.shm_name and ri.shm_name == receiver.pool.shm_name
    assert ti.endpoint == sender.endpoint and ri.endpoint == receiver.result_endpoint
    assert ti.device == "cpu" and ti.cuda_ipc_handle is None
    lay = ti.layout
    assert (lay.num_layers, lay.num_blocks, lay.block_bytes, lay.kv_offset) == (2, 64, 1024, 0)


@pytest.fixture
def fds_past_select() -> Iterator[None]:
    """Descriptors 0..1100 taken, as in an engine process (vLLM, NCCL, pools) holding many."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below 1300 (ulimit -Hn to raise)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1300), hard))
    held: list[int] = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_calls_work_from_a_process_holding_more_than_1024_descriptors(
    gateways: tuple[Started, Started], fds_past_select: None
) -> None:
    """A client whose socket is past select()'s FD_SETSIZE still calls (it waits with poll)."""
    (_, _, tx_ep), (_, _, rx_ep) = gateways
    tx = Client(tx_ep, timeout_s=CALL_S)
    try:
        for _ in range(3):  # each call waits for its reply on the socket's descriptor
            assert tx.describe().role == "sender"
        assert tx._chan is not None and tx._chan.fileno() > 1024  # noqa: SLF001
    finally:
        tx.close_client()


def test_engine_reasons_cover_every_service_reason() -> None:
    """Every service Reason has the same spelling in the engine protocol."""
    assert {r.value for r in Reason} <= {r.value for r in EngineReason}


# -- transfers through the gateways ----------------------------------------------------------
def test_publish_fetch_moves_bytes_through_shared_memory(
    clients: tuple[Client, Client], sender: Sender, receiver: Receiver
) -> None:
    """Blocks written through the engine's mapping arrive byte-exact in the receiver's mapping."""
    tx, rx = clients
    tx_info, rx_info = tx.describe(), rx.describe()
    src_kv, dst_kv = _attach(tx_info), _attach(rx_info)
    src, dst = [3, 4, 5, 9], [40, 41, 50, 7]
    data = _fill(src_kv, src, seed=1)
    dst_kv[:, dst, :] = 0

    h_tx = tx.publish("gw-rt-1", src, aux=b"first-token", expected_fetches=1)
    h_rx = rx.fetch("gw-rt-1", tx_info.endpoint or "", dst)
    out_rx = rx.wait(h_rx, CALL_S)
    out_tx = tx.wait(h_tx, CALL_S)

    assert out_rx is not None and out_rx.ok, out_rx
    assert out_rx.state == "done" and out_rx.aux == b"first-token" and out_rx.reusable
    assert out_rx.nbytes == 2 * 4 * 1024 + len(b"first-token")  # KV + aux
    assert out_tx is not None and out_tx.ok and out_tx.state == "complete"
    assert torch.equal(dst_kv[:, dst, :], data)
    assert torch.equal(receiver.pool.kv_bytes_view()[:, dst, :], data)  # the daemon's own view
    polled = tx.poll(h_tx)
    assert polled is not None and polled.state == "complete"
    assert tx.close(h_tx, CALL_S) and rx.close(h_rx, CALL_S)
    with pytest.raises(EngineRejected) as ei:  # a closed handle is forgotten
        rx.poll(h_rx)
    assert ei.value.reason is EngineReason.UNKNOWN_HANDLE
    # Unmapping in the engine leaves the daemon's segment in place.
    src_kv.kvxferd_mapping.close()  # type: ignore[attr-defined]
    assert os.path.exists(f"/dev/shm/{tx_info.shm_name}")


@pytest.mark.parametrize("ended_first", [False, True])
def test_wait_with_close_returns_the_outcome_and_closes_the_handle(
    clients: tuple[Client, Client], ended_first: bool
) -> None:
    """A wait with close answers the outcome with closed=True and forgets the handle (as close would), whether it had to wait or the transfer had already ended."""
    tx, rx = clients
    tx_info, rx_info = tx.describe(), rx.describe()
    src_kv, dst_kv = _attach(tx_info), _attach(rx_info)
    data = _fill(src_kv, [60, 61], seed=5)
    rid = f"gw-wait-close-{ended_first}"
    h_rx = rx.fetch(rid, tx_info.endpoint or "", [62, 63])  # parked until published
    h_tx = tx.publish(rid, [60, 61])
    if ended_first:
        assert rx.wait(h_rx, CALL_S) is not None and tx.wait(h_tx, CALL_S) is not None
    out_rx = rx.wait(h_rx, CALL_S, close=True)
    out_tx = tx.wait(h_tx, CALL_S, close=True)
    assert out_rx is not None and out_rx.ok and out_rx.closed is True and out_rx.reusable
    assert out_tx is not None and out_tx.ok and out_tx.closed is True
    assert torch.equal(dst_kv[:, [62, 63], :], data)
    for c, h in ((rx, h_rx), (tx, h_tx)):
        with pytest.raises(EngineRejected) as ei:  # closed: forgotten
            c.poll(h)
        assert ei.value.reason is EngineReason.UNKNOWN_HANDLE
    assert tx.lookup(rid) is None  # the key is free again
    plain = rx.fetch(f"{rid}-plain", tx_info.endpoint or "", [62])
    assert rx.wait(plain, 0.01) is None  # nothing published: pending, and no close asked
    assert rx.close(plain, CALL_S)


def test_fetch_wait_and_publish_wait_are_one_round_trip_each(
    clients: tuple[Client, Client], gateways: tuple[Started, Started]
) -> None:
    """fetch_wait and publish_wait each send one call and get one reply, the outcome, with
    the handle closed (forgotten) and the bytes in place."""
    tx, rx = clients
    (tx_gw, _, _), (rx_gw, _, _) = gateways
    tx_info = tx.describe()
    src_kv, dst_kv = _attach(tx_info), _attach(rx.describe())
    data = _fill(src_kv, [24, 25], seed=7)
    before = tx_gw.stats.snapshot(), rx_gw.stats.snapshot()
    published: list[ep.Outcome] = []
    t = threading.Thread(
        target=lambda: published.append(tx.publish_wait("gw-one", [24, 25], CALL_S)),
        name="publisher",
    )
    t.start()
    out = rx.fetch_wait("gw-one", tx_info.endpoint or "", [26, 27], CALL_S, want_aux=False)
    t.join(CALL_S)
    assert out.ok and out.closed is True and out.handle_id > 0 and out.nbytes == 2 * 2 * 1024
    assert torch.equal(dst_kv[:, [26, 27], :], data)
    [pub] = published
    assert pub.ok and pub.state == "complete" and pub.closed is True and pub.handle_id > 0
    for c, hid in ((rx, out.handle_id), (tx, pub.handle_id)):
        with pytest.raises(EngineRejected) as ei:  # closed: forgotten
            c.poll(hid)
        assert ei.value.reason is EngineReason.UNKNOWN_HANDLE
    after = tx_gw.stats.snapshot(), rx_gw.stats.snapshot()
    for b, a, call in ((before[0], after[0], "publish"), (before[1], after[1], "fetch")):
        assert a.get(f"calls_{call}", 0) - b.get(f"calls_{call}", 0) == 1
        assert a.get("calls_wait", 0) == b.get("calls_wait", 0)  # no second call
        assert a.get("calls_close", 0) == b.get("calls_close", 0)


def test_a_digest_mismatch_reaches_the_engine_as_a_failed_load(
    clients: tuple[Client, Client], receiver: Receiver
) -> None:
    """A Fetch asking for the digest (digest=True over the engine API) whose bytes were
    changed between the write and the check ends failed with reason digest_mismatch in the
    engine's Outcome, its blocks reusable; the same Fetch untouched is done."""
    tx, rx = clients
    tx_info = tx.describe()
    src_kv, dst_kv = _attach(tx_info), _attach(rx.describe())
    data = _fill(src_kv, [20, 21], seed=8)
    ep_ = tx_info.endpoint or ""
    tx.publish("gw-digest-ok", [20, 21])
    out = rx.fetch_wait("gw-digest-ok", ep_, [22, 23], CALL_S, want_aux=False, digest=True)
    assert out.ok and torch.equal(dst_kv[:, [22, 23], :], data), out
    checked = receiver.stats.get("digests_checked")
    assert checked >= 1

    def flip(f: Any) -> None:
        receiver.pool.kv_bytes_view()[0, int(f.dst_blocks[0]), 5] ^= 0xFF

    receiver.digests.landed = flip
    try:
        tx.publish("gw-digest-bad", [20, 21])
        out = rx.fetch_wait("gw-digest-bad", ep_, [22, 23], CALL_S, want_aux=False, digest=True)
    finally:
        receiver.digests.landed = None
    assert out.state == "failed" and out.reason is EngineReason.DIGEST_MISMATCH, out
    assert out.closed is True and out.reusable, out
    assert receiver.stats.get("digests_checked") == checked + 1


def test_a_fetch_wait_not_ended_in_its_wait_returns_its_open_handle(
    clients: tuple[Client, Client],
) -> None:
    """A fetch_wait whose transfer has not ended after its wait returns the open state and
    the handle, which serves a later wait and close."""
    tx, rx = clients
    ep_ = tx.describe().endpoint or ""
    out = rx.fetch_wait("gw-late-one", ep_, [28], 0.05, want_aux=False, timeout_ms=4000)
    assert out.state == "requested" and not out.ok and out.handle_id > 0 and out.closed is None
    h_tx = tx.publish("gw-late-one", [29])
    done = rx.wait(out.handle_id, CALL_S, close=True)
    assert done is not None and done.ok and done.closed is True
    assert tx.close(h_tx, CALL_S)


def test_a_waiting_publish_cannot_ask_the_daemon_for_a_token(
    gateways: tuple[Started, Started],
) -> None:
    """A token issued by the daemon would come only with the outcome: a waiting Publish must
    bring its own (fetch_token); asking for one is malformed, and nothing is published."""
    (gw, _, tx_ep), _ = gateways
    with RawEngine(tx_ep) as raw:
        reply = raw.call(
            ep.Publish(
                call_id=1, request_id="gw-wait-token", block_ids=[30], wait_ms=100, token=True
            )
        )
        assert isinstance(reply, ep.Error) and reply.reason is EngineReason.MALFORMED, reply
        assert isinstance(raw.call(ep.Lookup(call_id=2, request_id="gw-wait-token")), ep.Error)


def test_layer_range_and_pending_fetch(clients: tuple[Client, Client]) -> None:
    """A fetch before its publish is Pending to poll and wait, then completes with only its layers."""
    tx, rx = clients
    tx_info = tx.describe()
    src_kv, dst_kv = _attach(tx_info), _attach(rx.describe())
    src, dst = [20, 21], [22, 23]
    data = _fill(src_kv, src, seed=2)
    dst_kv[:, dst, :] = 0

    h_rx = rx.fetch("gw-layers", tx_info.endpoint or "", dst, layers=(1, 2), timeout_ms=4000)
    assert rx.poll(h_rx) is None
    assert rx.wait(h_rx, 0.05) is None
    h_tx = tx.publish("gw-layers", src)
    out = rx.wait(h_rx, CALL_S)
    assert out is not None and out.ok, out
    assert torch.equal(dst_kv[1, dst, :], data[1])
    assert int(dst_kv[0, dst, :].count_nonzero()) == 0  # layer 0 was not asked for
    assert tx.close(h_tx, CALL_S) and rx.close(h_rx, CALL_S)


def test_cancel_ends_the_handle_and_close_is_safe(clients: tuple[Client, Client]) -> None:
    """A cancelled publish ends CANCELLED, and close reports its blocks reusable."""
    tx, _ = clients
    h = tx.publish("gw-cancel", [30, 31])
    tx.cancel(h)
    out = tx.wait(h, CALL_S)
    assert out is not None and out.state == "cancelled"
    assert out.reason is EngineReason.CANCELLED and not out.in_doubt
    assert tx.close(h, CALL_S)


# -- typed errors ----------------------------------------------------------------------------
def test_unknown_and_foreign_handles_are_refused(
    clients: tuple[Client, Client], gateways: tuple[Started, Started]
) -> None:
    """A never-issued handle, or another connection's handle, is unknown_handle for every call."""
    tx, rx = clients
    (_, _, tx_ep), _ = gateways
    h = tx.publish("gw-foreign", [33])
    other = Client(tx_ep, timeout_s=CALL_S)
    try:
        calls: list[Callable[[Client, int], object]] = [
            lambda c, x: c.wait(x, 0.1),
            lambda c, x: c.poll(x),
            lambda c, x: c.cancel(x),
            lambda c, x: c.close(x, 0.1),
        ]
        for call in calls:
            for client, handle in ((tx, 10**12), (other, h)):
                with pytest.raises(EngineRejected) as ei:
                    call(client, handle)
                assert ei.value.reason is EngineReason.UNKNOWN_HANDLE
        with pytest.raises(EngineRejected) as ei:
            tx.fetch("gw-foreign", "tcp://127.0.0.1:1", [1])
        assert ei.value.reason is EngineReason.WRONG_ROLE
        with pytest.raises(EngineRejected) as ei:
            tx.publish("gw-bad-blocks", [64])
        assert ei.value.reason is EngineReason.BAD_BLOCKS
    finally:
        other.close_client()
    assert tx.close(h, CALL_S)


def test_malformed_frames_get_typed_errors_and_are_counted(
    gateways: tuple[Started, Started],
) -> None:
    """Garbage, bad headers and out-of-bounds fields each get an Error; serving goes on."""
    (gw, _, tx_ep), _ = gateways
    enc = msgspec.msgpack.encode
    cases: list[tuple[bytes, EngineReason, int]] = [
        (b"garbage", EngineReason.MALFORMED, 0),
        (ep.HEADER + b"\xc1", EngineReason.MALFORMED, 0),
        (b"KE\x09" + enc({"t": "describe", "call_id": 5}), EngineReason.UNSUPPORTED_VERSION, 0),
        (b"", EngineReason.MALFORMED, 0),
        (ep.HEADER + enc({"t": "launch", "call_id": 7}), EngineReason.UNKNOWN_MESSAGE, 7),
        (
            ep.HEADER + enc({"t": "publish", "call_id": 8, "request_id": "r", "block_ids": [-1]}),
            EngineReason.MALFORMED,
            8,
        ),
        (ep.HEADER + enc({"t": "wait", "call_id": 9, "handle_id": 1}), EngineReason.MALFORMED, 9),
    ]
    with RawEngine(tx_ep) as raw:
        for frame, reason, call_id in cases:
            raw.send_frame(frame)
            reply = raw.recv()
            assert isinstance(reply, ep.Error), frame
            assert (reply.reason, reply.call_id) == (reason, call_id), reply
        assert isinstance(raw.call(ep.Describe(call_id=10)), ep.PoolInfo)
    counts = gw.stats.snapshot()
    assert counts["rejected_malformed"] == 5
    assert counts["rejected_unsupported_version"] == 1
    assert counts["rejected_unknown_message"] == 1


def test_frames_before_a_length_over_the_bound_are_answered_then_the_connection_closes(
    gateways: tuple[Started, Started],
) -> None:
    """Frames that came before an oversized length prefix in the same write are each
    answered and counted; then the connection is closed (counted), nothing after it read."""
    (gw, _, tx_ep), _ = gateways
    before = gw.stats.snapshot()
    with RawEngine(tx_ep) as raw:
        frames = [ep.encode(ep.Describe(call_id=i)) for i in (1, 2)] + [b"garbage"]
        raw.sock.sendall(
            b"".join(LENGTH.pack(len(f)) + f for f in frames)
            + LENGTH.pack(ep.MAX_FRAME_BYTES + 1)
            + b"x" * 32
        )
        replies = [raw.recv() for _ in range(3)]
        assert [type(r) for r in replies] == [ep.PoolInfo, ep.PoolInfo, ep.Error], replies
        with pytest.raises(ConnectionError):
            raw.recv_frame()
    after = gw.stats.snapshot()
    assert after.get("calls_describe", 0) - before.get("calls_describe", 0) == 2
    assert after["rejected_malformed"] - before.get("rejected_malformed", 0) == 1
    wait_until(
        lambda: (
            gw.stats.get("engine_connections_dropped")
            == before.get("engine_connections_dropped", 0) + 1
        ),
        CALL_S,
        "the connection dropped and counted",
    )


def test_a_frame_over_the_bound_closes_its_connection_only(
    gateways: tuple[Started, Started],
) -> None:
    """A length prefix past the frame bound closes that connection (its length cannot be
    trusted), is counted, and the gateway serves the next connection."""
    (gw, _, tx_ep), _ = gateways
    with RawEngine(tx_ep) as raw:
        raw.sock.sendall(LENGTH.pack(ep.MAX_FRAME_BYTES + 1) + b"x" * 64)
        with pytest.raises(ConnectionError):
            raw.recv_frame()
    wait_until(
        lambda: gw.stats.get("engine_connections_dropped") == 1,
        CALL_S,
        "the oversized frame's connection was dropped and counted",
    )
    with RawEngine(tx_ep) as raw:
        assert isinstance(raw.call(ep.Describe(call_id=1)), ep.PoolInfo)


def test_calls_beyond_max_inflight_get_busy(
    sender: Sender, start_gateway: Callable[..., Started]
) -> None:
    """With max_inflight calls outstanding the next call gets BUSY at once; then service resumes."""
    gw, _, endpoint = start_gateway(sender, "busy", max_inflight=2)
    with RawEngine(endpoint) as raw:
        hid = raw.call(ep.Publish(call_id=1, request_id="gw-busy", block_ids=[35])).handle_id
        # Frames are taken in order: both Waits are in flight when the Cancel arrives.
        raw.send(ep.Wait(call_id=2, handle_id=hid, timeout_ms=1000))
        raw.send(ep.Wait(call_id=3, handle_id=hid, timeout_ms=1000))
        busy = raw.call(ep.Cancel(call_id=4, handle_id=hid))
        assert isinstance(busy, ep.Error) and busy.reason is EngineReason.BUSY
        assert isinstance(raw.call(ep.Poll(call_id=5, handle_id=hid)), ep.Pending)  # inline
        assert {type(raw.recv()), type(raw.recv())} == {ep.Pending}
        assert isinstance(raw.call(ep.Cancel(call_id=6, handle_id=hid)), ep.Ok)
        closed = raw.call(ep.Close(call_id=7, handle_id=hid, timeout_ms=5000))
        assert isinstance(closed, ep.Closed) and closed.safe
    assert gw.stats.get("rejected_busy") == 1


def test_refuse_new_refuses_publish_but_serves_existing_handles(
    clients: tuple[Client, Client], gateways: tuple[Started, Started]
) -> None:
    """After refuse_new, publish/fetch get draining or shutting_down; wait/poll/cancel/close work."""
    tx, rx = clients
    (tx_gw, _, _), (rx_gw, _, _) = gateways
    h = tx.publish("gw-drain", [36, 37])
    tx_gw.refuse_new("draining")
    rx_gw.refuse_new("shutting_down")
    with pytest.raises(EngineRejected) as ei:
        tx.publish("gw-drain-2", [38])
    assert ei.value.reason is EngineReason.DRAINING
    with pytest.raises(EngineRejected) as ei:
        rx.fetch("gw-drain", "tcp://127.0.0.1:1", [1])
    assert ei.value.reason is EngineReason.SHUTTING_DOWN
    assert tx.poll(h) is None and tx.wait(h, 0.01) is None
    tx.cancel(h)
    out = tx.wait(h, CALL_S)
    assert out is not None and out.state == "cancelled"
    assert tx.close(h, CALL_S)
    with pytest.raises(ValueError):
        tx_gw.refuse_new("busy")


# -- several event loops ---------------------------------------------------------------------
def test_async_client_wakes_each_waiter_on_its_own_loop(
    gateways: tuple[Started, Started],
) -> None:
    """Four loops in four threads share two AsyncClients; each waiter wakes on its own loop and thread, and a stopped fifth loop strands no one."""
    (_, _, tx_ep), (_, _, rx_ep) = gateways
    atx, arx = AsyncClient(tx_ep, timeout_s=CALL_S), AsyncClient(rx_ep, timeout_s=CALL_S)
    loops = [LoopThread(f"engine-{i}") for i in range(5)]
    try:
        with Client(tx_ep, timeout_s=CALL_S) as c:
            tx_info = c.describe()
        with Client(rx_ep, timeout_s=CALL_S) as c:
            dst_kv = _attach(c.describe())
        src_kv = _attach(tx_info)
        sender_ep = tx_info.endpoint or ""

        # Loop 4 starts a wait on a fetch that will never be published, then stops.
        stranded = loops[4]
        sent = threading.Event()

        async def doomed() -> object:
            h = await arx.fetch("gw-never", sender_ep, [60], timeout_ms=4000)
            asyncio.get_running_loop().call_soon(sent.set)  # runs once the Wait has been sent
            return await arx.wait(h, 4.0)

        stranded.submit(doomed())
        assert sent.wait(CALL_S)
        stranded.loop.call_soon_threadsafe(stranded.loop.stop)
        stranded.thread.join(CALL_S)

        start = threading.Barrier(4, timeout=CALL_S)
        datas = [_fill(src_kv, [4 * i, 4 * i + 1], seed=10 + i) for i in range(4)]

        async def engine(i: int) -> dict[str, object]:
            me = (threading.get_ident(), asyncio.get_running_loop())
            await asyncio.to_thread(start.wait)
            rid = f"gw-loop-{i}"
            h_rx = await arx.fetch(rid, sender_ep, [32 + 4 * i, 33 + 4 * i])
            h_tx = await atx.publish(rid, [4 * i, 4 * i + 1])
            out_rx = await arx.wait(h_rx, CALL_S)
            woke_rx = (threading.get_ident(), asyncio.get_running_loop())
            out_tx = await atx.wait(h_tx, CALL_S)
            woke_tx = (threading.get_ident(), asyncio.get_running_loop())
            closed = await atx.close(h_tx, CALL_S) and await arx.close(h_rx, CALL_S)
            await atx.aclose()
            await arx.aclose()
            return dict(me=me, woke=[woke_rx, woke_tx], out=[out_rx, out_tx], closed=closed)

        futures = [loops[i].submit(engine(i)) for i in range(4)]
        results = [f.result(3 * CALL_S) for f in futures]
        for i, r in enumerate(results):
            assert r["woke"] == [r["me"], r["me"]], f"loop {i} woke elsewhere"
            assert r["me"][1] is loops[i].loop  # type: ignore[index]
            outs = r["out"]
            assert all(o is not None and o.ok for o in outs), outs  # type: ignore[attr-defined,union-attr]
            assert r["closed"]
            assert torch.equal(dst_kv[:, [32 + 4 * i, 33 + 4 * i], :], datas[i])
    finally:
        atx.close_client()
        arx.close_client()
        for lt in loops:
            lt.stop()


# -- a dead or stopped daemon ----------------------------------------------------------------
def test_calls_toward_a_stopped_gateway_fail_within_their_bound(
    sender: Sender, start_gateway: Callable[..., Started], sock_dir: str
) -> None:
    """A wait in flight when the gateway stops gets shutting_down; later calls raise within timeout_s."""
    gw, _, endpoint = start_gateway(sender, "dying")
    with RawEngine(endpoint) as raw:
        hid = raw.call(ep.Publish(call_id=1, request_id="gw-dying", block_ids=[39])).handle_id
        raw.send(ep.Wait(call_id=2, handle_id=hid, timeout_ms=30_000))
        assert isinstance(raw.call(ep.Poll(call_id=3, handle_id=hid)), ep.Pending)  # Wait is in
        t0 = time.monotonic()
        gw.stop(2.0)
        assert time.monotonic() - t0 < 2.0
        stopped = raw.recv()
        assert isinstance(stopped, ep.Error) and stopped.call_id == 2
        assert stopped.reason is EngineReason.SHUTTING_DOWN
    c = Client(endpoint, timeout_s=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailable) as ei:  # nothing listens there any more
            c.wait(hid, 0.2)
        assert ei.value.reason is EngineReason.PEER_LOST
        assert time.monotonic() - t0 < 0.7 + 1.0
    finally:
        c.close_client()
    with pytest.raises(EngineUnavailable) as ei:  # a closed client refuses at once
        c.poll(1)
    assert ei.value.reason is EngineReason.PEER_LOST
    # Nothing ever listened here: the call is bounded all the same.
    never = Client(f"ipc://{sock_dir}/nobody.sock", timeout_s=0.3)
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailable):
            never.describe()
        assert time.monotonic() - t0 < 0.3 + 1.0
    finally:
        never.close_client()


def test_the_gateway_answers_after_its_service_shut_down_until_it_is_stopped(
    start_gateway: Callable[..., Started], sock_dir: str
) -> None:
    """The service's io thread ends with its shutdown, before the daemon stops the gateway:
    engines still poll, wait for and close what they published until then (a thread of the
    gateway's own serves them); stop() then ends it."""
    sx = Sender(
        load_sender_settings(listen="tcp://127.0.0.1:0", pool=POOL, deadlines=DEADLINES)
    ).start()
    gw, _, endpoint = start_gateway(sx, "tail")
    with Client(endpoint, timeout_s=CALL_S) as c:
        h = c.publish("gw-tail", [12])
        c.cancel(h)
        report = sx.shutdown(timeout=3.0)
        assert report.threads_joined
        out = c.poll(h)  # the listener is gone; the gateway still answers
        assert out is not None and out.state == "cancelled", out
        waited = c.wait(h, CALL_S, close=True)
        assert waited is not None and waited.closed is True
        with pytest.raises(EngineRejected) as ei:
            c.publish("gw-tail-2", [13])  # the sender is shut down: nothing new starts
        assert ei.value.reason in (EngineReason.DRAINING, EngineReason.SHUTTING_DOWN)
        gw.stop(2.0)
        with pytest.raises(EngineUnavailable):
            c.describe()


def test_a_lingering_stop_lets_the_engine_collect_and_close_what_it_holds(
    sender: Sender, start_gateway: Callable[..., Started]
) -> None:
    """stop(linger) first waits for the engines' handles to close: an engine that asks for
    its outcome meanwhile gets it (not shutting_down); a handle nobody closes delays the stop
    by the linger only."""
    gw, _, endpoint = start_gateway(sender, "linger")
    with Client(endpoint, timeout_s=CALL_S) as c:
        h = c.publish("gw-linger", [41])
        c.cancel(h)
        stopper = threading.Thread(target=gw.stop, args=(2.0, 10.0), name="test-stopper")
        stopper.start()
        try:
            out = c.wait(h, CALL_S, close=True)  # served while the stop lingers
            assert out is not None and out.closed is True, out
            stopper.join(CALL_S + 5.0)
            assert not stopper.is_alive(), "the stop went on lingering after the last close"
        finally:
            stopper.join(15.0)
    gw2, _, endpoint2 = start_gateway(sender, "linger-bound")
    with Client(endpoint2, timeout_s=CALL_S) as c:
        h = c.publish("gw-linger-2", [42])
        c.cancel(h)
        t0 = time.monotonic()
        gw2.stop(2.0, 0.3)  # the handle stays open: the linger bounds the wait
        took = time.monotonic() - t0
        assert 0.3 <= took < 0.3 + 2.0 + 3.0, took


# -- deadlines, idempotent calls, work found again by key ------------------------------------
def _sessions_of(sender: Sender, request_id: str) -> int:
    """How many sessions the sender holds for ``request_id`` (live or ended, not yet closed)."""
    with sender._lock:
        return sum(1 for s in sender.published.sessions.values() if s.request_id == request_id)


def _fetches_of(receiver: Receiver, request_id: str) -> int:
    with receiver._lock:
        return sum(1 for rx in receiver.fetches.by_id.values() if rx.request_id == request_id)


@contextlib.contextmanager
def hold_gateway(gw: Gateway) -> Iterator[None]:
    """Keep the io thread that serves the gateway busy (as a frozen or overloaded daemon
    would) until exit: the calls sent meanwhile wait unread, then are read in order."""
    release, busy = threading.Event(), threading.Event()

    def hold() -> None:
        busy.set()
        release.wait(4 * CALL_S)

    assert gw.service.io.call_soon(hold)
    try:
        assert busy.wait(CALL_S)
        yield
    finally:
        release.set()


def _unix_ms(offset_s: float = 0.0) -> int:
    return int((time.time() + offset_s) * 1000)


def test_publish_queued_past_its_deadline_never_runs(
    sender: Sender, start_gateway: Callable[..., Started]
) -> None:
    """A publish the gateway gets to only after its caller gave up is refused (timeout) and creates no session; a retry then creates one."""
    gw, _, endpoint = start_gateway(sender, "late")
    rid = "gw-late"
    with Client(endpoint, timeout_s=0.5) as c:
        with hold_gateway(gw):
            with pytest.raises(EngineUnavailable) as ei:
                c.publish(rid, [10, 11])
            assert ei.value.reason is EngineReason.TIMEOUT
        # The loop is free: the queued publish reaches its check (or, unfixed, runs).
        wait_until(
            lambda: gw.stats.get("rejected_timeout") >= 1 or _sessions_of(sender, rid) > 0,
            CALL_S,
            "the late publish was taken off the queue",
        )
        assert _sessions_of(sender, rid) == 0, "a publish ran after its caller gave up"
        assert gw.stats.get("rejected_timeout") == 1
    with Client(endpoint, timeout_s=CALL_S) as c:
        h = c.publish(rid, [10, 11])
        assert _sessions_of(sender, rid) == 1
        assert c.close(h, CALL_S)


def test_a_wait_whose_engine_gave_up_does_not_close_the_handle(
    clients: tuple[Client, Client],
    gateways: tuple[Started, Started],
    sender: Sender,
) -> None:
    """A Wait(close) whose transfer ends after the engine's deadline is not closed by the
    gateway (the engine never hears of it): the handle stays, with its outcome, to be
    found and closed again."""
    _, (_, _, rx_ep) = gateways
    tx, _ = clients
    rid = "gw-gave-up"
    with RawEngine(rx_ep) as raw:
        hid = raw.call(
            ep.Fetch(
                call_id=1,
                request_id=rid,
                sender_endpoint=sender.endpoint,
                block_ids=[44],
                want_aux=False,
                timeout_ms=4000,
            )
        ).handle_id
        # The engine waits 4 s for the outcome but gives up after 0.3 s (its deadline).
        gave_up = _unix_ms(0.3)
        raw.send(
            ep.Wait(call_id=2, handle_id=hid, timeout_ms=4000, close=True, deadline_unix_ms=gave_up)
        )
        # The deadline passes while the fetch is parked; then its request is published.
        wait_until(lambda: _unix_ms() > gave_up + 20, CALL_S, "the engine's deadline passed")
        h_tx = tx.publish(rid, [45])
        late = raw.recv()
        assert isinstance(late, ep.Error) and late.reason is EngineReason.TIMEOUT, late
        polled = raw.call(ep.Poll(call_id=3, handle_id=hid))  # not closed: still known
        assert isinstance(polled, ep.Outcome) and polled.ok, polled
        closed = raw.call(ep.Close(call_id=4, handle_id=hid, timeout_ms=1000))
        assert isinstance(closed, ep.Closed) and closed.safe
    assert tx.close(h_tx, CALL_S)


def test_expired_calls_are_refused_when_decoded(
    clients: tuple[Client, Client],
    gateways: tuple[Started, Started],
    sender: Sender,
    receiver: Receiver,
) -> None:
    """A publish, fetch, cancel or close that arrives after its deadline gets Error(timeout) and does nothing."""
    (tx_gw, _, tx_ep), (rx_gw, _, rx_ep) = gateways
    tx, _ = clients
    h = tx.publish("gw-expired-open", [48])
    past = _unix_ms(-1.0)
    with RawEngine(tx_ep) as raw_tx, RawEngine(rx_ep) as raw_rx:
        calls: list[tuple[RawEngine, ep._Msg]] = [
            (
                raw_tx,
                ep.Publish(
                    call_id=1, request_id="gw-expired", block_ids=[49], deadline_unix_ms=past
                ),
            ),
            (
                raw_rx,
                ep.Fetch(
                    call_id=2,
                    request_id="gw-expired",
                    sender_endpoint=sender.endpoint,
                    block_ids=[49],
                    deadline_unix_ms=past,
                ),
            ),
            (raw_tx, ep.Lookup(call_id=3, request_id="gw-expired-open", deadline_unix_ms=past)),
        ]
        for raw, msg in calls:
            reply = raw.call(msg)
            assert isinstance(reply, ep.Error) and reply.reason is EngineReason.TIMEOUT, reply
    assert _sessions_of(sender, "gw-expired") == 0 and _fetches_of(receiver, "gw-expired") == 0
    with RawEngine(tx_ep) as raw_tx:
        hid = raw_tx.call(ep.Lookup(call_id=4, request_id="gw-expired-open")).handle_id
        assert hid == h
        for msg in (
            ep.Cancel(call_id=5, handle_id=hid, deadline_unix_ms=past),
            ep.Close(call_id=6, handle_id=hid, timeout_ms=1000, deadline_unix_ms=past),
        ):
            reply = raw_tx.call(msg)
            assert isinstance(reply, ep.Error) and reply.reason is EngineReason.TIMEOUT, reply
    assert tx.poll(h) is None  # neither the cancel nor the close happened
    assert tx_gw.stats.get("rejected_timeout") == 4 and rx_gw.stats.get("rejected_timeout") == 1
    assert tx.close(h, CALL_S)


def test_publish_retried_while_the_first_is_queued_gets_the_same_handle(
    sender: Sender, start_gateway: Callable[..., Started]
) -> None:
    """A retry queued behind the first publish ends with one session and one handle for both; other blocks get duplicate."""
    gw, _, endpoint = start_gateway(sender, "retry")
    rid = "gw-retry"
    with RawEngine(endpoint) as raw:
        with hold_gateway(gw):
            raw.send(ep.Publish(call_id=1, request_id=rid, block_ids=[50, 51], aux=b"a"))
            raw.send(ep.Publish(call_id=2, request_id=rid, block_ids=[50, 51], aux=b"a"))
            raw.send(ep.Publish(call_id=3, request_id=rid, block_ids=[50], aux=b"a"))
        replies = {r.call_id: r for r in (raw.recv(), raw.recv(), raw.recv())}
        other = replies.pop(3)
        assert isinstance(other, ep.Error) and other.reason is EngineReason.DUPLICATE, other
        assert {type(r) for r in replies.values()} == {ep.Handle}, replies
        assert replies[1].handle_id == replies[2].handle_id
        assert _sessions_of(sender, rid) == 1
        again = raw.call(ep.Publish(call_id=4, request_id=rid, block_ids=[50, 51], aux=b"a"))
        assert isinstance(again, ep.Handle) and again.handle_id == replies[1].handle_id
        for aux, n in ((b"b", 1), (None, 1)):  # other aux: duplicate, never a second session
            dup = raw.call(
                ep.Publish(
                    call_id=5, request_id=rid, block_ids=[50, 51], aux=aux, expected_fetches=n
                )
            )
            assert isinstance(dup, ep.Error) and dup.reason is EngineReason.DUPLICATE, dup
        closed = raw.call(ep.Close(call_id=6, handle_id=again.handle_id, timeout_ms=5000))
        assert isinstance(closed, ep.Closed) and closed.safe
    assert _sessions_of(sender, rid) == 0


def test_a_recreated_client_finds_its_work_by_key_and_closes_it(
    clients: tuple[Client, Client],
    gateways: tuple[Started, Started],
    sender: Sender,
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After its Client was recreated, an engine finds its publish and fetch by key (retry or lookup), waits on them and closes them by request id."""
    tx, rx = clients
    (_, _, tx_ep), (_, _, rx_ep) = gateways
    src_kv, dst_kv = _attach(tx.describe()), _attach(rx.describe())
    data = _fill(src_kv, [52, 53], seed=3)
    rid = "gw-lost"
    calls: list[str] = []  # every publish / fetch the gateway asked of the service

    def counted(name: str, fn: Callable[..., T]) -> Callable[..., T]:
        def call(*args: Any, **kwargs: Any) -> T:
            calls.append(name)
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(sender, "publish", counted("publish", sender.publish))
    monkeypatch.setattr(receiver, "fetch", counted("fetch", receiver.fetch))
    h_tx = tx.publish(rid, [52, 53], aux=b"x")
    h_rx = rx.fetch(rid, sender.endpoint, [54, 55], layers=(0, 2))
    tx.close_client()
    rx.close_client()  # the handles are lost with their connections
    with Client(tx_ep, timeout_s=CALL_S) as tx2, Client(rx_ep, timeout_s=CALL_S) as rx2:
        assert tx2.lookup(rid) == h_tx
        assert tx2.publish(rid, [52, 53], aux=b"x") == h_tx  # a retry from another connection
        # Layers (0, 2) are all the layers: the same key as a fetch without a range.
        assert rx2.lookup(rid, sender_endpoint=sender.endpoint) == h_rx
        assert rx2.fetch(rid, sender.endpoint, [54, 55]) == h_rx
        with pytest.raises(EngineRejected) as ei:
            rx2.fetch(rid, sender.endpoint, [56, 57])
        assert ei.value.reason is EngineReason.DUPLICATE
        assert sorted(calls) == ["fetch", "publish"] and _sessions_of(sender, rid) == 1
        assert rx2.lookup(rid, sender_endpoint=sender.endpoint, layers=(1, 2)) is None
        assert rx2.lookup("gw-never-fetched", sender_endpoint=sender.endpoint) is None
        out = rx2.wait(h_rx, CALL_S)
        assert out is not None and out.ok and out.aux == b"x", out
        assert torch.equal(dst_kv[:, [54, 55], :], data)
        assert tx2.close_request(rid, CALL_S)
        assert rx2.close_request(rid, CALL_S, sender_endpoint=sender.endpoint)
        assert tx2.lookup(rid) is None and rx2.lookup(rid, sender_endpoint=sender.endpoint) is None
        assert tx2.close_request(rid, CALL_S)  # nothing open under that key: nothing to wait for
    assert _sessions_of(sender, rid) == 0 and _fetches_of(receiver, rid) == 0


def test_handle_ids_of_a_restarted_gateway_are_new(
    sender: Sender, start_gateway: Callable[..., Started]
) -> None:
    """A restarted gateway never issues a handle id of its predecessor, and knows none of them."""
    gw, _, endpoint = start_gateway(sender, "first")
    with Client(endpoint, timeout_s=CALL_S) as c:
        old = c.publish("gw-restart-1", [58])
        assert c.close(old, CALL_S)
    gw.stop(2.0)
    _, _, endpoint = start_gateway(sender, "second")
    with Client(endpoint, timeout_s=CALL_S) as c:
        new = c.publish("gw-restart-2", [58])
        assert new != old
        with pytest.raises(EngineRejected) as ei:
            c.poll(old)
        assert ei.value.reason is EngineReason.UNKNOWN_HANDLE
        assert c.close(new, CALL_S)


# -- the gateway survives its own bugs, and says so -------------------------------------------
def test_an_unexpected_error_in_the_serve_task_is_caught_counted_and_reported(
    gateways: tuple[Started, Started], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug while receiving or handling a frame is logged, counted in thread_errors, makes broken() name it, and serving goes on."""
    (gw, _, endpoint), _ = gateways
    assert gw.broken() is None
    failed = threading.Event()

    class FailsOnce:
        """The gateway's end of the connection, whose first read raises."""

        def __init__(self, real: Any) -> None:
            self.real = real

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

        def recv(self) -> list[bytes]:
            if not failed.is_set():
                failed.set()
                raise RuntimeError("injected receive bug")
            return self.real.recv()  # type: ignore[no-any-return]

    with Client(endpoint, timeout_s=CALL_S) as c:
        hold = threading.Event()
        # Swap the connection's channel on the io thread, before the first call is read.
        assert c.describe().role == "sender"

        def swap() -> None:
            for conn in gw._conns.values():
                conn.channel = FailsOnce(conn.channel)  # type: ignore[assignment]
            hold.set()

        assert gw.service.io.call_soon(swap) and hold.wait(CALL_S)
        # The first read fails; the call is read again and answered: the gateway lives on.
        assert c.describe().role == "sender"
        assert failed.is_set()
        real_decode = ep.decode_to_gateway

        def decode_fails(frames: list[bytes], max_bytes: int = ep.MAX_FRAME_BYTES) -> Any:
            msg = real_decode(frames, max_bytes)
            if isinstance(msg, ep.Poll):
                raise RuntimeError("injected handling bug")
            return msg

        monkeypatch.setattr(ep, "decode_to_gateway", decode_fails)
        with pytest.raises(EngineRejected) as ei:  # the engine hears of the bug at once
            c.poll(1)
        assert ei.value.reason is EngineReason.INTERNAL
        assert c.describe().role == "sender"
    assert gw.stats.get("thread_errors") == 2
    why = gw.broken()
    assert why is not None and "injected receive bug" in why


def test_an_unexpected_error_in_a_call_task_is_caught_and_reported(
    clients: tuple[Client, Client],
    gateways: tuple[Started, Started],
    sender: Sender,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A service call that raises an unexpected exception answers Error(internal), counts thread_errors and makes broken() name it."""
    tx, _ = clients
    (gw, _, _), _ = gateways

    def bug(*args: Any, **kwargs: Any) -> Any:
        raise ZeroDivisionError("injected service bug")

    monkeypatch.setattr(sender, "publish", bug)
    with pytest.raises(EngineRejected) as ei:
        tx.publish("gw-bug", [59])
    assert ei.value.reason is EngineReason.INTERNAL
    assert gw.stats.get("thread_errors") == 1
    why = gw.broken()
    assert why is not None and "injected service bug" in why


# -- AsyncClient.close_client from another thread --------------------------------------------
def test_async_close_client_racing_a_stopping_loop_still_closes_its_socket(
    gateways: tuple[Started, Started],
) -> None:
    """close_client from another thread while a connection's loop is stopping still closes that loop's socket."""
    (_, _, tx_ep), _ = gateways
    ac = AsyncClient(tx_ep, timeout_s=CALL_S)
    lt = LoopThread("engine-stopping")
    try:
        assert lt.run(ac.describe()).role == "sender"
        conn = ac._conns[lt.loop]
        entered, release, scheduled = threading.Event(), threading.Event(), threading.Event()

        def busy_then_stop() -> None:  # the loop's last turn: it stops before its next one
            entered.set()
            release.wait(CALL_S)
            lt.loop.stop()

        lt.loop.call_soon_threadsafe(busy_then_stop)
        assert entered.wait(CALL_S)
        schedule = lt.loop.call_soon_threadsafe

        def spy(callback: Callable[..., object], *args: Any) -> asyncio.Handle:
            handle = schedule(callback, *args)
            scheduled.set()
            return handle

        lt.loop.call_soon_threadsafe = spy  # type: ignore[method-assign]
        closer = threading.Thread(target=ac.close_client, name="closer")
        closer.start()
        assert scheduled.wait(CALL_S)  # close_client handed the close to the loop...
        release.set()  # ...which stops before it gets to it
        closer.join(CALL_S)
        assert not closer.is_alive()
        lt.thread.join(CALL_S)
        assert not lt.loop.is_running()
        wait_until(lambda: conn.chan.closed, CALL_S, "the stopped loop's socket is closed")
    finally:
        ac.close_client()
        lt.stop()


def test_async_close_client_fails_a_stopped_loops_calls_when_it_runs_again(
    gateways: tuple[Started, Started],
) -> None:
    """A wait in flight on a loop that stopped fails with peer_lost as soon as the loop runs again after close_client, not at its own timeout."""
    (tx_gw, _, tx_ep), _ = gateways
    ac = AsyncClient(tx_ep, timeout_s=CALL_S)
    lt = LoopThread("engine-paused")
    try:
        h = lt.run(ac.publish("gw-paused", [61]))
        # The publish's reply can reach us before its call leaves the gateway's table: wait
        # for that, so the one call counted next is the wait (else the loop may stop before
        # the wait was even sent, and its send fails for another reason).
        wait_until(lambda: tx_gw.calls_in_flight == 0, CALL_S, "the publish call ended")
        waiting = lt.submit(ac.wait(h, 60.0))
        wait_until(lambda: tx_gw.calls_in_flight == 1, CALL_S, "the wait reached the gateway")
        lt.loop.call_soon_threadsafe(lt.loop.stop)
        lt.thread.join(CALL_S)
        assert not lt.loop.is_running()
        ac.close_client()  # from the main thread, while that loop does not run
        lt.thread = threading.Thread(target=lt.loop.run_forever, name="engine-resumed", daemon=True)
        lt.thread.start()
        with pytest.raises(EngineUnavailable) as ei:
            waiting.result(2.0)
        assert ei.value.reason is EngineReason.PEER_LOST
    finally:
        ac.close_client()
        lt.stop()
    with Client(tx_ep, timeout_s=CALL_S) as c:
        assert c.close_request("gw-paused", CALL_S)
