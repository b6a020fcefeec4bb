"""Regression tests for the sender races of seed 004, each driven through the real Sender.

Every test builds its interleaving with events, never with sleeps: writes of the
:class:`~kvxferd.testing.ControlledDataPlane` stay in progress until the test
finishes them, and a hook on the listener tells when it handled a message.
Peers are real :class:`~kvxferd.transfer.receiver.Receiver` objects (with a controlled
data plane of their own) or raw ZMQ sockets (:class:`RawPeer`), which see every
message the sender sends. A tap on the sender's send functions counts every
Result it hands to ZMQ, whichever socket it goes out on.

Seed 004 fixes and the tests that hold them:

1. shared sockets         test_control.py; test_workers_send_results_only_on_their_own_dealers
2. failed slice reopened  test_failed_session_refuses_a_queued_slice_and_stays_failed
3. source freed in flight test_failed_session_keeps_its_source_until_the_other_write_returns
4. admission vs ending    test_no_write_is_admitted_after_the_session_ended;
                          test_an_ending_during_an_admission_waits_for_it
5. completion over error  test_completion_never_overwrites_the_first_ending
6. blocked send/shutdown  test_shutdown_is_bounded_*; test_control.py (close_all)
7. thread count           test_num_threads_*
8. build failure          test_build_failure_releases_its_admission_before_reporting

``make mutants`` (tests/mutants.py) reverts each of these fixes in a copy of the tree
and checks that the tests named here fail.

Beyond the seed: exactly one final Result per fetch on every path, stalled
writes (in doubt, memory kept), final Results still delivered at shutdown,
NIXL status checks that raise, and a worker choice that mixes request and receiver.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import zmq

from kvxferd.config import (
    DEFAULT_NUM_THREADS,
    THREADS_ENV,
    load_receiver_settings,
    load_sender_settings,
)
from kvxferd.errors import ConfigError, ProtocolError, Reason, RejectedError
from kvxferd.testing import ControlledDataPlane, ControlledXfer
from kvxferd.transfer import control
from kvxferd.transfer import protocol as wire
from kvxferd.transfer import session as session_mod
from kvxferd.transfer import worker_outbox as worker_mod
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.sender import Sender
from kvxferd.transfer.sender import listener as listener_mod
from kvxferd.transfer.session import RxState, SliceState, TxSession, TxState

WAIT_S = 5.0  # bound on anything that must happen
QUIET_S = 0.3  # how long something that must not happen is watched
POOL = dict(num_layers=2, num_blocks=16, block_elems=16, aux_slots=4, aux_slot_bytes=64)
BLOCKS = [3, 4, 5]
AUX = b"aux-payload"
SENDER_DEADLINES = dict(drain_timeout_ms=1000, shutdown_timeout_ms=3000)
RECEIVER_DEADLINES = dict(drain_timeout_ms=500, shutdown_timeout_ms=2000, cancel_fence_ms=500)


# -- what the sender sends ----------------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    msg: object  # the decoded message
    via: str  # "worker" (a worker's own DEALER), "router" (listener reply), "shared" (pool)
    thread: str
    sock: int  # id() of the socket it went out on


class Tap:
    """Wraps the sender's send functions: records every message it hands to ZMQ, and who sent it.

    ``hooks`` run in the sending thread just before the send (to observe state
    at report time). ``created`` maps each worker DEALER to the thread that connected it.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lock = threading.Condition()  # notified after every recorded message
        self.sent: list[Sent] = []
        self.hooks: list[Callable[[object], None]] = []
        self.created: dict[int, str] = {}
        worker_send, reply, shared_send = (
            worker_mod.send_bounded,
            listener_mod.router_reply,
            control.send_bounded,
        )
        connect = worker_mod.connect_dealer

        def tapped_connect(*args: Any, **kw: Any) -> zmq.Socket[bytes]:
            sock = connect(*args, **kw)
            with self.lock:
                self.created[id(sock)] = threading.current_thread().name
            return sock

        def tapped_worker_send(sock: zmq.Socket[bytes], frame: bytes) -> None:
            self._record(frame, "worker", sock)
            worker_send(sock, frame)

        def tapped_reply(sock: zmq.Socket[bytes], routing_id: bytes, frame: bytes) -> bool:
            self._record(frame, "router", sock)
            return reply(sock, routing_id, frame)

        def tapped_shared_send(sock: zmq.Socket[bytes], frame: bytes) -> None:
            self._record(frame, "shared", sock)
            shared_send(sock, frame)

        monkeypatch.setattr(worker_mod, "connect_dealer", tapped_connect)
        monkeypatch.setattr(worker_mod, "send_bounded", tapped_worker_send)
        monkeypatch.setattr(listener_mod, "router_reply", tapped_reply)
        monkeypatch.setattr(control, "send_bounded", tapped_shared_send)

    def _record(self, frame: bytes, via: str, sock: object) -> None:
        try:
            msg: object = wire.decode_to_receiver([frame], 1 << 30)
        except ProtocolError:
            return  # filler frames a test pushes through the pool
        for hook in list(self.hooks):
            hook(msg)
        with self.lock:
            self.sent.append(Sent(msg, via, threading.current_thread().name, id(sock)))
            self.lock.notify_all()

    def wait_results(self, fetch_id: int, n: int = 1) -> None:
        """Wait until ``n`` Results for ``fetch_id`` were handed to ZMQ."""
        with self.lock:
            ok = self.lock.wait_for(lambda: len(self.results(fetch_id)) >= n, WAIT_S)
        assert ok, f"fewer than {n} Result(s) for fetch {fetch_id} were sent"

    def results(self, fetch_id: int | None = None) -> list[Sent]:
        with self.lock:
            return [
                s
                for s in self.sent
                if isinstance(s.msg, wire.Result)
                and (fetch_id is None or s.msg.fetch_id == fetch_id)
            ]

    def result_counts(self) -> Counter[int]:
        return Counter(s.msg.fetch_id for s in self.results())  # type: ignore[attr-defined]


# -- a receiver made of raw sockets --------------------------------------------------------


