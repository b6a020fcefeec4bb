"""``/metrics``: a sender's or receiver's :class:`Snapshot` as Prometheus metric families.

The probe port (health.py) serves Prometheus text from one :class:`Snapshot`
per scrape, built in a worker thread with a deadline, so a slow scrape never
stalls the loop. Exported: every counter in stats.CATALOGUE (the service's and
the engine gateway's), the transfer-duration histogram, per-peer histograms
from the journal, gauges of what is in flight and held, and readiness as
``kvxferd_ready`` and ``kvxferd_not_ready{reason}``.

Label values are bounded: states, outcomes and reasons come from fixed enums,
workers are indices; never request ids.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvxferd.stats import specs_for
from kvxferd.transfer.journal import BUCKETS_S, Histogram

DURATION_BUCKETS_S = BUCKETS_S  # one bucket set for every duration histogram (journal.py)

# In-flight transfers by state, per role: every value exported, zero included (see Snapshot).
IN_FLIGHT_STATES: dict[str, tuple[str, ...]] = {
    "sender": ("parked", "queued", "writing", "in_doubt"),
    "receiver": ("requested", "fenced", "in_doubt"),
}
# What each role holds per peer (see Snapshot.peer_cache).
PEER_CACHE_KINDS: dict[str, tuple[str, ...]] = {
    "sender": ("peers", "nixl_agents", "retiring_agents", "shared_dealers", "worker_dealers"),
    "receiver": ("links", "ready_links", "down_links"),
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
    "discovery",
    "link_slow",
    "other",
)


def readiness_key(why: str) -> str:
    """The label of one readiness reason (its stable prefix, see health.py; "other" if unknown)."""
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
    if why.startswith("discovery: "):
        return "discovery"
    if why.startswith("link_slow: "):
        return "link_slow"
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
    # Sender: each link's measured GB/s by peer label (the journal's; "other": the slowest
    # of the peers past the label budget); links without a figure are left out.
    links: dict[str, float] = field(default_factory=dict)


class SnapshotSource(Protocol):
    """What :class:`SnapshotCollector` reads once per scrape (a probe, see health.Probe)."""

    def snapshot(self) -> Snapshot: ...


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


class SnapshotCollector(Collector):
    """Turns each :class:`Snapshot` into metric families; keeps the histogram cumulative."""

    def __init__(self, probe: SnapshotSource, build_info: dict[str, str]) -> None:
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
        if snap.role == "sender":
            links = GaugeMetricFamily(
                "kvxferd_link_gbps",
                "Sender: each link's GB/s as its last probe measured it (a WRITE into the"
                " receiver's scratch region at each new link); no series while unknown",
                labels=["peer"],
            )
            for peer, gbps in sorted(snap.links.items()):
                links.add_metric([peer], gbps)
            yield links
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
