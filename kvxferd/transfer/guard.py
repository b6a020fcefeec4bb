"""What a long-lived thread does with an exception nobody expected: log it, count it, say so.

Every long-lived loop (the sender's listener and workers, the receiver's io
thread, the engine gateway's serve task) wraps the body of one turn::

    try:
        one_turn()
    except Exception:
        guard.caught("listener")   # traceback logged, stats["thread_errors"] += 1

and goes on with the next turn, so one bad message never kills a thread. But a
daemon that has met a bug is not trusted to be healthy: from the first caught
exception on, :meth:`Guard.broken` names it, ``/healthz`` answers 503 with that
text and the systemd watchdog is withheld, so systemd or Kubernetes restarts
the process instead of letting it run on in an unknown state.
"""

from __future__ import annotations

import logging
import threading

from kvxferd.stats import Stats


class Guard:
    """The first unexpected exception of a component's threads, and their count."""

    def __init__(self, stats: Stats, log: logging.Logger) -> None:
        self._stats = stats
        self._log = log
        self._lock = threading.Lock()
        self._first: str | None = None

    def caught(self, where: str) -> None:
        """Call inside an ``except`` block: log with traceback, count, remember the first."""
        self._log.exception("%s: unexpected error (the thread goes on; liveness fails)", where)
        self._stats.add("thread_errors")
        with self._lock:
            if self._first is None:
                import sys

                exc = sys.exc_info()[1]
                self._first = f"{where}: {exc!r}"[:300]

    def dead(self, where: str) -> None:
        """A long-lived thread ended outside shutdown."""
        self._stats.add("threads_dead")
        with self._lock:
            if self._first is None:
                self._first = f"{where}: thread ended"

    def broken(self) -> str | None:
        """Why this component is not live any more (the first caught error), or None."""
        with self._lock:
            return self._first
