"""One side of one path in a child: the steps the parent calls, the receiving base, the result."""

from __future__ import annotations

import os
import re
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxferd.bench.content import poison, verify
from kvxferd.bench.plan import Plan
from kvxferd.bench.workload import STEP_TIMEOUT_S, BenchError


def _result(
    t0: float, t1: float, lat: list[float], requests: int, nbytes: int, failures: int
) -> dict[str, Any]:
    return {
        "t0": t0,
        "t1": t1,
        "requests": requests,
        "bytes": nbytes,
        "failures": failures,
        "lat_us": [round(x * 1e6, 1) for x in lat],
    }


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of every live thread of this process, by name (``/proc/self/task``).

    Python threads by their ``threading`` name (a numbered family such as
    ``kvxferd-worker-3`` summed as ``kvxferd-worker-*``), the others (UCX, ZMQ) by
    their kernel name.
    """
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            name = names.get(int(tid))
            if name is None:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        key = re.sub(r"-\d+$", "-*", name)
        out[key] = out.get(key, 0.0) + ns / 1e9
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per-name CPU spent between two :func:`thread_cpu_s` snapshots (new threads count whole)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


class _Side:
    """One process's part of one path for one workload; the parent calls each step in order."""

    def info(self) -> dict[str, Any]:
        return {}

    def connect(self, peers: list[dict[str, Any]]) -> None:
        return None

    def prepare(self, rep: int, count: int) -> dict[str, Any]:
        return {}

    def run(self, rep: int, count: int) -> dict[str, Any]:
        raise BenchError("this side does not drive requests")

    def finish(self, rep: int, count: int) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None


class _Destination(_Side):
    """A receiving side: poisons its slots before a repetition and verifies them after."""

    def __init__(self, plan: Plan, index: int) -> None:
        self.plan, self.index = plan, index
        self.slots = plan.slots()

    def kv(self) -> npt.NDArray[np.uint8]:
        raise NotImplementedError

    def prepare(self, rep: int, count: int) -> dict[str, Any]:
        poison(self.kv(), self.slots)
        return {}

    def finish(self, rep: int, count: int) -> dict[str, Any]:
        ok, checked, detail = verify(
            self.kv(), self.plan, self.plan.sources(rep, self.index), count
        )
        return {"verified": ok, "checked_blocks": checked, "detail": detail}


class _Group(_Side):
    """Several receivers of one path in one process (the peers curve): each step goes to every
    member; ``run`` drives all members at once, one thread each, and merges their results."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.members: list[_Side] = []

    def connect(self, peers: list[dict[str, Any]]) -> None:
        for m in self.members:
            m.connect(peers)

    def prepare(self, rep: int, count: int) -> dict[str, Any]:
        for m in self.members:
            m.prepare(rep, count)
        return {}

    def run(self, rep: int, count: int) -> dict[str, Any]:
        results: list[dict[str, Any] | BaseException | None] = [None] * len(self.members)

        def drive(j: int) -> None:
            try:
                results[j] = self.members[j].run(rep, count)
            except BaseException as e:  # reported below, in the caller's thread
                results[j] = e

        threads = [
            threading.Thread(target=drive, args=(j,), name=f"bench-rx-group{j}", daemon=True)
            for j in range(len(self.members))
        ]
        for t in threads:
            t.start()
        deadline = self.plan.run_timeout_s(count) + STEP_TIMEOUT_S
        for t in threads:
            t.join(deadline)  # each member bounds its own run; this bounds a stuck one
        for r in results:
            if isinstance(r, BaseException):
                raise BenchError(f"a receiver of the group failed: {r!r}")
            if r is None:
                raise BenchError("a receiver of the group did not finish its run")
        rs = [r for r in results if isinstance(r, dict)]
        out = {
            "t0": min(r["t0"] for r in rs),
            "t1": max(r["t1"] for r in rs),
            "lat_us": [x for r in rs for x in r["lat_us"]],
        }
        for key in ("requests", "bytes", "failures", "daemon_cpu_s", "engine_cpu_s"):
            out[key] = sum(r.get(key, 0) for r in rs)
        return out

    def finish(self, rep: int, count: int) -> dict[str, Any]:
        fs = [m.finish(rep, count) for m in self.members]
        return {
            "verified": all(f.get("verified", True) for f in fs),
            "checked_blocks": sum(int(f.get("checked_blocks", 0)) for f in fs),
            "detail": "; ".join(f["detail"] for f in fs if f.get("detail")),
        }

    def close(self) -> None:
        errors = []
        for m in self.members:
            try:
                m.close()
            except Exception as e:
                errors.append(e)
        self.members = []
        if errors:
            raise errors[0]
