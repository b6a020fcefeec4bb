"""``kvxferd bench --hetero``: heterogeneous TP next to equal TP, on real daemons, in one run.

A decode instance fetches each request from a prefill instance, the senders and
receivers real (in this process, real ZMQ on loopback, security off, real NIXL
moving the bytes), each rank declaring its topology record; the receivers fetch
naming the prefill instance (``sender_endpoints``) and the reshard mapping decides
which prefill rank each decode rank reads from::

    case   prefill TP  decode TP  what a decode rank reads
    -----  ----------  ---------  -------------------------------------------
    1P1D   1           1          the whole block from the one prefill rank
    1P2D   1           2          its half of the heads of the one prefill rank
    2P1D   2           1          half of the heads from each prefill rank

Every case has the same model geometry and moves the same bytes per request (the
request's whole KV cache, split over the ranks as each instance shards it). All
cases' daemons are started first; the repetitions then alternate the cases
(1P1D, 1P2D, 2P1D, 1P1D, ...) so that drift of the machine falls on all alike.
A repetition runs ``requests`` requests with up to ``window`` in flight: each
prefill rank publishes it (``expected_fetches`` from ``readers_for``), each decode
rank fetches it; the request ends when every decode rank's fetch is done (its
latency: from the first publish to the last decode rank's completion).

A request's blocks are scattered over the pool (a fixed random permutation, as an
engine's block allocator leaves them; ``scattered=False``: contiguous ids, which
lets 1P1D merge whole layers into one descriptor). The report names each case's
NIXL descriptors per piece (one decode rank's read of one prefill rank, as
``piece_descriptors`` builds and merges them): a heterogeneous case reads a slice
of every block, so it has more, smaller ones. And how the senders posted the KV
writes (``NixlDataPlane.posts``): ``piece`` through the piece's lists prepared at
REGISTER (indices per request, one entry per layer, block and range: the
``entries`` figure), ``descs`` with descriptors built per request (the fallback).

Before the timed repetitions each case runs one untimed request into destination
blocks filled with poison and compares every decode rank's blocks, byte for byte,
with the torch reference's reshard (the prefill pools hold the packed reference);
after them, one more such request is checked. The report gives each case's GB/s of
KV moved, requests/s and p50/p99 per request, and each heterogeneous case's ratio
against 1P1D.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from kvxferd.bench.workload import BenchError
from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.transfer.dataplane import NixlDataPlane
from kvxferd.transfer.receiver import Receiver, RxHandle
from kvxferd.transfer.reshard import piece_descriptors, plan_rank, prepared_indices, readers_for
from kvxferd.transfer.sender import Sender, TxHandle
from kvxferd.transfer.session import RxState, TxState
from kvxferd.transfer.topology import (
    LAYOUT_ORDER,
    LayoutKind,
    Topology,
    compat_hash,
    instance_ranks,
    make_topology,
)

ELEM = 2  # float16
CASES: dict[str, tuple[int, int]] = {"1P1D": (1, 1), "1P2D": (1, 2), "2P1D": (2, 1)}
BASELINE = "1P1D"
OFF = {"mode": "off"}  # loopback only (--curve-cost measures CURVE apart)


@dataclass(frozen=True)
class HeteroOptions:
    layers: int = 8
    heads: int = 8  # KV heads in total
    head_size: int = 128
    tokens_per_block: int = 16
    blocks: int = 16  # blocks per request
    layout: LayoutKind = "heads_major"
    scattered: bool = True  # a request's blocks scattered over the pool, as an engine's are
    requests: int = 64  # requests per repetition
    window: int = 4  # requests in flight
    reps: int = 7  # repetitions per case, alternating
    seed: int = 1
    timeout_s: float = 600.0  # bound on the whole run
    cases: tuple[str, ...] = field(default_factory=lambda: tuple(CASES))

    @property
    def request_bytes(self) -> int:
        """Bytes of one request's whole KV cache (what every case moves per request)."""
        return (
            self.layers
            * self.blocks
            * 2
            * self.heads
            * self.tokens_per_block
            * self.head_size
            * ELEM
        )


