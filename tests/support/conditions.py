"""Waiting for a condition another process or thread makes true: polled, with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(cond: Callable[[], bool], timeout: float, what: str, poll: float = 0.005) -> float:
    """Poll ``cond`` until true; the monotonic time it became true. AssertionError after ``timeout``.

    For state that no event announces (a file, a probe answer, bytes in another
    process's memory); a thread of this process signals with an Event instead.
    """
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return time.monotonic()
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(poll)
