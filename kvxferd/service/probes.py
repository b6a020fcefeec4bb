"""The sender's and receiver's probes: liveness, readiness, metrics and debug state.

:class:`SenderProbe` and :class:`ReceiverProbe` read a running service only
through its views (kvxferd/transfer/views.py), never its private attributes or
its locks: liveness, readiness and the dump take the unlocked view (they must
answer while a stuck thread holds a lock), ``/metrics`` the locked one. From
them: liveness from each thread's progress stamp and the errors its threads
caught, readiness as the reasons listed in health.py, a
:class:`~kvxferd.service.metrics.Snapshot` for ``/metrics``, and the ``/debug/state``
dump (debug_state.py).

Stuck counts from ``max(last ending, start of the oldest pending work)``: an idle
daemon that just got one request is not stuck; one whose pending work sees
nothing end for ``stuck_after_ms`` is.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvxferd.config import ReceiverSettings, SenderSettings
from kvxferd.service.debug_state import DEBUG_LIST_LIMIT, receiver_state, sender_state
from kvxferd.service.metrics import IN_FLIGHT_STATES, GatewayReading, Snapshot
from kvxferd.transfer.session import Fence, RxState, SliceState, TxState

if TYPE_CHECKING:
    from kvxferd.transfer.journal import Journal
    from kvxferd.transfer.receiver import Receiver
    from kvxferd.transfer.sender import Sender
    from kvxferd.transfer.views import ReceiverView, SenderView


def _discovery_problems(registrar: Any) -> list[str]:
    """Not ready while discovery does not advertise us (the etcd lease is lost): peers cannot find us."""
    if registrar is None or registrar.registered:
        return []
    return [f"discovery: not registered with {registrar.backend}"]


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
    """Liveness, readiness and metrics of a :class:`~kvxferd.transfer.sender.Sender`.

    A worker's one task may legitimately take up to two NIXL waits (kv + aux,
    each bounded by ``xfer_stall_timeout_ms``) plus a result send
    (``worker_send_timeout_ms``) without stamping progress, so a worker is
    judged against ``max(liveness_stall_ms, that bound + 1 s)``: a slow but
    bounded write must not restart the pod.
    """

    def __init__(self, sender: Sender, settings: SenderSettings, gateway: Any = None) -> None:
        self.sender = sender
        self.settings = settings
        self.registrar: Any = None  # the daemon's discovery registrar (daemon.py sets it)
        self.gateway = gateway  # the daemon's engine gateway (its broken() fails liveness)
        svc, d = settings.service, settings.deadlines
        self.listener_stall_s = svc.liveness_stall_ms / 1000
        task_bound_ms = 2 * d.xfer_stall_timeout_ms + d.worker_send_timeout_ms + 1000
        self.worker_stall_s = max(svc.liveness_stall_ms, task_bound_ms) / 1000

    def liveness(self) -> tuple[bool, str]:
        view, now = self.sender.view(locked=False), time.monotonic()
        stopping = view.draining
        stalls = _thread_stalls(
            [("listener", view.listener_progress, view.listener_alive)],
            now,
            self.listener_stall_s,
            stopping,
        )
        stalls += _thread_stalls(
            ((f"worker {i}", w.last_progress, w.alive) for i, w in enumerate(view.workers)),
            now,
            self.worker_stall_s,
            stopping,
        )
        broken = _broken(self.sender, self.gateway)
        if broken:
            stalls.append(broken)
        if stalls:
            return False, "; ".join(stalls)
        oldest = max((now - w.last_progress for w in view.workers), default=0.0)
        return True, (
            f"listener {now - view.listener_progress:.2f}s ago, "
            f"{len(view.workers)} workers, slowest {oldest:.2f}s ago"
        )

    def readiness(self, now: float | None = None) -> tuple[bool, list[str]]:
        """Every reason new work should go elsewhere now (``now``: judge at that instant)."""
        # The unlocked view: a probe must never wait on the registry lock.
        view = self.sender.view(locked=False)
        now = time.monotonic() if now is None else now
        failing: list[str] = []
        if view.draining:
            failing.append("draining")
        if not view.listener_alive:
            failing.append("listener thread not alive")
        failing += [
            f"worker {i} thread not alive" for i, w in enumerate(view.workers) if not w.alive
        ]
        limit = self.settings.limits.max_live_sessions
        if len(view.sessions) >= limit:
            failing.append(f"session table full (max_live_sessions={limit})")
        if view.aux_free == 0:  # every publish with aux would be refused busy
            failing.append(
                f"no free aux slot (0 free, aux_slots={self.settings.pool.aux_slots}:"
                " a publish with aux is refused busy)"
            )
        if view.dataplane_closed:
            failing.append("data plane closed (pool not registered)")
        count, oldest = _tx_pending(view)
        what = f"{count} slice{'' if count == 1 else 's'} queued or writing"
        failing += _work_problems(self.sender.journal, self.settings, now, count, oldest, what)
        failing += _slow_links(view, self.settings.dataplane.min_link_gbps)
        failing += _discovery_problems(self.registrar)
        return not failing, failing

    def pending_work(self) -> tuple[int, float]:
        """(slices queued or writing, when the oldest was attached), read without any lock."""
        return _tx_pending(self.sender.view(locked=False))

    def debug_state(self, limit: int = DEBUG_LIST_LIMIT) -> dict[str, Any]:
        """The sender's hang dump for ``/debug/state`` (its shape: debug_state.sender_state)."""
        return sender_state(self.sender, self.settings, limit)

    def snapshot(self) -> Snapshot:
        snd = self.sender
        view, now = snd.view(), time.monotonic()
        by_state = dict.fromkeys((s.value for s in TxState), 0)
        in_flight = dict.fromkeys(IN_FLIGHT_STATES["sender"], 0)
        in_flight["parked"] = view.parked_count
        oldest = 0.0
        for s in view.sessions:
            by_state[s.state.value] += 1
            if not s.ended or s.writes_in_flight > 0:
                oldest = max(oldest, now - s.created)
            for sl in s.slices:
                if sl.state is SliceState.QUEUED:
                    in_flight["queued"] += 1
                elif sl.state is SliceState.WRITING:
                    in_flight["writing"] += 1
                elif sl.state is SliceState.IN_DOUBT and sl.writes_in_flight > 0:
                    in_flight["in_doubt"] += 1
        retiring = {r.nixl_name for r in view.retiring}
        aux_total = self.settings.pool.aux_slots
        links: dict[str, float] = {}
        for link in view.links:
            if link.gbps is not None:
                label = snd.journal.label(link.peer)
                links[label] = min(link.gbps, links.get(label, link.gbps))
        return Snapshot(
            role="sender",
            stats=snd.stats.snapshot(),
            sessions_by_state=by_state,
            queue_depths=[w.queue_depth for w in view.workers],
            writes_in_flight=sum(s.writes_in_flight for s in view.sessions),
            peers=len(view.peers),
            durations_s=snd.stats.take_samples("slice_seconds"),
            in_flight=in_flight,
            oldest_in_flight_s=oldest,
            peer_cache={
                "peers": len(view.peers),
                "nixl_agents": len({p.nixl_name for p in view.peers} | retiring),
                "retiring_agents": len(retiring),
                "shared_dealers": view.shared_dealers,
                "worker_dealers": sum(w.dealers for w in view.workers),
            },
            aux_slots={"free": view.aux_free, "in_use": aux_total - view.aux_free},
            histograms=snd.journal.histograms(),
            gateway=_gateway_reading(self.gateway),
            links=links,
        )