def _instance(o: HeteroOptions, tp: int) -> list[Topology]:
    compat = compat_hash(2, "bench-hetero", "float16", o.layers, o.heads, o.head_size, 2)
    return instance_ranks(
        make_topology(
            compat=compat,
            tp_rank=0,
            tp_size=tp,
            num_layers=o.layers,
            kv_heads_total=o.heads,
            head_size=o.head_size,
            tokens_per_block=o.tokens_per_block,
            elem_bytes=ELEM,
            kv_planes=2,
            layout=o.layout,
        )
    )


def _full(o: HeteroOptions) -> torch.Tensor:
    """One request's whole KV cache, [layers, planes, heads, tokens, head_size], random bits."""
    g = torch.Generator().manual_seed(o.seed)
    shape = (o.layers, 2, o.heads, o.blocks * o.tokens_per_block, o.head_size)
    return torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int16).view(torch.float16)


def packed(t: Topology, full: torch.Tensor, blocks: int) -> torch.Tensor:
    """What rank ``t`` holds of ``full``: [its layers, request block, block bytes] in its layout."""
    h0, h1 = t.head_range
    x = full[t.layer_begin : t.layer_end, :, h0:h1]
    x = x.reshape(x.shape[0], t.kv_planes, h1 - h0, blocks, t.tokens_per_block, t.head_size)
    dims = {"P": 1, "H": 2, "T": 4}  # [L, P, h, n, T, D] -> [L, n, <its order>, D]
    x = x.permute(0, 3, *(dims[d] for d in LAYOUT_ORDER[t.layout]), 5)
    return x.contiguous().view(torch.uint8).reshape(x.shape[0], blocks, -1)


def _pool(t: Topology, num_blocks: int) -> dict[str, Any]:
    return dict(
        num_layers=t.num_stage_layers,
        num_blocks=num_blocks,
        block_elems=t.block_bytes // ELEM,
        dtype="float16",
        aux_slots=2,
        aux_slot_bytes=64,
    )


