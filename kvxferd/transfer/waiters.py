"""Deliver one completion to every waiter: threads, and asyncio tasks on any number of loops.

Each asyncio waiter is woken on its *own* loop (``call_soon_threadsafe`` on the
loop that created its future); a loop that has stopped or closed is skipped, so
it cannot strand waiters on other loops. See seed 001: waking every waiter on
the first waiter's loop left consumers on other loops blocked forever.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger("kvxferd.waiters")


def _resolve(fut: asyncio.Future[T], value: T) -> None:
    if not fut.done():
        fut.set_result(value)


class Flag:
    """``threading.Event``'s is_set / set / wait, its Condition made only when a thread waits.

    Every transfer carries a few of these (ended, fence done, drained); most are only set
    and read, never waited on, and building a threading.Event for each was a sixth of
    the sender's CPU per small request (issue 22).
    """

    _lock = threading.Lock()  # only around creating an event (rare): one for all flags

    def __init__(self) -> None:
        self._set = False
        self._event: threading.Event | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with Flag._lock:
            self._set = True
            event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        with Flag._lock:
            if self._set:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)


class Completion(Generic[T]):
    """A value set once; ``wait`` blocks a thread, ``wait_async`` suspends a task on its own loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _value, _set and _futures
        self._event = Flag()
        self._set = False
        self._value: T | None = None
        self.set_at: float | None = None  # time.monotonic() when the value was set
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[T]]] = []
        self._callbacks: list[Callable[[T], None]] = []

    def done(self) -> bool:
        return self._set

    def value(self) -> T | None:
        return self._value

    def set(self, value: T) -> bool:
        """Set the value once; False (and nothing changes) if it was already set."""
        with self._lock:
            if self._set:
                return False
            self._value, self._set = value, True
            self.set_at = time.monotonic()
            futures, self._futures = self._futures, []
            callbacks, self._callbacks = self._callbacks, []
        self._event.set()
        for fn in callbacks:
            try:
                fn(value)
            except Exception:  # a waiter's bug must not break the thread that ended the transfer
                log.exception("a completion callback failed")
        for loop, fut in futures:
            try:
                loop.call_soon_threadsafe(_resolve, fut, value)
            except RuntimeError:  # that loop is closed; its waiters are gone with it
                pass
        return True

    def add_done_callback(self, fn: Callable[[T], None]) -> None:
        """Call ``fn(value)`` once the value is set: on the thread that sets it, or now if set.

        ``fn`` must not block (it runs inside whatever ended the transfer: a worker, an io
        thread); the engine gateway only queues a reply for its own io thread.
        """
        with self._lock:
            if not self._set:
                self._callbacks.append(fn)
                return
            value = self._value
        fn(value)  # type: ignore[arg-type]

    def wait(self, timeout: float | None) -> T | None:
        """The value, or None if ``timeout`` seconds passed first."""
        if self._event.wait(timeout):
            return self._value
        return None

    async def wait_async(self, timeout: float | None = None) -> T | None:
        """The value, awaited on the running loop; None after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._set:
                return self._value
            fut: asyncio.Future[T] = loop.create_future()
            self._futures.append((loop, fut))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            return None
        finally:
            with self._lock:
                self._futures = [(lp, f) for lp, f in self._futures if f is not fut]


class Once(Generic[T]):
    """Work that runs once however many threads ask: the first caller claims and does it;
    the others wait, each within its own bound, for the first one's result."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claimed = False
        self._done = threading.Event()
        self._result: T | None = None

    def run(self, work: Callable[[], T], timeout: float) -> T | None:
        """``work()`` for the first caller; the others get its result (None after ``timeout``)."""
        if not self.claim():
            return self.wait(timeout)
        result: T | None = None
        try:
            result = work()
            return result
        finally:
            self.finish(result)

    def claim(self) -> bool:
        """True for the first caller only: it must call :meth:`finish`, also on failure."""
        with self._lock:
            first, self._claimed = not self._claimed, True
        return first

    def finish(self, result: T | None) -> None:
        self._result = result
        self._done.set()

    def wait(self, timeout: float) -> T | None:
        """The first caller's result; None if it has not finished within ``timeout`` (or failed)."""
        return self._result if self._done.wait(max(0.0, timeout)) else None
