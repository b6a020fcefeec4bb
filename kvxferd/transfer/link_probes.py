"""A sender's link probes: at each new link, a few timed NIXL WRITEs into the receiver's scratch region; the figure per link.

A receiver advertises a scratch region in its Register (``scratch_base``,
``scratch_bytes``, protocol version 4): memory registered with the link's NIXL agent,
outside its KV pool and aux slots. When such a Register is accepted (a receiver's
first contact, a reconnect with a fresh NIXL agent, a restarted receiver), the
listener hands this table a probe and goes on: the ``kvxferd-tx-probe`` thread posts
one untimed WRITE (it opens the UCX connection) and then ``link_probe_writes`` WRITEs
of ``min(link_probe_bytes, scratch_bytes)`` bytes from the sender's own scratch region
(dataplane.py: ``probe_write``), one after another, and records bytes / time as the
link's GB/s. A peer moved to a fresh NIXL path (path_moves.py) is probed again.

One link's figure (keyed by the receiver's result endpoint, the per-peer label)::

    (none)   --Register with scratch accepted--> probing
    probing  --every WRITE DONE within the deadline--> measured: gbps
    probing  --a post raised, a WRITE ended ERR, the peer is gone--> failed: gbps None
    probing  --link_probe_timeout_ms passed--> timeout: gbps None (a WRITE still in
                                                progress stays counted until NIXL ends it)
    any      --a new probe (reconnect, fresh path, new incarnation)--> probing
    any      --the peer left the table (evicted, reclaimed)--> (none)

What holds, and where:

* Never a KV block: the destination is the region the receiver advertised, and no
  more than its ``scratch_bytes``; the source is the sender's scratch region.
* No probe toward a receiver that advertised no scratch (an older receiver, or
  ``link_probe_bytes`` 0 on either side): its figure stays unknown, nothing counted.
* Nothing waits for a probe: the listener only queues it (at most ``MAX_QUEUED``;
  a full queue drops it, counted); fetches never read a figure. A probe's WRITEs
  are counted as writes toward the peer's NIXL agent (peer_agents.py), so the agent
  is not removed from under one; one stalled past the deadline stays counted until
  NIXL ends it (polled on this thread's later turns).
* Each probe ends once, counted in ``link_probes_{result}``: ``ok``, ``failed``,
  ``timeout``, ``dropped`` (queue full, superseded by a newer probe of the link or the
  incarnation gone before it ran, or the sender shutting down).

``transport``: what this process asked UCX for (``UCX_TLS``, from ``dataplane.ucx_tls``
or the environment). NIXL 1.5 does not say which transport UCX picked for an endpoint
(its backend parameters are empty and per-transfer telemetry is off), so with ``UCX_TLS``
unset the figure is what UCX chose among all transports.

Threads: the listener calls ``request`` and ``forget``; the probe thread runs probes;
the view (probes, /metrics, the engine's ``links``) reads ``figures()``. ``_lock``
guards ``_figures``, ``_queue``, ``_latest`` and ``_last``. ``again`` may be called by any
thread (the data plane's, under its lock): it takes only ``_lock``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvxferd.transfer.dataplane import DataPlane, Xfer, XferState
from kvxferd.transfer.guard import Guard
from kvxferd.transfer.peer_agents import PeerAgents
from kvxferd.transfer.worker_tasks import Peer

if TYPE_CHECKING:
    from kvxferd.stats import Stats

log = logging.getLogger("kvxferd.sender")

MAX_QUEUED = 1024  # probes waiting for the probe thread; beyond: dropped (counted)
_IDLE_S = 0.1  # the thread's wait while a stalled probe WRITE is still polled
_SPIN_S = 200e-6  # a probe WRITE is polled without sleeping this long (see _wait)


def transport() -> str:
    """What UCX was asked for (module docstring: NIXL does not say what it picked)."""
    tls = os.environ.get("UCX_TLS", "").strip()
    return f"UCX_TLS={tls}" if tls else "UCX (UCX_TLS unset: any transport)"


@dataclass(frozen=True, slots=True)
class LinkFigure:
    """One link's latest probe: ``gbps`` None while probing or when it failed."""

    peer: str  # the receiver's result endpoint
    receiver_id: str
    state: str  # probing | ok | failed | timeout
    gbps: float | None
    transport: str
    nbytes: int  # bytes per timed WRITE
    writes: int  # timed WRITEs
    measured_at: float  # Unix time the probe ended (requested, while probing)
    measured_mono: float  # the same, monotonic
    detail: str = ""


@dataclass(frozen=True, slots=True)
class _Probe:
    peer: Peer
    base: int
    nbytes: int
    seq: int


