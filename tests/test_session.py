"""TxSession and RxSession state machines, without I/O: transitions, single outcomes, drain rules."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvxferd.errors import Reason, RejectedError
from kvxferd.transfer.session import (
    TX_TERMINAL,
    Fence,
    RxSession,
    RxState,
    Slice,
    SliceState,
    TxOutcome,
    TxSession,
    TxState,
)

WAIT_S = 5.0


def make_session(
    expected_fetches: int = 1, *, aux: bool = False, ttl_s: float = 120.0
) -> TxSession:
    return TxSession(
        7,
        "req-1",
        np.arange(3, dtype=np.int64),
        expected_fetches=expected_fetches,
        aux_slot=0 if aux else -1,
        aux_len=16 if aux else 0,
        ttl_s=ttl_s,
    )


def make_slice(n: int = 1, *, deadline: float = math.inf) -> Slice:
    return Slice(
        f"peer-{n}",
        n,
        "tcp://127.0.0.1:1",
        np.arange(3, dtype=np.int64),
        0,
        2,
        -1,
        deadline,
    )


def attached(s: TxSession, n: int = 1, **kw: float) -> Slice:
    sl = make_slice(n, **kw)
    s.add_slice(sl)
    return sl


# -- TxSession: admission ------------------------------------------------------------


class TestTxAdmission:
    def test_first_admission_moves_published_to_transferring(self) -> None:
        """An admitted write counts in flight and moves the session to TRANSFERRING."""
        s = make_session()
        sl = attached(s)
        assert s.state is TxState.PUBLISHED
        assert s.admit_write(sl) is None
        assert s.state is TxState.TRANSFERRING
        assert (s.writes_in_flight, sl.writes_in_flight, sl.state) == (1, 1, SliceState.WRITING)
        assert not s.drained

    @pytest.mark.parametrize(
        ("end", "reason"),
        [
            ("fail", Reason.SESSION_FAILED),
            ("cancel", Reason.CANCELLED),
            ("expire", Reason.EXPIRED),
        ],
    )
    def test_admission_after_the_session_ended_is_refused(self, end: str, reason: Reason) -> None:
        """Once a session ended, admit_write refuses with the ending's reason and never reopens it."""
        s = make_session(ttl_s=1.0)
        if end == "expire":
            assert s.expire(s.ttl_deadline + 1)
            sl = make_slice()  # an expired session takes no slice; admit a stray one
        else:
            sl = attached(s)
            assert s.fail(Reason.PEER_LOST, "x") if end == "fail" else s.cancel()
        before = s.outcome
        assert s.admit_write(sl) == reason
        assert s.outcome is before and s.state is before.state
        assert s.writes_in_flight == 0 and sl.state is SliceState.FAILED
        assert s.drained

    def test_queued_slice_of_a_failed_session_is_refused_and_reports_session_failed(self) -> None:
        """A slice still queued when another slice's write failed is refused with session_failed."""
        s = make_session(expected_fetches=2)
        a, b = attached(s, 1), attached(s, 2)
        assert s.admit_write(a) is None
        s.finish_write(a, ok=False, detail="NIXL error")
        assert s.state is TxState.FAILED
        assert s.admit_write(b) is Reason.SESSION_FAILED
        assert s.state is TxState.FAILED
        assert s.outcome == TxOutcome(TxState.FAILED, Reason.TRANSFER_ERROR, "NIXL error")
        rep = s.take_report(b)
        assert rep is not None and (rep.status, rep.reason) == ("failed", Reason.SESSION_FAILED)

    def test_admission_past_the_slice_deadline_is_refused_with_timeout(self) -> None:
        """No write of a slice starts after the slice's deadline."""
        s = make_session()
        sl = attached(s, deadline=100.0)
        assert s.admit_write(sl, now=100.5) is Reason.TIMEOUT
        assert s.writes_in_flight == 0 and sl.state is SliceState.FAILED

    def test_second_write_of_a_failed_slice_is_refused(self) -> None:
        """A slice that already failed admits no further write (no AUX after a failed KV)."""
        s = make_session(expected_fetches=2)
        a, _ = attached(s, 1), attached(s, 2)
        assert s.admit_write(a) is None
        s.fail_slice(a, Reason.PEER_LOST, "gone")  # e.g. the peer vanished mid-slice
        assert s.admit_write(a) is not None
        assert s.writes_in_flight == 1  # the first write is still counted


