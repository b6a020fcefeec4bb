"""The report: each workload's figures, the targets met or not, the machine, the Markdown tables."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict
from importlib import metadata
from typing import TYPE_CHECKING, Any

import numpy as np

from kvxferd.bench.plan import Plan
from kvxferd.bench.workload import Options, _size
from kvxferd.config import DataPlaneSettings

if TYPE_CHECKING:
    from kvxferd.bench.runner import Rep


def _spread(values: Sequence[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max())}


def summarize_workload(plan: Plan, reps: dict[str, list[Rep]]) -> dict[str, Any]:
    w = plan.workload
    paths: dict[str, Any] = {}
    for path, rs in reps.items():
        lat_ms = np.asarray([x for r in rs for x in r.lat_us], dtype=float) / 1000
        if lat_ms.size == 0:
            lat_ms = np.asarray([float("nan")])
        paths[path] = {
            "gbps": _spread([r.gbps for r in rs]),
            "rps": _spread([r.rps for r in rs]),
            "latency_ms": {
                "p50": float(np.percentile(lat_ms, 50)),
                "p99": float(np.percentile(lat_ms, 99)),
                "mean": float(lat_ms.mean()),
                "max": float(lat_ms.max()),
            },
            "failures": sum(r.failures for r in rs),
            "verified": all(r.verified for r in rs),
            "reps": [
                {
                    k: v
                    for k, v in asdict(r).items()
                    if k not in ("lat_us", "sender_stats", "tx_threads_cpu_s")
                }
                | {"gbps": r.gbps, "rps": r.rps}
                for r in rs
            ],
        }
        requests = sum(r.requests for r in rs)
        if requests and any(r.tx_threads_cpu_s for r in rs):  # the sender process, by thread
            names = sorted({n for r in rs for n in r.tx_threads_cpu_s})
            paths[path]["tx_cpu_us_per_request"] = {
                n: sum(r.tx_threads_cpu_s.get(n, 0.0) for r in rs) / requests * 1e6 for n in names
            }
        if requests and any(r.rx_cpu_s for r in rs):  # the receiving processes, all threads
            paths[path]["rx_cpu_us_per_request"] = sum(r.rx_cpu_s for r in rs) / requests * 1e6
        if rs and rs[-1].sender_stats:  # cumulative over the workload's repetitions
            paths[path]["sender_stats"] = rs[-1].sender_stats
        if not paths[path]["verified"]:
            paths[path]["detail"] = "; ".join(r.detail for r in rs if r.detail)

    def ratio(a: str, b: str) -> float | None:
        if a not in paths or b not in paths:
            return None
        den = paths[b]["gbps"]["median"]
        return paths[a]["gbps"]["median"] / den if den > 0 else float("inf")

    kx = w.kvxferd_path
    out = {
        **asdict(w),
        "block_bytes": w.block_bytes,
        "request_bytes": w.request_bytes,
        "descs_per_request": plan.descs_per_request(),
        "requests_per_rep": plan.requests,
        "pool_blocks": plan.num_blocks,
        "paths": paths,
        "ratio_kvxferd_nixl": ratio(kx, "nixl"),
        "ratio_kvxferd_nixl_default": ratio(kx, "nixl-default"),
        "ratio_kvxferd_zmq": ratio(kx, "zmq"),
    }
    if w.engine:
        rs = reps["engine"]
        out["daemon_cpu_us_per_request"] = _spread(
            [r.daemon_cpu_s / r.requests * 1e6 if r.requests else float("nan") for r in rs]
        )
        out["engine_cpu_us_per_request"] = _spread(
            [r.engine_cpu_s / r.requests * 1e6 if r.requests else float("nan") for r in rs]
        )
    return out


def evaluate_targets(workloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target of the issue, met or not (None when this run had no workload for it)."""

    def tagged(tag: str) -> list[dict[str, Any]]:
        return [w for w in workloads if w["target"] == tag]

    out: list[dict[str, Any]] = []

    def ratio_target(key: str, tag: str, text: str, bound: float) -> None:
        ws = tagged(tag)
        out.append(
            {
                "target": key,
                "text": text,
                "met": all(w["ratio_kvxferd_nixl"] >= bound for w in ws) if ws else None,
                "detail": ", ".join(f"{w['name']} {w['ratio_kvxferd_nixl']:.2f}x" for w in ws)
                or "not run",
            }
        )

    library = [w for w in workloads if not w.get("engine")]
    engine = [w for w in workloads if w.get("engine")]
    _engine_targets(engine, out)
    small = [w for w in library if w["name"].startswith("small-") and not w["rate"]]
    out.append(
        {
            "target": "small-vs-nixl",
            "text": "library path, small requests: kvxferd >= 0.5x prepared raw NIXL requests/s",
            "met": all(w["ratio_kvxferd_nixl"] >= 0.5 for w in small) if small else None,
            "detail": ", ".join(f"{w['name']} {w['ratio_kvxferd_nixl']:.3f}x" for w in small)
            or "not run",
        }
    )
    ratio_target(
        "bulk", "bulk", "64 MiB requests of >= 256 KiB blocks: kvxferd >= 0.95x raw NIXL", 0.95
    )
    ratio_target(
        "scatter16k",
        "scatter16k",
        "64 MiB of 16 KiB scattered blocks (one descriptor per block): kvxferd >= 1.0x raw NIXL",
        1.0,
    )
    # The one-block target: latency of a request on its own (one in flight) and the
    # rate with 16 in flight. The stricter reading, the same latency bounds while 5000 req/s
    # are offered, is reported as a target of its own.
    rate, alone, paced = tagged("small4k-rate"), tagged("small4k-latency"), tagged("small4k-loaded")

    def latency_ok(lat: dict[str, float]) -> bool:
        return lat["p50"] < 0.5 and lat["p99"] < 2.0

    if rate and alone:
        rps = rate[0]["paths"]["kvxferd"]["rps"]["median"]
        lat = alone[0]["paths"]["kvxferd"]["latency_ms"]
        met: bool | None = latency_ok(lat) and rps >= 5000
        detail = (
            f"one in flight ({alone[0]['name']}): p50 {lat['p50']:.3f} ms, p99 {lat['p99']:.3f} ms; "
            f"{rps:.0f} req/s closed loop with 16 in flight ({rate[0]['name']})"
        )
    else:
        met, detail = None, "not run"
    out.append(
        {
            "target": "small4k",
            "text": "4 KiB single-block requests: p50 < 0.5 ms, p99 < 2 ms; >= 5000 req/s with 16 in flight",
            "met": met,
            "detail": detail,
        }
    )
    if paced:
        lat = paced[0]["paths"]["kvxferd"]["latency_ms"]
        met, detail = (
            latency_ok(lat),
            f"p50 {lat['p50']:.3f} ms, p99 {lat['p99']:.3f} ms at {paced[0]['rate']:g} req/s "
            f"offered, up to 16 in flight ({paced[0]['name']})",
        )
    else:
        met, detail = None, "not run"
    out.append(
        {
            "target": "small4k-loaded",
            "text": "the same latency bounds while 5000 req/s of 4 KiB requests are offered",
            "met": met,
            "detail": detail,
        }
    )
    behind = [w["name"] for w in library if w["ratio_kvxferd_zmq"] <= 1.0]
    out.append(
        {
            "target": "zmq",
            "text": "kvxferd ahead of the ZMQ-copy path on every workload",
            "met": not behind if library else None,
            "detail": ("behind on " + ", ".join(behind)) if behind else "ahead on all",
        }
    )
    return out


