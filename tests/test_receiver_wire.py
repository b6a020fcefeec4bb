"""The receiver against a scripted sender: bad endpoints, in-doubt outcomes resolved, sender restarts, shutdown races.

The sender here is :class:`ScriptedSender`, a raw ZMQ ROUTER that speaks the
wire protocol and answers only what the test tells it to, so each test builds
the exact exchange it needs (a late CancelAck, an unsolicited one, a new
incarnation on the same endpoint) without sleeps. The Receiver is the real one
with real sockets; its data plane is the controlled double, because the
scripted sender never writes a byte (the byte path is tested with real NIXL in
test_integration.py and test_receiver_restart.py).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvxferd import endpoints as endpoints_mod
from kvxferd.config import load_receiver_settings
from kvxferd.errors import Reason, RejectedError
from kvxferd.testing import ControlledDataPlane
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.receiver import fetches as fetches_mod
from kvxferd.transfer.session import Fence, RxState
from tests.support.conditions import wait_until

pytestmark = pytest.mark.timeout(60)

WAIT_S = 5.0  # bound on anything that must happen
POOL = dict(num_layers=2, num_blocks=16, block_elems=16, aux_slots=4, aux_slot_bytes=64)
DEADLINES = dict(
    drain_timeout_ms=300,
    shutdown_timeout_ms=3000,
    cancel_fence_ms=300,
    register_timeout_ms=3000,
    in_doubt_retry_ms=100,
    in_doubt_retry_max_ms=400,
)


class ScriptedSender:
    """A sender made of one raw ROUTER: it sees every message and answers only when told."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:*", sender_id: str = "scripted-tx-1"):
        self.sender_id = sender_id
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # The previous owner of a fixed port closes asynchronously (libzmq's io thread).
        wait_until(lambda: self._try_bind(endpoint), WAIT_S, f"bind {endpoint}", poll=0.02)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
        self.seen: list[object] = []
        self.queued: list[object] = []  # decoded, not handed out yet
        self.routing_id = b""

    def _try_bind(self, endpoint: str) -> bool:
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE:
                raise
            return False
        return True

    def next(self, kind: type[Any], timeout: float = WAIT_S) -> Any:
        """The next message of ``kind`` (others are kept in ``seen``); AssertionError on timeout.

        A receiver sends the messages of one turn as one multipart message: each frame
        after the routing id is one message (protocol.py, MAX_BATCH).
        """
        deadline = time.monotonic() + timeout
        while True:
            while self.queued:
                msg = self.queued.pop(0)
                self.seen.append(msg)
                if isinstance(msg, kind):
                    return msg
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise AssertionError(f"no {kind.__name__} within {timeout}s; seen {self.seen}")
            rid, *body = self.sock.recv_multipart()
            self.routing_id = rid
            self.queued += [wire.decode_to_sender([frame], 1 << 24) for frame in body]

    def quiet(self, kind: type[Any], seconds: float) -> bool:
        """True when no message of ``kind`` arrives within ``seconds``."""
        try:
            self.next(kind, seconds)
        except AssertionError:
            return True
        return False

    def send(self, msg: wire._Msg) -> None:
        self.sock.send_multipart([self.routing_id, wire.encode(msg)])

    def accept_register(self) -> wire.Register:
        reg = self.next(wire.Register)
        self.send(wire.RegisterReply(ok=True, sender_id=self.sender_id))
        return reg

    def done(self, req: wire.RequestData) -> None:
        self.send(wire.Result(request_id=req.request_id, fetch_id=req.fetch_id, status="done"))

    def close(self) -> None:
        self.sock.close(linger=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def make_rx() -> Iterator[Any]:
    made: list[Receiver] = []

    def make(**deadlines: Any) -> Receiver:
        settings = load_receiver_settings(
            name="wire-rx",
            result_endpoint="tcp://127.0.0.1:0",
            pool=POOL,
            deadlines={**DEADLINES, **deadlines},
        )
        rx = Receiver(settings, dataplane=ControlledDataPlane("wire-rx")).start()
        made.append(rx)
        return rx

    yield make
    for rx in made:
        if not rx._draining.is_set():
            rx.shutdown(timeout=3)


@pytest.fixture
def tx() -> Iterator[ScriptedSender]:
    s = ScriptedSender()
    yield s
    s.close()


# -- item 1: no argument kills the io thread ---------------------------------------------------


@pytest.mark.parametrize(
    "endpoint", ["tcp://no-port-here", "tcp://*:5555", "tcp://0.0.0.0:5555", "ipc://" + "x" * 200]
)
def test_a_bad_endpoint_is_refused_on_the_callers_thread_and_later_fetches_complete(
    make_rx: Any, tx: ScriptedSender, endpoint: str
) -> None:
    """fetch() refuses an endpoint kvxferd will not dial with bad_endpoint; the io thread lives on."""
    rx = make_rx()
    with pytest.raises(RejectedError) as e:
        rx.fetch("req-bad", endpoint, [1])
    assert e.value.reason is Reason.BAD_ENDPOINT
    h = rx.fetch("req-ok", tx.endpoint, [2])
    tx.accept_register()
    tx.done(tx.next(wire.RequestData))
    out = h.wait(WAIT_S)
    assert out is not None and out.state is RxState.DONE, out
    assert rx.broken() is None
    assert rx.stats.get("fetch_refused_bad_endpoint") == 1


def test_a_connect_error_on_the_io_thread_fails_only_that_fetch(
    make_rx: Any, tx: ScriptedSender, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An endpoint that passes the check but fails connect() fails its fetch with a reason."""
    monkeypatch.setattr(endpoints_mod, "connect_problem", lambda endpoint: None)
    rx = make_rx()
    monkeypatch.setattr(rx.dial_allow, "problem", lambda endpoint: None)  # the parser too
    out = rx.fetch("req-bad", "tcp://no-port-here", [1]).wait(WAIT_S)
    assert out is not None and out.state is RxState.FAILED, out
    assert out.reason is Reason.BAD_ENDPOINT, out
    h = rx.fetch("req-ok", tx.endpoint, [2])
    tx.accept_register()
    tx.done(tx.next(wire.RequestData))
    out = h.wait(WAIT_S)
    assert out is not None and out.state is RxState.DONE, out
    assert rx._io.is_alive()


def test_refused_connects_fail_waiting_fetches_well_before_the_register_timeout(
    make_rx: Any,
) -> None:
    """A port nobody listens on fails the fetch with peer_lost within connect_refused_ms, not register_timeout_ms."""
    rx = make_rx(register_timeout_ms=20_000, connect_refused_ms=500)
    t0 = time.monotonic()
    out = rx.fetch("req-x", f"tcp://127.0.0.1:{free_port()}", [1]).wait(5.0)
    assert out is not None, "still waiting 5 s after the fetch (register timeout is 20 s)"
    assert out.state is RxState.FAILED and out.reason is Reason.PEER_LOST, out
    assert "refused" in out.detail, out
    assert time.monotonic() - t0 < 5.0


# -- item 6: the fetch's own deadline travels ----------------------------------------------------


def test_request_data_carries_the_fetch_deadline_as_unix_ms(
    make_rx: Any, tx: ScriptedSender
) -> None:
    """deadline_unix_ms is the wall-clock time of the fetch's deadline; timeout_ms the budget left."""
    rx = make_rx()
    before = time.time() * 1000
    rx.fetch("req-d", tx.endpoint, [1], timeout_ms=7000)
    after = time.time() * 1000
    tx.accept_register()
    req = tx.next(wire.RequestData)
    assert before + 7000 - 50 <= req.deadline_unix_ms <= after + 7000 + 50, (req, before)
    assert 0 < req.timeout_ms <= 7000


# -- item 2: in-doubt outcomes are resolved when the sender answers ---------------------------


def _timed_out_in_doubt(rx: Receiver, tx: ScriptedSender, rid: str, aux: bool = True) -> Any:
    """A fetch that timed out and whose fence expired without an ack: in doubt."""
    h = rx.fetch(rid, tx.endpoint, [3, 4], timeout_ms=200, want_aux=aux)
    if not tx.routing_id:
        tx.accept_register()
    req = tx.next(wire.RequestData)
    tx.next(wire.Cancel)
    out = h.wait(WAIT_S)
    assert out is not None and out.state is RxState.TIMED_OUT, out
    wait_until(lambda: h.session.fence is Fence.IN_DOUBT, WAIT_S, "fence in doubt")
    assert h.close(0.1) is False
    return h, req


def test_a_late_cancel_ack_releases_an_in_doubt_fence_and_its_aux_slot(
    make_rx: Any, tx: ScriptedSender
) -> None:
    """A CancelAck(in_doubt=false) after the fence deadline releases the blocks and the aux slot."""
    rx = make_rx()
    h, req = _timed_out_in_doubt(rx, tx, "req-late")
    assert rx.aux_slots.free == POOL["aux_slots"] - 1
    tx.send(wire.CancelAck(request_id=req.request_id, fetch_id=req.fetch_id))
    wait_until(lambda: h.close(0) is True, WAIT_S, "blocks reusable after the late ack")
    wait_until(lambda: rx.aux_slots.free == POOL["aux_slots"], WAIT_S, "aux slot back")
    assert rx.stats.get("in_doubt_resolved") == 1
    assert rx.stats.get("late_messages") == 0
    assert rx.shutdown(timeout=3) is True


def test_an_unsolicited_cancel_ack_releases_an_in_doubt_result(
    make_rx: Any, tx: ScriptedSender
) -> None:
    """Result in_doubt, then an unsolicited CancelAck(in_doubt=false): the blocks become reusable."""
    rx = make_rx()
    h = rx.fetch("req-stall", tx.endpoint, [5])
    tx.accept_register()
    req = tx.next(wire.RequestData)
    tx.send(
        wire.Result(
            request_id=req.request_id,
            fetch_id=req.fetch_id,
            status="in_doubt",
            reason=Reason.STALLED,
        )
    )
    out = h.wait(WAIT_S)
    assert out is not None and out.state is RxState.FAILED and out.reason is Reason.STALLED
    assert h.close(0.1) is False
    tx.send(wire.CancelAck(request_id=req.request_id, fetch_id=req.fetch_id, in_doubt=False))
    wait_until(lambda: h.close(0) is True, WAIT_S, "blocks reusable after the ack")
    assert rx.doubts.unresolved == 0


def test_cancel_is_resent_for_an_in_doubt_fetch_until_answered(
    make_rx: Any, tx: ScriptedSender
) -> None:
    """The receiver re-sends Cancel for an in-doubt fetch (backing off) until an ack releases it."""
    rx = make_rx()
    h, req = _timed_out_in_doubt(rx, tx, "req-retry")
    again = [tx.next(wire.Cancel, 2.0) for _ in range(3)]
    assert all(c.fetch_id == req.fetch_id for c in again)
    tx.send(wire.CancelAck(request_id=req.request_id, fetch_id=req.fetch_id, in_doubt=True))
    assert h.close(0.2) is False  # still in doubt: the sender says a write may land
    tx.send(wire.CancelAck(request_id=req.request_id, fetch_id=req.fetch_id, in_doubt=False))
    wait_until(lambda: h.close(0) is True, WAIT_S, "released")
    assert tx.quiet(wire.Cancel, 0.8), "Cancel re-sent after the fetch was resolved"


def test_shutdown_resends_cancel_and_is_safe_once_the_sender_answers(
    make_rx: Any, tx: ScriptedSender
) -> None:
    """At shutdown the receiver asks again about in-doubt fetches; an answer makes it safe."""
    rx = make_rx(in_doubt_retry_ms=60_000, in_doubt_retry_max_ms=60_000)
    h, req = _timed_out_in_doubt(rx, tx, "req-shut")
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(rx.shutdown(timeout=3)))
    t.start()
    tx.next(wire.Cancel, 2.0)
    tx.send(wire.CancelAck(request_id=req.request_id, fetch_id=req.fetch_id, in_doubt=False))
    t.join(5)
    assert result == [True]
    assert h.session.blocks_reusable
    assert rx.dataplane.closed  # type: ignore[attr-defined]


# -- item 7: shutdown never deregisters under a possible write; a fetch racing it ends --------


def test_shutdown_keeps_memory_registered_while_an_outcome_is_in_doubt(
    make_rx: Any, tx: ScriptedSender
) -> None:
    """A shutdown with an unanswered in-doubt fetch reports unsafe and leaves the data plane open."""
    rx = make_rx(shutdown_timeout_ms=1000, drain_timeout_ms=100)
    _timed_out_in_doubt(rx, tx, "req-keep")
    assert rx.shutdown(timeout=1) is False
    assert not rx.dataplane.closed  # type: ignore[attr-defined]


def test_a_fetch_racing_shutdown_is_refused_or_ends(
    make_rx: Any, tx: ScriptedSender, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetch that passed the draining check when shutdown began is refused, never left open."""
    rx = make_rx()
    inside, go = threading.Event(), threading.Event()
    real_check = fetches_mod.check_blocks

    def slow_check(*args: Any) -> None:
        inside.set()
        go.wait(WAIT_S)
        real_check(*args)

    monkeypatch.setattr(fetches_mod, "check_blocks", slow_check)
    outcome: list[object] = []

    def fetch() -> None:
        try:
            h = rx.fetch("req-race", tx.endpoint, [1])
        except RejectedError as e:
            outcome.append(e.reason)
        else:
            outcome.append(h.wait(WAIT_S))

    t = threading.Thread(target=fetch)
    t.start()
    assert inside.wait(WAIT_S)
    rx.shutdown(timeout=2)
    go.set()
    t.join(WAIT_S + 1)
    assert outcome and outcome[0] is not None, "the fetch never ended"
    assert outcome[0] in (Reason.DRAINING, Reason.SHUTTING_DOWN) or getattr(
        outcome[0], "state", None
    ) in (RxState.FAILED, RxState.CANCELLED), outcome


def test_no_free_aux_slot_is_a_busy_refusal(make_rx: Any, tx: ScriptedSender) -> None:
    """With every aux slot taken, fetch() refuses with busy (typed), and without aux it still works."""
    rx = make_rx()
    handles = [rx.fetch(f"req-a{i}", tx.endpoint, [i]) for i in range(POOL["aux_slots"])]
    with pytest.raises(RejectedError) as e:
        rx.fetch("req-more", tx.endpoint, [9])
    assert e.value.reason is Reason.BUSY and "aux slot" in e.value.detail
    assert rx.fetch("req-noaux", tx.endpoint, [10], want_aux=False) is not None
    for h in handles:
        h.cancel()


# -- item 4: a sender restart loses no fetch --------------------------------------------------


def test_a_new_sender_incarnation_gets_every_open_fetch_again(make_rx: Any) -> None:
    """After the sender at an endpoint is replaced, open fetches are re-sent (same ids) and old fences released."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    old = ScriptedSender(endpoint, "scripted-tx-old")
    rx = make_rx()
    try:
        handles = [rx.fetch(f"req-r{i}", endpoint, [i], timeout_ms=20_000) for i in range(3)]
        old.accept_register()
        sent = {old.next(wire.RequestData).fetch_id for _ in handles}
        assert sent == {h.fetch_id for h in handles}
        fenced, _ = _timed_out_in_doubt(rx, old, "req-fenced", aux=False)
    finally:
        old.close()
    new = ScriptedSender(endpoint, "scripted-tx-new")
    try:
        new.accept_register()
        again = [new.next(wire.RequestData) for _ in handles]
        assert {r.fetch_id for r in again} == sent
        for r in again:
            new.done(r)
        for h in handles:
            out = h.wait(WAIT_S)
            assert out is not None and out.state is RxState.DONE, out
        wait_until(lambda: fenced.close(0) is True, WAIT_S, "fence toward the old one released")
        assert rx.stats.get("sender_restarts") == 1
    finally:
        new.close()


def test_unknown_peer_refusals_register_again_and_resend_every_refused_fetch(
    make_rx: Any, tx: ScriptedSender
) -> None:
    """Two fetches refused with unknown_peer are both re-sent after one new Register."""
    rx = make_rx()
    handles = [rx.fetch(f"req-u{i}", tx.endpoint, [i]) for i in range(2)]
    tx.accept_register()
    reqs = [tx.next(wire.RequestData) for _ in handles]
    for r in reqs:
        tx.send(
            wire.Result(
                request_id=r.request_id,
                fetch_id=r.fetch_id,
                status="failed",
                reason=Reason.UNKNOWN_PEER,
            )
        )
    tx.accept_register()
    again = [tx.next(wire.RequestData) for _ in handles]
    assert sorted(r.fetch_id for r in again) == sorted(r.fetch_id for r in reqs)
    for r in again:
        tx.done(r)
    for h in handles:
        out = h.wait(WAIT_S)
        assert out is not None and out.state is RxState.DONE, out


def test_a_new_incarnation_that_refuses_the_register_fails_open_fetches_peer_restarted(
    make_rx: Any,
) -> None:
    """When the new sender at an endpoint refuses our Register, fetches sent to the old one fail peer_restarted at once."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    old = ScriptedSender(endpoint, "scripted-tx-old")
    rx = make_rx()
    try:
        h = rx.fetch("req-gone", endpoint, [1], timeout_ms=20_000)
        old.accept_register()
        old.next(wire.RequestData)
    finally:
        old.close()
    new = ScriptedSender(endpoint, "scripted-tx-new")
    try:
        new.next(wire.Register)
        new.send(
            wire.RegisterReply(
                ok=False, sender_id=new.sender_id, reason=Reason.DRAINING, detail="draining"
            )
        )
        out = h.wait(WAIT_S)
        assert out is not None and out.state is RxState.FAILED, out
        assert out.reason is Reason.PEER_RESTARTED, out
        assert h.close(0) is True  # the old process is gone: nothing of it can land
    finally:
        new.close()