class RawPeer:
    """A receiver made of raw ZMQ sockets: registers, fetches, cancels, and sees every reply."""

    def __init__(self, sx: Sender, receiver_id: str, result_endpoint: str | None = None) -> None:
        ctx = zmq.Context.instance()
        self.receiver_id = receiver_id
        self.results: zmq.Socket[bytes] | None = None
        if result_endpoint is None:
            self.results = ctx.socket(zmq.ROUTER)
            self.results.setsockopt(zmq.LINGER, 0)
            self.results.bind("tcp://127.0.0.1:*")
            result_endpoint = self.results.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.result_endpoint = result_endpoint
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(sx.endpoint)
        self.layout = wire.WireLayout.of(sx.pool.layout)
        self.received: list[object] = []

    def _send(self, msg: wire._Msg) -> None:
        self.dealer.send(wire.encode(msg))

    def try_register(self) -> wire.RegisterReply:
        """Send Register; the sender's reply, whatever it says."""
        self._send(
            wire.Register(
                receiver_id=self.receiver_id,
                result_endpoint=self.result_endpoint,
                agent_metadata=self.receiver_id.encode(),  # the sender's NIXL peer name
                layout=self.layout,
                kv_base=0,
                aux_base=0,
            )
        )
        reply = self.next_message()
        assert isinstance(reply, wire.RegisterReply), reply
        return reply

    def register(self) -> RawPeer:
        reply = self.try_register()
        assert reply.ok, reply
        return self

    def fetch(
        self,
        request_id: str,
        fetch_id: int,
        blocks: list[int] = BLOCKS,
        *,
        aux_slot: int = -1,
        timeout_ms: int = 60_000,
    ) -> None:
        self._send(
            wire.RequestData(
                request_id=request_id,
                fetch_id=fetch_id,
                dst_blocks=list(blocks),
                aux_slot=aux_slot,
                timeout_ms=timeout_ms,
            )
        )

    def cancel(self, request_id: str, fetch_id: int) -> None:
        self._send(wire.Cancel(request_id=request_id, fetch_id=fetch_id))

    def _poll(self, timeout: float) -> object | None:
        poller = zmq.Poller()
        poller.register(self.dealer, zmq.POLLIN)
        if self.results is not None:
            poller.register(self.results, zmq.POLLIN)
        events = dict(poller.poll(int(timeout * 1000)))
        if not events:
            return None
        sock = self.dealer if self.dealer in events else self.results
        assert sock is not None
        frames = sock.recv_multipart()
        msg = wire.decode_to_receiver(frames if sock is self.dealer else frames[1:], 1 << 30)
        self.received.append(msg)
        return msg

    def next_message(self, timeout: float = WAIT_S) -> object:
        """The next message on either socket; AssertionError after ``timeout``."""
        msg = self._poll(timeout)
        assert msg is not None, f"{self.receiver_id}: nothing arrived within {timeout}s"
        return msg

    def next_result(self, timeout: float = WAIT_S) -> wire.Result:
        msg = self.next_message(timeout)
        assert isinstance(msg, wire.Result), msg
        return msg

    def more(self, timeout: float = QUIET_S) -> list[object]:
        """Whatever else arrives within ``timeout`` (a test usually wants nothing)."""
        extra: list[object] = []
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self._poll(left)
            if msg is None:
                break
            extra.append(msg)
        return extra

    def close(self) -> None:
        self.dealer.close(linger=0)
        if self.results is not None:
            self.results.close(linger=0)


def frozen_endpoint() -> tuple[socket.socket, str]:
    """A TCP port that accepts connections and never reads: a receiver frozen mid-flight."""
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    return lsock, f"tcp://127.0.0.1:{lsock.getsockname()[1]}"


# -- the harness ---------------------------------------------------------------------------


