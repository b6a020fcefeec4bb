"""Counters every part bumps: rejections by reason, outcomes, bytes, send timeouts.

Label values are bounded (reason codes, states), never request ids.
"""

from __future__ import annotations

import threading
from collections import Counter


class Stats:
    """Thread-safe named counters; ``snapshot()`` for tests, logs and the metrics endpoint."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, value: int = 1) -> None:
        with self._lock:
            self._counts[name] += value

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
