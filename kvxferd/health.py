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
              with a deadline, so a slow scrape never stalls the loop.

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
from kvxferd.errors import Reason
from kvxferd.session import RxState, TxState

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

# Outcome counters per role: metric label -> Stats key. Fixed, so the label set is bounded.
OUTCOMES: dict[str, dict[str, str]] = {
    "sender": {"done": "slices_done", "failed": "slices_failed", "in_doubt": "slices_in_doubt"},
    "receiver": {
        "done": "fetches_done",
        "failed": "fetches_failed",
        "timed_out": "fetches_timed_out",
        "cancelled": "fetches_cancelled",
    },
}
BYTES_KEY: dict[str, str] = {"sender": "bytes_written", "receiver": "bytes_received"}


@dataclass(frozen=True)
class Snapshot:
    """One reading of a sender or receiver for ``/metrics``.

    ``durations_s`` holds the transfer durations recorded since the previous
    snapshot (taking a snapshot drains them): only the metrics collector takes one.
    """

    role: str  # "sender" | "receiver"
    stats: dict[str, int]
    sessions_by_state: dict[str, int]
    queue_depths: list[int]
    writes_in_flight: int
    peers: int
    durations_s: list[float] = field(default_factory=list)


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
        stats = snap.stats
        sessions = GaugeMetricFamily(
            "kvxferd_sessions", "Sessions (sender) or fetches (receiver) by state", labels=["state"]
        )
        for state, n in sorted(snap.sessions_by_state.items()):
            sessions.add_metric([state], n)
        yield sessions

        outcomes = CounterMetricFamily(
            "kvxferd_outcomes",
            "Final results: slices (sender) or fetches (receiver)",
            labels=["outcome"],
        )
        for outcome, key in OUTCOMES.get(snap.role, {}).items():
            outcomes.add_metric([outcome], stats.get(key, 0))
        yield outcomes

        yield CounterMetricFamily(
            "kvxferd_bytes",
            "KV bytes written (sender) or received (receiver)",
            value=stats.get(BYTES_KEY.get(snap.role, "bytes"), 0),
        )

        yield self._histogram(snap.durations_s)

        depth = GaugeMetricFamily(
            "kvxferd_queue_depth", "Tasks queued per worker thread", labels=["worker"]
        )
        for i, n in enumerate(snap.queue_depths):
            depth.add_metric([str(i)], n)
        yield depth

        if snap.role == "sender":  # one series per worker thread: bounded by num_threads
            per_worker = CounterMetricFamily(
                "kvxferd_worker_slices",
                "Slices a worker thread finished (any outcome)",
                labels=["worker"],
            )
            for i in range(len(snap.queue_depths)):
                per_worker.add_metric([str(i)], stats.get(f"worker_{i}_slices", 0))
            yield per_worker

        rejections = CounterMetricFamily(
            "kvxferd_rejections", "Messages or requests refused, by reason", labels=["reason"]
        )
        for reason in Reason:  # every known reason, zero included: stable series, bounded labels
            rejections.add_metric([reason.value], stats.get(f"rejected_{reason.value}", 0))
        yield rejections

        yield GaugeMetricFamily("kvxferd_peers", "Peers connected", value=snap.peers)
        yield GaugeMetricFamily(
            "kvxferd_writes_in_flight",
            "Writes that may still touch registered memory",
            value=snap.writes_in_flight,
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
            "Slice (sender: queued to reported) or fetch (receiver: sent to result) duration",
            buckets=buckets,
            sum_value=total,
        )


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
        snd = self.sender
        with snd._lock:
            sessions = list(snd._sessions.values())
            peers = len(snd._peers)
        by_state = dict.fromkeys((s.value for s in TxState), 0)
        for s in sessions:
            by_state[s.state.value] += 1
        return Snapshot(
            role="sender",
            stats=snd.stats.snapshot(),
            sessions_by_state=by_state,
            queue_depths=snd.queue_depths(),
            writes_in_flight=sum(s.writes_in_flight for s in sessions),
            peers=peers,
            durations_s=snd.stats.take_samples("slice_seconds"),
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
        rx = self.receiver
        with rx._lock:
            fetches = list(rx._fetches.values())
            in_doubt = len(rx._in_doubt)
            queued = len(rx._commands)
        by_state = dict.fromkeys((s.value for s in RxState), 0)
        for f in fetches:
            by_state[f.state.value] += 1
        links = _copy_values(rx._links)
        return Snapshot(
            role="receiver",
            stats=rx.stats.snapshot(),
            sessions_by_state=by_state,
            queue_depths=[queued],
            # A fetch in our table, or one in doubt, may still receive a write into its blocks.
            writes_in_flight=len(fetches) + in_doubt,
            peers=sum(1 for link in links if link.ready),
            durations_s=rx.stats.take_samples("fetch_seconds"),
        )


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
