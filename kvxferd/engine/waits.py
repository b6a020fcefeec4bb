"""The engine calls that wait: a Wait, a Close, or a Publish/Fetch with ``wait_ms``, until answered.

No call ever blocks the gateway's io thread: a call that must wait registers a
callback on its transfer's completion and a timer for its timeout; a call that closes
once its transfer ended but whose writes are still in flight re-checks every
``CLOSE_POLL_S`` until they ended or its timeout passed. One call's states::

    state     event                                    next
    --------  ---------------------------------------  ---------------------------------------
    waiting   the transfer ended, no close asked       answered: its outcome
    waiting   ended, close asked, nothing in flight    answered: closed (Closed, or the
              (the role's ``closes_at_once``)          Outcome with ``closed``)
    waiting   ended, close asked, writes in flight     closing (a close poll timer)
    waiting   its timeout                              answered: Pending, or the open outcome
                                                       of a waiting Publish/Fetch
    closing   the writes ended, or its timeout         answered: closed what it can
    any       the gateway stops                        answered: Error(shutting_down)

A Close starts in ``closing`` unless its handle closes at once. A close whose deadline
(the engine's ``deadline_unix_ms``) has passed is not executed: the engine gave up and
never hears of it, so the handle stays (``Error(timeout)``). An answered call is never
answered again (``done``); its timers are skipped when due, and dropped once they
outnumber the waiting calls (a publish_wait answered in a millisecond keeps its
2-minute timeout otherwise).

Owner: the gateway's io thread, the only thread that touches this table (no lock);
a transfer that ends on another thread hands its answer over with ``post``. The calls
waiting here are the gateway's ``calls_in_flight`` (bounded by ``max_inflight``).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

import msgspec

from kvxferd.engine import engine_protocol as ep
from kvxferd.engine.handles import Entry, HandleTable
from kvxferd.engine.roles import Role
from kvxferd.stats import Stats
from kvxferd.transfer.guard import Guard
from kvxferd.transfer.receiver import RxHandle
from kvxferd.transfer.sender import TxHandle

T = TypeVar("T")

CLOSE_POLL_S = 0.002  # a Close that waits for writes in flight looks again this often


class Expired(Exception):
    """The call's deadline passed before the service was called."""


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _left_s(deadline_ms: int) -> float | None:
    """Seconds until ``deadline_ms`` (Unix ms; negative once passed), None for no deadline."""
    return None if deadline_ms == 0 else (deadline_ms - now_ms()) / 1000


def before(deadline_ms: int, fn: Callable[[], T]) -> T:
    """``fn()``, only if ``deadline_ms`` has not passed yet."""
    left = _left_s(deadline_ms)
    if left is not None and left <= 0:
        raise Expired
    return fn()


def expired(call_id: int, when: str) -> ep.Error:
    return ep.Error(
        call_id=call_id,
        reason=ep.EngineReason.TIMEOUT,
        detail=f"the call's deadline had passed when {when}; it was not executed",
    )


def _close(handle: TxHandle | RxHandle, deadline_ms: int) -> bool:
    """Close without waiting (the io thread never waits): not at all once the deadline passed."""
    left = _left_s(deadline_ms)
    if left is not None and left <= 0:  # the engine gave up: it never hears of this close
        raise Expired
    return handle.close(0)


@dataclass(slots=True, eq=False)
class Call:
    """A call that waits: a Wait (or a waiting Publish/Fetch) or a Close; io thread only."""

    rid: bytes
    call_id: int
    handle_id: int
    entry: Entry
    close: bool  # close once ended (Wait.close, Close, a waiting Publish/Fetch's close)
    until: float  # monotonic: its timeout (Pending / an open outcome / closed False then)
    deadline_ms: int  # the engine's deadline_unix_ms (0: none)
    kind: Literal["wait", "close", "start"]  # Wait, Close, or a waiting Publish/Fetch
    closing: bool = False  # ended; waiting for its writes before the close answers
    done: bool = False


