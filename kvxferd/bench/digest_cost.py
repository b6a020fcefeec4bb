"""``kvxferd bench --digest``: what the per-request digest costs, in one run.

Two measures (kvxferd/transfer/digest.py has the function, receiver/digests.py the check):

    function   the digest itself (``kv_digest``, as the sender and the receiver call it)
               over scattered 256 KiB blocks of a CPU pool: GB/s for 1, 4, 16, 64 MiB,
               median of ``reps`` after a warm-up, in this process
    fetches    the bench's own machinery (runner.py) on three workloads, three paths
               alternating repetitions: ``kvxferd`` (no digest: done by the NIXL
               notification), ``kvxferd-digest`` (every fetch asks for the digest: the
               sender computes it, the done Result carries it, the receiver checks it
               before the fetch is done) and prepared raw NIXL, every byte verified

The report gives each path's GB/s, req/s and latency, digest / plain and each against
raw NIXL, the machine and its load average at the start and the end (a shared machine:
the figures are only comparable inside one run).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from kvxferd.bench.report import dataplane_description, machine_info
from kvxferd.bench.runner import _Runner
from kvxferd.bench.workload import KiB, MiB, Options, Path_, Workload
from kvxferd.transfer.digest import kv_digest

PATHS: tuple[Path_, ...] = ("kvxferd", "kvxferd-digest", "nixl")
WORKLOADS: tuple[Workload, ...] = (
    Workload("digest-4k-w1", 4, 1, inflight=1, only=PATHS),
    Workload("digest-64k-4m", 64, 64, inflight=8, only=PATHS),
    Workload("digest-1m-64m", 1024, 64, inflight=4, only=PATHS),
)
SIZES_MIB = (1, 4, 16, 64)


def function_gbps(sizes_mib: tuple[int, ...] = SIZES_MIB, reps: int = 7) -> list[dict[str, Any]]:
    """The digest's own speed over scattered 256 KiB blocks of a CPU pool, per size."""
    rng = np.random.default_rng(1)
    block = 256 * KiB
    out = []
    for mib in sizes_mib:
        n = mib * MiB // block
        kv = torch.from_numpy(rng.integers(0, 256, (1, 2 * n, block), dtype=np.uint8))
        blocks = rng.permutation(2 * n)[:n].astype(np.int64)
        kv_digest(kv, (0, 1), blocks)  # warm-up: the column weights, the allocator
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            kv_digest(kv, (0, 1), blocks)
            times.append(time.perf_counter() - t0)
        t = float(np.median(times))
        out.append({"mib": mib, "ms": t * 1000, "gbps": mib * MiB / t / 1e9})
    return out


def run_digest_cost(
    opts: Options,
    workloads: tuple[Workload, ...] = WORKLOADS,
    sizes_mib: tuple[int, ...] = SIZES_MIB,
) -> dict[str, Any]:
    """The function's speed, then the three paths on ``workloads`` (``opts``: reps, bounds)."""
    load0 = os.getloadavg()
    t0 = time.monotonic()
    function = function_gbps(sizes_mib)
    results = _Runner(replace(opts, workloads=workloads), sys.stderr).run_workloads()
    return {
        "machine": machine_info(),
        "dataplane_text": dataplane_description(opts.dataplane),
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "elapsed_s": time.monotonic() - t0,
        "reps": opts.reps,
        "function": function,
        "workloads": [w for w in results if w is not None],
    }


def format_digest_cost(doc: dict[str, Any]) -> str:
    """Markdown: the function's GB/s, then each workload's paths side by side."""
    m = doc["machine"]
    la0, la1 = doc["loadavg_start"], doc["loadavg_end"]
    lines = [
        f"kvxferd bench --digest, {doc['reps']} repetitions per path (alternating), "
        f"{doc['elapsed_s']:.0f} s",
        f"machine: {m['nproc']} CPUs ({m['cpu_model']}), torch {doc['torch_threads']} threads; "
        f"load average {la0[0]:.2f} at the start, {la1[0]:.2f} at the end",
        f"data plane of kvxferd: {doc['dataplane_text']}",
        "",
        "| digest over | ms | GB/s |",
        "|--:|--:|--:|",
    ]
    lines += [f"| {f['mib']} MiB | {f['ms']:.2f} | {f['gbps']:.2f} |" for f in doc["function"]]
    lines += [
        "",
        "| workload | request | in flight | kvxferd GB/s | + digest GB/s | NIXL GB/s "
        "| digest/plain | plain/NIXL | digest/NIXL | kvxferd p50 ms | + digest p50 ms "
        "| kvxferd req/s | + digest req/s |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    problems = []
    for w in doc["workloads"]:
        p = w["paths"]
        plain, dig, nixl = (p[k]["gbps"]["median"] for k in PATHS)
        for k in PATHS:
            if p[k]["failures"] or not p[k]["verified"]:
                problems.append(
                    f"{w['name']}/{k}: {p[k]['failures']} failed, verified={p[k]['verified']}"
                )
        size = f"{w['block_bytes'] // KiB} KiB x {w['blocks']}"
        lines.append(
            f"| {w['name']} | {size} | {w['inflight']} | {plain:.3f} | {dig:.3f} | {nixl:.3f} "
            f"| {dig / plain:.2f} | {plain / nixl:.2f} | {dig / nixl:.2f} "
            f"| {p['kvxferd']['latency_ms']['p50']:.3f} "
            f"| {p['kvxferd-digest']['latency_ms']['p50']:.3f} "
            f"| {p['kvxferd']['rps']['median']:.0f} | {p['kvxferd-digest']['rps']['median']:.0f} |"
        )
    lines += ["", "bytes verified on every path and repetition" if not problems else "PROBLEMS:"]
    lines += [f"  {x}" for x in problems]
    return "\n".join(lines) + "\n"