class Harness:
    """Builds senders, receivers and raw peers for one test and always shuts them down."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tap = Tap(monkeypatch)
        self.changed = threading.Condition()  # notified after the listener handled a message
        self._senders: list[tuple[Sender, ControlledDataPlane]] = []
        self._receivers: list[Receiver] = []
        self._closers: list[Callable[[], None]] = []

    def sender(
        self,
        *,
        num_threads: int = 1,
        deadlines: dict[str, int] | None = None,
        limits: dict[str, int] | None = None,
    ) -> tuple[Sender, ControlledDataPlane]:
        settings = load_sender_settings(
            name="race-tx",
            listen="tcp://127.0.0.1:0",
            num_threads=num_threads,
            # These tests drive the worker threads; the listener's inline writes (small
            # requests) have their own tests (tests/test_inline_writes.py).
            inline_write_max_bytes=0,
            pool=POOL,
            deadlines={**SENDER_DEADLINES, **(deadlines or {})},
            limits=limits or {},
        )
        dp = ControlledDataPlane("race-tx")
        sx = Sender(settings, dataplane=dp)
        dp.notify_as = sx.sender_id  # a real sender's NIXL agent is named after its id
        handle = sx.listener._handle

        def hooked(frames: list[bytes], max_bytes: int, *rest: Any) -> None:
            try:
                handle(frames, max_bytes, *rest)  # rest: the peer's identity
            finally:
                with self.changed:
                    self.changed.notify_all()

        sx.listener._handle = hooked  # type: ignore[method-assign]
        self._senders.append((sx, dp))
        return sx.start(), dp

    def receiver(self, name: str, *, notifications: bool = True) -> Receiver:
        """``notifications`` False: done Results, not NIXL notifications (the Result path)."""
        settings = load_receiver_settings(
            name=name,
            result_endpoint="tcp://127.0.0.1:0",
            pool=POOL,
            deadlines=RECEIVER_DEADLINES,
            dataplane={"notifications": notifications},
        )
        rx = Receiver(settings, dataplane=ControlledDataPlane(name))
        self._receivers.append(rx)
        return rx.start()

    def peer(self, sx: Sender, receiver_id: str, result_endpoint: str | None = None) -> RawPeer:
        p = RawPeer(sx, receiver_id, result_endpoint)
        self._closers.append(p.close)
        return p.register()

    def frozen(self) -> str:
        lsock, endpoint = frozen_endpoint()
        self._closers.append(lsock.close)
        return endpoint

    def until(self, pred: Callable[[], bool], what: str) -> None:
        """Wait until the listener made ``pred`` true."""
        with self.changed:
            assert self.changed.wait_for(pred, WAIT_S), f"timed out waiting: {what}"

    def close(self) -> None:
        for sx, dp in self._senders:
            with sx._lock:
                sessions = list(sx.published.sessions.values())
            for s in sessions:
                s.cancel(Reason.SHUTTING_DOWN, "test teardown")  # no write is admitted from here
            for x in list(dp.xfers):
                if x.state == "PROC":
                    x.finish(True)
        for rx in self._receivers:
            rx.shutdown(timeout=3)
        for sx, _ in self._senders:
            sx.shutdown()
        for close in self._closers:
            close()
        for sx, _ in self._senders:  # leave no worker behind for the next test
            for w in sx._workers:
                w.thread.join(WAIT_S)


@pytest.fixture
def h(monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    harness = Harness(monkeypatch)
    try:
        yield harness
    finally:
        harness.close()


def request_for(sx: Sender, peer_ids: list[str], *, same_worker: bool, prefix: str = "req") -> str:
    """A request id whose (request, peer) pairs land on one worker, or each on its own."""
    for i in range(10_000):
        rid = f"{prefix}-{i}"
        workers = {sx._worker_for(rid, p).index for p in peer_ids}
        if len(workers) == (1 if same_worker else len(peer_ids)):
            return rid
    raise AssertionError("no such request id")


def xfer_of(dp: ControlledDataPlane, peer: str, n: int = 0) -> ControlledXfer:
    """The ``n``-th write posted toward ``peer``."""
    with dp.posted:
        return [x for x in dp.xfers if x.peer == peer][n]


def record_admissions(session: TxSession) -> list[tuple[bool, Reason | None]]:
    """Wrap ``session.admit_write``: (ended before the call, its answer) per call."""
    calls: list[tuple[bool, Reason | None]] = []
    admit = session.admit_write

    def recorded(sl: Any, now: float | None = None) -> Reason | None:
        ended = session.ended
        reason = admit(sl, now)
        calls.append((ended, reason))
        return reason

    session.admit_write = recorded  # type: ignore[method-assign]
    return calls


# -- 1. shared sockets: workers send only on their own DEALERs ------------------------------


def test_workers_send_results_only_on_their_own_dealers(h: Harness) -> None:
    """Every Result a worker sends (done, build_failed, refused) goes out on a DEALER that worker created, never on the shared pool."""
    sx, dp = h.sender(num_threads=2)
    a, b = h.peer(sx, "peer-a"), h.peer(sx, "peer-b")
    rid = request_for(sx, ["peer-a", "peer-b"], same_worker=False)
    wa = sx._worker_for(rid, "peer-a")
    rid2 = next(f"other-{i}" for i in range(10_000) if sx._worker_for(f"other-{i}", "peer-a") is wa)
    shared_threads: list[str] = []
    shared_send = sx._shared.send

    def spy(endpoint: str, frame: bytes) -> None:
        shared_threads.append(threading.current_thread().name)
        shared_send(endpoint, frame)

    sx._shared.send = spy  # type: ignore[method-assign]

    hd = sx.publish(rid, BLOCKS, expected_fetches=2)
    hd2 = sx.publish(rid2, BLOCKS)
    a.fetch(rid, 1)
    xa = dp.wait_posted(1)
    a.fetch(rid2, 3)  # queued on the same worker, behind the write in flight
    h.until(lambda: len(hd2.session.slices()) == 1, "fetch 3 attached")
    hd2.cancel()
    dp.fail_next_post = RuntimeError("descriptors could not be built")
    b.fetch(rid, 2)  # its worker fails to build the write
    rb = b.next_result()
    assert (rb.fetch_id, rb.status, rb.reason) == (2, "failed", Reason.BUILD_FAILED)
    xa.finish(True)
    r1, r3 = a.next_result(), a.next_result()
    assert (r1.fetch_id, r1.status) == (1, "done")
    assert (r3.fetch_id, r3.status, r3.reason) == (3, "failed", Reason.CANCELLED)
    assert hd.session.state is TxState.FAILED

    worker_names = {w.thread.name for w in sx._workers}
    assert not [t for t in shared_threads if t in worker_names]
    expected_thread = {
        1: wa.thread.name,
        2: sx._worker_for(rid, "peer-b").thread.name,
        3: wa.thread.name,
    }
    for sent in h.tap.results():
        assert sent.via == "worker", sent
        assert sent.thread == expected_thread[sent.msg.fetch_id], sent  # type: ignore[attr-defined]
        assert h.tap.created[sent.sock] == sent.thread, "sent on a DEALER another thread created"


def test_worker_choice_mixes_request_and_receiver(h: Harness) -> None:
    """With four workers, two receivers of one request share a worker for some requests only, and each receiver's requests reach every worker."""
    sx, _ = h.sender(num_threads=4)
    peers = ["peer-a", "peer-b", "rx-0123456789ab", "rx-ba9876543210"]
    rids = [f"req-{i}" for i in range(400)]
    for p in peers:
        assert {sx._worker_for(r, p).index for r in rids} == {0, 1, 2, 3}
    for i, p in enumerate(peers):
        for q in peers[i + 1 :]:
            same = sum(sx._worker_for(r, p) is sx._worker_for(r, q) for r in rids)
            assert 40 < same < 160, f"{p} and {q} share a worker for {same}/400 requests"


# -- 2. a failed slice is never reopened ------------------------------------------------------


def test_failed_session_refuses_a_queued_slice_and_stays_failed(h: Harness) -> None:
    """After one receiver's write failed, another receiver's queued write is refused (session_failed) and the session stays FAILED."""
    sx, dp = h.sender(num_threads=1)
    a, b = h.peer(sx, "peer-a"), h.peer(sx, "peer-b")
    hd = sx.publish("req-1", BLOCKS, expected_fetches=2)
    admissions = record_admissions(hd.session)
    a.fetch("req-1", 1)
    xa = dp.wait_posted(1)
    b.fetch("req-1", 2)  # queued behind a's write on the only worker
    h.until(lambda: len(hd.session.slices()) == 2, "fetch 2 attached")
    xa.finish(False)
    ra, rb = a.next_result(), b.next_result()
    assert (ra.status, ra.reason) == ("failed", Reason.TRANSFER_ERROR)
    assert (rb.status, rb.reason) == ("failed", Reason.SESSION_FAILED)
    assert admissions == [(False, None), (True, Reason.SESSION_FAILED)]
    assert hd.session.state is TxState.FAILED
    assert hd.session.outcome is not None and hd.session.outcome.reason is Reason.TRANSFER_ERROR
    sl_b = hd.session.slice(("peer-b", 2))
    assert sl_b is not None and sl_b.state is SliceState.FAILED
    assert len(dp.xfers) == 1 and sx.stats.get("writes_refused") == 1
    assert hd.wait(0) is hd.session.outcome


