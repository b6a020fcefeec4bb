"""Counters every part bumps: rejections by reason, outcomes, bytes, send timeouts.

Label values are bounded (reason codes, states), never request ids.
"""

from __future__ import annotations

import threading
from collections import Counter, deque


class Stats:
    """Thread-safe named counters; ``snapshot()`` for tests, logs and the metrics endpoint."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._samples: dict[str, deque[float]] = {}

    def add(self, name: str, value: int = 1) -> None:
        with self._lock:
            self._counts[name] += value

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def observe(self, name: str, value: float) -> None:
        """Record one sample (e.g. a transfer duration in seconds); the newest 65,536 are kept."""
        with self._lock:
            q = self._samples.get(name)
            if q is None:
                q = self._samples[name] = deque(maxlen=65_536)
            q.append(value)

    def take_samples(self, name: str) -> list[float]:
        """The samples recorded since the last call (a metrics exporter drains them)."""
        with self._lock:
            q = self._samples.get(name)
            if not q:
                return []
            out = list(q)
            q.clear()
            return out
