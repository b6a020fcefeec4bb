"""Race tests of issue 9 for the sender: peers isolated on a worker, in-doubt writes, deadlines, leaks.

Driven through the real Sender with the controllable data plane and raw ZMQ
peers (the harness of tests/test_races.py): every interleaving is built with
events and conditions, never with sleeps.
"""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvxferd.errors import Reason
from kvxferd.testing import ControlledXfer
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.session import SliceState, TxState
from tests.support.conditions import wait_until
from tests.test_races import BLOCKS, QUIET_S, WAIT_S, Harness, RawPeer, h, xfer_of

__all__ = ["h"]  # the fixture, shared with tests/test_races.py


def hold_status_check(x: ControlledXfer) -> list[bool]:
    """Make ``x``'s NIXL status check raise (as nixl does) while the write is still in progress.

    Returns a switch: append True to let the status check answer again.
    """
    answer: list[bool] = []
    poll = x.poll

    def raising() -> Any:
        x.polled.set()
        if answer:
            return poll()
        raise RuntimeError("NIXL_ERR_BACKEND: status unknown")

    x.poll = raising  # type: ignore[method-assign]
    return answer


# -- item 5: one bad peer never slows another -----------------------------------------------


def test_a_write_held_toward_one_peer_never_holds_another_peers_write(h: Harness) -> None:
    """With one worker, peer A's write held in progress does not stop peer B's write from being posted and reported done."""
    sx, dp = h.sender(num_threads=1)
    a, b = h.peer(sx, "peer-a"), h.peer(sx, "peer-b")
    sx.publish("req-a", BLOCKS)
    hb = sx.publish("req-b", BLOCKS)
    a.fetch("req-a", 1)
    xa = dp.wait_posted(1)
    b.fetch("req-b", 2)
    xb = dp.wait_posted(2)  # posted while A's write is still in progress
    assert xb.peer == "peer-b" and xa.state == "PROC"
    xb.finish(True)
    r = b.next_result()
    assert (r.fetch_id, r.status) == (2, "done")
    assert hb.wait(WAIT_S) is not None and hb.session.state is TxState.COMPLETE
    assert xa.state == "PROC" and a.more(0.05) == []
    xa.finish(True)
    assert a.next_result().status == "done"


def test_a_stalled_write_toward_one_peer_never_delays_another_peer(h: Harness) -> None:
    """Peer B's fetch completes while peer A's write on the same worker is stalling (long before A's stall deadline)."""
    sx, dp = h.sender(num_threads=1, deadlines=dict(xfer_stall_timeout_ms=4000))
    a, b = h.peer(sx, "peer-a"), h.peer(sx, "peer-b")
    sx.publish("req-a", BLOCKS)
    sx.publish("req-b", BLOCKS)
    a.fetch("req-a", 1)
    dp.wait_posted(1)
    t0 = time.monotonic()
    b.fetch("req-b", 2)
    dp.wait_posted(2).finish(True)
    assert b.next_result(timeout=2.0).status == "done"
    assert time.monotonic() - t0 < 2.0
    r = a.next_result()  # A's write stalls in its own time
    assert (r.status, r.reason) == ("in_doubt", Reason.STALLED)


def test_results_to_a_receiver_that_does_not_read_never_delay_another(h: Harness) -> None:
    """A receiver that accepts the connection but never reads costs another receiver's Result nothing, though each send to it may wait worker_send_timeout."""
    sx, dp = h.sender(
        num_threads=1, deadlines=dict(worker_send_timeout_ms=3000), limits=dict(sndhwm=1)
    )
    frozen = h.peer(sx, "peer-frozen", result_endpoint=h.frozen())
    b = h.peer(sx, "peer-b")
    for i in range(4):  # four Results toward a receiver that never reads them
        sx.publish(f"req-f{i}", BLOCKS)
        frozen.fetch(f"req-f{i}", i + 1)
        dp.wait_posted(i + 1).finish(True)
    h.tap.wait_results(1)
    sx.publish("req-b", BLOCKS)
    t0 = time.monotonic()
    b.fetch("req-b", 10)
    dp.wait_posted(5).finish(True)
    r = b.next_result(timeout=2.5)
    assert (r.fetch_id, r.status) == (10, "done")
    assert time.monotonic() - t0 < 2.5, "B's Result waited behind sends to a frozen receiver"
    wait_until(lambda: sx.stats.get("send_timeouts") >= 1, WAIT_S, "undeliverable Results dropped")