# -- 3. the source stays until every admitted write returned -----------------------------


@pytest.mark.parametrize("in_flight", ["kv", "aux"])
def test_failed_session_keeps_its_source_until_the_other_write_returns(
    h: Harness, in_flight: str
) -> None:
    """When one receiver's write fails while another's (KV or AUX) is in progress, the session is FAILED but not drained, and close() says False until that write returns."""
    sx, dp = h.sender(num_threads=4)
    ra, rb = h.receiver("rx-a"), h.receiver("rx-b")
    rid = request_for(sx, [ra.receiver_id, rb.receiver_id], same_worker=False)
    aux = AUX if in_flight == "aux" else None
    hd = sx.publish(rid, BLOCKS, aux=aux, expected_fetches=2)
    fa = ra.fetch(rid, sx.endpoint, BLOCKS, want_aux=aux is not None)
    fb = rb.fetch(rid, sx.endpoint, BLOCKS, want_aux=aux is not None)
    dp.wait_posted(2)
    xa, xb = xfer_of(dp, "rx-a"), xfer_of(dp, "rx-b")
    if in_flight == "aux":
        xb.finish(True)  # b's KV returns; its AUX write is posted next
        xb = dp.wait_posted(3)
        assert xb.peer == "rx-b" and int(xb.src[0, 1]) == len(AUX)
    xa.finish(False)
    out_a = fa.wait(WAIT_S)
    assert out_a is not None and (out_a.state, out_a.reason) == (
        RxState.FAILED,
        Reason.TRANSFER_ERROR,
    )
    s = hd.session
    assert s.state is TxState.FAILED
    assert s.writes_in_flight == 1 and sx.writes_in_flight() == 1
    assert not s.drained
    assert hd.close(timeout=0.05) is False
    xb.finish(True)
    assert hd.close(timeout=WAIT_S) is True
    assert s.drained and s.writes_in_flight == 0
    assert s.state is TxState.FAILED
    out_b = fb.wait(WAIT_S)
    assert out_b is not None and out_b.state is RxState.DONE  # its bytes did arrive


# -- 4. admission is atomic with failure and cancellation -----------------------------------


@pytest.mark.parametrize("where", ["between_slices", "between_kv_and_aux"])
@pytest.mark.parametrize("ending", ["cancel", "fail"])
def test_no_write_is_admitted_after_the_session_ended(h: Harness, ending: str, where: str) -> None:
    """A write admitted before the ending keeps the session undrained until it returns; the next write (another slice's, or the AUX) is refused."""
    sx, dp = h.sender(num_threads=1)
    a = h.peer(sx, "peer-a")
    if where == "between_slices":
        b = h.peer(sx, "peer-b")
        hd = sx.publish("req-1", BLOCKS, expected_fetches=2)
        admissions = record_admissions(hd.session)
        a.fetch("req-1", 1)
        x = dp.wait_posted(1)
        b.fetch("req-1", 2)
        h.until(lambda: len(hd.session.slices()) == 2, "fetch 2 attached")
        refused_peer, refused_fetch = b, 2
    else:
        hd = sx.publish("req-1", BLOCKS, aux=AUX)
        admissions = record_admissions(hd.session)
        a.fetch("req-1", 1, aux_slot=0)
        x = dp.wait_posted(1)
        refused_peer, refused_fetch = a, 1
    s = hd.session
    if ending == "cancel":
        assert hd.cancel()
        reason = Reason.CANCELLED
    else:
        assert s.fail(Reason.PEER_LOST, "another peer is gone")
        reason = Reason.SESSION_FAILED
    # The KV write was admitted before the ending: it is still counted, the source is kept.
    assert s.ended and s.writes_in_flight == 1 and not s.drained
    assert hd.close(timeout=0.05) is False
    x.finish(True)
    assert s.drained_event.wait(WAIT_S)
    if where == "between_slices":
        done = a.next_result()
        assert (done.fetch_id, done.status) == (1, "done")
    refused = refused_peer.next_result()
    assert (refused.fetch_id, refused.status, refused.reason) == (refused_fetch, "failed", reason)
    assert len(dp.xfers) == 1, "a write was posted after the session ended"
    assert admissions == [(False, None), (True, reason)]
    assert not [ended for ended, r in admissions if ended and r is None]
    assert hd.close(timeout=0) is True


class ArmedClock:
    """Stands in for the ``time`` module of kvxferd/transfer/session.py: the first clock read from a
    sender worker thread calls ``hook`` there (inside admission, between the state check and
    the count); every read returns the real clock."""

    def __init__(self, hook: Callable[[], None]) -> None:
        self._hook: Callable[[], None] | None = hook
        self.fired = threading.Event()

    def _maybe_fire(self) -> None:
        if self._hook is not None and threading.current_thread().name.startswith("kvxferd-worker"):
            hook, self._hook = self._hook, None
            hook()
            self.fired.set()

    def monotonic(self) -> float:
        self._maybe_fire()
        return time.monotonic()

    def time(self) -> float:
        self._maybe_fire()
        return time.time()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.mark.parametrize("ending", ["cancel", "fail"])
