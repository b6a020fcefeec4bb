"""The data plane's peers: the metadata each was loaded with, the claims on them, closing.

A table with no lock of its own: **the caller holds the data plane's lock**, and ``changed``
is a condition on that lock. A peer is *known* from the moment its metadata loaded on path 0
until it is removed; ``closed`` is set once by ``close()`` and ends every change.

Loads and removals of one peer name are serialised by a *claim*: a thread claims the name
(:meth:`claim`, waiting on ``changed`` while another holds it), calls NIXL with the lock
released, then unclaims it. A second ``add_peer`` of the same agent, a removal, or a post
toward that peer waits for the claim (:meth:`wait_unclaimed`); posts toward other peers
never do. A name goes::

    unknown --claimed, loaded--> known --claimed, removed--> unknown
    known --claimed (a reload in place), unclaimed--> known

``counts`` counts ``added``, ``removed`` and ``claimed``.
"""

from __future__ import annotations

import threading
from collections import Counter


class LoadedPeers:
    """Known peers and their metadata, the names being loaded or removed, and ``closed``."""

    def __init__(self, lock: threading.Lock) -> None:
        self.meta: dict[str, bytes] = {}  # peer -> the metadata add_peer loaded
        self.closed = False
        # Peers whose remote agent a thread is loading or removing on a path agent, with the
        # lock released; another load, removal or post toward one waits on changed.
        self._changing: set[str] = set()
        self.changed = threading.Condition(lock)
        self.counts: Counter[str] = Counter()

    def __contains__(self, peer: object) -> bool:
        return peer in self.meta

    def names(self) -> set[str]:
        return set(self.meta)

    def live(self, peer: str) -> bool:
        """``peer`` is known and the data plane open: lists made for it may be installed."""
        return peer in self.meta and not self.closed

    def add(self, peer: str, metadata: bytes) -> None:
        self.meta[peer] = metadata
        self.counts["added"] += 1

    def remove(self, peer: str) -> bool:
        """Forget ``peer``; False when it was not known."""
        if self.meta.pop(peer, None) is None:
            return False
        self.counts["removed"] += 1
        return True

    def wait_unclaimed(self, peer: str) -> None:
        """Wait until no thread loads or removes ``peer`` (the lock released meanwhile)."""
        while peer in self._changing:
            self.changed.wait()

    def claim(self, peer: str) -> None:
        """Wait until no other thread loads or removes ``peer``'s remote agent, then claim it
        (the lock held; released while waiting). A load or removal claims the peer only
        after its probe reached it, so those waits last milliseconds; a reload in place
        holds it through its probe, as the lock was held through it before."""
        self.wait_unclaimed(peer)
        self._changing.add(peer)
        self.counts["claimed"] += 1

    def unclaim(self, peer: str) -> None:
        self._changing.discard(peer)
        self.changed.notify_all()
