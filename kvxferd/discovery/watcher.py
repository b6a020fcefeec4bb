"""What every discovery backend offers a daemon: the peers of one role, as events and a snapshot.

A :class:`Watcher` runs one thread, ``kvxferd-disc-<backend>``, which owns the
source (the file, the resolver, the etcd connection) and is the only writer of
the peer table. Each change reaches the daemon two ways:

* ``on_event(event)``, called on that thread, in order: :class:`PeerAdded`,
  :class:`PeerChanged` (same name, another record: a new incarnation, moved
  endpoints) or :class:`PeerRemoved`. It must not block (enqueue and return);
  an exception in it is logged and counted (``callback_errors``), never fatal.
* :meth:`Watcher.snapshot`: ``(version, peers)``; the version goes up by one on
  every event, so a reader can tell whether it missed something.

``_cond`` (a Condition) guards ``_peers``, ``_version``, ``connected`` and
``counts``; callbacks run outside it. Every step of the thread is bounded
(file read, resolver call, HTTP call with a timeout); the loop body is guarded:
an unexpected exception is logged and counted (``errors``), the thread waits a
bounded backoff and goes on. A bad record is counted (``malformed``) and
skipped. While the source is unreachable the watcher keeps the last peers it
knew (``connected`` is False): an outage of the discovery service does not make
a daemon forget working peers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvxferd.discovery.record import PeerRecord, Role

log = logging.getLogger("kvxferd.discovery")

ERROR_BACKOFF_S = 1.0  # after an unexpected exception in a turn


@dataclass(frozen=True, slots=True)
class PeerAdded:
    """A peer we did not know: dial it when needed."""

    peer: PeerRecord


@dataclass(frozen=True, slots=True)
class PeerChanged:
    """A known name with another record (a restart shows as a new incarnation)."""

    old: PeerRecord
    new: PeerRecord


@dataclass(frozen=True, slots=True)
class PeerRemoved:
    """A peer gone: deleted, lease expired, out of the file or the DNS answer, or now malformed."""

    peer: PeerRecord
    reason: str


PeerEvent = PeerAdded | PeerChanged | PeerRemoved
EventCallback = Callable[[PeerEvent], None]


@dataclass(frozen=True, slots=True)
class PeerSet:
    """The peers known at one version (a copy: safe to keep)."""

    version: int
    peers: Mapping[str, PeerRecord] = field(default_factory=dict)


class Watcher:
    """The peers of one role, kept current by one thread; subclasses read one kind of source."""

    backend = "base"

    def __init__(self, role: Role, on_event: EventCallback | None = None) -> None:
        self.role = role
        self._on_event = on_event
        self._cond = threading.Condition()
        self._peers: dict[str, PeerRecord] = {}
        self._version = 0
        self.connected = False  # the last attempt to read the source succeeded
        self.last_error = ""
        self.counts: dict[str, int] = {
            "reads": 0,
            "malformed": 0,
            "source_errors": 0,
            "errors": 0,
            "callback_errors": 0,
        }
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kvxferd-disc-{self.backend}", daemon=True
        )

    # -- the daemon's side -------------------------------------------------------------------

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the thread; True when it ended within ``timeout`` seconds."""
        self._stopping.set()
        self._interrupt()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def snapshot(self) -> PeerSet:
        with self._cond:
            return PeerSet(self._version, dict(self._peers))

    def wait_for(self, pred: Callable[[PeerSet], bool], timeout: float) -> PeerSet | None:
        """The first snapshot for which ``pred`` holds, or None after ``timeout`` seconds."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: pred(PeerSet(self._version, dict(self._peers))), timeout
            )
            return PeerSet(self._version, dict(self._peers)) if ok else None

    def count(self, name: str) -> int:
        with self._cond:
            return self.counts[name]

    def state(self) -> dict[str, Any]:
        """For /debug/state: backend, role, version, connected, counts, peers (name -> endpoint)."""
        with self._cond:
            return {
                "backend": self.backend,
                "role": self.role,
                "version": self._version,
                "connected": self.connected,
                "last_error": self.last_error,
                "counts": dict(self.counts),
                "peers": {n: r.endpoint for n, r in sorted(self._peers.items())},
            }

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._turn()
            except Exception:
                log.exception(
                    "discovery %s watcher: unexpected error (the thread goes on)", self.backend
                )
                self._bump("errors")
                self._stopping.wait(ERROR_BACKOFF_S)
        self._close()

    def _turn(self) -> None:
        """One bounded step: read the source, apply what changed, wait. Subclasses define it."""
        raise NotImplementedError

    def _interrupt(self) -> None:
        """Unblock a turn waiting on the source (stop() calls it from another thread)."""

    def _close(self) -> None:
        """Release the source (on the watcher's own thread, after its last turn)."""

    # -- applying changes (watcher thread only) -------------------------------------------------

    def _bump(self, name: str, n: int = 1) -> None:
        with self._cond:
            self.counts[name] += n

    def _source_ok(self) -> None:
        with self._cond:
            self.counts["reads"] += 1
            self.connected = True
            self.last_error = ""

    def _source_failed(self, why: str) -> None:
        with self._cond:
            self.counts["source_errors"] += 1
            if self.connected or why != self.last_error:
                log.warning(
                    "discovery %s: %s (keeping %d known peers)", self.backend, why, len(self._peers)
                )
            self.connected = False
            self.last_error = why[:300]

    def _malformed(self, where: str, why: str) -> None:
        log.warning(
            "discovery %s: skipping a malformed record at %s: %s", self.backend, where, why[:200]
        )
        self._bump("malformed")

    def _replace_all(self, peers: Mapping[str, PeerRecord], reason: str) -> None:
        """Make the table equal to ``peers``; names missing from it are removed for ``reason``."""
        with self._cond:
            gone = [self._peers[n] for n in self._peers if n not in peers]
        for old in gone:
            self._remove(old.name, reason)
        for rec in peers.values():
            self._upsert(rec)

    def _upsert(self, rec: PeerRecord) -> None:
        if rec.role != self.role:
            return
        with self._cond:
            old = self._peers.get(rec.name)
            if old == rec:
                return
            self._peers[rec.name] = rec
            self._version += 1
            self._cond.notify_all()
        self._emit(PeerAdded(rec) if old is None else PeerChanged(old, rec))

    def _remove(self, name: str, reason: str) -> None:
        with self._cond:
            old = self._peers.pop(name, None)
            if old is None:
                return
            self._version += 1
            self._cond.notify_all()
        self._emit(PeerRemoved(old, reason))

    def _emit(self, event: PeerEvent) -> None:
        log.info("discovery %s: %s", self.backend, _describe(event))
        if self._on_event is None:
            return
        try:
            self._on_event(event)
        except Exception:
            log.exception(
                "discovery %s: the event callback failed (the watcher goes on)", self.backend
            )
            self._bump("callback_errors")


def _describe(event: PeerEvent) -> str:
    if isinstance(event, PeerAdded):
        p = event.peer
        return f"added {p.role} {p.name} ({p.incarnation or '-'}) at {p.endpoint}"
    if isinstance(event, PeerChanged):
        o, n = event.old, event.new
        return (
            f"changed {n.role} {n.name}: {o.incarnation or '-'} at {o.endpoint}"
            f" -> {n.incarnation or '-'} at {n.endpoint}"
        )
    p = event.peer
    return f"removed {p.role} {p.name} ({p.incarnation or '-'}): {event.reason}"