class LinkProbes:
    """The links' figures and the probe thread (module docstring)."""

    def __init__(
        self,
        dataplane: DataPlane,
        agents: PeerAgents,
        stats: Stats,
        guard: Guard,
        *,
        scratch_bytes: int,
        writes: int,
        timeout_s: float,
    ) -> None:
        self._dp = dataplane
        self._agents = agents
        self.stats = stats
        self._guard = guard
        self.scratch_bytes = scratch_bytes
        self.writes = writes
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[_Probe] = deque()
        self._figures: dict[str, LinkFigure] = {}
        self._latest: dict[str, int] = {}  # peer -> the seq of its newest probe
        self._last: dict[str, _Probe] = {}  # peer -> its newest probe (``again``)
        self._seq = 0
        self._stalled: list[tuple[Xfer, str]] = []  # probe thread only: (write, NIXL name)
        self._stopping = False
        self._thread: threading.Thread | None = None

    @classmethod
    def of(
        cls, dataplane: DataPlane, agents: PeerAgents, stats: Stats, guard: Guard, settings: Any
    ) -> LinkProbes:
        """A sender's (``settings``: its SenderSettings): the data plane's scratch region (none
        on a test double without one: no probe), and a peer moved to a fresh NIXL path (a
        ``NixlDataPlane``'s ``on_new_path``) is probed again."""
        probes = cls(
            dataplane,
            agents,
            stats,
            guard,
            scratch_bytes=int(getattr(dataplane, "scratch_bytes", 0)),
            writes=settings.dataplane.link_probe_writes,
            timeout_s=settings.deadlines.link_probe_timeout_ms / 1000,
        )
        on_new_path = getattr(dataplane, "on_new_path", None)
        if on_new_path is not None:
            on_new_path(probes.again)
        return probes

    # -- listener ------------------------------------------------------------------------
    def request(self, peer: Peer, scratch_base: int, scratch_bytes: int) -> bool:
        """Probe ``peer``'s link (its Register was accepted); False when it gets no probe
        (it advertised no scratch, this sender has none, or the queue is full)."""
        nbytes = min(self.scratch_bytes, scratch_bytes)
        if nbytes <= 0 or scratch_base <= 0:
            return False
        with self._lock:
            if self._stopping:
                return False
            if len(self._queue) >= MAX_QUEUED:
                full = True
            else:
                full = False
                self._seq += 1
                key = peer.result_endpoint
                self._latest[key] = self._seq
                job = _Probe(peer, scratch_base, nbytes, self._seq)
                self._last[key] = job
                self._queue.append(job)
                now = time.monotonic()
                self._figures[key] = LinkFigure(
                    key, peer.receiver_id, "probing", None, transport(), nbytes, self.writes,
                    time.time(), now,
                )  # fmt: skip
                self._wake.notify()
            if self._thread is None and not full:  # started under the lock: close joins it
                self._thread = threading.Thread(
                    target=self._run, name="kvxferd-tx-probe", daemon=True
                )
                self._thread.start()
        if full:
            self.stats.add("link_probes_dropped")
            return False
        return True

    def again(self, nixl_name: str) -> bool:
        """Probe again the link whose receiver agent is ``nixl_name`` (its transport is fresh:
        a move to a fresh NIXL path, a reload in place); False when it was never probed."""
        with self._lock:
            last = next((j for j in self._last.values() if j.peer.nixl_name == nixl_name), None)
        return last is not None and self.request(last.peer, last.base, last.nbytes)

    def forget(self, peer: Peer) -> None:
        """``peer`` left the table: its link has no figure any more (unless a newer
        incarnation on the same endpoint was probed since)."""
        with self._lock:
            fig = self._figures.get(peer.result_endpoint)
            if fig is not None and fig.receiver_id == peer.receiver_id:
                del self._figures[peer.result_endpoint]
                self._latest.pop(peer.result_endpoint, None)
                self._last.pop(peer.result_endpoint, None)

    # -- readers ---------------------------------------------------------------------------
    def figures(self) -> list[LinkFigure]:
        """A copy of every link's figure, by peer."""
        with self._lock:
            return sorted(self._figures.values(), key=lambda f: f.peer)

    def figures_unlocked(self) -> list[LinkFigure]:
        """The same without the lock (the hang dump); may raise if it changes meanwhile: retry."""
        return sorted(self._figures.values(), key=lambda f: f.peer)

    def in_flight(self) -> int:
        """Probe WRITEs NIXL still holds past their deadline (the pool stays registered)."""
        return len(self._stalled)

    def close(self, timeout_s: float) -> None:
        """Stop the thread (a probe running ends at its deadline); bounded by ``timeout_s``."""
        with self._lock:
            self._stopping = True
            dropped = len(self._queue)
            self._queue.clear()
            self._wake.notify()
            thread = self._thread
        if dropped:
            self.stats.add("link_probes_dropped", dropped)
        if thread is not None:
            thread.join(timeout_s)
        if thread is None or not thread.is_alive():
            self._poll_stalled()

    # -- the probe thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._queue:
                    if self._stalled:
                        self._wake.wait(_IDLE_S)
                        break
                    self._wake.wait()
                if self._stopping:
                    return
                job = self._queue.popleft() if self._queue else None
            try:
                self._poll_stalled()
                if job is not None:
                    self._probe(job)
            except Exception:
                self._guard.caught("link probe")

    def _probe(self, job: _Probe) -> None:
        peer = job.peer
        name = peer.nixl_name
        with self._lock:
            if self._latest.get(peer.result_endpoint) != job.seq:
                superseded = True  # a newer probe of this link is queued, or it left
            else:
                superseded = False
        if superseded or not self._agents.write_started(name):
            self.stats.add("link_probes_dropped")
            return
        deadline = time.monotonic() + self.timeout_s
        elapsed = 0.0
        result, detail, ended = "ok", "", True
        try:
            for i in range(self.writes + 1):  # the first opens the connection: untimed
                if self._stopping:  # read without the lock: one more WRITE at most
                    result, detail = "dropped", "the sender is shutting down"
                    break
                t0 = time.monotonic()
                xfer, state = self._dp.probe_write(name, job.base, job.nbytes, 0)
                end = _wait(xfer, state, deadline)
                t1 = time.monotonic()
                if end == "STALLED" or not xfer.release():
                    self._stalled.append((xfer, name))
                    ended = False
                    result, detail = "timeout", "a WRITE still in progress at the deadline"
                    break
                if end != "DONE":
                    result, detail = "failed", f"a WRITE ended {end}"
                    break
                if i:
                    elapsed += t1 - t0
        except Exception as e:  # the post raised: nothing of it is in flight
            result, detail = "failed", f"{type(e).__name__}: {e}"[:300]
        finally:
            if ended:
                self._agents.write_ended(name)
        gbps = job.nbytes * self.writes / elapsed / 1e9 if result == "ok" and elapsed else None
        if result == "ok" and gbps is None:
            result, detail = "failed", "no time measured"
        self._record(job, result, gbps, detail)

    def _record(self, job: _Probe, result: str, gbps: float | None, detail: str) -> None:
        peer = job.peer
        state = "failed" if result == "dropped" else result
        fig = LinkFigure(
            peer.result_endpoint, peer.receiver_id, state, gbps, transport(), job.nbytes,
            self.writes, time.time(), time.monotonic(), detail,
        )  # fmt: skip
        with self._lock:
            if self._latest.get(peer.result_endpoint) == job.seq:
                self._figures[peer.result_endpoint] = fig
        if result == "ok":
            self.stats.add("link_probes_ok")
            log.info(
                "link to %s measured: %.2f GB/s (%s, %d x %d bytes)",
                peer.result_endpoint, gbps, fig.transport, self.writes, job.nbytes,
            )  # fmt: skip
            return
        if result == "dropped":
            self.stats.add("link_probes_dropped")
            return
        self.stats.add("link_probes_failed" if result == "failed" else "link_probes_timeout")
        log.warning("link probe toward %s %s: %s", peer.result_endpoint, result, detail)

    def _poll_stalled(self) -> None:
        """Release the probe WRITEs that ended since their deadline; each ends its count."""
        left = []
        for xfer, name in self._stalled:
            try:
                done = xfer.poll() != "PROC" and xfer.release()
            except Exception:
                done = False  # NIXL could not say: it stays counted (as a worker's in doubt)
            if done:
                self._agents.write_ended(name)
            else:
                left.append((xfer, name))
        self._stalled = left


def _wait(xfer: Xfer, state: XferState, deadline: float) -> XferState | str:
    """Poll ``xfer`` until it leaves PROC or ``deadline`` passes ("STALLED").

    Tight polling for the first ``_SPIN_S`` (a probe WRITE over shared memory takes under a
    millisecond, and a fixed backoff's sleep would be most of what is measured), then sleeps
    of a fiftieth of the time waited so far (at most 1 ms): the figure stays within about
    2 %, and a slow link's probe does not hold a core.
    """
    start = time.monotonic()
    while state == "PROC":
        now = time.monotonic()
        if now >= deadline:
            return "STALLED"
        if now - start > _SPIN_S:
            time.sleep(min(1e-3, (now - start) / 50))
        state = xfer.poll()
    return state
