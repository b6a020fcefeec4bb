"""One side of one path in a child: the steps the parent calls, the receiving base, the result."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvxferd.bench.content import poison, verify
from kvxferd.bench.plan import Plan
from kvxferd.bench.workload import BenchError


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