def test_an_ending_during_an_admission_waits_for_it(
    h: Harness, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    """An ending (cancel or fail) that arrives while a write is being admitted takes effect only after the admission: the write counts in flight, the source stays until it returns, and the session is never reopened."""
    sx, dp = h.sender(num_threads=1)
    a = h.peer(sx, "peer-a")
    hd = sx.publish("req-1", BLOCKS)
    s = hd.session
    ending_returned = threading.Event()
    returned_inside: list[bool] = []

    def end() -> None:
        if ending == "cancel":
            hd.cancel()
        else:
            s.fail(Reason.PEER_LOST, "another peer is gone")
        ending_returned.set()

    def inside_admission() -> None:
        threading.Thread(target=end, name="ending", daemon=True).start()
        # With admission atomic, the ending cannot commit before this admission is done.
        returned_inside.append(ending_returned.wait(QUIET_S))

    clock = ArmedClock(inside_admission)
    monkeypatch.setattr(session_mod, "time", clock)
    a.fetch("req-1", 1)
    x = dp.wait_posted(1)
    assert clock.fired.wait(WAIT_S), "no clock read inside the admission: the hook never ran"
    assert ending_returned.wait(WAIT_S)
    assert returned_inside == [False], "the ending committed in the middle of an admission"
    want = TxState.CANCELLED if ending == "cancel" else TxState.FAILED
    assert s.state is want, f"session reopened: {s.state}"
    assert s.writes_in_flight == 1 and not s.drained
    assert hd.close(timeout=0.05) is False
    x.finish(True)
    assert s.drained_event.wait(WAIT_S)
    assert s.state is want and hd.close(timeout=0) is True


# -- 5. a completion never overwrites an error ------------------------------------------------


@pytest.mark.parametrize("ending", ["fail", "cancel"])
def test_completion_never_overwrites_the_first_ending(h: Harness, ending: str) -> None:
    """Writes that complete after the session failed or was cancelled leave its first outcome in place."""
    sx, dp = h.sender(num_threads=2)
    a, b = h.peer(sx, "peer-a"), h.peer(sx, "peer-b")
    rid = request_for(sx, ["peer-a", "peer-b"], same_worker=False)
    hd = sx.publish(rid, BLOCKS, expected_fetches=2)
    a.fetch(rid, 1)
    b.fetch(rid, 2)
    dp.wait_posted(2)
    if ending == "fail":
        hd.session.fail(Reason.PEER_LOST, "engine saw the peer die")
    else:
        hd.cancel()
    first = hd.wait(0)
    assert first is not None and not first.ok
    xfer_of(dp, "peer-a").finish(True)
    xfer_of(dp, "peer-b").finish(True)
    assert {a.next_result().status, b.next_result().status} == {"done"}
    assert hd.session.drained_event.wait(WAIT_S)
    # Both slices are written: a complete that could overwrite would have happened by now.
    assert all(sl.state is SliceState.DONE for sl in hd.session.slices())
    assert hd.session.outcome is first and hd.wait(0) is first
    assert hd.session.state is first.state


# -- 6. a blocked send never holds up shutdown --------------------------------------------------


def test_shutdown_is_bounded_when_a_receiver_never_reads_its_parked_refusals(h: Harness) -> None:
    """Shutdown returns within shutdown_timeout even when each of its refusals to a parked fetch blocks toward a receiver that never reads."""
    total_s = 1.0
    sx, _ = h.sender(
        num_threads=1,
        deadlines=dict(send_timeout_ms=200, drain_timeout_ms=200, shutdown_timeout_ms=1000),
        limits=dict(sndhwm=1),
    )
    p = h.peer(sx, "peer-frozen", result_endpoint=h.frozen())
    n = 20  # 20 refusals x 200 ms would be 4 s without the shutdown deadline
    for i in range(n):
        p.fetch(f"never-published-{i}", i + 1)
    h.until(lambda: sx.stats.get("fetches_parked") == n, "fetches parked")
    reports: list[Any] = []
    t0 = time.monotonic()
    t = threading.Thread(target=lambda: reports.append(sx.shutdown()), daemon=True)
    t.start()
    t.join(total_s + 2.0)
    elapsed = time.monotonic() - t0
    assert not t.is_alive(), "shutdown hung on a receiver that does not read"
    assert elapsed < total_s + 1.0, f"shutdown took {elapsed:.2f}s"
    assert sx.stats.get("send_timeouts") >= 1
    assert reports[0].drained


def test_shutdown_is_bounded_when_a_worker_send_blocks(h: Harness) -> None:
    """Shutdown returns within shutdown_timeout while a worker is blocked sending Results to a receiver that never reads; the worker itself gets free later."""
    total_s = 1.0
    sx, dp = h.sender(
        num_threads=1,
        deadlines=dict(worker_send_timeout_ms=300, drain_timeout_ms=200, shutdown_timeout_ms=1000),
        limits=dict(sndhwm=1),
    )
    p = h.peer(sx, "peer-frozen", result_endpoint=h.frozen())
    handles = [sx.publish(f"req-{i}", BLOCKS) for i in range(6)]
    for i, hd in enumerate(handles):
        p.fetch(hd.request_id, i + 1)
    x = dp.wait_posted(1)
    h.until(lambda: all(hd.session.slices() for hd in handles), "every fetch attached")
    for hd in handles:
        hd.cancel()
    x.finish(True)  # the worker now reports 6 slices toward a receiver that never reads
    t0 = time.monotonic()
    report = sx.shutdown()
    elapsed = time.monotonic() - t0
    assert elapsed < total_s + 1.0, f"shutdown took {elapsed:.2f}s"
    assert report.drained  # no write in flight: blocked sends never hold memory
    worker = sx._workers[0].thread
    worker.join(6 * 0.3 + WAIT_S)
    assert not worker.is_alive(), "a worker send never gave up"
    assert sx.stats.get("send_timeouts") >= 1


def test_shutdown_final_results_reach_a_reading_receiver(h: Harness) -> None:
    """The Results shutdown sends (a parked fetch: draining at the drain's start; a queued slice: shutting_down at its deadline) reach a receiver that is reading, exactly once each."""
    sx, dp = h.sender(num_threads=1)
    p = h.peer(sx, "peer-a")
    hd1 = sx.publish("req-1", BLOCKS)
    hd2 = sx.publish("req-2", BLOCKS)
    p.fetch("req-1", 1)
    x = dp.wait_posted(1)
    p.fetch("req-2", 2)  # queued behind fetch 1
    p.fetch("never-published", 3)  # parked
    h.until(
        lambda: bool(hd2.session.slices()) and sx.stats.get("fetches_parked") == 1,
        "fetch 2 attached and fetch 3 parked",
    )
    t = threading.Thread(target=sx.shutdown, daemon=True)
    t.start()
    assert hd2.session.completion.wait(WAIT_S) is not None  # shutdown cancelled the sessions
    x.finish(True)
    t.join(WAIT_S)
    assert not t.is_alive()
    got = {}
    for _ in range(3):
        r = p.next_result()
        got[r.fetch_id] = (r.status, r.reason)
    assert got == {
        1: ("done", None),
        2: ("failed", Reason.SHUTTING_DOWN),
        3: ("failed", Reason.DRAINING),
    }
    assert h.tap.result_counts() == {1: 1, 2: 1, 3: 1}
    assert hd1.wait(0) is not None


def test_new_work_during_the_drain_is_refused_as_draining(h: Harness) -> None:
    """While a drain waits on an in-flight write: publish and a RequestData for a request not published get DRAINING, a Register is still taken (a receiver may come for a published request); the write still completes."""
    sx, dp = h.sender(
        num_threads=1, deadlines=dict(drain_timeout_ms=8000, shutdown_timeout_ms=10000)
    )
    p = h.peer(sx, "peer-a")
    hd = sx.publish("req-1", BLOCKS)
    p.fetch("req-1", 1)
    x = dp.wait_posted(1)  # held in flight: the drain waits for it
    t = threading.Thread(target=sx.shutdown, daemon=True)
    t.start()
    assert sx._draining.wait(WAIT_S)

    with pytest.raises(RejectedError) as ei:
        sx.publish("req-late", [9])
    assert ei.value.reason is Reason.DRAINING
    p.fetch("req-never-published", 2)  # nothing can be published any more: refused
    late = p.next_result()
    assert (late.fetch_id, late.status, late.reason) == (2, "failed", Reason.DRAINING)
    newcomer = RawPeer(sx, "peer-late")
    try:
        reply = newcomer.try_register()
    finally:
        newcomer.close()
    assert reply.ok, reply

    assert t.is_alive(), "the drain ended before the in-flight write did"
    x.finish(True)
    t.join(WAIT_S)
    assert not t.is_alive()
    first = p.next_result()
    assert (first.fetch_id, first.status) == (1, "done")
    assert hd.wait(0) is not None and sx.stats.get("rejected_draining") >= 2


def test_a_fetch_after_the_receiver_began_draining_is_refused_as_draining(h: Harness) -> None:
    """Once the receiver's shutdown started, fetch raises DRAINING at once and sends nothing."""
    rx = h.receiver("rx-drain")
    sx, _ = h.sender()
    t = threading.Thread(target=rx.shutdown, kwargs={"timeout": 3}, daemon=True)
    t.start()
    assert rx._draining.wait(WAIT_S)
    with pytest.raises(RejectedError) as ei:
        rx.fetch("req-late", sx.endpoint, [0])
    assert ei.value.reason is Reason.DRAINING
    t.join(WAIT_S)
    assert not t.is_alive()
    assert rx.stats.get("requests_sent") == 0


def test_a_full_peer_table_evicts_the_longest_idle_peer_never_a_busy_one(h: Harness) -> None:
    """max_peers reached: a new Register evicts the least recently heard-from idle peer; a peer with a write in flight stays."""
    sx, dp = h.sender(num_threads=1, limits=dict(max_peers=2))
    a, b = h.peer(sx, "peer-a"), h.peer(sx, "peer-b")
    sx.publish("req-1", BLOCKS)
    b.fetch("req-1", 1)
    x = dp.wait_posted(1)  # b has a write in flight
    a.cancel("req-none", 99)  # a spoke last: b is the longest idle by time, but busy
    assert isinstance(a.next_message(), wire.CancelAck)

    h.peer(sx, "peer-c")  # registers (asserts ok) by evicting a
    assert sx.stats.get("peers_evicted") == 1
    assert "peer-a" not in dp.peers and {"peer-b", "peer-c"} <= dp.peers
    a.fetch("req-1", 2)
    late = a.next_result()
    assert (late.fetch_id, late.status, late.reason) == (2, "failed", Reason.UNKNOWN_PEER)

    x.finish(True)
    done = b.next_result()
    assert (done.fetch_id, done.status) == (1, "done"), "the busy peer kept its write and result"


def test_a_full_peer_table_with_every_peer_busy_refuses_busy(h: Harness) -> None:
    """When every registered peer has work in flight, a new Register gets busy and nobody is evicted."""
    sx, dp = h.sender(num_threads=1, limits=dict(max_peers=1))
    a = h.peer(sx, "peer-a")
    sx.publish("req-1", BLOCKS)
    a.fetch("req-1", 1)
    x = dp.wait_posted(1)
    c = RawPeer(sx, "peer-c")
    try:
        reply = c.try_register()
    finally:
        c.close()
    assert not reply.ok and reply.reason is Reason.BUSY
    assert sx.stats.get("peers_evicted") == 0 and "peer-a" in dp.peers
    x.finish(True)
    assert a.next_result().status == "done"


def test_a_result_queued_before_shutdown_is_still_delivered(h: Harness) -> None:
    """A worker's final Result still queued (connection not up) when shutdown closes its DEALER reaches the receiver once it listens."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.bind(("127.0.0.1", 0))
    endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    probe.close()  # nobody listens there until after the shutdown
    sx, dp = h.sender(num_threads=1, deadlines=dict(worker_send_timeout_ms=2000))
    p = h.peer(sx, "peer-late", result_endpoint=endpoint)
    sx.publish("req-1", BLOCKS)
    dp.fail_next_post = RuntimeError("no descriptors")
    p.fetch("req-1", 1)
    h.tap.wait_results(1)
    sx.shutdown()
    sx._workers[0].thread.join(WAIT_S)  # its DEALER is closed now
    late = zmq.Context.instance().socket(zmq.ROUTER)
    late.setsockopt(zmq.LINGER, 0)
    try:
        late.bind(endpoint)
        assert late.poll(int(WAIT_S * 1000)), "the final Result was dropped at shutdown"
        r = wire.decode_to_receiver(late.recv_multipart()[1:], 1 << 20)
        assert isinstance(r, wire.Result) and (r.fetch_id, r.reason) == (1, Reason.BUILD_FAILED)
    finally:
        late.close(linger=0)


def test_shutdown_keeps_memory_registered_under_a_stalled_write(h: Harness) -> None:
    """Shutdown with a write still in progress reports it in doubt and never closes the data plane under it."""
    sx, dp = h.sender(
        num_threads=1,
        deadlines=dict(xfer_stall_timeout_ms=200, drain_timeout_ms=200, shutdown_timeout_ms=1000),
    )
    p = h.peer(sx, "peer-a")
    sx.publish("req-1", BLOCKS)
    p.fetch("req-1", 1)
    x = dp.wait_posted(1)
    r = p.next_result()
    assert (r.status, r.reason) == ("in_doubt", Reason.STALLED)
    report = sx.shutdown()
    assert not report.drained and report.writes_in_doubt == 1
    assert not dp.closed
    x.finish(True)
    sx.pool.close()  # the test knows the write returned; shutdown rightly did not


# -- 7. thread-count validation ------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "want"), [(None, DEFAULT_NUM_THREADS), ("1", 1), ("8", 8)])
def test_num_threads_comes_from_the_env_and_defaults_to_four(
    monkeypatch: pytest.MonkeyPatch, raw: str | None, want: int
) -> None:
    """TRTLLM_KV_TRANSFER_NUM_THREADS sets the worker count; unset, it is 4."""
    monkeypatch.delenv("KVXFERD_NUM_THREADS", raising=False)
    if raw is None:
        monkeypatch.delenv(THREADS_ENV, raising=False)
    else:
        monkeypatch.setenv(THREADS_ENV, raw)
    assert DEFAULT_NUM_THREADS == 4
    assert load_sender_settings().num_threads == want


@pytest.mark.parametrize("raw", ["0", "-3", "abc", "", "2.5"])
def test_num_threads_rejects_non_positive_or_non_numeric_values(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    """A TRTLLM_KV_TRANSFER_NUM_THREADS below 1 or not an integer is a ConfigError naming the variable."""
    monkeypatch.setenv(THREADS_ENV, raw)
    with pytest.raises(ConfigError, match=THREADS_ENV):
        load_sender_settings()


def test_sender_starts_the_configured_number_of_workers(h: Harness) -> None:
    """A Sender runs exactly num_threads worker threads, each with its own name."""
    sx, _ = h.sender(num_threads=3)
    names = [w.thread.name for w in sx._workers]
    assert len(names) == 3 == len(set(names))
    assert all(w.thread.is_alive() for w in sx._workers)


# -- 8. a build failure releases its admission first ---------------------------------------------


@pytest.mark.parametrize("kind", ["kv", "aux"])
def test_build_failure_releases_its_admission_before_reporting(h: Harness, kind: str) -> None:
    """A write that fails to post gives its admission back before the failure Result (build_failed) is sent."""
    sx, dp = h.sender(num_threads=1)
    rx = h.receiver("rx-a")
    hd = sx.publish("req-1", BLOCKS, aux=AUX if kind == "aux" else None)
    s = hd.session
    at_report: list[tuple[str, int, bool]] = []
    h.tap.hooks.append(
        lambda m: (
            at_report.append((m.status, s.writes_in_flight, s.drained))
            if isinstance(m, wire.Result)
            else None
        )
    )
    if kind == "kv":
        dp.fail_next_post = RuntimeError("descriptors could not be built")
    f = rx.fetch("req-1", sx.endpoint, BLOCKS, want_aux=kind == "aux")
    if kind == "aux":
        x = dp.wait_posted(1)
        dp.fail_next_post = RuntimeError("aux descriptors could not be built")
        x.finish(True)
    out = f.wait(WAIT_S)
    assert out is not None and (out.state, out.reason) == (RxState.FAILED, Reason.BUILD_FAILED)
    # When the receiver sees the failure, the sender holds no admission for it.
    assert s.writes_in_flight == 0 and sx.writes_in_flight() == 0 and s.drained
    assert at_report == [("failed", 0, True)]
    assert s.outcome is not None and s.outcome.reason is Reason.BUILD_FAILED
    assert sx.stats.get("writes_build_failed") == 1
    assert hd.close(timeout=0) is True


# -- NIXL reports a failed write by raising ----------------------------------------------------


class NixlBackendError(RuntimeError):
    """Stands in for nixl's typed errors: getXferStatus raises instead of returning ERR."""


def raise_on_poll(x: ControlledXfer) -> None:
    """Make ``x`` fail the way real NIXL does: its status check raises."""

    def poll() -> str:
        x.polled.set()
        raise NixlBackendError("NIXL_ERR_BACKEND: remote disconnected")

    x.state = "ERR"  # what the handle holds now; release() is allowed
    x.poll = poll  # type: ignore[method-assign]


def test_a_write_whose_status_check_raises_fails_and_releases_its_admission(h: Harness) -> None:
    """A write whose NIXL status check raises is a failed write: one failed Result, session FAILED, admission released."""
    sx, dp = h.sender(num_threads=1)
    p = h.peer(sx, "peer-a")
    hd = sx.publish("req-1", BLOCKS)
    p.fetch("req-1", 1)
    raise_on_poll(dp.wait_posted(1))
    r = p.next_result()
    assert (r.status, r.reason) == ("failed", Reason.TRANSFER_ERROR)
    out = hd.wait(WAIT_S)
    assert out is not None and (out.state, out.reason) == (TxState.FAILED, Reason.TRANSFER_ERROR)
    assert hd.close(timeout=WAIT_S) is True
    assert hd.session.writes_in_flight == 0 and sx.writes_in_flight() == 0


def test_a_stalled_write_whose_status_check_raises_leaves_the_worker_serving(h: Harness) -> None:
    """A stalled write that later fails by raising is settled (memory released) and its worker keeps serving later fetches."""
    sx, dp = h.sender(num_threads=1, deadlines=dict(xfer_stall_timeout_ms=200))
    p = h.peer(sx, "peer-a")
    hd = sx.publish("req-1", BLOCKS)
    p.fetch("req-1", 1)
    x = dp.wait_posted(1)
    assert p.next_result().status == "in_doubt"
    raise_on_poll(x)
    assert hd.close(timeout=WAIT_S) is True  # the late failure settled the write
    # ... and the receiver is told its in-doubt outcome is resolved
    assert p.next_message() == wire.CancelAck(request_id="req-1", fetch_id=1, in_doubt=False)
    sx.publish("req-2", BLOCKS)
    p.fetch("req-2", 2)
    dp.wait_posted(2).finish(True)
    r = p.next_result()
    assert (r.fetch_id, r.status) == (2, "done")
    assert sx._workers[0].thread.is_alive()


# -- exactly one final Result per slice, on every path ------------------------------------------


def _done(h: Harness, sx: Sender, dp: ControlledDataPlane, p: RawPeer) -> dict[int, tuple]:
    sx.publish("req-1", BLOCKS)
    p.fetch("req-1", 1)
    dp.wait_posted(1).finish(True)
    return {1: ("done", None)}


def _transfer_error(
    h: Harness, sx: Sender, dp: ControlledDataPlane, p: RawPeer
) -> dict[int, tuple]:
    sx.publish("req-1", BLOCKS)
    p.fetch("req-1", 1)
    dp.wait_posted(1).finish(False)
    return {1: ("failed", Reason.TRANSFER_ERROR)}


def _build_failed(h: Harness, sx: Sender, dp: ControlledDataPlane, p: RawPeer) -> dict[int, tuple]:
    sx.publish("req-1", BLOCKS)
    dp.fail_next_post = RuntimeError("no descriptors")
    p.fetch("req-1", 1)
    return {1: ("failed", Reason.BUILD_FAILED)}


def _engine_cancel(h: Harness, sx: Sender, dp: ControlledDataPlane, p: RawPeer) -> dict[int, tuple]:
    hd = sx.publish("req-1", BLOCKS, aux=AUX)
    p.fetch("req-1", 1, aux_slot=0)
    x = dp.wait_posted(1)
    hd.cancel()
    x.finish(True)
    return {1: ("failed", Reason.CANCELLED)}


def _peer_cancel(h: Harness, sx: Sender, dp: ControlledDataPlane, p: RawPeer) -> dict[int, tuple]:
    hd = sx.publish("req-1", BLOCKS, aux=AUX)
    p.fetch("req-1", 1, aux_slot=0)
    x = dp.wait_posted(1)
    p.cancel("req-1", 1)
    h.until(lambda: hd.session.ended, "peer cancel handled")
    x.finish(True)
    return {1: ("failed", Reason.CANCELLED)}


def _session_failed(
    h: Harness, sx: Sender, dp: ControlledDataPlane, p: RawPeer
) -> dict[int, tuple]:
    q = h.peer(sx, "peer-b")
    hd = sx.publish("req-1", BLOCKS, expected_fetches=2)
    q.fetch("req-1", 2)
    x = dp.wait_posted(1)
    p.fetch("req-1", 1)
    h.until(lambda: len(hd.session.slices()) == 2, "fetch 1 attached")
    x.finish(False)
    assert q.next_result().reason is Reason.TRANSFER_ERROR
    return {1: ("failed", Reason.SESSION_FAILED)}


def _stalled(h: Harness, sx: Sender, dp: ControlledDataPlane, p: RawPeer) -> dict[int, tuple]:
    sx.publish("req-1", BLOCKS)
    p.fetch("req-1", 1)
    dp.wait_posted(1)  # never finished here: it stalls, then returns late at teardown
    return {1: ("in_doubt", Reason.STALLED)}


def _bad_blocks(h: Harness, sx: Sender, dp: ControlledDataPlane, p: RawPeer) -> dict[int, tuple]:
    sx.publish("req-1", BLOCKS)
    p.fetch("req-1", 1, blocks=[1, 2])  # two destination blocks for three published
    return {1: ("failed", Reason.BAD_BLOCKS)}


def _never_published(
    h: Harness, sx: Sender, dp: ControlledDataPlane, p: RawPeer
) -> dict[int, tuple]:
    p.fetch("never-published", 1, timeout_ms=100)
    return {1: ("failed", Reason.EXPIRED)}


PATHS: dict[str, tuple[Callable[..., dict[int, tuple]], dict[str, int]]] = {
    "done": (_done, {}),
    "transfer_error": (_transfer_error, {}),
    "build_failed": (_build_failed, {}),
    "engine_cancel_before_aux": (_engine_cancel, {}),
    "peer_cancel_before_aux": (_peer_cancel, {}),
    "session_failed": (_session_failed, {}),
    "stalled": (_stalled, {"xfer_stall_timeout_ms": 200}),
    "bad_blocks": (_bad_blocks, {}),
    "never_published": (_never_published, {}),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_every_slice_gets_exactly_one_final_result(h: Harness, path: str) -> None:
    """Each fetch gets exactly one final Result with the right status and reason, whichever path ends it."""
    scenario, deadlines = PATHS[path]
    sx, dp = h.sender(num_threads=1, deadlines=deadlines)
    p = h.peer(sx, "peer-a")
    want = scenario(h, sx, dp, p)
    got: dict[int, tuple] = {}
    while set(got) != set(want):
        msg = p.next_message()
        if isinstance(msg, wire.Result):
            assert msg.fetch_id not in got, f"second Result for fetch {msg.fetch_id}: {msg}"
            got[msg.fetch_id] = (msg.status, msg.reason)
    assert got == want
    # Let every thread finish what it was doing (late stalled writes included), then count.
    for x in list(dp.xfers):
        if x.state == "PROC":
            x.finish(True)
    sx.shutdown()
    for w in sx._workers:
        w.thread.join(WAIT_S)
    counts = h.tap.result_counts()
    assert {f: counts[f] for f in want} == {f: 1 for f in want}
    extra = p.more()
    if path == "peer_cancel_before_aux":  # the CancelAck follows the slice's one Result
        assert extra == [wire.CancelAck(request_id="req-1", fetch_id=1, in_doubt=False)]
    elif path == "stalled":  # the stalled write ended: its in-doubt outcome is resolved
        assert extra == [wire.CancelAck(request_id="req-1", fetch_id=1, in_doubt=False)]
    else:
        assert extra == []


# -- a stalled write: in doubt, memory kept -------------------------------------------------------


def test_stalled_write_is_reported_in_doubt_and_keeps_memory_until_it_returns(h: Harness) -> None:
    """A write in progress past xfer_stall_timeout is reported in_doubt and the session keeps its memory until NIXL returns."""
    sx, dp = h.sender(num_threads=1, deadlines=dict(xfer_stall_timeout_ms=200))
    p = h.peer(sx, "peer-a")
    hd = sx.publish("req-1", BLOCKS)
    p.fetch("req-1", 1)
    x = dp.wait_posted(1)
    r = p.next_result()
    assert (r.status, r.reason) == ("in_doubt", Reason.STALLED)
    s = hd.session
    out = hd.wait(0)
    assert out is not None and out.state is TxState.FAILED and out.in_doubt
    assert s.writes_in_flight == 1 and sx.writes_in_flight() == 1 and not s.drained
    assert hd.close(timeout=0.05) is False
    assert not x.released
    x.finish(True)  # NIXL returns late
    assert hd.close(timeout=WAIT_S) is True
    assert s.drained and s.writes_in_flight == 0 and x.released
    assert hd.wait(0) is out  # the late success changes nothing
    # ... except that the receiver is told no write is in flight any more
    assert p.more() == [wire.CancelAck(request_id="req-1", fetch_id=1, in_doubt=False)]
    assert len(h.tap.results(1)) == 1
