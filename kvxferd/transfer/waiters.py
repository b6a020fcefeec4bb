"""Deliver one completion to every waiter: threads, and asyncio tasks on any number of loops.

Each asyncio waiter is woken on its *own* loop (``call_soon_threadsafe`` on the
loop that created its future); a loop that has stopped or closed is skipped, so
it cannot strand waiters on other loops. See seed 001: waking every waiter on
the first waiter's loop left consumers on other loops blocked forever.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


def _resolve(fut: asyncio.Future[T], value: T) -> None:
    if not fut.done():
        fut.set_result(value)


class Completion(Generic[T]):
    """A value set once; ``wait`` blocks a thread, ``wait_async`` suspends a task on its own loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _value, _set and _futures
        self._event = threading.Event()
        self._set = False
        self._value: T | None = None
        self.set_at: float | None = None  # time.monotonic() when the value was set
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[T]]] = []

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
        self._event.set()
        for loop, fut in futures:
            try:
                loop.call_soon_threadsafe(_resolve, fut, value)
            except RuntimeError:  # that loop is closed; its waiters are gone with it
                pass
        return True

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