ENGINE_P50_MS = 0.5  # at one in flight
ENGINE_RPS = 5000.0  # at 16 in flight
ENGINE_CPU_US = 200.0  # daemon CPU per request, every in-flight depth


def _engine_targets(engine: list[dict[str, Any]], out: list[dict[str, Any]]) -> None:
    """Issue 12's engine-path targets, each with its value and the ratio to prepared raw NIXL."""

    def at(n: int) -> list[dict[str, Any]]:
        return [w for w in engine if w["inflight"] == n]

    def fig(w: dict[str, Any], what: str) -> str:
        e = w["paths"]["engine"]
        value = (
            f"p50 {e['latency_ms']['p50']:.3f} ms (p99 {e['latency_ms']['p99']:.3f})"
            if what == "p50"
            else f"{e['rps']['median']:.0f} req/s"
        )
        return f"{w['name']} {value}, {w['ratio_kvxferd_nixl']:.3f}x raw NIXL"

    one, sixteen = at(1), at(16)
    out.append(
        {
            "target": "engine-latency",
            "text": f"engine path, 1-4 x 16 KiB: p50 < {ENGINE_P50_MS} ms at one in flight",
            "met": all(w["paths"]["engine"]["latency_ms"]["p50"] < ENGINE_P50_MS for w in one)
            if one
            else None,
            "detail": "; ".join(fig(w, "p50") for w in one) or "not run",
        }
    )
    out.append(
        {
            "target": "engine-rate",
            "text": f"engine path: >= {ENGINE_RPS:.0f} req/s at 16 in flight",
            "met": all(w["paths"]["engine"]["rps"]["median"] >= ENGINE_RPS for w in sixteen)
            if sixteen
            else None,
            "detail": "; ".join(fig(w, "rps") for w in sixteen) or "not run",
        }
    )
    out.append(
        {
            "target": "engine-cpu",
            "text": f"engine path: daemon CPU per request < {ENGINE_CPU_US / 1000} ms",
            "met": all(w["daemon_cpu_us_per_request"]["median"] < ENGINE_CPU_US for w in engine)
            if engine
            else None,
            "detail": ", ".join(
                f"{w['name']} {w['daemon_cpu_us_per_request']['median']:.0f} us" for w in engine
            )
            or "not run",
        }
    )


