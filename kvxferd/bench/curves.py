"""``kvxferd bench --curves``: how a request's cost grows, each point against raw NIXL in the same run.

Four axes (issue 12, item 4), every point a workload of its own run by the
bench's children (:mod:`kvxferd.bench.runner`), kvxferd's path and tuned raw
NIXL (prepared lists, :mod:`kvxferd.bench.nixl_path`) alternating::

    axis          what varies                    path     fixed
    ------------  -----------------------------  -------  -----------------------------------------
    inflight      requests in flight 1..64        engine   16 KiB x 1 block, daemons + kvxferd.engine.client
    workers       sender worker threads 1..8      library  4 KiB x 1 at 16 in flight (small) and
                                                           256 KiB x 16 = 4 MiB at 4 in flight (bulk)
    blocks        blocks per request 1..65 536    library  4 KiB blocks, 1 layer, 1 in flight, pool
                                                           of max(16 384, blocks) blocks per side
    peers         receivers per sender 1..64      library  4 KiB x 1, 4 in flight per receiver; the
                                                           receivers live in at most 4 rx processes
                                                           (receiver k in process k % 4), one thread
                                                           per receiver

Each point runs a fixed number of requests (``requests`` below), a warm-up and
``reps`` repetitions per path; points not begun within ``budget_s`` are skipped
and marked so. ``prep`` times the library's own preparation of one request
(``check_blocks`` of both block lists, the prepared-list indices, NIXL's
``make_prepped_xfer``; no transfer) with ``time.perf_counter_ns`` over many
repetitions, in this process.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import numpy as np

from kvxferd.bench.report import dataplane_description, machine_info
from kvxferd.bench.runner import _Runner
from kvxferd.bench.workload import KiB, MiB, Options, Path_, Workload
from kvxferd.config import DataPlaneSettings

AXES = ("inflight", "workers-small", "workers-bulk", "blocks", "peers")
PEER_PROCS = 4  # rx processes that host the peers axis's receivers
PREP_BLOCKS = 1000
PREP_TARGET_US = 100.0  # issue 12: preparing a 1000-block request under 0.1 ms
TRTLLM_PREP_MS = 0.424  # TensorRT-LLM PR #12273, prepare_args mean (median 0.385 ms)
LINEAR_TOLERANCE = 0.25  # a point further than this from the affine fit is "not linear"


@dataclass(frozen=True)
class CurveOptions:
    """The points of each axis, the requests per point, and the bounds of the run."""

    inflight: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    workers: tuple[int, ...] = (1, 2, 4, 8)
    blocks: tuple[int, ...] = (1, 4, 16, 256, 4096, 65536)
    peers: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    reps: int = 5
    engine_requests: int = 400  # inflight axis: per point and repetition (at least 4 x inflight)
    small_requests: int = 2000  # workers axis, small requests
    bulk_requests: int = 64  # workers axis, 4 MiB requests
    blocks_bytes: int = 256 * MiB  # blocks axis: bytes per repetition, 3 to 300 requests
    peer_requests: int = 800  # peers axis: all receivers together (at least 8 each)
    peer_procs: int = PEER_PROCS  # rx processes hosting the peers axis's receivers
    prep_reps: int = 3000
    prep_layers: tuple[int, ...] = (1, 8, 32)
    budget_s: float = 300.0  # points not begun by then are skipped
    timeout_s: float = 1200.0  # the whole run fails past this
    seed: int = 1
    child_module: str = "kvxferd"
    dataplane: DataPlaneSettings = field(default_factory=DataPlaneSettings)


LIB: tuple[Path_, ...] = ("kvxferd", "nixl")  # the library axes: kvxferd and tuned raw NIXL


def curve_points(c: CurveOptions) -> list[tuple[str, int, Workload]]:
    """(axis, x, workload) of every point, in the order they run."""
    W = Workload
    pts: list[tuple[str, int, Workload]] = []
    for n in c.inflight:
        w = W(
            f"c-inflight-{n}",
            16,
            1,
            inflight=n,
            engine=True,
            only=("engine", "nixl"),
            pool_blocks=4096,  # one pool for every point: the daemons are kept between them
            keep_daemons=True,
        )
        pts.append(("inflight", n, _with_requests(w, max(4 * n, c.engine_requests))))
    for t in c.workers:
        w = W(f"c-workers-4k-t{t}", 4, 1, threads=t, inflight=16, only=LIB)
        pts.append(("workers-small", t, _with_requests(w, c.small_requests)))
    for t in c.workers:
        w = W(f"c-workers-4m-t{t}", 256, 16, threads=t, inflight=4, only=LIB)
        pts.append(("workers-bulk", t, _with_requests(w, c.bulk_requests)))
    for b in c.blocks:
        w = W(f"c-blocks-{b}", 4, b, inflight=1, pool_blocks=max(16384, b), only=LIB)
        n = min(300, max(3, math.ceil(c.blocks_bytes / (b * 4 * KiB))))
        pts.append(("blocks", b, _with_requests(w, n)))
    for n in c.peers:
        w = W(
            f"c-peers-{n}",
            4,
            1,
            receivers=n,
            inflight=4,
            pool_blocks=64,
            rx_procs=c.peer_procs,
            only=LIB,
        )
        pts.append(("peers", n, _with_requests(w, max(8, c.peer_requests // n))))
    return pts


def _with_requests(w: Workload, n: int) -> Workload:
    return Workload(**{**asdict(w), "requests": n})


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_curves(c: CurveOptions, progress: IO[str] | None = None) -> dict[str, Any]:
    """Measure the preparation figures and every point of every axis; the ``--json`` document."""
    out = progress or sys.stderr
    started, t0, load_start = time.time(), time.monotonic(), _load()
    out.write(f"curves: timing the preparation of a {PREP_BLOCKS}-block request\n")
    prep = measure_prep(c.prep_layers, c.prep_reps, c.seed)
    points = curve_points(c)
    opts = Options(
        preset="curves",
        workloads=tuple(w for _, _, w in points),
        reps=c.reps,
        dataplane=c.dataplane,
        seed=c.seed,
        child_module=c.child_module,
        timeout_s=c.timeout_s,
    )
    results = _Runner(opts, out).run_workloads(skip_after_s=c.budget_s)
    axes: dict[str, Any] = {a: {"points": []} for a in AXES}
    for (axis, x, w), r in zip(points, results, strict=True):
        axes[axis]["points"].append(_point(x, w, r))
    for axis in AXES:
        axes[axis].update(AXIS_TEXT[axis])
    doc = {
        "version": 1,
        "started_unix": started,
        "elapsed_s": time.monotonic() - t0,
        "load_start": load_start,
        "load_end": _load(),
        "machine": machine_info(),
        "dataplane": c.dataplane.model_dump(),
        "dataplane_text": dataplane_description(c.dataplane),
        "options": {k: v for k, v in asdict(c).items() if k != "dataplane"},
        "axes": axes,
        "prep": prep,
    }
    doc["targets"] = curve_targets(doc)
    return doc


AXIS_TEXT: dict[str, dict[str, str]] = {
    "inflight": {
        "x": "requests in flight",
        "path": "engine",
        "what": "engine path (daemons + kvxferd.engine.client), 16 KiB x 1 block",
    },
    "workers-small": {
        "x": "sender worker threads",
        "path": "kvxferd",
        "what": "library path, 4 KiB x 1 block, 16 in flight",
    },
    "workers-bulk": {
        "x": "sender worker threads",
        "path": "kvxferd",
        "what": "library path, 256 KiB x 16 blocks = 4 MiB, 4 in flight",
    },
    "blocks": {
        "x": "blocks per request",
        "path": "kvxferd",
        "what": "library path, 4 KiB blocks, 1 layer, 1 in flight",
    },
    "peers": {
        "x": "receivers per sender",
        "path": "kvxferd",
        "what": f"library path, 4 KiB x 1 block, 4 in flight per receiver, receivers in "
        f"at most {PEER_PROCS} processes",
    },
}


def _point(x: int, w: Workload, r: dict[str, Any] | None) -> dict[str, Any]:
    """One point: per path requests/s, GB/s, p50/p99, and the per-block cost."""
    if r is None:
        return {"x": x, "name": w.name, "label": w.label(), "skipped": True}
    paths: dict[str, Any] = {}
    for name, p in r["paths"].items():
        rps = p["rps"]["median"]
        paths[name] = {
            "rps": rps,
            "rps_min": p["rps"]["min"],
            "rps_max": p["rps"]["max"],
            "gbps": p["gbps"]["median"],
            "gbps_min": p["gbps"]["min"],
            "gbps_max": p["gbps"]["max"],
            "p50_ms": p["latency_ms"]["p50"],
            "p99_ms": p["latency_ms"]["p99"],
            # receivers x requests/s is what the rate counts; a request is `blocks` blocks
            "us_per_request": 1e6 / rps if rps > 0 else None,
            "us_per_block": 1e6 / (rps * w.blocks) if rps > 0 else None,
            "p50_us": p["latency_ms"]["p50"] * 1000,
            "p50_us_per_block": p["latency_ms"]["p50"] * 1000 / w.blocks,
            "failures": p["failures"],
            "verified": p["verified"],
        }
        for key in ("tx_cpu_us_per_request", "rx_cpu_us_per_request"):  # where the CPU went
            if key in p:
                paths[name][key] = p[key]
    mine = paths.get(w.kvxferd_path, {})
    base = paths.get("nixl", {})
    out: dict[str, Any] = {
        "x": x,
        "name": w.name,
        "label": w.label(),
        "skipped": False,
        "requests_per_rep": r["requests_per_rep"] * w.receivers,
        "request_bytes": w.request_bytes,
        "pool_blocks": r["pool_blocks"],
        "paths": paths,
        "ratio_rps_nixl": mine["rps"] / base["rps"] if base.get("rps") else None,
    }
    if "daemon_cpu_us_per_request" in r:
        out["daemon_cpu_us_per_request"] = r["daemon_cpu_us_per_request"]["median"]
    return out


def measure_prep(layers: tuple[int, ...], reps: int, seed: int) -> list[dict[str, Any]]:
    """Time the sender's own preparation of a 1000-block request, without the transfer.

    What the library runs per request before NIXL moves a byte: ``check_blocks`` of the
    published source ids and of the receiver's destination ids, the two index arrays into
    the prepared lists (``prepped_indices``), and ``make_prepped_xfer``. Two NIXL agents in
    this process, one pool each (1 KiB blocks: the size does not enter the preparation);
    the handle is released outside the timed span. One figure per layer count (a request
    of ``b`` blocks over ``L`` layers is ``b x L`` descriptors) and one with contiguous ids.
    """
    from kvxferd.config import PoolSettings
    from kvxferd.transfer.dataplane import NixlDataPlane
    from kvxferd.transfer.layout import check_blocks, prepped_indices
    from kvxferd.transfer.pool import KvPool

    out: list[dict[str, Any]] = []
    cases = [(n, True) for n in layers] + [(1, False)]
    for nl, scattered in cases:
        nb = 4 * PREP_BLOCKS
        ps = PoolSettings(
            num_layers=nl, num_blocks=nb, block_elems=1024, dtype="uint8", aux_slots=1
        )
        pools = [KvPool(ps, owner=f"bench-prep{j}") for j in range(2)]
        dps: list[NixlDataPlane] = []
        try:
            dps = [
                NixlDataPlane(f"bench-prep{j}-{os.getpid()}", DataPlaneSettings(), pools[j])
                for j in range(2)
            ]
            peer = dps[0].add_peer(dps[1].metadata())
            lay = pools[1].layout
            if not dps[0].prepare_peer(peer, lay, pools[1].kv_base, "DRAM", 0):
                raise RuntimeError("no prepared list for the peer")
            agent, local = dps[0]._agent, dps[0]._paths[0].local
            lists = dps[0]._lists.current[(peer, 0)]
            remote, dst_nb = lists.remote, lists.num_blocks
            rng = np.random.default_rng([seed, nl, 5])
            ns = np.zeros(reps, dtype=np.int64)
            parts = np.zeros((reps, 3), dtype=np.int64)
            for i in range(reps + 50):  # the first 50: warm-up, not counted
                if scattered:
                    src = rng.permutation(nb)[:PREP_BLOCKS].astype(np.int64)
                    dst = rng.permutation(nb)[:PREP_BLOCKS].astype(np.int64)
                else:
                    a, b = rng.integers(0, nb - PREP_BLOCKS, size=2)
                    src = np.arange(a, a + PREP_BLOCKS, dtype=np.int64)
                    dst = np.arange(b, b + PREP_BLOCKS, dtype=np.int64)
                t0 = time.perf_counter_ns()
                check_blocks(pools[0].layout, src, "published blocks")
                check_blocks(lay, dst, "destination blocks")
                t1 = time.perf_counter_ns()
                li = prepped_indices(src, 0, nl, nb)
                ri = prepped_indices(dst, 0, nl, dst_nb)
                t2 = time.perf_counter_ns()
                h = agent.make_prepped_xfer("WRITE", local, li, remote, ri)
                t3 = time.perf_counter_ns()
                agent.release_xfer_handle(h)
                if i >= 50:
                    ns[i - 50] = t3 - t0
                    parts[i - 50] = (t1 - t0, t2 - t1, t3 - t2)
        finally:
            for dp in dps:
                dp.close()
            for p in pools:
                p.close()
        us = ns / 1000
        out.append(
            {
                "blocks": PREP_BLOCKS,
                "layers": nl,
                "descriptors": PREP_BLOCKS * nl,
                "ids": "scattered" if scattered else "contiguous",
                "reps": reps,
                "median_us": float(np.median(us)),
                "p99_us": float(np.percentile(us, 99)),
                "min_us": float(us.min()),
                "check_blocks_median_us": float(np.median(parts[:, 0])) / 1000,
                "indices_median_us": float(np.median(parts[:, 1])) / 1000,
                "make_prepped_xfer_median_us": float(np.median(parts[:, 2])) / 1000,
            }
        )
    return out


def affine_fit(xs: list[float], ts: list[float]) -> tuple[float, float]:
    """``t = a + c x`` fitted to relative error (each point weighs alike): ``(a, c)``."""
    x, t = np.asarray(xs, dtype=float), np.asarray(ts, dtype=float)
    m = np.stack([1 / t, x / t], axis=1)
    (a, c), *_ = np.linalg.lstsq(m, np.ones_like(t), rcond=None)
    return float(a), float(c)


def curve_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 12's three cost-growth targets, met or not (None when their points did not run)."""
    axes, out = doc["axes"], []

    def ran(axis: str) -> list[dict[str, Any]]:
        return [p for p in axes[axis]["points"] if not p["skipped"]]

    # N workers never slower than 1: kvxferd's rate at every worker count against 1 worker.
    details, met = [], True
    any_run = False
    for axis, what in (("workers-small", "req/s"), ("workers-bulk", "GB/s")):
        pts = ran(axis)
        one = next((p for p in pts if p["x"] == 1), None)
        if one is None or len(pts) < 2:
            continue
        any_run = True
        key = "rps" if what == "req/s" else "gbps"
        base = one["paths"]["kvxferd"][key]
        rel = {p["x"]: p["paths"]["kvxferd"][key] / base for p in pts}
        met = met and all(v >= 1.0 for v in rel.values())
        details.append(
            f"{axis}: "
            + ", ".join(f"{x} thr {v:.2f}x" for x, v in rel.items())
            + f" of 1 thr ({base:.3g} {what})"
        )
    out.append(
        {
            "target": "workers",
            "text": "N workers never slower than 1 (kvxferd rate at N workers / at 1)",
            "met": met if any_run else None,
            "detail": "; ".join(details) or "not run",
        }
    )

    pts = ran("blocks")
    if len(pts) >= 2:
        xs = [float(p["x"]) for p in pts]
        fits: dict[str, dict[str, Any]] = {}
        for path in ("kvxferd", "nixl"):
            ts = [p["paths"][path]["p50_us"] for p in pts]  # one in flight: the request's time
            a, c = affine_fit(xs, ts)
            dev = [t / (a + c * x) - 1 for x, t in zip(xs, ts, strict=True)]
            fits[path] = {"fixed_us": a, "us_per_block": c, "deviation": dev}
        doc["blocks_fit"] = fits
        dev = fits["kvxferd"]["deviation"]
        worst = int(np.argmax(np.abs(dev)))
        met_lin: bool | None = all(abs(d) <= LINEAR_TOLERANCE for d in dev)
        f = fits["kvxferd"]
        ratio = f["us_per_block"] / fits["nixl"]["us_per_block"]
        detail = (
            f"kvxferd {f['fixed_us']:.0f} us + {f['us_per_block']:.3f} us/block (raw NIXL "
            f"{fits['nixl']['fixed_us']:.0f} us + {fits['nixl']['us_per_block']:.3f}; per-block "
            f"{ratio:.2f}x); largest deviation from the fit {dev[worst]:+.0%} at "
            f"{int(xs[worst])} blocks"
        )
    else:
        met_lin, detail = None, "not run"
    out.append(
        {
            "target": "blocks-linear",
            "text": "cost linear in blocks per request, 1 to 65 536 (p50 time of a request "
            f"at 1 in flight within {LINEAR_TOLERANCE:.0%} of a + c x blocks at every point)",
            "met": met_lin,
            "detail": detail,
        }
    )

    prep = [p for p in doc["prep"] if p["layers"] == 1 and p["ids"] == "scattered"]
    if prep:
        p = prep[0]
        met_prep: bool | None = p["median_us"] < PREP_TARGET_US
        detail = (
            f"median {p['median_us']:.1f} us, p99 {p['p99_us']:.1f} us (1 layer, scattered ids); "
            + ", ".join(
                f"{q['layers']} layers {q['ids']} {q['median_us']:.1f} / {q['p99_us']:.1f} us"
                for q in doc["prep"]
                if q is not p
            )
            + f"; TensorRT-LLM {TRTLLM_PREP_MS} ms"
        )
    else:
        met_prep, detail = None, "not run"
    out.append(
        {
            "target": "prep-1000",
            "text": f"preparing a {PREP_BLOCKS}-block request < {PREP_TARGET_US / 1000} ms",
            "met": met_prep,
            "detail": detail,
        }
    )
    return out