def test_publish_never_sends_on_the_callers_thread(h: Harness) -> None:
    """A parked fetch refused at publish gets its Result from the pair's worker, not from the thread that called publish."""
    sx, _ = h.sender(num_threads=2)
    p = h.peer(sx, "peer-a")
    p.fetch("req-1", 1, blocks=[1, 2])  # parked; two destination blocks
    h.until(lambda: sx.stats.get("fetches_parked") == 1, "fetch parked")
    sx.publish("req-1", BLOCKS)  # three published: the parked fetch is refused
    r = p.next_result()
    assert (r.fetch_id, r.status, r.reason) == (1, "failed", Reason.BAD_BLOCKS)
    (sent,) = h.tap.results(1)
    assert sent.via == "worker" and sent.thread == sx._worker_for("req-1", "peer-a").thread.name
    assert sent.thread != threading.current_thread().name


def test_writes_in_progress_per_worker_are_bounded(h: Harness) -> None:
    """With max_writes_in_flight_per_worker=1 a second peer's write is posted only once the first ended."""
    sx, dp = h.sender(num_threads=1, limits=dict(max_writes_in_flight_per_worker=1))
    a, b = h.peer(sx, "peer-a"), h.peer(sx, "peer-b")
    sx.publish("req-a", BLOCKS)
    sx.publish("req-b", BLOCKS)
    a.fetch("req-a", 1)
    xa = dp.wait_posted(1)
    b.fetch("req-b", 2)
    with pytest.raises(TimeoutError):
        dp.wait_posted(2, timeout=QUIET_S)
    xa.finish(True)
    dp.wait_posted(2).finish(True)
    assert {a.next_result().status, b.next_result().status} == {"done"}


# -- item 2: nothing is reused while a write may land -------------------------------------------


def test_a_status_check_that_raises_keeps_the_write_in_flight_until_nixl_answers(
    h: Harness,
) -> None:
    """A raising status check on a write NIXL will not release yet reports in_doubt and keeps the source; when it ends the receiver gets CancelAck(in_doubt=false)."""
    sx, dp = h.sender(num_threads=1)
    p = h.peer(sx, "peer-a")
    hd = sx.publish("req-1", BLOCKS)
    p.fetch("req-1", 1)
    x = dp.wait_posted(1)
    answer = hold_status_check(x)
    r = p.next_result()
    assert (r.status, r.reason) == ("in_doubt", Reason.TRANSFER_ERROR)
    s = hd.session
    out = hd.wait(0)
    assert out is not None and out.state is TxState.FAILED and out.in_doubt
    assert s.writes_in_flight == 1 and not s.drained and not x.released
    assert hd.close(timeout=0.05) is False
    answer.append(True)
    x.finish(True)
    ack = p.next_message()
    assert ack == wire.CancelAck(request_id="req-1", fetch_id=1, in_doubt=False)
    assert hd.close(timeout=WAIT_S) is True and x.released
    assert sx.stats.get("in_doubt_resolved") == 1


def test_a_refused_release_keeps_the_write_in_flight_until_released(h: Harness) -> None:
    """A write NIXL says is DONE but whose handle release() refuses stays in flight and in doubt until a later release succeeds."""
    sx, dp = h.sender(num_threads=1)
    p = h.peer(sx, "peer-a")
    hd = sx.publish("req-1", BLOCKS)
    p.fetch("req-1", 1)
    x = dp.wait_posted(1)
    allow: list[bool] = []
    release = x.release
    x.release = lambda: bool(allow) and release()  # type: ignore[method-assign]
    x.finish(True)
    r = p.next_result()
    assert (r.status, r.reason) == ("in_doubt", Reason.TRANSFER_ERROR)
    assert hd.session.writes_in_flight == 1 and hd.close(timeout=0.05) is False
    allow.append(True)
    assert p.next_message() == wire.CancelAck(request_id="req-1", fetch_id=1, in_doubt=False)
    assert hd.close(timeout=WAIT_S) is True


def test_a_stalled_write_that_ends_is_resolved_on_the_wire(h: Harness) -> None:
    """A stalled write reported in_doubt is followed, when NIXL returns, by CancelAck(in_doubt=false) for that fetch; the session drains."""
    sx, dp = h.sender(num_threads=1, deadlines=dict(xfer_stall_timeout_ms=200))
    p = h.peer(sx, "peer-a")
    hd = sx.publish("req-1", BLOCKS)
    p.fetch("req-1", 1)
    x = dp.wait_posted(1)
    assert p.next_result().status == "in_doubt"
    x.finish(True)
    assert p.next_message() == wire.CancelAck(request_id="req-1", fetch_id=1, in_doubt=False)
    assert hd.close(timeout=WAIT_S) is True
    assert p.more() == []


