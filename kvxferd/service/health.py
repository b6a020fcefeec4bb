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
              (:func:`~kvxferd.service.metrics.readiness_key` maps it to the
              ``kvxferd_not_ready{reason}`` label).
    /metrics  Prometheus text (metrics.py), built in a worker thread with a deadline, so
              a slow scrape never stalls the loop.
    /debug/state  JSON dump of sessions, slices, fetches, peers, links, parked fetches,
              workers and aux slots (the shape is in debug_state.py), built in a worker
              thread with a deadline from the services' unlocked views (copies taken
              without their locks, kvxferd/transfer/views.py), so it answers during a
              deadlock.
              ``health.debug_state``: "off" (404), "loopback" (403 to any other
              client address), "any".

Readiness reasons (stable prefixes an operator can grep; the label in parentheses;
probes.py judges them)::

    draining                                   (draining)
    listener|io|worker N thread not alive      (thread_dead)
    session|fetch table full (...)             (table_full)
    no free aux slot (...)                     (no_aux_slot)
    data plane closed (pool not registered)    (data_plane_closed)
    stuck: N slices queued or writing | N fetches open, and nothing ended for Xs  (stuck)
    peer failing: PEER F/T ended failed in the last Ws (...)                       (peer_failing)
    discovery: not registered with BACKEND     (discovery: the etcd lease is lost)
    link_slow: PEER measured X GB/s < min_link_gbps=F (...)   (link_slow: a sender's link probe)
    readiness check timed out                  (HTTP only: the check itself hung)

The server runs inside the daemon's own event loop (aiohttp ``AppRunner``; no
signal handlers touched, no extra HTTP thread that would stay healthy while
the loop is stuck). A heartbeat task stamps ``loop_heartbeat`` every
``heartbeat_interval_s``; ``/healthz`` fails when it is older than ``loop_stall_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, Protocol, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvxferd import __version__
from kvxferd.service.debug_state import DEBUG_LIST_LIMIT
from kvxferd.service.metrics import ReadinessCollector, Snapshot, SnapshotCollector

DebugAccess = Literal["off", "loopback", "any"]
_T = TypeVar("_T")


class Probe(Protocol):
    """What the probe port asks a sender or receiver.

    A probe may also offer ``debug_state(limit) -> dict`` (both real probes do) for
    ``/debug/state``; without it that route answers 404.
    """

    def liveness(self) -> tuple[bool, str]: ...

    def readiness(self) -> tuple[bool, list[str]]: ...

    def snapshot(self) -> Snapshot: ...


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