def format_curves(doc: dict[str, Any]) -> str:
    """Markdown tables: one per axis, the preparation figures, the targets."""
    lines = [
        f"kvxferd bench --curves: {doc['elapsed_s']:.0f} s, load average "
        f"{doc['load_start'][0]} at the start, {doc['load_end'][0]} at the end",
        f"data plane of kvxferd: {doc['dataplane_text']}; raw NIXL tuned, prepared lists",
    ]
    for axis in AXES:
        ax = doc["axes"][axis]
        mine = ax["path"]
        lines += [
            "",
            f"{axis}: {ax['what']}",
            "",
            f"| {ax['x']} | {mine} req/s | NIXL req/s | {mine}/NIXL | {mine} GB/s "
            f"| {mine} p50 / p99 ms | NIXL p50 / p99 ms | {mine} us/block | NIXL us/block |",
            "|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for p in ax["points"]:
            if p["skipped"]:
                lines.append(f"| {p['x']} | skipped (time budget) | | | | | | | |")
                continue
            k, n = p["paths"][mine], p["paths"]["nixl"]
            flag = "" if k["verified"] and not k["failures"] else " (!)"
            lines.append(
                f"| {p['x']} | {k['rps']:.0f}{flag} | {n['rps']:.0f} | {p['ratio_rps_nixl']:.3f} "
                f"| {k['gbps']:.3f} | {k['p50_ms']:.3f} / {k['p99_ms']:.3f} "
                f"| {n['p50_ms']:.3f} / {n['p99_ms']:.3f} | {k['us_per_block']:.3f} "
                f"| {n['us_per_block']:.3f} |"
            )
        if mine == "kvxferd":
            lines += [
                "",
                f"{axis}: CPU per request (us) of the sender process by thread; rx = the "
                "receiving processes",
                "",
            ]
            lines += [
                f"- {p['x']}: rx {p['paths'][mine].get('rx_cpu_us_per_request', 0):.0f}; "
                + ", ".join(
                    f"{n} {v:.0f}"
                    for n, v in sorted(
                        p["paths"][mine].get("tx_cpu_us_per_request", {}).items(),
                        key=lambda kv: -kv[1],
                    )
                    if v >= 1
                )
                for p in ax["points"]
                if not p["skipped"]
            ]
    lines += [
        "",
        f"preparing a {PREP_BLOCKS}-block request (check_blocks x2 + indices + make_prepped_xfer):",
        "",
        "| layers | ids | descriptors | median us | p99 us | check_blocks | indices "
        "| make_prepped_xfer |",
        "|--:|---|--:|--:|--:|--:|--:|--:|",
    ]
    for q in doc["prep"]:
        lines.append(
            f"| {q['layers']} | {q['ids']} | {q['descriptors']} | {q['median_us']:.1f} "
            f"| {q['p99_us']:.1f} | {q['check_blocks_median_us']:.1f} "
            f"| {q['indices_median_us']:.1f} | {q['make_prepped_xfer_median_us']:.1f} |"
        )
    lines += ["", "| target | met | measured |", "|---|---|---|"]
    for t in doc["targets"]:
        met = {True: "yes", False: "NO", None: "not run"}[t["met"]]
        lines.append(f"| {t['text']} | {met} | {t['detail']} |")
    return "\n".join(lines) + "\n"


__all__ = [
    "AXES",
    "CurveOptions",
    "curve_points",
    "curve_targets",
    "format_curves",
    "measure_prep",
    "run_curves",
]