def machine_info() -> dict[str, Any]:
    cpu = ""
    mem_kib = 0
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
        with open("/proc/meminfo") as f:
            mem_kib = int(next(ln.split()[1] for ln in f if ln.startswith("MemTotal")))
    except (OSError, StopIteration, ValueError):
        pass

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "-"

    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "mem_gib": round(mem_kib / (1 << 20), 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "nixl": version("nixl"),
        "pyzmq": version("pyzmq"),
        "torch": version("torch"),
    }


def dataplane_description(dp: DataPlaneSettings) -> str:
    tls = dp.ucx_tls or os.environ.get("UCX_TLS") or "UCX default"
    return (
        f"NIXL backend {dp.backend}, progress thread {'on' if dp.progress_thread else 'off'}, "
        f"sync mode {dp.sync_mode}, ucx_error_handling_mode {dp.ucx_error_handling_mode}, "
        f"UCX_TLS {tls}, {dp.ucx_num_workers} UCX worker(s)"
    )


def build_report(opts: Options, workloads: list[dict[str, Any]], started: float) -> dict[str, Any]:
    return {
        "version": 2,  # 2: engine workloads, nixl tuned + nixl-default baselines
        "preset": opts.preset,
        "started_unix": started,
        "elapsed_s": time.time() - started,
        "reps": opts.reps,
        "machine": machine_info(),
        "dataplane": opts.dataplane.model_dump(),
        "dataplane_text": dataplane_description(opts.dataplane),
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "workloads": workloads,
        "targets": evaluate_targets(workloads),
    }