# -- TxSession: drain and outcome ------------------------------------------------------


class TestTxDrain:
    def test_failed_session_is_not_drained_while_another_write_is_in_flight(self) -> None:
        """One write failing does not drain a session while another admitted write is in flight."""
        s = make_session(expected_fetches=2)
        a, b = attached(s, 1), attached(s, 2)
        assert s.admit_write(a) is None and s.admit_write(b) is None
        s.finish_write(a, ok=False, detail="err")
        assert s.state is TxState.FAILED
        assert not s.drained and not s.drained_event.is_set()
        s.finish_write(b, ok=True, nbytes=10)
        assert s.drained and s.drained_event.is_set()

    def test_release_admission_gives_back_the_count_before_anyone_sees_the_failure(self) -> None:
        """A write that was never posted releases its admission in the same step that fails the session."""
        s = make_session()
        sl = attached(s)
        seen: list[tuple[TxState, int]] = []
        assert s.admit_write(sl) is None

        def watch() -> None:
            out = s.completion.wait(WAIT_S)
            assert out is not None
            seen.append((out.state, s.writes_in_flight))

        t = threading.Thread(target=watch)
        t.start()
        s.release_admission(sl, "descriptors could not be built")
        t.join(WAIT_S)
        assert seen == [(TxState.FAILED, 0)]
        assert s.outcome is not None and s.outcome.reason is Reason.BUILD_FAILED
        assert s.drained

    def test_stalled_write_fails_in_doubt_and_keeps_memory_until_it_returns(self) -> None:
        """A stalled write makes the outcome in doubt; the session drains only once NIXL returns."""
        s = make_session()
        sl = attached(s)
        assert s.admit_write(sl) is None
        s.write_stalled(sl, "in progress past deadline")
        assert s.outcome is not None and s.outcome.in_doubt and s.outcome.reason is Reason.STALLED
        assert sl.state is SliceState.IN_DOUBT and not s.drained
        rep = s.take_report(sl)
        assert rep is not None and rep.status == "in_doubt"
        s.finish_write(sl, ok=False)  # a late error changes neither slice nor outcome
        assert sl.state is SliceState.IN_DOUBT and s.outcome.reason is Reason.STALLED
        assert s.drained and s.take_report(sl) is None

    def test_complete_after_every_expected_fetch(self) -> None:
        """The session completes once every expected fetch was written."""
        s = make_session(expected_fetches=2)
        a, b = attached(s, 1), attached(s, 2)
        for sl in (a, b):
            assert s.admit_write(sl) is None
            s.finish_write(sl, ok=True, nbytes=5)
            s.slice_written(sl)
        assert s.outcome == TxOutcome(TxState.COMPLETE)
        assert s.completion.value() is s.outcome and s.drained

    @pytest.mark.parametrize("first", ["fail", "cancel", "stall"])
    def test_completion_never_overwrites_an_earlier_ending(self, first: str) -> None:
        """After FAILED/CANCELLED, slice_written and finish_write never change the outcome to COMPLETE."""
        s = make_session()
        sl = attached(s)
        assert s.admit_write(sl) is None
        if first == "fail":
            s.fail(Reason.PEER_LOST, "peer gone")
        elif first == "cancel":
            s.cancel()
        else:
            s.write_stalled(sl, "stalled")
        outcome = s.outcome
        assert outcome is not None
        s.finish_write(sl, ok=True, nbytes=99)
        s.slice_written(sl)
        assert s.outcome is outcome and s.state is outcome.state
        assert s.completion.value() is outcome
        assert s.fail(Reason.TRANSFER_ERROR) is False and s.cancel() is False
        assert s.outcome is outcome

    def test_expire_only_without_slices(self) -> None:
        """A request nobody fetched expires after its TTL; one with a fetch never expires."""
        s = make_session(ttl_s=1.0)
        assert not s.expire(s.ttl_deadline - 0.5)
        assert s.expire(s.ttl_deadline)
        assert s.state is TxState.EXPIRED and s.drained
        t = make_session(ttl_s=1.0)
        attached(t)
        assert not t.expire(t.ttl_deadline + 10)

    def test_add_slice_refuses_after_end_and_beyond_expected(self) -> None:
        """add_slice refuses an ended session, a known fetch and one fetch too many."""
        s = make_session(expected_fetches=1)
        sl = attached(s)
        with pytest.raises(RejectedError) as dup:
            s.add_slice(sl)
        assert dup.value.reason is Reason.DUPLICATE
        with pytest.raises(RejectedError):
            s.add_slice(make_slice(2))
        t = make_session()
        t.cancel()
        with pytest.raises(RejectedError) as ended:
            t.add_slice(make_slice())
        assert ended.value.reason is Reason.CANCELLED

    def test_each_slice_reports_once(self) -> None:
        """take_report hands out a slice's final result exactly once, and nothing while it is open."""
        s = make_session()
        sl = attached(s)
        assert s.take_report(sl) is None
        assert s.admit_write(sl) is None
        assert s.take_report(sl) is None
        s.finish_write(sl, ok=True, nbytes=12)
        s.slice_written(sl)
        rep = s.take_report(sl)
        assert rep is not None and (rep.status, rep.nbytes) == ("done", 12)
        assert s.take_report(sl) is None


