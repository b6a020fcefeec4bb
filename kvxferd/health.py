"""The probe port: ``/healthz`` (liveness), ``/readyz`` (readiness), ``/metrics`` (Prometheus), ``/debug/state``.

Health that lies is a known failure (an HTTP thread answering 200 while the
workers are wedged), so::

    /healthz  200 only when the listener/io thread, EVERY worker and this event loop
              made progress recently, and neither the service nor the engine gateway
              met an unexpected exception (``broken()``, see guard.py). Never depends
              on peers: one dead decode pod must not restart every prefill pod.
    /readyz   200 only when new work would be accepted and work is moving: not draining,
              every thread alive, the session/fetch table below its limit, a free aux
              slot, the data plane open, no pending work that saw nothing end for
              ``health.stuck_after_ms``, no peer failing at ``health.peer_failure_ratio``.
              503 lists one reason per line; each starts with a stable phrase
              (:func:`readiness_key` maps it to the ``kvxferd_not_ready{reason}`` label).
    /metrics  Prometheus text from one :class:`Snapshot`, built in a worker thread
              with a deadline, so a slow scrape never stalls the loop. Every counter in
              stats.CATALOGUE (the service's and the engine gateway's), per-peer
              histograms from the journal, and gauges of what is in flight and held.
    /debug/state  JSON dump of sessions, slices, fetches, peers, links, parked fetches,
              workers and aux slots (the shape is in :meth:`SenderProbe.debug_state` and
              :meth:`ReceiverProbe.debug_state`), built in a worker thread with a deadline
              from copies taken without the services' locks, so it answers during a
              deadlock. ``health.debug_state``: "off" (404), "loopback" (403 to any other
              client address), "any".

Readiness reasons (stable prefixes an operator can grep; the label in parentheses)::

    draining                                   (draining)
    listener|io|worker N thread not alive      (thread_dead)
    session|fetch table full (...)             (table_full)
    no free aux slot (...)                     (no_aux_slot)
    data plane closed (pool not registered)    (data_plane_closed)
    stuck: N slices queued or writing | N fetches open, and nothing ended for Xs  (stuck)
    peer failing: PEER F/T ended failed in the last Ws (...)                       (peer_failing)
    readiness check timed out                  (HTTP only: the check itself hung)

Stuck counts from ``max(last ending, start of the oldest pending work)``: an idle
daemon that just got one request is not stuck; one whose pending work sees
nothing end for ``stuck_after_ms`` is.

The server runs inside the daemon's own event loop (aiohttp ``AppRunner``; no
signal handlers touched, no extra HTTP thread that would stay healthy while
the loop is stuck). A heartbeat task stamps ``loop_heartbeat`` every
``heartbeat_interval_s``; ``/healthz`` fails when it is older than ``loop_stall_s``.

Label values are bounded: states, outcomes and reasons come from fixed enums,
workers are indices; never request ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvxferd import __version__
from kvxferd.config import ReceiverSettings, SenderSettings
from kvxferd.journal import BUCKETS_S, Histogram
from kvxferd.session import Fence, RxState, SliceState, TxState
from kvxferd.stats import specs_for

if TYPE_CHECKING:
    from kvxferd.journal import Journal
    from kvxferd.receiver import Receiver
    from kvxferd.sender import Sender

DebugAccess = Literal["off", "loopback", "any"]
DEBUG_LIST_LIMIT = 100  # entries per list in /debug/state (the oldest first)
_T = TypeVar("_T")

DURATION_BUCKETS_S = BUCKETS_S  # one bucket set for every duration histogram (journal.py)

# In-flight transfers by state, per role: every value exported, zero included (see Snapshot).
IN_FLIGHT_STATES: dict[str, tuple[str, ...]] = {
    "sender": ("parked", "queued", "writing", "in_doubt"),
    "receiver": ("requested", "fenced", "in_doubt"),
}
# What each role holds per peer (see Snapshot.peer_cache).
PEER_CACHE_KINDS: dict[str, tuple[str, ...]] = {
    "sender": ("peers", "nixl_agents", "retiring_agents", "shared_dealers", "worker_dealers"),
    "receiver": ("links", "ready_links"),
}
AUX_SLOT_STATES: dict[str, tuple[str, ...]] = {
    "sender": ("free", "in_use"),
    "receiver": ("free", "in_use", "quarantined"),
}
# journal.PHASES -> (family, help). One family per phase, not one with a phase label: the
# phases overlap (end_to_end contains post and transfer), so a sum over a phase label would
# be meaningless, and each is read on its own (histogram_quantile per family).
PEER_HISTOGRAMS: dict[str, tuple[str, str]] = {
    "post": (
        "kvxferd_peer_post_seconds",
        "Sender: a slice's wait from queued to its first WRITE posted, per peer",
    ),
    "transfer": (
        "kvxferd_peer_transfer_seconds",
        "Sender: first WRITE posted to the last one released by NIXL, per peer",
    ),
    "end_to_end": (
        "kvxferd_peer_end_to_end_seconds",
        "Sender: slice queued to its result; receiver: fetch started to its outcome; per peer",
    ),
}


@dataclass(frozen=True)
class GatewayReading:
    """The engine gateway's own counters and tables, read with the service's snapshot."""

    stats: dict[str, int]
    handles: int  # handles open (bounded by max_handles)
    calls_in_flight: int  # engine calls being served (bounded by max_client_inflight)


# The kvxferd_not_ready{reason} labels: fixed, so the series are stable and bounded.
READINESS_REASONS: tuple[str, ...] = (
    "draining",
    "thread_dead",
    "table_full",
    "no_aux_slot",
    "data_plane_closed",
    "stuck",
    "peer_failing",
    "other",
)


def readiness_key(why: str) -> str:
    """The metric label of one readiness reason (its stable prefix; "other" if unknown)."""
    if why.startswith("draining"):
        return "draining"
    if why.endswith("thread not alive"):
        return "thread_dead"
    if why.startswith(("session table full", "fetch table full")):
        return "table_full"
    if why.startswith("no free aux slot"):
        return "no_aux_slot"
    if why.startswith("data plane closed"):
        return "data_plane_closed"
    if why.startswith("stuck: "):
        return "stuck"
    if why.startswith("peer failing: "):
        return "peer_failing"
    return "other"


@dataclass(frozen=True)
class Snapshot:
    """One reading of a sender or receiver for ``/metrics``.

    ``durations_s`` holds the transfer durations recorded since the previous
    snapshot (taking a snapshot drains them): only the metrics collector takes one.

    ``in_flight`` (keys: :data:`IN_FLIGHT_STATES`): sender ``parked`` (a fetch waiting
    for its publish), ``queued`` / ``writing`` (slices), ``in_doubt`` (slices reported
    in doubt whose write NIXL still holds); receiver ``requested`` (open fetches),
    ``fenced`` (ended, waiting for the sender's CancelAck), ``in_doubt`` (ended in doubt,
    blocks held). ``oldest_in_flight_s``: sender, the oldest session not ended or with a
    write in flight; receiver, the oldest fetch open or fenced; 0 when none.
    """

    role: str  # "sender" | "receiver"
    stats: dict[str, int]
    sessions_by_state: dict[str, int]
    queue_depths: list[int]
    writes_in_flight: int
    peers: int
    durations_s: list[float] = field(default_factory=list)
    in_flight: dict[str, int] = field(default_factory=dict)
    oldest_in_flight_s: float = 0.0
    peer_cache: dict[str, int] = field(default_factory=dict)  # keys: PEER_CACHE_KINDS
    aux_slots: dict[str, int] = field(default_factory=dict)  # keys: AUX_SLOT_STATES
    # journal.histograms(): {(phase, peer label): (cumulative buckets, sum)}
    histograms: dict[tuple[str, str], tuple[list[tuple[float, int]], float]] = field(
        default_factory=dict
    )
    gateway: GatewayReading | None = None


class Probe(Protocol):
    """What the probe port asks a sender or receiver.

    A probe may also offer ``debug_state(limit) -> dict`` (both real probes do) for
    ``/debug/state``; without it that route answers 404.
    """

    def liveness(self) -> tuple[bool, str]: ...

    def readiness(self) -> tuple[bool, list[str]]: ...

    def snapshot(self) -> Snapshot: ...


# -- the HTTP layer ---------------------------------------------------------------------------


class ProbeServer:
    """``/healthz``, ``/readyz``, ``/metrics`` and ``/debug/state`` on ``host:port``, inside the running loop.

    ``debug_state`` None takes the probe's ``settings.health.debug_state`` ("off" for a
    probe without settings). Readiness, metrics and the debug dump are computed in
    worker threads with ``scrape_timeout_s`` each (readiness on a thread of its own, so
    a hung scrape never delays it); liveness stays on the loop (it only reads stamps).
    """

    def __init__(
        self,
        probe: Probe,
        host: str,
        port: int,
        *,
        build_info: dict[str, str] | None = None,
        loop_stall_s: float = 10.0,
        heartbeat_interval_s: float = 0.5,
        scrape_timeout_s: float = 5.0,
        debug_state: DebugAccess | None = None,
    ) -> None:
        self.probe = probe
        if debug_state is None:
            health = getattr(getattr(probe, "settings", None), "health", None)
            debug_state = health.debug_state if health is not None else "off"
        self.debug_state: DebugAccess = debug_state
        self.host = host
        self.port = port
        self.loop_stall_s = loop_stall_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.scrape_timeout_s = scrape_timeout_s
        self.loop_heartbeat = time.monotonic()
        # Set by the daemon at the first signal, before the service itself starts draining.
        self.draining = False
        self.registry = CollectorRegistry(auto_describe=False)
        self._collector = SnapshotCollector(probe, {"version": __version__, **(build_info or {})})
        self.registry.register(self._collector)
        self.registry.register(ReadinessCollector(self.readiness))
        self._runner: web.AppRunner | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        # One thread: a scrape stuck on a lock holds it alone; later scrapes time out, no pile-up.
        self._executor: ThreadPoolExecutor | None = None  # /metrics and /debug/state
        self._ready_executor: ThreadPoolExecutor | None = None  # /readyz

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> int:
        """Bind and serve; the bound port (``port`` 0 picks a free one)."""
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/debug/state", self._debug_state)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvxferd-metrics")
        self._ready_executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvxferd-readiness"
        )
        self.loop_heartbeat = time.monotonic()
        self._heartbeat = asyncio.get_running_loop().create_task(
            self.loop_progress(), name="kvxferd-loop-heartbeat"
        )
        self.port = int(runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for executor in (self._executor, self._ready_executor):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)
        self._executor = self._ready_executor = None

    async def loop_progress(self) -> None:
        """Stamp ``loop_heartbeat`` while the loop runs; a stale stamp means a stuck loop."""
        while True:  # start() stamped once already
            await asyncio.sleep(self.heartbeat_interval_s)
            self.loop_heartbeat = time.monotonic()

    # -- checks (also for the daemon's systemd watchdog) ----------------------------------
    def loop_lag_s(self, now: float | None = None) -> float:
        """Seconds since the loop last stamped its heartbeat."""
        return (time.monotonic() if now is None else now) - self.loop_heartbeat

    def liveness(self, now: float | None = None) -> tuple[bool, str]:
        """The probe's liveness combined with this loop's heartbeat."""
        lag = self.loop_lag_s(now)
        if lag > self.loop_stall_s:
            return (
                False,
                f"event loop stalled: no heartbeat for {lag:.1f}s (> {self.loop_stall_s:g}s)",
            )
        ok, text = self.probe.liveness()
        return ok, f"{text}; loop {lag:.2f}s ago"

    # -- handlers -------------------------------------------------------------------------
    async def _healthz(self, request: web.Request) -> web.Response:
        ok, text = self.liveness()
        if ok:
            return web.Response(text=f"ok {text}\n")
        return web.Response(status=503, text=f"{text}\n")

    def readiness(self) -> tuple[bool, list[str]]:
        """The probe's readiness, failing with "draining" as soon as ``draining`` is set."""
        ok, failing = self.probe.readiness()
        if self.draining and "draining" not in failing:
            failing = ["draining", *failing]
        return not failing and ok, failing

    async def _bounded(self, executor: ThreadPoolExecutor | None, fn: Callable[[], _T]) -> _T:
        """``fn()`` on ``executor``; TimeoutError after ``scrape_timeout_s`` (or if not started)."""
        if executor is None:
            raise TimeoutError("not started")
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(loop.run_in_executor(executor, fn), self.scrape_timeout_s)

    async def _readyz(self, request: web.Request) -> web.Response:
        try:
            ok, failing = await self._bounded(self._ready_executor, self.readiness)
        except TimeoutError:
            return web.Response(status=503, text="readiness check timed out\n")
        if ok:
            return web.Response(text="ready\n")
        return web.Response(
            status=503, text="".join(f"{why}\n" for why in failing or ["not ready"])
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        if self._executor is None:
            return web.Response(status=503, text="not started\n")
        try:
            body = await self._bounded(self._executor, lambda: generate_latest(self.registry))
        except TimeoutError:
            return web.Response(status=503, text="metrics snapshot timed out\n")
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _debug_state(self, request: web.Request) -> web.Response:
        if self.debug_state == "off":
            return web.Response(status=404, text="/debug/state is off (health.debug_state)\n")
        if not hasattr(self.probe, "debug_state"):
            return web.Response(status=404, text="this probe keeps no debug state\n")
        if self.debug_state == "loopback" and not _is_loopback(request.remote):
            return web.Response(
                status=403,
                text="/debug/state is served to loopback clients only (health.debug_state)\n",
            )
        try:
            body = await self._bounded(self._executor, self.debug_dump)
        except TimeoutError:
            return web.Response(status=503, text="debug state timed out\n")
        return web.Response(text=body, content_type="application/json")

    def debug_dump(self, limit: int = DEBUG_LIST_LIMIT) -> str:
        """The ``/debug/state`` body: the probe's dump with this server's verdicts added."""
        state: dict[str, Any] = self.probe.debug_state(limit)  # type: ignore[attr-defined]
        ok, failing = self.readiness()
        live, liveness = self.liveness()
        head = ("role", "id", "endpoint", "version", "uptime_s")
        out = {k: state.pop(k) for k in head if k in state}
        out["draining"] = bool(state.pop("draining", False) or self.draining)
        out.update(ready=ok, not_ready=failing, live=live, liveness=liveness)
        out.update(state)
        return json.dumps(out, indent=1, default=str) + "\n"


class ReadinessCollector(Collector):
    """``kvxferd_ready`` and ``kvxferd_not_ready{reason}`` (every reason, 0 included)."""

    def __init__(self, readiness: Callable[[], tuple[bool, list[str]]]) -> None:
        self._readiness = readiness

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterable[Metric]:
        ok, failing = self._readiness()
        keys = {readiness_key(why) for why in failing}
        ready = GaugeMetricFamily("kvxferd_ready", "1 when /readyz answers 200, else 0")
        ready.add_metric([], 1 if ok and not failing else 0)
        not_ready = GaugeMetricFamily(
            "kvxferd_not_ready",
            "1 for each reason /readyz fails now (docs/operations.md lists them)",
            labels=["reason"],
        )
        for key in READINESS_REASONS:
            not_ready.add_metric([key], 1 if key in keys else 0)
        return [ready, not_ready]


def _is_loopback(remote: str | None) -> bool:
    """Whether a client address is loopback (127/8, ::1, or IPv4-mapped 127/8)."""
    if not remote:
        return False
    try:
        ip = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


class SnapshotCollector(Collector):
    """Turns each :class:`Snapshot` into metric families; keeps the histogram cumulative."""

    def __init__(self, probe: Probe, build_info: dict[str, str]) -> None:
        self._probe = probe
        self._build_info = build_info
        self._lock = threading.Lock()  # guards the histogram accumulator
        self._durations = Histogram()

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterable[Metric]:
        snap = self._probe.snapshot()
        return list(self._families(snap))

    def _families(self, snap: Snapshot) -> Iterator[Metric]:
        sessions = GaugeMetricFamily(
            "kvxferd_sessions", "Sessions (sender) or fetches (receiver) by state", labels=["state"]
        )
        for state, n in sorted(snap.sessions_by_state.items()):
            sessions.add_metric([state], n)
        yield sessions

        workers = len(snap.queue_depths) if snap.role == "sender" else 0
        yield from _counters(snap.role, snap.stats, workers)

        yield self._histogram(snap.durations_s)

        depth = GaugeMetricFamily(
            "kvxferd_queue_depth", "Tasks queued per worker thread", labels=["worker"]
        )
        for i, n in enumerate(snap.queue_depths):
            depth.add_metric([str(i)], n)
        yield depth

        yield GaugeMetricFamily("kvxferd_peers", "Peers connected", value=snap.peers)
        yield GaugeMetricFamily(
            "kvxferd_writes_in_flight",
            "Writes that may still touch registered memory",
            value=snap.writes_in_flight,
        )
        yield from _gauges(snap)
        yield from _peer_histograms(snap.histograms)
        if snap.gateway is not None:
            yield from _counters("gateway", snap.gateway.stats, 0)
            yield GaugeMetricFamily(
                "kvxferd_gateway_handles",
                "Engine handles open on the gateway (bounded by max_handles)",
                value=snap.gateway.handles,
            )
            yield GaugeMetricFamily(
                "kvxferd_gateway_calls_in_flight",
                "Engine calls being served (bounded by max_client_inflight)",
                value=snap.gateway.calls_in_flight,
            )
        labels = {"role": snap.role, **self._build_info}
        info = GaugeMetricFamily("kvxferd_build_info", "Build information", labels=list(labels))
        info.add_metric(list(labels.values()), 1)
        yield info

    def _histogram(self, samples: Sequence[float]) -> HistogramMetricFamily:
        with self._lock:
            for v in samples:
                self._durations.observe(v)
            cumulative, total = self._durations.cumulative()
        buckets = [(floatToGoString(bound), n) for bound, n in cumulative]
        return HistogramMetricFamily(
            "kvxferd_transfer_duration_seconds",
            "Slice (sender: queued to reported) or fetch (receiver: the engine's fetch call"
            " to its outcome) duration",
            buckets=buckets,
            sum_value=total,
        )


def _counters(component: str, stats: dict[str, int], workers: int) -> Iterator[Metric]:
    """Every catalogued counter of ``component`` (stats.CATALOGUE), zero included.

    Specs that share a family (``kvxferd_outcomes``: one per role) are one family here;
    each label value of a family is one series, so the label set is the catalogue's.
    """
    families: dict[str, CounterMetricFamily] = {}
    for spec in specs_for(component):
        name = spec.metric_for(component)
        fam = families.get(name)
        if fam is None:
            labels = [spec.label] if spec.label else []
            fam = families[name] = CounterMetricFamily(name, spec.help, labels=labels)
        if not spec.label:
            fam.add_metric([], stats.get(spec.key, 0))
            continue
        values = spec.values or tuple(str(i) for i in range(workers))
        for v in values:
            fam.add_metric([v], stats.get(spec.stats_key(v), 0))
    yield from families.values()


def _gauges(snap: Snapshot) -> Iterator[Metric]:
    """In-flight transfers, the oldest one's age, aux slots and the peer cache (bounded labels)."""
    in_flight = GaugeMetricFamily(
        "kvxferd_transfers_in_flight",
        "Transfers not finished, by state (sender: parked fetches and slices queued, writing"
        " or in doubt; receiver: fetches requested, fenced or in doubt)",
        labels=["state"],
    )
    for state in IN_FLIGHT_STATES.get(snap.role, ()):
        in_flight.add_metric([state], snap.in_flight.get(state, 0))
    yield in_flight
    yield GaugeMetricFamily(
        "kvxferd_oldest_in_flight_seconds",
        "Age of the oldest transfer not finished (sender: a session not ended or with a write"
        " in flight; receiver: a fetch open or fenced); 0 when none",
        value=snap.oldest_in_flight_s,
    )
    aux = GaugeMetricFamily(
        "kvxferd_aux_slots",
        "Aux slots by state (receiver: quarantined = held by a fetch in doubt)",
        labels=["state"],
    )
    for state in AUX_SLOT_STATES.get(snap.role, ()):
        aux.add_metric([state], snap.aux_slots.get(state, 0))
    yield aux
    cache = GaugeMetricFamily(
        "kvxferd_peer_cache_entries",
        "What is held per peer (sender: registered peers, NIXL remote agents incl. retiring"
        " ones, retiring agents, shared and worker DEALERs; receiver: links, ready links)",
        labels=["kind"],
    )
    for kind in PEER_CACHE_KINDS.get(snap.role, ()):
        cache.add_metric([kind], snap.peer_cache.get(kind, 0))
    yield cache


def _peer_histograms(
    hists: dict[tuple[str, str], tuple[list[tuple[float, int]], float]],
) -> Iterator[Metric]:
    """journal.histograms() as one family per phase, labelled by peer (bounded by the journal)."""
    for phase, (name, text) in PEER_HISTOGRAMS.items():
        fam = HistogramMetricFamily(name, text, labels=["peer"])
        for (p, peer), (buckets, total) in sorted(hists.items()):
            if p == phase:
                fam.add_metric(
                    [peer], [(floatToGoString(b), n) for b, n in buckets], sum_value=total
                )
        yield fam


# -- the probes the daemon uses -------------------------------------------------------------


def _broken(service: Any, gateway: Any) -> str | None:
    """Why the service or the engine gateway is not live (a caught unexpected error), or None."""
    why = service.broken()
    if why is None and gateway is not None:
        gw = gateway.broken()
        why = f"gateway: {gw}" if gw else None
    return why


def _thread_stalls(
    names_progress: Iterable[tuple[str, float, bool]], now: float, limit_s: float, stopping: bool
) -> list[str]:
    """``name: no progress for Xs`` for each thread past ``limit_s``.

    A thread that exited while the process is stopping is not stalled: it was told to stop.
    """
    out = []
    for name, last, alive in names_progress:
        if stopping and not alive:
            continue
        age = now - last
        if age > limit_s:
            out.append(f"{name}: no progress for {age:.1f}s (> {limit_s:g}s)")
    return out


class SenderProbe:
    """Liveness, readiness and metrics of a :class:`~kvxferd.sender.Sender`.

    A worker's one task may legitimately take up to two NIXL waits (kv + aux,
    each bounded by ``xfer_stall_timeout_ms``) plus a result send
    (``worker_send_timeout_ms``) without stamping progress, so a worker is
    judged against ``max(liveness_stall_ms, that bound + 1 s)``: a slow but
    bounded write must not restart the pod.
    """

    def __init__(self, sender: Sender, settings: SenderSettings, gateway: Any = None) -> None:
        self.sender = sender
        self.settings = settings
        self.gateway = gateway  # the daemon's engine gateway (its broken() fails liveness)
        svc, d = settings.service, settings.deadlines
        self.listener_stall_s = svc.liveness_stall_ms / 1000
        task_bound_ms = 2 * d.xfer_stall_timeout_ms + d.worker_send_timeout_ms + 1000
        self.worker_stall_s = max(svc.liveness_stall_ms, task_bound_ms) / 1000

    def liveness(self) -> tuple[bool, str]:
        snd, now = self.sender, time.monotonic()
        stopping = snd.draining
        listener = snd._listener
        stalls = _thread_stalls(
            [("listener", snd.listener_progress, listener.is_alive())],
            now,
            self.listener_stall_s,
            stopping,
        )
        workers = snd._workers
        stalls += _thread_stalls(
            (
                (f"worker {i}", last, w.thread.is_alive())
                for i, (w, last) in enumerate(zip(workers, snd.worker_progress(), strict=True))
            ),
            now,
            self.worker_stall_s,
            stopping,
        )
        broken = _broken(snd, self.gateway)
        if broken:
            stalls.append(broken)
        if stalls:
            return False, "; ".join(stalls)
        oldest = max((now - t for t in snd.worker_progress()), default=0.0)
        return True, (
            f"listener {now - snd.listener_progress:.2f}s ago, "
            f"{len(workers)} workers, slowest {oldest:.2f}s ago"
        )

    def readiness(self, now: float | None = None) -> tuple[bool, list[str]]:
        """Every reason new work should go elsewhere now (``now``: judge at that instant)."""
        snd = self.sender
        now = time.monotonic() if now is None else now
        failing: list[str] = []
        if snd.draining:
            failing.append("draining")
        if not snd._listener.is_alive():
            failing.append("listener thread not alive")
        failing += [
            f"worker {i} thread not alive"
            for i, w in enumerate(snd._workers)
            if not w.thread.is_alive()
        ]
        # len() of the dict without the registry lock: a probe must never wait on that lock.
        limit = self.settings.limits.max_live_sessions
        if len(snd._sessions) >= limit:
            failing.append(f"session table full (max_live_sessions={limit})")
        if snd.aux_slots.free == 0:  # every publish with aux would be refused busy
            failing.append(
                f"no free aux slot (0 free, aux_slots={self.settings.pool.aux_slots}:"
                " a publish with aux is refused busy)"
            )
        if _dataplane_closed(snd.dataplane):
            failing.append("data plane closed (pool not registered)")
        count, oldest = self.pending_work()
        what = f"{count} slice{'' if count == 1 else 's'} queued or writing"
        failing += _work_problems(snd.journal, self.settings, now, count, oldest, what)
        return not failing, failing

    def pending_work(self) -> tuple[int, float]:
        """(slices queued or writing, when the oldest was attached), read without any lock."""
        count, oldest = 0, float("inf")
        for session in _copy_values(self.sender._sessions):
            for sl in _copy_values(session._slices):
                if sl.state in (SliceState.QUEUED, SliceState.WRITING):
                    count += 1
                    oldest = min(oldest, sl.attached_at)
        return count, oldest

    def debug_state(self, limit: int = DEBUG_LIST_LIMIT) -> dict[str, Any]:
        """The sender's hang dump (``/debug/state``), from copies taken without its locks.

        Ages and times in seconds (ms precision); each list holds the ``limit`` oldest::

            role "sender", id (sender_id: this incarnation), endpoint, version, uptime_s,
            draining; ProbeServer adds ready, not_ready [reasons], live, liveness
            sessions   {total, by_state {state: n}, oldest_age_s {state: age},
                        open [{request_id, session_id, state, age_s, writes_in_flight,
                               expected_fetches, ttl_in_s, aux_slot, outcome,
                               slices [{receiver_id, endpoint, fetch_id, state, age_s,
                                        writes_in_flight, posted_age_s, deadline_in_s,
                                        nbytes, reason}]}]}
                       open: sessions not ended, or ended with writes still in flight
                       (in doubt); outcome {state, reason, detail, in_doubt} or null
            peers      [{receiver_id, endpoint, nixl_name, idle_s, writes_in_flight, prepped}]
                       receiver_id names the receiver's incarnation (name-uuid)
            retiring_peers [{nixl_name, writes_in_flight}]  replaced or evicted peers whose
                       NIXL agent is kept until their last write ends
            parked     {count, oldest [{request_id, receiver_id, fetch_id, age_s,
                        expires_in_s}]}  fetches waiting for their request to be published
            workers    [{index, alive, queue_depth, lanes_busy, writes_in_flight,
                         last_progress_age_s}]
            aux_slots  {free, total}
            journal    {endings, idle_s, last_done_age_s, window_s,
                        peer_rates [{peer, failed, total, ratio}]}
            stats      {counter: value}
        """
        snd, now = self.sender, time.monotonic()
        sessions = sorted(_copy_values(snd._sessions), key=lambda x: x.created)
        by_state = dict.fromkeys((st.value for st in TxState), 0)
        oldest: dict[str, float] = {}
        per_worker = [0] * len(snd._workers)
        listed: list[dict[str, Any]] = []
        for session in sessions:
            state = session.state.value
            by_state[state] += 1
            oldest.setdefault(state, _age(now, session.created))
            slices = _copy_values(session._slices)
            for sl in slices:
                if sl.writes_in_flight > 0:
                    worker = snd._worker_for(session.request_id, sl.peer_id)
                    per_worker[worker.index] += sl.writes_in_flight
            if (not session.ended or session.writes_in_flight) and len(listed) < limit:
                listed.append(_tx_session_view(session, slices, now))
        seen: dict[bytes, float] = _copy(lambda: dict(snd._peer_seen), {})
        peer_writes: dict[str, int] = _copy(lambda: dict(snd._peer_writes), {})
        peers = [
            {
                "receiver_id": p.receiver_id,
                "endpoint": p.result_endpoint,
                "nixl_name": p.nixl_name,
                "idle_s": _age(now, seen[p.routing_id]) if p.routing_id in seen else None,
                "writes_in_flight": peer_writes.get(p.nixl_name, 0),
                "prepped": p.prepped,
            }
            for p in _copy_values(snd._peers)
        ]
        retiring: list[str] = _copy(lambda: sorted(snd._retiring), [])
        parked: list[Any] = _copy(
            lambda: [p for ps in list(snd._pending.values()) for p in list(ps)], []
        )
        parked.sort(key=lambda p: p.parked_at)
        return {
            "role": "sender",
            "id": snd.sender_id,
            "endpoint": snd.endpoint,
            "version": __version__,
            "uptime_s": _age(now, snd.journal.started),
            "draining": snd.draining,
            "sessions": {
                "total": len(sessions),
                "by_state": by_state,
                "oldest_age_s": oldest,
                "open": listed,
            },
            "peers": peers,
            "retiring_peers": [
                {"nixl_name": n, "writes_in_flight": peer_writes.get(n, 0)} for n in retiring
            ],
            "parked": {
                "count": snd._pending_count,
                "oldest": [
                    {
                        "request_id": p.msg.request_id,
                        "receiver_id": p.peer.receiver_id,
                        "fetch_id": p.msg.fetch_id,
                        "age_s": _age(now, p.parked_at),
                        "expires_in_s": _age(p.deadline, now),
                    }
                    for p in parked[:limit]
                ],
            },
            "workers": [
                {
                    "index": i,
                    "alive": w.thread.is_alive(),
                    "queue_depth": w.queue.qsize(),
                    "lanes_busy": len(w._busy_lanes),
                    "writes_in_flight": per_worker[i],
                    "last_progress_age_s": _age(now, w.last_progress),
                }
                for i, w in enumerate(snd._workers)
            ],
            "aux_slots": {"free": snd.aux_slots.free, "total": self.settings.pool.aux_slots},
            "journal": _journal_view(snd.journal, now),
            "stats": snd.stats.snapshot(),
        }

    def snapshot(self) -> Snapshot:
        snd, now = self.sender, time.monotonic()
        with snd._lock:
            sessions = list(snd._sessions.values())
            peers = list(snd._peers.values())
            parked = snd._pending_count
        with snd._peer_lock:
            retiring = set(snd._retiring)
        by_state = dict.fromkeys((s.value for s in TxState), 0)
        in_flight = dict.fromkeys(IN_FLIGHT_STATES["sender"], 0)
        in_flight["parked"] = parked
        oldest = 0.0
        for s in sessions:
            by_state[s.state.value] += 1
            if not s.ended or s.writes_in_flight > 0:
                oldest = max(oldest, now - s.created)
            for sl in s.slices():
                if sl.state is SliceState.QUEUED:
                    in_flight["queued"] += 1
                elif sl.state is SliceState.WRITING:
                    in_flight["writing"] += 1
                elif sl.state is SliceState.IN_DOUBT and sl.writes_in_flight > 0:
                    in_flight["in_doubt"] += 1
        aux_total, aux_free = self.settings.pool.aux_slots, snd.aux_slots.free
        return Snapshot(
            role="sender",
            stats=snd.stats.snapshot(),
            sessions_by_state=by_state,
            queue_depths=snd.queue_depths(),
            writes_in_flight=sum(s.writes_in_flight for s in sessions),
            peers=len(peers),
            durations_s=snd.stats.take_samples("slice_seconds"),
            in_flight=in_flight,
            oldest_in_flight_s=oldest,
            peer_cache={
                "peers": len(peers),
                "nixl_agents": len({p.nixl_name for p in peers} | retiring),
                "retiring_agents": len(retiring),
                # len() of dicts other threads own: a count, never an iteration
                "shared_dealers": len(snd._shared._dealers),
                "worker_dealers": sum(len(w._dealers) for w in snd._workers),
            },
            aux_slots={"free": aux_free, "in_use": aux_total - aux_free},
            histograms=snd.journal.histograms(),
            gateway=_gateway_reading(self.gateway),
        )


class ReceiverProbe:
    """Liveness, readiness and metrics of a :class:`~kvxferd.receiver.Receiver`.

    The io thread's every wait is bounded by ``send_timeout_ms`` per send and a
    50 ms poll, so it is judged against ``liveness_stall_ms`` as it is.
    """

    def __init__(self, receiver: Receiver, settings: ReceiverSettings, gateway: Any = None) -> None:
        self.receiver = receiver
        self.settings = settings
        self.gateway = gateway  # the daemon's engine gateway (its broken() fails liveness)
        self.io_stall_s = settings.service.liveness_stall_ms / 1000

    @property
    def draining(self) -> bool:
        return self.receiver._draining.is_set()

    def liveness(self) -> tuple[bool, str]:
        rx, now = self.receiver, time.monotonic()
        stalls = _thread_stalls(
            [("io thread", rx.io_progress, rx._io.is_alive())], now, self.io_stall_s, self.draining
        )
        broken = _broken(rx, self.gateway)
        if broken:
            stalls.append(broken)
        if stalls:
            return False, "; ".join(stalls)
        return True, f"io thread {now - rx.io_progress:.2f}s ago"

    def readiness(self, now: float | None = None) -> tuple[bool, list[str]]:
        """Every reason new work should go elsewhere now (``now``: judge at that instant)."""
        rx = self.receiver
        now = time.monotonic() if now is None else now
        failing: list[str] = []
        if self.draining:
            failing.append("draining")
        if not rx._io.is_alive():
            failing.append("io thread not alive")
        limit = self.settings.limits.max_fetches_in_flight
        if len(rx._fetches) >= limit:  # without the lock, like SenderProbe
            failing.append(f"fetch table full (max_fetches_in_flight={limit})")
        free, quarantined = rx.aux_slot_counts()
        if free == 0:  # every fetch with aux would be refused busy
            failing.append(
                f"no free aux slot ({free} free, {quarantined} quarantined by outcomes in doubt,"
                f" aux_slots={self.settings.pool.aux_slots})"
            )
        if _dataplane_closed(rx.dataplane):
            failing.append("data plane closed (pool not registered)")
        count, oldest = self.pending_work()
        what = f"{count} fetch{'' if count == 1 else 'es'} open"
        failing += _work_problems(rx.journal, self.settings, now, count, oldest, what)
        return not failing, failing

    def pending_work(self) -> tuple[int, float]:
        """(fetches asked for and not ended, when the oldest started), read without any lock."""
        open_ = [f for f in _copy_values(self.receiver._fetches) if not f.ended]
        return len(open_), min((f.started for f in open_), default=float("inf"))

    def debug_state(self, limit: int = DEBUG_LIST_LIMIT) -> dict[str, Any]:
        """The receiver's hang dump (``/debug/state``), from copies taken without its locks.

        Ages and times in seconds (ms precision); each list holds the ``limit`` oldest::

            role "receiver", id (receiver_id: this incarnation), endpoint (result endpoint),
            version, uptime_s, draining; ProbeServer adds ready, not_ready, live, liveness
            fetches   {total, by_state {state: n}, oldest_age_s {state: age},
                       oldest [{fetch_id, request_id, state, fence, age_s, sender_endpoint,
                                sent, sent_to, deadline_in_s, fence_deadline_in_s,
                                aux_slot, blocks, reason}]}
                      every fetch in the table: open ones, and ended ones whose fence is up
                      (sent_to: the sender incarnation it was last sent to)
            in_doubt  {count, tracked, oldest [same fields + next_retry_in_s]}  ended with
                      a write possibly still landing; blocks and aux slot kept
            aux_slots {free, quarantined, total}
            links     [{endpoint, ready, sender_id, waiting, ever_connected, disconnected,
                        register_deadline_in_s}]  sender_id: the incarnation that answered;
                      waiting: fetches queued until it registers
            commands_queued, io_thread {alive, last_progress_age_s}
            journal   {endings, idle_s, last_done_age_s, window_s, peer_rates [...]}
            stats     {counter: value}
        """
        rx, now = self.receiver, time.monotonic()
        fetches = sorted(_copy_values(rx._fetches), key=lambda f: f.started)
        doubtful = sorted(_copy_values(rx._in_doubt), key=lambda f: f.started)
        by_state = dict.fromkeys((st.value for st in RxState), 0)
        oldest: dict[str, float] = {}
        for f in fetches:
            by_state[f.state.value] += 1
            oldest.setdefault(f.state.value, _age(now, f.started))
        free, quarantined = rx.aux_slot_counts()
        return {
            "role": "receiver",
            "id": rx.receiver_id,
            "endpoint": rx.result_endpoint,
            "version": __version__,
            "uptime_s": _age(now, rx.journal.started),
            "draining": self.draining,
            "fetches": {
                "total": len(fetches),
                "by_state": by_state,
                "oldest_age_s": oldest,
                "oldest": [_rx_fetch_view(f, now) for f in fetches[:limit]],
            },
            "in_doubt": {
                "count": rx._forgotten_in_doubt,
                "tracked": len(doubtful),
                "oldest": [
                    {**_rx_fetch_view(f, now), "next_retry_in_s": _age(f.retry_at, now)}
                    for f in doubtful[:limit]
                ],
            },
            "aux_slots": {
                "free": free,
                "quarantined": quarantined,
                "total": self.settings.pool.aux_slots,
            },
            "links": [
                {
                    "endpoint": link.endpoint,
                    "ready": link.ready,
                    "sender_id": link.sender_id,
                    "waiting": len(link.waiting),
                    "ever_connected": link.ever_connected,
                    "disconnected": link.disconnected,
                    "register_deadline_in_s": None
                    if link.ready
                    else _age(link.register_deadline, now),
                }
                for link in _copy_values(rx._links)[:limit]
            ],
            "commands_queued": len(rx._commands),
            "io_thread": {
                "alive": rx._io.is_alive(),
                "last_progress_age_s": _age(now, rx.io_progress),
            },
            "journal": _journal_view(rx.journal, now),
            "stats": rx.stats.snapshot(),
        }

    def snapshot(self) -> Snapshot:
        rx, now = self.receiver, time.monotonic()
        with rx._lock:
            fetches = list(rx._fetches.values())
            in_doubt = len(rx._in_doubt)
            unresolved = rx._forgotten_in_doubt  # in doubt, asked about or not any more
            queued = len(rx._commands)
        by_state = dict.fromkeys((s.value for s in RxState), 0)
        requested = fenced = 0
        oldest = 0.0
        for f in fetches:
            by_state[f.state.value] += 1
            if not f.ended:
                requested += 1
            elif f.fence is Fence.FENCED:
                fenced += 1
            else:
                continue
            oldest = max(oldest, now - f.started)
        links = _copy_values(rx._links)
        ready = sum(1 for link in links if link.ready)
        free, quarantined = rx.aux_slot_counts()
        total = self.settings.pool.aux_slots
        return Snapshot(
            role="receiver",
            stats=rx.stats.snapshot(),
            sessions_by_state=by_state,
            queue_depths=[queued],
            # A fetch in our table, or one in doubt, may still receive a write into its blocks.
            writes_in_flight=len(fetches) + in_doubt,
            peers=ready,
            durations_s=rx.stats.take_samples("fetch_seconds"),
            in_flight={"requested": requested, "fenced": fenced, "in_doubt": unresolved},
            oldest_in_flight_s=oldest,
            peer_cache={"links": len(links), "ready_links": ready},
            aux_slots={
                "free": free,
                "in_use": max(0, total - free - quarantined),
                "quarantined": quarantined,
            },
            histograms=rx.journal.histograms(),
            gateway=_gateway_reading(self.gateway),
        )


def _gateway_reading(gateway: Any) -> GatewayReading | None:
    """The engine gateway's counters and table sizes, when the daemon runs one."""
    if gateway is None:
        return None
    return GatewayReading(gateway.stats.snapshot(), gateway.handle_count, gateway.calls_in_flight)


def _copy(make: Callable[[], _T], empty: _T) -> _T:
    """A copy of a container another thread changes, taken without its lock (retried)."""
    for _ in range(10):
        try:
            return make()
        except RuntimeError:  # changed size while copying: try again
            continue
    return empty


def _copy_values(d: dict[Any, Any]) -> list[Any]:
    """The values of a dict another thread owns (the receiver's io thread), without its lock."""
    return _copy(lambda: list(d.values()), [])


def _age(now: float, then: float) -> float:
    """``now - then`` in seconds, rounded to the millisecond (JSON stays short)."""
    return round(now - then, 3)


def _work_problems(
    journal: Journal, settings: Any, now: float, count: int, oldest: float, what: str
) -> list[str]:
    """The stuck and failing-peer readiness reasons of one side (see the module docstring)."""
    health = settings.health
    out: list[str] = []
    if count:
        # Pending since the later of the last ending and the oldest pending start: an idle
        # daemon's first request is judged from when it started, not from the last ending.
        quiet = now - max(journal.last_ending, oldest)
        if quiet * 1000 >= health.stuck_after_ms:
            out.append(
                f"stuck: {what} and nothing ended for {quiet:.1f}s"
                f" (stuck_after_ms={health.stuck_after_ms})"
            )
    for rate in sorted(journal.peer_rates(now), key=lambda r: r.peer):
        if rate.total >= health.peer_failure_min and rate.ratio >= health.peer_failure_ratio:
            out.append(
                f"peer failing: {rate.peer} {rate.failed}/{rate.total} ended failed in the last"
                f" {journal.window_s:g}s (peer_failure_ratio={health.peer_failure_ratio:g},"
                f" peer_failure_min={health.peer_failure_min})"
            )
    return out


def _journal_view(journal: Journal, now: float) -> dict[str, Any]:
    return {
        "endings": journal.endings,
        "idle_s": round(journal.idle_s(now), 3),
        "last_done_age_s": _age(now, journal.last_done) if journal.last_done else None,
        "window_s": journal.window_s,
        "peer_rates": [
            {"peer": r.peer, "failed": r.failed, "total": r.total, "ratio": round(r.ratio, 3)}
            for r in journal.peer_rates(now)
        ],
    }


def _tx_session_view(session: Any, slices: list[Any], now: float) -> dict[str, Any]:
    outcome = session.outcome
    return {
        "request_id": session.request_id,
        "session_id": session.session_id,
        "state": session.state.value,
        "age_s": _age(now, session.created),
        "writes_in_flight": session.writes_in_flight,
        "expected_fetches": session.expected_fetches,
        "ttl_in_s": None if slices else _age(session.ttl_deadline, now),
        "aux_slot": session.aux_slot,
        "outcome": None
        if outcome is None
        else {
            "state": outcome.state.value,
            "reason": outcome.reason,
            "detail": outcome.detail,
            "in_doubt": outcome.in_doubt,
        },
        "slices": [
            {
                "receiver_id": sl.peer_id,
                "endpoint": sl.result_endpoint,
                "fetch_id": sl.fetch_id,
                "state": sl.state.value,
                "age_s": _age(now, sl.attached_at),
                "writes_in_flight": sl.writes_in_flight,
                "posted_age_s": _age(now, sl.posted_at) if sl.posted_at else None,
                "deadline_in_s": _age(sl.deadline, now),
                "nbytes": sl.nbytes,
                "reason": sl.reason,
            }
            for sl in slices
        ],
    }


def _rx_fetch_view(f: Any, now: float) -> dict[str, Any]:
    return {
        "fetch_id": f.fetch_id,
        "request_id": f.request_id,
        "state": f.state.value,
        "fence": f.fence.value,
        "age_s": _age(now, f.started),
        "sender_endpoint": f.sender_endpoint,
        "sent": f.sent,
        "sent_to": f.sent_to,
        "deadline_in_s": _age(f.deadline, now),
        "fence_deadline_in_s": _age(f.fence_deadline, now) if f.fence_deadline else None,
        "aux_slot": f.aux_slot,
        "blocks": int(f.dst_blocks.size),
        "reason": f.outcome.reason if f.outcome is not None else None,
    }


def _dataplane_closed(dataplane: Any) -> bool:
    # NixlDataPlane keeps ``_closed``; the test double ``closed``. Neither is in the protocol.
    return bool(getattr(dataplane, "_closed", False) or getattr(dataplane, "closed", False))