class Waits:
    """The calls waiting for their transfer's end (or its writes), with their timers; io thread only."""

    def __init__(
        self,
        adapter: Role,
        handles: HandleTable,
        stats: Stats,
        guard: Guard,
        reply: Callable[[bytes, ep._Msg], None],
        post: Callable[[Callable[[], None]], None],
    ) -> None:
        self.adapter = adapter
        self.handles = handles
        self.stats = stats
        self.guard = guard
        self._reply = reply  # send a reply to a connection (io thread)
        self._post = post  # run on the io thread (from any thread)
        self._calls: set[Call] = set()
        # (when, seq, call, what): a call's timeout or its next close check; an entry whose
        # call was answered meanwhile is skipped when due, and dropped by ``_timer``.
        self._timers: list[tuple[float, int, Call, Callable[[], None]]] = []
        self._timer_seq = itertools.count()

    def __len__(self) -> int:
        return len(self._calls)

    def run_due(self, now: float) -> float | None:
        """Run the timers due by ``now``; seconds until the next one (None: none left)."""
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, call, fn = heapq.heappop(timers)
            if not call.done:
                try:
                    fn()
                except Exception:
                    self.guard.caught("gateway")
        return None if not timers else max(0.0, timers[0][0] - now)

    def stop(self) -> None:
        """The gateway stops: every waiting call gets Error(shutting_down), no timer is left."""
        for call in list(self._calls):
            self._answer(
                call,
                ep.Error(
                    call_id=call.call_id,
                    reason=ep.EngineReason.SHUTTING_DOWN,
                    detail="the gateway is stopping",
                ),
            )
        self._timers.clear()

    def wait(self, call: Call) -> ep._Msg | None:
        """Answer ``call`` now if its transfer ended (and, closing, its writes too), else later."""
        completion = call.entry.handle.session.completion
        if completion.done():
            return self._ended(call)
        self._calls.add(call)
        completion.add_done_callback(functools.partial(self._done_callback, call))
        self._timer(call.until, call, functools.partial(self._on_timeout, call))
        return None

    def _done_callback(self, call: Call, _value: object) -> None:
        """The transfer ended (on whatever thread ended it): answer on the io thread."""
        self._post(functools.partial(self._on_done, call))

    def _on_done(self, call: Call) -> None:
        if call.done or call.closing:
            return
        reply = self._ended(call)
        if reply is not None:
            self._answer(call, reply)

    def _on_timeout(self, call: Call) -> None:
        if call.done:
            return
        if call.closing:  # the writes did not end in time: close answers what it can
            self._answer(call, self._close_now(call))
            return
        if call.kind == "wait":
            self._answer(call, ep.Pending(call_id=call.call_id))
        else:
            self._answer(call, self._open_outcome(call))

    def _ended(self, call: Call) -> ep._Msg | None:
        """The transfer of ``call`` ended: its outcome, closed if asked (None: the close waits)."""
        if not call.close:
            return self._outcome_of(call)
        if self.adapter.closes_at_once(call.entry.handle) or time.monotonic() >= call.until:
            return self._close_now(call)
        if not call.closing:  # the outcome is known; its writes in flight are not over yet
            call.closing = True
            self._calls.add(call)
            self._timer(
                time.monotonic() + CLOSE_POLL_S, call, functools.partial(self._close_poll, call)
            )
        return None

    def _close_poll(self, call: Call) -> None:
        if call.done:
            return
        if self.adapter.closes_at_once(call.entry.handle) or time.monotonic() >= call.until:
            self._answer(call, self._close_now(call))
        else:
            self._timer(
                time.monotonic() + CLOSE_POLL_S, call, functools.partial(self._close_poll, call)
            )

    def begin_close(self, call: Call) -> ep._Msg | None:
        """A Close: cancel if open; answered at once when safe, else once its writes ended."""
        handle = call.entry.handle
        if self.adapter.closes_at_once(handle):
            return self._close_now(call)
        safe = before(call.deadline_ms, lambda: handle.close(0))  # cancels an open transfer
        if safe or time.monotonic() >= call.until:
            return self._closed_reply(call, safe)
        call.closing = True
        self._calls.add(call)
        self._timer(
            time.monotonic() + CLOSE_POLL_S, call, functools.partial(self._close_poll, call)
        )
        return None

    def _close_now(self, call: Call) -> ep._Msg:
        """Close the handle with no further wait; the reply (Closed, or the closed Outcome)."""
        try:
            safe = _close(call.entry.handle, call.deadline_ms)
        except Expired:
            self.stats.add("rejected_timeout")
            return expired(call.call_id, "its close was due")
        return self._closed_reply(call, safe)

    def _closed_reply(self, call: Call, safe: bool) -> ep._Msg:
        self.handles.forget(call.handle_id, call.entry, safe)
        if call.kind == "close":
            return ep.Closed(call_id=call.call_id, safe=bool(safe))
        out = self._outcome_of(call)
        return msgspec.structs.replace(out, closed=bool(safe))

    def _outcome_of(self, call: Call) -> ep.Outcome:
        handle = call.entry.handle
        value = handle.session.completion.value()
        if value is None:  # pragma: no cover - only asked once ended
            return self._open_outcome(call)
        hid = call.handle_id if call.kind == "start" else 0
        return self.adapter.outcome(call.call_id, handle, value, hid)

    def _open_outcome(self, call: Call) -> ep.Outcome:
        """A waiting Publish/Fetch not ended within its wait: its open state and handle."""
        return ep.Outcome(
            call_id=call.call_id, state=self.adapter.open_state, handle_id=call.handle_id
        )

    def _answer(self, call: Call, reply: ep._Msg) -> None:
        if call.done:
            return
        call.done = True
        self._calls.discard(call)
        self._reply(call.rid, reply)

    def _timer(self, when: float, call: Call, fn: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (when, next(self._timer_seq), call, fn))
        if len(self._timers) > 2 * len(self._calls) + 1024:
            # Answered calls' timeouts (a publish_wait answered in a millisecond keeps its
            # 2-minute timeout here): dropped, so the heap is bounded by the calls waiting.
            self._timers = [t for t in self._timers if not t[2].done]
            heapq.heapify(self._timers)
