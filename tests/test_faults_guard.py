"""Guard: what a long-lived thread does with an exception nobody expected (kvxferd/transfer/guard.py)."""

from __future__ import annotations

import logging

import pytest

from kvxferd.stats import Stats
from kvxferd.transfer.guard import Guard


def test_every_caught_exception_is_logged_counted_and_the_first_is_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each caught exception is logged with its traceback and counted; broken() names the first."""
    stats = Stats()
    guard = Guard(stats, logging.getLogger("kvxferd.test-guard"))
    assert guard.broken() is None
    with caplog.at_level(logging.ERROR, logger="kvxferd.test-guard"):
        for i in range(3):
            try:
                raise ValueError(f"bad input {i}")
            except ValueError:
                guard.caught("listener" if i == 0 else "worker")
    assert stats.get("thread_errors") == 3
    assert guard.broken() == "listener: ValueError('bad input 0')"
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert len(tracebacks) == 3 and "listener" in tracebacks[0].getMessage()


def test_a_dead_thread_makes_the_component_broken() -> None:
    """A long-lived thread that ended outside shutdown is counted and named by broken()."""
    stats = Stats()
    guard = Guard(stats, logging.getLogger("kvxferd.test-guard"))
    guard.dead("io thread")
    assert stats.get("threads_dead") == 1
    assert guard.broken() == "io thread: thread ended"