def test_a_cancel_during_a_stalled_write_is_acked_in_doubt_then_resolved(h: Harness) -> None:
    """A receiver's cancel of a fetch whose write stalled gets CancelAck(in_doubt=true) after its in_doubt Result, then CancelAck(in_doubt=false) when the write ends."""
    sx, dp = h.sender(num_threads=1, deadlines=dict(xfer_stall_timeout_ms=200))
    p = h.peer(sx, "peer-a")
    sx.publish("req-1", BLOCKS)
    p.fetch("req-1", 1)
    x = dp.wait_posted(1)
    p.cancel("req-1", 1)
    assert p.next_result().status == "in_doubt"
    assert p.next_message() == wire.CancelAck(request_id="req-1", fetch_id=1, in_doubt=True)
    x.finish(True)
    assert p.next_message() == wire.CancelAck(request_id="req-1", fetch_id=1, in_doubt=False)


# -- item 6: deadlines end to end ------------------------------------------------------------


def _fetch_with_deadline(p: RawPeer, request_id: str, fetch_id: int, deadline_unix_ms: int) -> None:
    p._send(
        wire.RequestData(
            request_id=request_id,
            fetch_id=fetch_id,
            dst_blocks=list(BLOCKS),
            aux_slot=-1,
            timeout_ms=60_000,
            deadline_unix_ms=deadline_unix_ms,
        )
    )


def test_a_fetch_whose_receiver_deadline_passed_starts_no_write(h: Harness) -> None:
    """A RequestData read after its deadline_unix_ms (plus clock skew) is refused with timeout; no write is posted and the request stays fetchable."""
    sx, dp = h.sender(num_threads=1)
    p = h.peer(sx, "peer-a")
    hd = sx.publish("req-1", BLOCKS)
    skew = sx.settings.deadlines.clock_skew_ms
    _fetch_with_deadline(p, "req-1", 1, int(time.time() * 1000) - skew - 5_000)
    r = p.next_result()
    assert (r.fetch_id, r.status, r.reason) == (1, "failed", Reason.TIMEOUT)
    assert dp.xfers == [] and not hd.session.ended
    _fetch_with_deadline(p, "req-1", 2, int(time.time() * 1000) + 30_000)
    dp.wait_posted(1).finish(True)
    assert p.next_result().status == "done"


def test_a_parked_fetch_keeps_the_receivers_deadline(h: Harness) -> None:
    """A fetch parked until publish is not written once its deadline_unix_ms passed, though its timeout_ms counted from arrival has not."""
    sx, dp = h.sender(num_threads=1, deadlines=dict(clock_skew_ms=0))
    p = h.peer(sx, "peer-a")
    _fetch_with_deadline(p, "req-1", 1, int(time.time() * 1000) + 300)
    h.until(lambda: sx.stats.get("fetches_parked") == 1, "fetch parked")
    r = p.next_result()  # nobody published within the receiver's deadline
    assert (r.fetch_id, r.status) == (1, "failed")
    assert r.reason in (Reason.EXPIRED, Reason.TIMEOUT)
    sx.publish("req-1", BLOCKS)
    assert p.more() == [] and dp.xfers == []


# -- item 7: no leaks --------------------------------------------------------------------------


def test_a_receiver_replaced_at_its_endpoint_loses_its_nixl_peer_after_its_write(
    h: Harness,
) -> None:
    """A new receiver id registering at an existing peer's result endpoint retires the old NIXL peer, but only once the write toward it ended."""
    sx, dp = h.sender(num_threads=1)
    old = h.peer(sx, "peer-old")
    sx.publish("req-1", BLOCKS)
    old.fetch("req-1", 1)
    x = dp.wait_posted(1)
    h.peer(sx, "peer-new", result_endpoint=old.result_endpoint)  # the old process is gone
    assert "peer-old" in dp.peers, "removed under a write in flight"
    assert "peer-new" in dp.peers
    x.finish(True)
    wait_until(lambda: "peer-old" not in dp.peers, WAIT_S, "old NIXL peer removed")
    assert sx.stats.get("peer_removals_deferred") == 1
    with sx._lock:
        assert [p.receiver_id for p in sx.peers.peers()] == ["peer-new"]


def test_a_replaced_idle_receiver_is_removed_at_once(h: Harness) -> None:
    """With no write toward it, a receiver replaced at its endpoint loses its NIXL peer when the new one registers."""
    sx, dp = h.sender(num_threads=1)
    old = h.peer(sx, "peer-old")
    h.peer(sx, "peer-new", result_endpoint=old.result_endpoint)
    assert "peer-old" not in dp.peers and "peer-new" in dp.peers
    assert sx.stats.get("peers_replaced") == 1


