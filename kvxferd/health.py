"""The probe port: ``/healthz`` (liveness), ``/readyz`` (readiness), ``/metrics`` (Prometheus).

Health that lies is a known failure (an HTTP thread answering 200 while the
workers are wedged), so::

    /healthz  200 only when the listener/io thread, EVERY worker and this event loop
              made progress recently, and neither the service nor the engine gateway
              met an unexpected exception (``broken()``, see guard.py). Never depends
              on peers: one dead decode pod must not restart every prefill pod.
    /readyz   200 only when new work would be accepted: not draining, every thread
              alive, the session/fetch table below its limit, (receiver) a free aux slot.
    /metrics  Prometheus text from one :class:`Snapshot`, built in a worker thread
              with a deadline, so a slow scrape never stalls the loop. Every counter in
              stats.CATALOGUE (the service's and the engine gateway's), per-peer
              histograms from the journal, and gauges of what is in flight and held.

The server runs inside the daemon's own event loop (aiohttp ``AppRunner``; no
signal handlers touched, no extra HTTP thread that would stay healthy while
the loop is stuck). A heartbeat task stamps ``loop_heartbeat`` every
``heartbeat_interval_s``; ``/healthz`` fails when it is older than ``loop_stall_s``.

Label values are bounded: states, outcomes and reasons come from fixed enums,
workers are indices; never request ids.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

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
from kvxferd.session import Fence, RxState, SliceState, TxState
from kvxferd.stats import specs_for

if TYPE_CHECKING:
    from kvxferd.receiver import Receiver
    from kvxferd.sender import Sender

DURATION_BUCKETS_S: tuple[float, ...] = (
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
    """What the probe port asks a sender or receiver."""

    def liveness(self) -> tuple[bool, str]: ...

    def readiness(self) -> tuple[bool, list[str]]: ...

    def snapshot(self) -> Snapshot: ...


# -- the HTTP layer ---------------------------------------------------------------------------


class ProbeServer:
    """``/healthz``, ``/readyz`` and ``/metrics`` on ``host:port``, inside the running loop."""

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
    ) -> None:
        self.probe = probe
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
        self._runner: web.AppRunner | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        # One thread: a scrape stuck on a lock holds it alone; later scrapes time out, no pile-up.
        self._executor: ThreadPoolExecutor | None = None

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> int:
        """Bind and serve; the bound port (``port`` 0 picks a free one)."""
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
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
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

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

    async def _readyz(self, request: web.Request) -> web.Response:
        ok, failing = self.readiness()
        if ok:
            return web.Response(text="ready\n")
        return web.Response(
            status=503, text="".join(f"{why}\n" for why in failing or ["not ready"])
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        if self._executor is None:
            return web.Response(status=503, text="not started\n")
        loop = asyncio.get_running_loop()
        try:
            body = await asyncio.wait_for(
                loop.run_in_executor(self._executor, generate_latest, self.registry),
                self.scrape_timeout_s,
            )
        except TimeoutError:
            return web.Response(status=503, text="metrics snapshot timed out\n")
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


class SnapshotCollector(Collector):
    """Turns each :class:`Snapshot` into metric families; keeps the histogram cumulative."""

    def __init__(self, probe: Probe, build_info: dict[str, str]) -> None:
        self._probe = probe
        self._build_info = build_info
        self._lock = threading.Lock()  # guards the histogram accumulator
        self._bucket_counts = [0] * (len(DURATION_BUCKETS_S) + 1)  # last one: +Inf
        self._sum = 0.0

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
                self._bucket_counts[bisect.bisect_left(DURATION_BUCKETS_S, v)] += 1
                self._sum += v
            cumulative, buckets = 0, []
            for bound, n in zip(
                (*DURATION_BUCKETS_S, float("inf")), self._bucket_counts, strict=True
            ):
                cumulative += n
                buckets.append((floatToGoString(bound), cumulative))
            total = self._sum
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

    def readiness(self) -> tuple[bool, list[str]]:
        snd = self.sender
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
        if _dataplane_closed(snd.dataplane):
            failing.append("data plane closed (pool not registered)")
        return not failing, failing

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

    def readiness(self) -> tuple[bool, list[str]]:
        rx = self.receiver
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
        return not failing, failing

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


def _copy_values(d: dict[Any, Any]) -> list[Any]:
    """The values of a dict another thread owns (the receiver's io thread), without its lock."""
    for _ in range(10):
        try:
            return list(d.values())
        except RuntimeError:  # changed size while copying: try again
            continue
    return []


def _dataplane_closed(dataplane: Any) -> bool:
    # NixlDataPlane keeps ``_closed``; the test double ``closed``. Neither is in the protocol.
    return bool(getattr(dataplane, "_closed", False) or getattr(dataplane, "closed", False))
