"""The journal: one record per request end, feeding its log line, the per-peer histograms and the health checks.

"What happened to request X?" must be answered by one log line, and the
per-peer histograms and the readiness checks on stuck work and failing peers
must read the same facts, so every ending goes through :meth:`Journal.record`
once::

    role      kind     who records it, and when
    sender    request  TxSession commits its one outcome (any thread: listener, worker, API)
    sender    slice    a worker hands out a slice's one report (one receiver's fetch)
    receiver  fetch    RxSession commits its one outcome (io thread, or an engine's cancel)

What a record feeds:

* **The log line** (logger ``kvxferd.journal``): every record at DEBUG, and a
  record whose outcome is not ``done`` at WARNING, except a sender slice (its
  request's record carries the WARNING, so a failed request logs one line per
  side). The values are structlog fields (JSON keys in JSON mode), never prose:
  ``request_id, role, kind, peer, fetch_id, outcome, reason, detail,
  duration_ms, bytes, blocks``.
* **Per-peer histograms** (seconds): ``post`` (slice queued to its first
  WRITE posted), ``transfer`` (first WRITE posted to the last one released),
  ``end_to_end`` (sender: slice queued to its report; receiver: fetch started
  to its outcome). The label set is bounded: the first
  ``health.metrics_peer_labels`` peers seen keep their own label for the life
  of the process; later ones share ``other``.
* **Progress**: the monotonic time of the last ending and of the last ``done``
  (readiness: work pending and nothing ended for ``stuck_after_ms``).
* **Per-peer windows**: each peer's endings in the last
  ``peer_failure_window_ms`` (bounded), for its failure rate. An ending whose
  reason is in :data:`NOT_PEER_FAULTS` (a cancel, our drain or shutdown)
  counts, but not as a failure: an engine that cancels much is no failing peer.

Thread-safety: one lock guards the histograms, windows and progress stamps;
nothing is logged under it. Safe from any thread.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

# Bucket upper bounds in seconds, from 100 us (a small write on one host) to 10 s.
BUCKETS_S: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
PHASES: tuple[str, ...] = ("post", "transfer", "end_to_end")
OTHER = "other"  # the shared label of peers past the label budget
_WINDOW_MAX = 4096  # endings kept per peer window
# Endings that say nothing against the peer (an engine's or a receiver's cancel, our own
# drain or shutdown, another slice's failure): they count in its window, never as failures.
NOT_PEER_FAULTS = frozenset({"cancelled", "draining", "shutting_down", "session_failed"})

# A stdlib logger with the fields in ``extra`` (logs.RECORD_FIELDS): a process that never
# configured logging prints nothing extra on stdout, and a configured one gets the fields.
log = logging.getLogger("kvxferd.journal")


@dataclass(frozen=True, slots=True)
class Ending:
    """How one request (or one slice of it) ended, with what a person reading a log needs."""

    role: str  # "sender" | "receiver"
    kind: str  # "request" | "slice" | "fetch"
    request_id: str
    outcome: str  # done, failed, in_doubt, timed_out, cancelled, expired
    reason: str | None = None
    detail: str = ""
    peer: str = ""  # the other side's endpoint ("" for a request nobody fetched)
    fetch_id: int | None = None
    duration_s: float = 0.0
    nbytes: int = 0
    blocks: int = 0
    post_s: float | None = None
    transfer_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.outcome == "done"

    def fields(self) -> dict[str, Any]:
        """The log line's fields, in a stable order (each one of logs.RECORD_FIELDS)."""
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "role": self.role,
            "kind": self.kind,
            "peer": self.peer,
            "fetch_id": self.fetch_id,
            "outcome": self.outcome,
            "reason": self.reason,
            "detail": self.detail,
            "duration_ms": round(self.duration_s * 1000, 3),
            "bytes": self.nbytes,
            "blocks": self.blocks,
        }
        if self.post_s is not None:
            out["post_ms"] = round(self.post_s * 1000, 3)
        if self.transfer_s is not None:
            out["transfer_ms"] = round(self.transfer_s * 1000, 3)
        return out