def format_report(report: dict[str, Any]) -> str:
    """Markdown tables: library path (throughput, latency), engine path, then targets."""
    m = report["machine"]
    lines = [
        f"kvxferd bench, {report['preset']} preset, {report['reps']} repetitions per path "
        f"(alternating), {report['elapsed_s']:.0f} s",
        f"machine: {m['nproc']} CPUs ({m['cpu_model']}), {m['mem_gib']} GiB, kernel {m['kernel']}, "
        f"nixl {m['nixl']}, pyzmq {m['pyzmq']}",
        f"data plane of kvxferd and its daemons: {report['dataplane_text']}",
        "raw NIXL: prepared lists, a notification per WRITE; 'NIXL' tuned (progress thread off, "
        "UCX_TLS shm, error handling none), 'NIXL default' as NIXL ships",
    ]
    library = [w for w in report["workloads"] if not w.get("engine")]
    engine = [w for w in report["workloads"] if w.get("engine")]

    def gb(p: dict[str, Any]) -> str:
        g = p["gbps"]
        flag = "" if p["verified"] and not p["failures"] else " (!)"
        return f"{g['median']:.2f} [{g['min']:.2f}-{g['max']:.2f}]{flag}"

    def x(r: float | None) -> str:
        return "-" if r is None else f"{r:.3f}" if r < 0.1 else f"{r:.2f}"

    def lat(p: dict[str, Any]) -> str:
        return f"{p['latency_ms']['p50']:.3f} / {p['latency_ms']['p99']:.3f}"

    if library:
        lines += [
            "",
            "| workload | request | descs | kvxferd GB/s | NIXL GB/s | NIXL default GB/s | ZMQ copy GB/s "
            "| kvxferd/NIXL | kvxferd/NIXL default | kvxferd/ZMQ |",
            "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for w in library:
            p = w["paths"]
            req = f"{_size(w['block_bytes'])} x {w['blocks']}" + (
                f" x {w['layers']}L" if w["layers"] > 1 else ""
            )
            lines.append(
                f"| {w['name']} | {req} {'scat' if w['scattered'] else 'contig'} "
                f"| {w['descs_per_request']} | {gb(p['kvxferd'])} | {gb(p['nixl'])} "
                f"| {gb(p['nixl-default'])} | {gb(p['zmq'])} | {x(w['ratio_kvxferd_nixl'])} "
                f"| {x(w['ratio_kvxferd_nixl_default'])} | {x(w['ratio_kvxferd_zmq'])} |"
            )
        cols = ("kvxferd", "nixl", "nixl-default", "zmq")
        lines += [
            "",
            "| workload | thr | rx | in flight | kvxferd p50 / p99 ms | NIXL p50 / p99 ms "
            "| NIXL default p50 / p99 ms | ZMQ p50 / p99 ms | kvxferd req/s | NIXL req/s "
            "| NIXL default req/s | ZMQ req/s |",
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for w in library:
            p = w["paths"]
            inflight = f"{w['inflight']}" + (f" @ {w['rate']:g}/s" if w["rate"] else "")
            lines.append(
                f"| {w['name']} | {w['threads']} | {w['receivers']} | {inflight} | "
                + " | ".join(
                    [lat(p[c]) for c in cols] + [f"{p[c]['rps']['median']:.0f}" for c in cols]
                )
                + " |"
            )
    if engine:
        lines += [
            "",
            "Engine path (daemons driven through kvxferd.engine.client; latency fetch call -> outcome):",
            "",
            "| workload | request | in flight | engine p50 / p99 ms | engine req/s | NIXL req/s "
            "| NIXL default req/s | engine/NIXL | engine/NIXL default | daemon CPU us/req "
            "| engine CPU us/req | NIXL p50 / p99 ms |",
            "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for w in engine:
            p = w["paths"]
            r = p["engine"]["rps"]
            flag = "" if p["engine"]["verified"] and not p["engine"]["failures"] else " (!)"
            cpu = w["daemon_cpu_us_per_request"]
            lines.append(
                f"| {w['name']} | {_size(w['block_bytes'])} x {w['blocks']} | {w['inflight']} "
                f"| {lat(p['engine'])} | {r['median']:.0f} [{r['min']:.0f}-{r['max']:.0f}]{flag} "
                f"| {p['nixl']['rps']['median']:.0f} | {p['nixl-default']['rps']['median']:.0f} "
                f"| {x(w['ratio_kvxferd_nixl'])} | {x(w['ratio_kvxferd_nixl_default'])} "
                f"| {cpu['median']:.0f} [{cpu['min']:.0f}-{cpu['max']:.0f}] "
                f"| {w['engine_cpu_us_per_request']['median']:.0f} | {lat(p['nixl'])} |"
            )
    problems = [
        f"{w['name']}/{path}: {p['failures']} failed requests, verified={p['verified']} {p.get('detail', '')}"
        for w in report["workloads"]
        for path, p in w["paths"].items()
        if p["failures"] or not p["verified"]
    ]
    lines += ["", "bytes verified on every path and repetition" if not problems else "PROBLEMS:"]
    lines += [f"  {x}" for x in problems]
    lines += ["", "| target | met | measured |", "|---|---|---|"]
    for t in report["targets"]:
        met = {True: "yes", False: "NO", None: "not run"}[t["met"]]
        lines.append(f"| {t['text']} | {met} | {t['detail']} |")
    return "\n".join(lines) + "\n"
