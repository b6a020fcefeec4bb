"""The moved table: requests a draining sender handed to another one, and where they went.

A draining sender that moved a request tells its receivers in two ways (version 4): a
``Moved`` message on the result endpoint (request ids -> the new sender endpoint), and a
fetch of a moved request answered ``Result{failed, moved, moved_to}``. Each entry is
(draining endpoint, request id) -> (new endpoint, expiry)::

    (none) --learn (Moved, or a moved Result)--> held until its TTL (the request's own
                                                 remaining TTL on its new sender)
    held   --target (a new fetch of it toward the draining endpoint)--> the fetch is sent
                                                 to the new endpoint directly
    held   --expired / evicted (oldest first, beyond MAX_ENTRIES)--> (none)

A fetch answered ``moved`` is sent again to the new endpoint (same fetch id, token,
blocks and deadline: nothing was written by the draining sender), at most ``MAX_HOPS``
times; the engine sees one fetch. Bounded: at most ``MAX_ENTRIES`` entries. Its own lock
(engine threads read it at admission, the io thread writes it).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

MAX_ENTRIES = 65_536
MAX_HOPS = 2  # a fetch follows at most this many moves


class MovedTable:
    """(draining endpoint, request id) -> (new endpoint, expiry); bounded, with a TTL."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._lock = threading.Lock()
        self._max = max_entries
        self._entries: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def learn(self, old: str, request_id: str, new: str, ttl_s: float) -> None:
        """``request_id`` at ``old`` is served by ``new`` for ``ttl_s`` seconds."""
        if old == new:
            return
        with self._lock:
            self._entries[(old, request_id)] = (new, time.monotonic() + ttl_s)
            self._entries.move_to_end((old, request_id))
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)

    def target(self, old: str, request_id: str) -> str | None:
        """Where a fetch of ``request_id`` toward ``old`` goes instead, or None."""
        now = time.monotonic()
        with self._lock:
            entry = self._entries.get((old, request_id))
            if entry is None:
                return None
            if entry[1] <= now:
                del self._entries[(old, request_id)]
                return None
            return entry[0]
