"""Routes: which path each peer's next write takes, and the writes in flight on each.

A table with no lock of its own: **the caller holds the data plane's lock.** Each peer has a
current path (``at``: path 0 until it moved); each (peer, path) *key* is loaded on that path's
agent or not, has its writes in flight (write id -> when posted, monotonic), and may be
*broken* (its transport failed; ``broken_at`` says when). A peer is *moving* while a connect
thread loads it on a fresh path (:mod:`kvxferd.transfer.path_moves`), and ``opening`` counts
the paths those threads are opening (they count toward ``max_paths``). A key goes::

    absent --loaded (add_peer, a reload, a move's load)--> loaded
    loaded --a post raised, a write ended in ERR or its check raised--> broken
    broken --reloaded in place, or the peer moved onto the path--> loaded
    any --the peer removed--> absent

and a peer's route: ``at 0 --moved--> at N``, dropped when it is removed. A write is counted
in flight from its post (``posted``) until its handle is released (``released``); a key whose
oldest write is older than ``stall_s`` is *stalled* (:meth:`trouble`). ``counts`` counts
``loaded``, ``broken``, ``healed``, ``moved`` and ``removed``.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter

Key = tuple[str, int]  # (peer, path index)


class Routes:
    """Each peer's current path, each (peer, path)'s load, writes in flight and failure."""

    def __init__(self) -> None:
        self.at: dict[str, int] = {}  # peer -> the path its next write takes
        self.loaded: set[Key] = set()  # (peer, path) whose agent holds the peer
        self.inflight: dict[Key, dict[int, float]] = {}  # key -> {write id: posted at}
        self.broken: set[Key] = set()
        self.broken_at: dict[Key, float] = {}  # when each was marked (monotonic)
        self.moving: set[str] = set()  # peers a connect thread is moving to a fresh path
        self.opening = 0  # paths being opened by connect threads (counted toward max_paths)
        self._ids = itertools.count()
        self.counts: Counter[str] = Counter()

    def path_of(self, peer: str) -> int:
        return self.at.get(peer, 0)

    def load(self, key: Key) -> None:
        """``key``'s agent holds the peer now (a new peer: on path 0, its route)."""
        self.loaded.add(key)
        self.counts["loaded"] += 1

    def added(self, peer: str) -> None:
        """``add_peer`` loaded ``peer`` on path 0: its route starts there, not broken."""
        self.at[peer] = 0
        self.load((peer, 0))
        self.heal((peer, 0))

    def mark_broken(self, key: Key) -> bool:
        """``key``'s transport failed; True when it was not marked yet."""
        if key in self.broken:
            return False
        self.broken.add(key)
        self.broken_at[key] = time.monotonic()
        self.counts["broken"] += 1
        return True

    def heal(self, key: Key) -> None:
        """``key`` carries writes again (reloaded, or a fresh path)."""
        if key in self.broken:
            self.counts["healed"] += 1
        self.broken.discard(key)
        self.broken_at.pop(key, None)

    def move(self, peer: str, index: int) -> None:
        """``peer``'s next writes take path ``index`` (loaded there by a connect thread)."""
        self.at[peer] = index
        self.heal((peer, index))
        self.counts["moved"] += 1

    def trouble(self, key: Key, stall_s: float | None) -> tuple[bool, bool]:
        """(broken with no write in flight, a write in flight for ``stall_s`` or more)."""
        writes = self.inflight.get(key)
        broken = key in self.broken and not writes
        stalled = bool(
            writes and stall_s is not None and time.monotonic() - min(writes.values()) >= stall_s
        )
        return broken, stalled

    def busy(self, index: int) -> bool:
        """A write is in flight on path ``index``."""
        return any(k[1] == index for k in self.inflight)

    def posted(self, key: Key) -> int:
        """A write toward ``key`` is posted: its id, in flight until :meth:`released`."""
        wid = next(self._ids)
        self.inflight.setdefault(key, {})[wid] = time.monotonic()
        return wid

    def released(self, key: Key, wid: int) -> None:
        writes = self.inflight.get(key)
        if writes is not None:
            writes.pop(wid, None)
            if not writes:
                del self.inflight[key]

    def remove(self, peer: str, indices: list[int]) -> list[int]:
        """Forget ``peer`` on paths ``indices``; the indices whose agent held it."""
        self.at.pop(peer, None)
        held = []
        for i in indices:
            key = (peer, i)
            self.broken.discard(key)
            self.broken_at.pop(key, None)
            self.inflight.pop(key, None)
            if key in self.loaded:
                self.loaded.discard(key)
                held.append(i)
        self.counts["removed"] += 1
        return held