def test_close_racing_the_last_write_never_leaks_the_session(h: Harness) -> None:
    """When the last write ends between close()'s wait giving up and close() taking the session out of the live table, the session is still forgotten."""
    sx, dp = h.sender(num_threads=1)
    p = h.peer(sx, "peer-a")
    hd = sx.publish("req-1", BLOCKS)
    p.fetch("req-1", 1)
    x = dp.wait_posted(1)
    s = hd.session
    worker_done = threading.Event()
    drained = sx.session_drained

    def observed(session: Any, remove: bool = False) -> None:
        drained(session, remove)
        if not remove:
            worker_done.set()

    sx.session_drained = observed  # type: ignore[method-assign]
    wait = s.drained_event.wait

    def wait_then_race(timeout: float | None = None) -> bool:
        got = wait(0)  # close gives up...
        x.finish(True)  # ...and the write ends before close leaves the live table
        assert worker_done.wait(WAIT_S)
        return got

    s.drained_event.wait = wait_then_race  # type: ignore[method-assign]
    hd.close(timeout=0.01)
    wait_until(lambda: sx.session_count() == 0, 1.0, "closed session forgotten")


# -- item 1: no argument kills a thread; every turn is guarded --------------------------------


def test_a_result_endpoint_zmq_would_misuse_is_refused_as_bad_endpoint(h: Harness) -> None:
    """Register with a wildcard, a source-address or a port-less result_endpoint is refused with bad_endpoint."""
    sx, _ = h.sender()
    for i, endpoint in enumerate(["tcp://0.0.0.0:5555", "tcp://a:1;b:2", "tcp://no-port-here"]):
        raw = RawPeer(sx, f"peer-bad-{i}", result_endpoint=endpoint)
        try:
            reply = raw.try_register()
        finally:
            raw.close()
        assert not reply.ok and reply.reason is Reason.BAD_ENDPOINT, (endpoint, reply)
    assert sx.broken() is None


def test_a_listener_bug_is_counted_and_reported_and_the_listener_goes_on(h: Harness) -> None:
    """An unexpected exception while handling a message is counted as a thread error, makes broken() say so, and the listener serves the next message."""
    sx, dp = h.sender(num_threads=1)
    p = h.peer(sx, "peer-a")

    def bug(*args: Any) -> None:
        raise KeyError("a bug")

    sx.listener._on_cancel = bug  # type: ignore[method-assign]
    p.cancel("req-x", 1)
    h.until(lambda: sx.stats.get("thread_errors") == 1, "bug caught")
    assert "listener" in (sx.broken() or "")
    sx.publish("req-1", BLOCKS)
    p.fetch("req-1", 1)
    dp.wait_posted(1).finish(True)
    assert p.next_result().status == "done"


def test_a_worker_bug_is_counted_and_reported_and_the_worker_goes_on(h: Harness) -> None:
    """An unexpected exception in a worker task is counted, makes broken() name the worker, and the worker serves later fetches."""
    sx, dp = h.sender(num_threads=1)
    p = h.peer(sx, "peer-a")
    w = sx._workers[0]

    def bug(task: Any) -> None:
        raise KeyError("a bug")

    w._ack_cancel = bug  # type: ignore[method-assign]
    hd = sx.publish("req-1", BLOCKS)
    p.fetch("req-1", 1)
    x = dp.wait_posted(1)
    p.cancel("req-1", 1)
    h.until(lambda: hd.session.ended, "cancel handled")
    x.finish(True)
    wait_until(lambda: sx.stats.get("thread_errors") == 1, WAIT_S, "worker bug caught")
    assert "worker" in (sx.broken() or "")
    assert w.thread.is_alive()
    sx.publish("req-2", BLOCKS)
    p.fetch("req-2", 2)
    dp.wait_posted(2).finish(True)
    msgs = [p.next_message(), p.next_message()]
    assert any(isinstance(m, wire.Result) and m.fetch_id == 2 and m.status == "done" for m in msgs)


# -- item 9: no import circle -------------------------------------------------------------------


def test_the_worker_module_does_not_import_the_sender() -> None:
    """kvxferd/transfer/worker.py and its worker_*.py modules import nothing from kvxferd.transfer.sender, even for type checking."""
    modules = sorted((Path(__file__).parents[1] / "kvxferd" / "transfer").glob("worker*.py"))
    assert len(modules) > 1
    for path in modules:
        tree = ast.parse(path.read_text())
        imported = {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module is not None
        } | {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        assert not [m for m in imported if m.startswith("kvxferd.transfer.sender")], path.name


def test_slice_states_after_a_late_in_doubt_write(h: Harness) -> None:
    """A write that returns after being reported in doubt leaves its slice IN_DOUBT (its one Result stands) and the session FAILED in doubt."""
    sx, dp = h.sender(num_threads=1, deadlines=dict(xfer_stall_timeout_ms=200))
    p = h.peer(sx, "peer-a")
    hd = sx.publish("req-1", BLOCKS)
    p.fetch("req-1", 1)
    x = xfer_of(dp, "peer-a") if dp.xfers else dp.wait_posted(1)
    assert p.next_result().status == "in_doubt"
    x.finish(True)
    assert hd.close(timeout=WAIT_S) is True
    sl = hd.session.slices()[0]
    assert sl.state is SliceState.IN_DOUBT
    out = hd.wait(0)
    assert out is not None and out.in_doubt