class _Case:
    """One case's prefill senders and decode receivers, alive for the whole run."""

    def __init__(self, name: str, o: HeteroOptions, full: torch.Tensor) -> None:
        p_tp, d_tp = CASES[name]
        self.name, self.o = name, o
        self.prefill, self.decode = _instance(o, p_tp), _instance(o, d_tp)
        self.senders: list[Sender] = []
        self.receivers: list[Receiver] = []
        self.slots = o.window
        n = o.blocks
        order = torch.arange(n * self.slots)
        if o.scattered:
            order = torch.randperm(n * self.slots, generator=torch.Generator().manual_seed(o.seed))
        self.slot_ids = [order[k * n : (k + 1) * n].tolist() for k in range(self.slots)]
        try:
            for t in self.prefill:
                s = Sender(
                    load_sender_settings(
                        listen="tcp://127.0.0.1:0",
                        pool=_pool(t, n * self.slots),
                        num_threads=1,
                        security=OFF,
                    ),
                    topology=t,
                ).start()
                self.senders.append(s)
                view = s.pool.kv_bytes_view()
                ref = packed(t, full, n)
                for k in range(self.slots):
                    view[:, self.slot_ids[k]] = ref
            for d in self.decode:
                r = Receiver(
                    load_receiver_settings(pool=_pool(d, n * self.slots), security=OFF),
                    topology=d,
                ).start()
                self.receivers.append(r)
        except BaseException:
            self.close()
            raise
        self.want = [packed(d, full, n) for d in self.decode]
        self.readers = [readers_for(self.decode[0], t) for t in self.prefill]
        self.endpoints = [s.endpoint for s in self.senders]
        self.seq = 0
        self.descriptors, self.entries = self._descriptors()

    def _descriptors(self) -> tuple[list[int], list[int]]:
        """Per request, per piece (a decode rank's read of one prefill rank): NIXL descriptors
        built (merged) per request, and entries of the prepared lists posted instead."""
        ids = np.asarray(self.ids(0), dtype=np.int64)
        nb = self.o.blocks * self.slots
        pieces = [(d, p) for d in self.decode for p in plan_rank(d, self.prefill).pieces]
        return (
            [
                len(piece_descriptors(p, d, 0, nb, ids, 0, nb, ids, 0, self.o.layers)[0])
                for d, p in pieces
            ],
            [prepared_indices(p, nb, ids, 0, self.o.layers).size for _d, p in pieces],
        )

    def posts(self) -> dict[str, int]:
        """The senders' KV writes so far by how they were posted (``NixlDataPlane.posts``)."""
        out = {"blocks": 0, "piece": 0, "descs": 0}
        for s in self.senders:
            if isinstance(s.dataplane, NixlDataPlane):
                for k, n in s.dataplane.posts.items():
                    out[k] += n
        return out

    def ids(self, slot: int) -> list[int]:
        return self.slot_ids[slot]

    def issue(self, slot: int) -> tuple[float, list[TxHandle], list[RxHandle]]:
        """Publish the next request on every prefill rank and fetch it on every decode rank."""
        self.seq += 1
        rid = f"hetero-{self.name}-{self.seq}"
        ids = self.ids(slot)
        t0 = time.monotonic()
        txs = [
            s.publish(rid, ids, expected_fetches=k)
            for s, k in zip(self.senders, self.readers, strict=True)
        ]
        rxs = [
            r.fetch(rid, self.endpoints[0], ids, sender_endpoints=self.endpoints, want_aux=False)
            for r in self.receivers
        ]
        return t0, txs, rxs

    def finish(self, t0: float, txs: list[TxHandle], rxs: list[RxHandle], deadline: float) -> float:
        """Wait for the request's end; its latency in seconds. BenchError on a failure."""
        ends = []
        for rank, h in enumerate(rxs):
            out = h.wait(max(0.0, deadline - time.monotonic()))
            if out is None or out.state is not RxState.DONE:
                raise BenchError(f"hetero {self.name}: decode rank {rank} fetch ended {out}")
            ends.append(h.session.completion.set_at or time.monotonic())
            if not h.close(max(0.0, deadline - time.monotonic())):
                raise BenchError(f"hetero {self.name}: decode rank {rank} blocks not reusable")
        for rank, tx in enumerate(txs):
            end = tx.wait(max(0.0, deadline - time.monotonic()))
            if end is None or end.state is not TxState.COMPLETE:
                raise BenchError(f"hetero {self.name}: prefill rank {rank} request ended {end}")
        return max(ends) - t0

    def verified_request(self, deadline: float) -> None:
        """One untimed request into poisoned blocks; every decode byte against the reference."""
        for r in self.receivers:
            r.pool.kv_bytes_view()[:, self.ids(0)] = 0xA5
        self.finish(*self.issue(0), deadline)
        for rank, r in enumerate(self.receivers):
            got = r.pool.kv_bytes_view()[:, self.ids(0)]
            if not torch.equal(got, self.want[rank]):
                raise BenchError(
                    f"hetero {self.name}: decode rank {rank} differs from the reference"
                )

    def rep(self, deadline: float) -> dict[str, Any]:
        """``requests`` requests with up to ``window`` in flight: GB/s, requests/s, latencies."""
        o = self.o
        flight: list[tuple[float, list[TxHandle], list[RxHandle]]] = []
        lat: list[float] = []
        t = time.monotonic()
        for i in range(o.requests):
            if len(flight) == o.window:
                lat.append(self.finish(*flight.pop(0), deadline))
            flight.append(self.issue(i % self.slots))
        while flight:
            lat.append(self.finish(*flight.pop(0), deadline))
        wall = time.monotonic() - t
        lat.sort()
        return {
            "gbps": o.requests * o.request_bytes / wall / 1e9,
            "requests_per_s": o.requests / wall,
            "p50_ms": lat[len(lat) // 2] * 1000,
            "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
            "latencies_ms": [x * 1000 for x in lat],
        }

    def close(self) -> None:
        for r in self.receivers:
            r.shutdown()
        for s in self.senders:
            s.shutdown()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def run_hetero(o: HeteroOptions) -> dict[str, Any]:
    """Every case, repetitions alternating; medians per case and ratios against 1P1D."""
    if o.requests < 1 or o.reps < 1 or o.window < 1 or o.blocks < 1:
        raise BenchError("hetero: requests, reps, window and blocks must be >= 1")
    if BASELINE not in o.cases or any(c not in CASES for c in o.cases):
        raise BenchError(f"hetero: cases must include {BASELINE} and be among {list(CASES)}")
    if o.heads % 2:
        raise BenchError("hetero: heads must be even (TP2 splits them)")
    deadline = time.monotonic() + o.timeout_s
    full = _full(o)
    cases: dict[str, _Case] = {}
    try:
        for name in o.cases:
            cases[name] = _Case(name, o, full)
        verified = {name: 0 for name in o.cases}
        for name, c in cases.items():
            c.verified_request(deadline)  # also the warm-up: REGISTER, prepared descriptors
            verified[name] += 1
        reps: dict[str, list[dict[str, Any]]] = {name: [] for name in o.cases}
        for _ in range(o.reps):
            for name, c in cases.items():
                reps[name].append(c.rep(deadline))
        for name, c in cases.items():
            c.verified_request(deadline)
            verified[name] += 1
        posts = {name: c.posts() for name, c in cases.items()}
    finally:
        for c in cases.values():
            c.close()
    figures: dict[str, dict[str, Any]] = {}
    for name, runs in reps.items():
        lat = [x for r in runs for x in r["latencies_ms"]]
        p_tp, d_tp = CASES[name]
        figures[name] = {
            "prefill_tp": p_tp,
            "decode_tp": d_tp,
            "gbps": statistics.median(r["gbps"] for r in runs),
            "requests_per_s": statistics.median(r["requests_per_s"] for r in runs),
            "p50_ms": _pct(lat, 0.5),
            "p99_ms": _pct(lat, 0.99),
            "verified_requests": verified[name],
            "descriptors_per_piece": cases[name].descriptors,
            "entries_per_piece": cases[name].entries,
            "posts": posts[name],
        }
    base = figures[BASELINE]
    ratio = {
        name: {
            "gbps": f["gbps"] / base["gbps"],
            "requests_per_s": f["requests_per_s"] / base["requests_per_s"],
            "p50": f["p50_ms"] / base["p50_ms"],
            "p99": f["p99_ms"] / base["p99_ms"],
        }
        for name, f in figures.items()
        if name != BASELINE
    }
    return {
        "kind": "hetero",
        "options": {**asdict(o), "cases": list(o.cases)},
        "request_bytes": o.request_bytes,
        "baseline": BASELINE,
        "cases": figures,
        "ratio": ratio,
        "reps": {
            name: [{k: v for k, v in r.items() if k != "latencies_ms"} for r in runs]
            for name, runs in reps.items()
        },
        "load_avg": list(os.getloadavg()),
        "cpus": os.cpu_count(),
    }


def format_hetero(doc: dict[str, Any]) -> str:
    """The report: one line per case, then each heterogeneous case over 1P1D."""
    o = doc["options"]
    lines = [
        f"Heterogeneous TP on real daemons over NIXL: {o['layers']} layers, {o['heads']} KV "
        f"heads x {o['head_size']}, {o['tokens_per_block']} tokens/block, {o['layout']}; "
        f"{doc['request_bytes'] / 2**20:.2f} MiB per request ({o['blocks']} blocks); "
        f"{o['requests']} requests x {o['reps']} alternating reps, window {o['window']}; "
        f"load {doc['load_avg'][0]:.2f} on {doc['cpus']} CPUs",
        f"{'case':<14}{'GB/s':>9}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'verified':>10}"
        "  descriptors per piece (built) / entries (prepared); writes posted by",
    ]
    for name, f in doc["cases"].items():
        posted = ", ".join(f"{k} {n}" for k, n in f["posts"].items() if n)
        lines.append(
            f"{name:<14}{f['gbps']:>9.3f}{f['requests_per_s']:>10.1f}{f['p50_ms']:>10.2f}"
            f"{f['p99_ms']:>10.2f}{f['verified_requests']:>10}  "
            f"{' + '.join(str(n) for n in f['descriptors_per_piece'])} / "
            f"{' + '.join(str(n) for n in f['entries_per_piece'])}; {posted}"
        )
    for name, r in doc["ratio"].items():
        label = f"{name}/{doc['baseline']}"
        lines.append(
            f"{label:<14}{r['gbps']:>8.2f}x{r['requests_per_s']:>9.2f}x{r['p50']:>9.2f}x"
            f"{r['p99']:>9.2f}x"
        )
    return "\n".join(lines) + "\n"