# -- TxSession: concurrency ------------------------------------------------------------


def race_admissions_against(ending: str, n: int = 8) -> tuple[list[Reason | None], int, bool]:
    """``n`` threads admit one write each while the main thread ends the session.

    Returns every answer, and writes_in_flight and drained right after the ending.
    """
    s = make_session(expected_fetches=n)
    slices = [attached(s, i) for i in range(n)]
    barrier = threading.Barrier(n + 1)
    results: dict[int, Reason | None] = {}

    def admit(i: int) -> None:
        barrier.wait(WAIT_S)
        results[i] = s.admit_write(slices[i])

    threads = [threading.Thread(target=admit, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait(WAIT_S)
    if ending == "cancel":
        s.cancel()
    else:
        s.fail(Reason.PEER_LOST, "racing failure")
    # Nothing is finished yet: every admission that counted happened before the ending.
    in_flight_at_end, drained_at_end = s.writes_in_flight, s.drained
    for t in threads:
        t.join(WAIT_S)
    assert len(results) == n
    assert s.writes_in_flight == in_flight_at_end
    return [results[i] for i in range(n)], in_flight_at_end, drained_at_end


@pytest.mark.parametrize("ending", ["cancel", "fail"])
def test_admission_racing_an_ending_is_either_counted_or_refused(ending: str) -> None:
    """Writes racing an ending are admitted before it (and block the drain) or refused; never after."""
    for _ in range(30):
        results, in_flight_at_end, drained_at_end = race_admissions_against(ending)
        admitted = sum(r is None for r in results)
        assert admitted == in_flight_at_end
        assert drained_at_end == (admitted == 0)


# -- TxSession: stateful ---------------------------------------------------------------


REASONS = st.sampled_from([Reason.PEER_LOST, Reason.TRANSFER_ERROR, Reason.TIMEOUT])


class TxSessionMachine(RuleBasedStateMachine):
    """Random sequences of TxSession calls, checked against its invariants after every step."""

    @initialize(expected=st.integers(1, 3))
    def start(self, expected: int) -> None:
        self.s = make_session(expected_fetches=expected, ttl_s=1.0)
        self.slices: list[Slice] = []
        self.admitted: dict[int, int] = {}  # fetch id -> admissions not yet returned
        self.first_outcome: TxOutcome | None = None
        self.reported: set[int] = set()
        self.next_id = 1

    def _pick(self, i: int) -> Slice:
        return self.slices[i % len(self.slices)]

    def _open(self) -> list[Slice]:
        return [sl for sl in self.slices if self.admitted[sl.fetch_id] > 0]

    @rule()
    def add_slice(self) -> None:
        sl = make_slice(self.next_id)
        self.next_id += 1
        try:
            self.s.add_slice(sl)
        except RejectedError:
            assert self.s.ended or len(self.slices) >= self.s.expected_fetches
            return
        assert not self.s.ended
        self.slices.append(sl)
        self.admitted[sl.fetch_id] = 0

    @precondition(lambda self: self.slices)
    @rule(i=st.integers(0, 10))
    def admit(self, i: int) -> None:
        sl = self._pick(i)
        ended_before, before = self.s.ended, self.s.writes_in_flight
        reason = self.s.admit_write(sl)
        if ended_before:
            assert reason is not None, "a write was admitted after the session ended"
            assert self.s.writes_in_flight == before
        if reason is None:
            self.admitted[sl.fetch_id] += 1

    @precondition(lambda self: any(n > 0 for n in self.admitted.values()))
    @rule(i=st.integers(0, 10), ok=st.booleans())
    def finish(self, i: int, ok: bool) -> None:
        open_ = self._open()
        sl = open_[i % len(open_)]
        self.s.finish_write(sl, ok, nbytes=8 if ok else 0, detail="" if ok else "err")
        self.admitted[sl.fetch_id] -= 1

    @precondition(lambda self: any(n > 0 for n in self.admitted.values()))
    @rule(i=st.integers(0, 10))
    def release(self, i: int) -> None:
        open_ = self._open()
        sl = open_[i % len(open_)]
        self.s.release_admission(sl, "not built")
        self.admitted[sl.fetch_id] -= 1

    @precondition(lambda self: any(n > 0 for n in self.admitted.values()))
    @rule(i=st.integers(0, 10))
    def stall(self, i: int) -> None:
        open_ = self._open()
        self.s.write_stalled(open_[i % len(open_)], "stalled")  # stays in flight

    @precondition(lambda self: self.slices)
    @rule(i=st.integers(0, 10))
    def written(self, i: int) -> None:
        self.s.slice_written(self._pick(i))

    @precondition(lambda self: self.slices)
    @rule(i=st.integers(0, 10), reason=REASONS)
    def fail_slice(self, i: int, reason: Reason) -> None:
        self.s.fail_slice(self._pick(i), reason, "slice failed")

    @rule(reason=REASONS)
    def fail(self, reason: Reason) -> None:
        ended = self.s.ended
        assert self.s.fail(reason, "failed") is not ended

    @rule()
    def cancel(self) -> None:
        ended = self.s.ended
        assert self.s.cancel() is not ended

    @rule(late=st.booleans())
    def expire(self, late: bool) -> None:
        now = self.s.ttl_deadline + (1.0 if late else -0.5)
        if self.s.expire(now):
            # No reader came, or (the readers' lease) only some of the expected ones came and
            # none of them is still queued or writing.
            assert late
            assert not self.slices or (
                len(self.slices) < self.s.expected_fetches
                and not any(
                    sl.state in (SliceState.QUEUED, SliceState.WRITING) for sl in self.slices
                )
            )

    @precondition(lambda self: self.slices)
    @rule(i=st.integers(0, 10))
    def report(self, i: int) -> None:
        sl = self._pick(i)
        rep = self.s.take_report(sl)
        if rep is not None:
            assert sl.fetch_id not in self.reported, "a slice reported twice"
            self.reported.add(sl.fetch_id)
            assert sl.state not in (SliceState.QUEUED, SliceState.WRITING)

    @invariant()
    def outcome_committed_once(self) -> None:
        out = self.s.outcome
        if self.first_outcome is None:
            self.first_outcome = out
        else:
            assert out is self.first_outcome, "the terminal outcome changed"
        if out is not None:
            assert self.s.state is out.state and self.s.state in TX_TERMINAL
            assert self.s.completion.value() is out
        else:
            assert not self.s.ended and not self.s.completion.done()

    @invariant()
    def writes_in_flight_counted(self) -> None:
        assert self.s.writes_in_flight >= 0
        assert self.s.writes_in_flight == sum(self.admitted.values())
        for sl in self.slices:
            assert sl.writes_in_flight == self.admitted[sl.fetch_id] >= 0

    @invariant()
    def drained_iff_ended_and_idle(self) -> None:
        drained = self.s.ended and self.s.writes_in_flight == 0
        assert self.s.drained == drained
        assert self.s.drained_event.is_set() == drained

    @invariant()
    def done_slices_have_nothing_in_flight(self) -> None:
        for sl in self.slices:
            if sl.state is SliceState.DONE:
                assert sl.writes_in_flight == 0
        if self.s.state is TxState.COMPLETE:
            done = sum(sl.state is SliceState.DONE for sl in self.slices)
            assert done >= self.s.expected_fetches


TestTxSessionStateful = TxSessionMachine.TestCase
TestTxSessionStateful.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- RxSession -------------------------------------------------------------------------


def make_rx() -> RxSession:
    return RxSession(
        fetch_id=1,
        request_id="req-1",
        sender_endpoint="tcp://127.0.0.1:1",
        dst_blocks=np.arange(3, dtype=np.int64),
        layer_begin=0,
        layer_end=2,
        aux_slot=-1,
        deadline=math.inf,
    )


class TestRxSession:
    def test_done_result_completes_and_frees_the_blocks(self) -> None:
        """A done Result completes the fetch and its blocks are reusable at once."""
        rx = make_rx()
        rx.mark_sent()
        assert rx.on_result("done", None, "", 48, b"aux")
        assert rx.state is RxState.DONE and rx.outcome is not None and rx.outcome.aux == b"aux"
        assert rx.blocks_reusable and rx.fence_done.is_set()

    def test_failed_result_fails_without_fencing(self) -> None:
        """A failed Result means no write is in flight: FAILED with reusable blocks."""
        rx = make_rx()
        rx.mark_sent()
        assert rx.on_result("failed", Reason.SESSION_FAILED, "other slice failed", 0, None)
        assert rx.outcome is not None and rx.outcome.reason is Reason.SESSION_FAILED
        assert rx.blocks_reusable

    def test_in_doubt_result_keeps_the_blocks(self) -> None:
        """An in-doubt Result fails the fetch and the blocks stay unusable."""
        rx = make_rx()
        rx.mark_sent()
        rx.on_result("in_doubt", Reason.STALLED, "stalled", 0, None)
        assert rx.state is RxState.FAILED and rx.fence is Fence.IN_DOUBT
        assert not rx.blocks_reusable and rx.fence_done.is_set()

    def test_cancel_after_send_fences_until_acknowledged(self) -> None:
        """A fetch cancelled after REQUEST_DATA left keeps its blocks fenced until the CancelAck."""
        rx = make_rx()
        rx.mark_sent()
        assert rx.end_locally(RxState.CANCELLED, Reason.CANCELLED, "engine", fence_s=5.0)
        assert rx.fence is Fence.FENCED and not rx.blocks_reusable
        assert not rx.fence_done.is_set()
        rx.on_cancel_ack(in_doubt=False)
        assert rx.fence is Fence.RELEASED and rx.blocks_reusable and rx.fence_done.is_set()

    def test_cancel_before_send_needs_no_fence(self) -> None:
        """A fetch cancelled before REQUEST_DATA left can free its blocks at once."""
        rx = make_rx()
        assert rx.end_locally(RxState.CANCELLED, Reason.CANCELLED, "engine", fence_s=5.0)
        assert rx.fence is Fence.NONE and rx.blocks_reusable

    def test_in_doubt_ack_and_expired_fence_keep_the_blocks(self) -> None:
        """An in-doubt CancelAck, or none before the fence deadline, leaves the blocks in doubt."""
        a, b = make_rx(), make_rx()
        for rx in (a, b):
            rx.mark_sent()
            rx.end_locally(RxState.TIMED_OUT, Reason.TIMEOUT, "timeout", fence_s=1.0)
        a.on_cancel_ack(in_doubt=True)
        assert a.fence is Fence.IN_DOUBT and not a.blocks_reusable
        assert not b.fence_expired(b.fence_deadline - 0.5)
        assert b.fence_expired(b.fence_deadline)
        assert b.fence is Fence.IN_DOUBT and not b.blocks_reusable and b.fence_done.is_set()

    def test_late_result_after_cancel_keeps_the_outcome_and_releases_the_fence(self) -> None:
        """A final Result after a local cancel changes no outcome but proves no write is in flight."""
        rx = make_rx()
        rx.mark_sent()
        rx.end_locally(RxState.CANCELLED, Reason.CANCELLED, "engine", fence_s=5.0)
        outcome = rx.outcome
        assert not rx.on_result("done", None, "", 48, None)
        assert rx.outcome is outcome and rx.state is RxState.CANCELLED
        assert rx.fence is Fence.RELEASED and rx.blocks_reusable

    def test_first_ending_wins(self) -> None:
        """The first terminal outcome of a fetch is final."""
        rx = make_rx()
        rx.mark_sent()
        assert rx.fail(Reason.PEER_LOST, "gone")
        outcome = rx.outcome
        assert not rx.on_result("done", None, "", 1, None)
        assert not rx.end_locally(RxState.CANCELLED, Reason.CANCELLED, "x", fence_s=1.0)
        assert rx.outcome is outcome and rx.completion.value() is outcome