def _slow_links(view: SenderView, floor: float | None) -> list[str]:
    """A ``link_slow`` reason for each link measured below ``dataplane.min_link_gbps``.

    A link whose figure is unknown (probing, failed, no scratch advertised) is no reason:
    its probe counter says why (``kvxferd_link_probes_total{result}``).
    """
    if floor is None:
        return []
    return [
        f"link_slow: {link.peer} measured {link.gbps:.3g} GB/s < min_link_gbps={floor:g}"
        f" ({link.transport}, receiver {link.receiver_id})"
        for link in view.links
        if link.gbps is not None and link.gbps < floor
    ]


class ReceiverProbe:
    """Liveness, readiness and metrics of a :class:`~kvxferd.transfer.receiver.Receiver`.

    The io thread's every wait is bounded by ``send_timeout_ms`` per send and a
    50 ms poll, so it is judged against ``liveness_stall_ms`` as it is.
    """

    def __init__(self, receiver: Receiver, settings: ReceiverSettings, gateway: Any = None) -> None:
        self.receiver = receiver
        self.settings = settings
        self.registrar: Any = None  # the daemon's discovery registrar (daemon.py sets it)
        self.gateway = gateway  # the daemon's engine gateway (its broken() fails liveness)
        self.io_stall_s = settings.service.liveness_stall_ms / 1000

    @property
    def draining(self) -> bool:
        return self.receiver.view(locked=False).draining

    def liveness(self) -> tuple[bool, str]:
        view, now = self.receiver.view(locked=False), time.monotonic()
        stalls = _thread_stalls(
            [("io thread", view.io_progress, view.io_alive)], now, self.io_stall_s, view.draining
        )
        broken = _broken(self.receiver, self.gateway)
        if broken:
            stalls.append(broken)
        if stalls:
            return False, "; ".join(stalls)
        return True, f"io thread {now - view.io_progress:.2f}s ago"

    def readiness(self, now: float | None = None) -> tuple[bool, list[str]]:
        """Every reason new work should go elsewhere now (``now``: judge at that instant)."""
        view = self.receiver.view(locked=False)  # without the lock, like SenderProbe
        now = time.monotonic() if now is None else now
        failing: list[str] = []
        if view.draining:
            failing.append("draining")
        if not view.io_alive:
            failing.append("io thread not alive")
        limit = self.settings.limits.max_fetches_in_flight
        if len(view.fetches) >= limit:
            failing.append(f"fetch table full (max_fetches_in_flight={limit})")
        if view.aux_free == 0:  # every fetch with aux would be refused busy
            failing.append(
                f"no free aux slot ({view.aux_free} free, {view.aux_quarantined} quarantined by"
                f" outcomes in doubt, aux_slots={self.settings.pool.aux_slots})"
            )
        if view.dataplane_closed:
            failing.append("data plane closed (pool not registered)")
        count, oldest = _rx_pending(view)
        what = f"{count} fetch{'' if count == 1 else 'es'} open"
        failing += _work_problems(self.receiver.journal, self.settings, now, count, oldest, what)
        failing += _discovery_problems(self.registrar)
        return not failing, failing

    def pending_work(self) -> tuple[int, float]:
        """(fetches asked for and not ended, when the oldest started), read without any lock."""
        return _rx_pending(self.receiver.view(locked=False))

    def debug_state(self, limit: int = DEBUG_LIST_LIMIT) -> dict[str, Any]:
        """The receiver's hang dump for ``/debug/state`` (its shape: debug_state.receiver_state)."""
        return receiver_state(self.receiver, self.settings, limit)

    def snapshot(self) -> Snapshot:
        rx = self.receiver
        view, now = rx.view(), time.monotonic()
        by_state = dict.fromkeys((s.value for s in RxState), 0)
        requested = fenced = 0
        oldest = 0.0
        for f in view.fetches:
            by_state[f.state.value] += 1
            if not f.ended:
                requested += 1
            elif f.fence is Fence.FENCED:
                fenced += 1
            else:
                continue
            oldest = max(oldest, now - f.started)
        ready = sum(1 for link in view.links if link.ready)
        down = sum(1 for link in view.links if link.down)
        free, quarantined = view.aux_free, view.aux_quarantined
        total = self.settings.pool.aux_slots
        return Snapshot(
            role="receiver",
            stats=rx.stats.snapshot(),
            sessions_by_state=by_state,
            queue_depths=[view.commands_queued],
            # A fetch in our table, or one in doubt, may still receive a write into its blocks.
            writes_in_flight=len(view.fetches) + len(view.in_doubt.tracked),
            peers=ready,
            durations_s=rx.stats.take_samples("fetch_seconds"),
            # in doubt: asked about or not any more
            in_flight={"requested": requested, "fenced": fenced, "in_doubt": view.in_doubt.count},
            oldest_in_flight_s=oldest,
            peer_cache={"links": len(view.links), "ready_links": ready, "down_links": down},
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


def _tx_pending(view: SenderView) -> tuple[int, float]:
    """(slices queued or writing, when the oldest was attached)."""
    count, oldest = 0, float("inf")
    for session in view.sessions:
        for sl in session.slices:
            if sl.state in (SliceState.QUEUED, SliceState.WRITING):
                count += 1
                oldest = min(oldest, sl.attached_at)
    return count, oldest


def _rx_pending(view: ReceiverView) -> tuple[int, float]:
    """(fetches asked for and not ended, when the oldest started)."""
    open_ = [f for f in view.fetches if not f.ended]
    return len(open_), min((f.started for f in open_), default=float("inf"))
