"""The receivers' NIXL agents on a sender: loaded at REGISTER, removed only once no write toward them is in flight.

A receiver incarnation is known to the data plane by its NIXL agent name. Its
agent (and prepared lists) must not be removed while a write toward it is posted:
NIXL would write through a released handle. This table counts the writes in
flight per name and decides when a removal runs. One name's states::

    live      --retire, no write in flight-->  removed (now, by the caller's thread)
    live      --retire, writes in flight--->   retiring
    retiring  --the last write ends-------->   removed (by the thread that ended it)
    retiring  --the same agent registers--->   live (the deferred removal is cancelled)
    any       --retire(gone=True)----------->  also gone: a newer incarnation replaced it;
                                               no write starts and no message is sent
                                               toward it (remembered for the last
                                               ``gone_max`` names)

It also keeps when each receiver last sent the sender a message (``heard``): the
data plane reconnects a stalled path only once the peer has been heard from since.

Owners: the listener registers, retires and notes messages; the workers count
writes and ask ``is_gone``; the data plane reads ``heard_from``; probes read
copies. ``_lock`` guards the counts, ``_retiring`` and ``_gone``; ``_heard`` takes
single-item operations only (the listener sets, a removal pops, the data plane reads),
each atomic under the GIL, so it needs no lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Protocol

from kvxferd.stats import Stats

log = logging.getLogger("kvxferd.sender")

GONE_MAX = 4096  # replaced incarnations remembered


class _Removes(Protocol):
    def remove_peer(self, peer: str) -> None: ...


class PeerAgents:
    """Writes in flight per NIXL agent, deferred removals and replaced incarnations."""

    def __init__(self, dataplane: _Removes, stats: Stats, gone_max: int = GONE_MAX) -> None:
        self.dataplane = dataplane
        self.stats = stats
        self.gone_max = gone_max
        self._lock = threading.Lock()
        self._writes: dict[str, int] = {}
        self._retiring: set[str] = set()
        # Names of incarnations a newer one replaced (that process is gone). Bounded: a
        # name is unique per incarnation, and a task for one lives only until its deadline.
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._heard: dict[str, float] = {}  # name -> when it last sent us a message

    # -- messages ------------------------------------------------------------------------
    def heard(self, name: str) -> None:
        """The receiver ``name`` sent us a message now (listener)."""
        self._heard[name] = time.monotonic()

    def heard_from(self, name: str) -> float:
        """When ``name`` last sent us a message (monotonic; 0: never)."""
        return self._heard.get(name, 0.0)

    # -- writes --------------------------------------------------------------------------
    def write_started(self, name: str) -> bool:
        """Count a write toward ``name``; False (nothing counted) when that incarnation is gone."""
        with self._lock:
            if name in self._gone:
                return False
            self._writes[name] = self._writes.get(name, 0) + 1
            return True

    def write_ended(self, name: str) -> None:
        """A write toward ``name`` ended; the last one runs a removal deferred meanwhile."""
        with self._lock:
            left = self._writes.get(name, 0) - 1
            if left > 0:
                self._writes[name] = left
                return
            self._writes.pop(name, None)
            if name not in self._retiring:
                return
            self._retiring.discard(name)
        self._remove(name)

    def is_gone(self, name: str) -> bool:
        """True when a newer incarnation replaced ``name`` (nothing is sent or written to it)."""
        with self._lock:
            return name in self._gone

    # -- registration ----------------------------------------------------------------------
    def registered(self, name: str) -> None:
        """``name`` registered (again): a removal deferred for it must not run, and it is
        not gone (the same agent came back after an invalidation)."""
        with self._lock:
            if name in self._retiring:
                self._retiring.discard(name)
                self.stats.add("peer_removals_cancelled")
            self._gone.pop(name, None)

    def mark_gone(self, name: str) -> None:
        """A newer incarnation replaced ``name``, whose agent was already retired."""
        with self._lock:
            self._gone_locked(name)

    def retire(self, name: str, gone: bool = False) -> None:
        """Remove ``name``'s agent now, or when its last write in flight ends.

        ``gone``: a newer incarnation replaced it; from now on no write toward it starts.
        """
        with self._lock:
            if gone:
                self._gone_locked(name)
            if self._writes.get(name, 0) > 0:
                self._retiring.add(name)
                self.stats.add("peer_removals_deferred")
                return
        self._remove(name)

    def _gone_locked(self, name: str) -> None:
        self._gone[name] = None
        while len(self._gone) > self.gone_max:
            self._gone.popitem(last=False)

    def _remove(self, name: str) -> None:
        self._heard.pop(name, None)
        try:
            self.dataplane.remove_peer(name)
            self.stats.add("peers_removed")
        except Exception:  # the entry is gone either way; NIXL keeps a stale remote at worst
            log.exception("removing NIXL peer %s failed", name)

    # -- views (probes, /debug/state) --------------------------------------------------------
    def writes(self) -> dict[str, int]:
        """A copy of the writes in flight per name."""
        with self._lock:
            return dict(self._writes)

    def retiring(self) -> set[str]:
        """A copy of the names whose removal waits for their last write."""
        with self._lock:
            return set(self._retiring)

    def writes_unlocked(self) -> dict[str, int]:
        """The same copy without the lock (a hang dump must answer during a deadlock);
        it may raise if a writer changes the dict meanwhile: retry."""
        return dict(self._writes)

    def retiring_unlocked(self) -> list[str]:
        """Without the lock, as :meth:`writes_unlocked`."""
        return sorted(self._retiring)