class Histogram:
    """A cumulative histogram over :data:`BUCKETS_S` (not thread-safe: its owner's lock guards it)."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS_S) + 1)  # the last one: +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_S, value)] += 1
        self.total += value

    def cumulative(self) -> tuple[list[tuple[float, int]], float]:
        """``[(upper bound, count <= bound)]`` ending with ``(inf, count)``, and the sum."""
        run, out = 0, []
        for bound, n in zip((*BUCKETS_S, float("inf")), self.counts, strict=True):
            run += n
            out.append((bound, run))
        return out, self.total


@dataclass(frozen=True, slots=True)
class PeerRate:
    """A peer's endings in the failure window."""

    peer: str
    failed: int
    total: int

    @property
    def ratio(self) -> float:
        return self.failed / self.total if self.total else 0.0


class Journal:
    """Where every ending of one sender or receiver is recorded (see the module docstring)."""

    def __init__(self, role: str, *, peer_labels: int = 16, window_s: float = 60.0) -> None:
        self.role = role
        self.peer_labels = peer_labels
        self.window_s = window_s
        self._lock = threading.Lock()
        self._labels: dict[str, str] = {}  # peer -> its label (itself, or OTHER)
        self._hist: dict[tuple[str, str], Histogram] = {}  # (phase, label) -> histogram
        self._windows: dict[str, deque[tuple[float, bool]]] = {}  # label -> (t, ok)
        self.started = time.monotonic()
        self.last_ending = 0.0  # monotonic; 0.0: none yet
        self.last_done = 0.0
        self.endings = 0

    # -- recording ---------------------------------------------------------------------
    def record(self, e: Ending) -> None:
        """Log ``e`` and account it; never raises into the caller's path."""
        now = time.monotonic()
        with self._lock:
            self.endings += 1
            self.last_ending = now
            if e.ok:
                self.last_done = now
            if e.peer and e.kind != "request":  # requests repeat their slices' facts
                label = self._label_locked(e.peer)
                for phase, value in (
                    ("post", e.post_s),
                    ("transfer", e.transfer_s),
                    ("end_to_end", e.duration_s),
                ):
                    if value is not None:
                        self._histogram_locked(phase, label).observe(value)
                window = self._windows.get(label)
                if window is None:
                    window = self._windows[label] = deque(maxlen=_WINDOW_MAX)
                window.append((now, e.ok or e.reason in NOT_PEER_FAULTS))
        self._log(e)

    def _log(self, e: Ending) -> None:
        level = logging.WARNING if not e.ok and e.kind != "slice" else logging.DEBUG
        if log.isEnabledFor(level):
            log.log(level, "request ended", extra=e.fields())

    def label(self, peer: str) -> str:
        """``peer``'s label in the per-peer families (itself, or ``other`` past the budget)."""
        with self._lock:
            return self._label_locked(peer)

    def _label_locked(self, peer: str) -> str:
        label = self._labels.get(peer)
        if label is None:
            own = sum(1 for v in self._labels.values() if v != OTHER) < self.peer_labels
            label = peer if own else OTHER
            if own or len(self._labels) < 65_536:  # remember, within a bound
                self._labels[peer] = label
        return label

    def _histogram_locked(self, phase: str, label: str) -> Histogram:
        h = self._hist.get((phase, label))
        if h is None:
            h = self._hist[(phase, label)] = Histogram()
        return h

    # -- reading -----------------------------------------------------------------------
    def histograms(self) -> dict[tuple[str, str], tuple[list[tuple[float, int]], float]]:
        """``{(phase, peer label): (cumulative buckets, sum)}`` (a copy)."""
        with self._lock:
            return {key: h.cumulative() for key, h in self._hist.items()}

    def peer_rates(self, now: float | None = None) -> list[PeerRate]:
        """Each labelled peer's failed and total endings within the window."""
        now = time.monotonic() if now is None else now
        since = now - self.window_s
        out = []
        with self._lock:
            for label, window in self._windows.items():
                while window and window[0][0] < since:
                    window.popleft()
                if window:
                    failed = sum(1 for _, ok in window if not ok)
                    out.append(PeerRate(label, failed, len(window)))
        return out

    def idle_s(self, now: float | None = None) -> float:
        """Seconds since the last ending (or since start, if none yet)."""
        now = time.monotonic() if now is None else now
        return now - (self.last_ending or self.started)
