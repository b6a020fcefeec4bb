"""The raw NIXL path: kvxferd's own descriptors posted through NixlDataPlane, no control plane."""

from __future__ import annotations

import base64
import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvxferd.bench.content import _kv_array, fill_source
from kvxferd.bench.plan import Plan
from kvxferd.bench.side import _Destination, _result, _Side
from kvxferd.bench.workload import BenchError
from kvxferd.config import DataPlaneSettings
from kvxferd.layout import write_descriptors

if TYPE_CHECKING:
    from kvxferd.dataplane import NixlDataPlane
    from kvxferd.pool import KvPool


def _raw_dataplane(
    name: str, plan: Plan, dataplane: DataPlaneSettings
) -> tuple[KvPool, NixlDataPlane]:
    from kvxferd.dataplane import NixlDataPlane
    from kvxferd.pool import KvPool

    pool = KvPool(plan.pool_settings(), owner=name)
    return pool, NixlDataPlane(f"{name}-{os.getpid()}", dataplane, pool)


class RawTx(_Side):
    """One thread posting kvxferd's own descriptors through NixlDataPlane, no control plane."""

    def __init__(self, plan: Plan, dataplane: DataPlaneSettings) -> None:
        self.plan = plan
        self.pool, self.dp = _raw_dataplane(f"bench-raw-tx{plan.tag}", plan, dataplane)
        fill_source(_kv_array(self.pool), plan)
        self.peers: list[tuple[str, int]] = []  # (NIXL name, remote KV base)

    def connect(self, peers: list[dict[str, Any]]) -> None:
        for p in peers:
            self.peers.append(
                (self.dp.add_peer(base64.b64decode(p["metadata"])), int(p["kv_base"]))
            )

    def run(self, rep: int, count: int) -> dict[str, Any]:
        plan, w, layout = self.plan, self.plan.workload, self.plan.layout
        slots = plan.slots()
        srcs = [plan.sources(rep, k) for k in range(len(self.peers))]
        windows: list[deque[list[Any]]] = [deque() for _ in self.peers]  # [xfer, t_ref, done_at]
        nxt = [0] * len(self.peers)
        lat: list[float] = []
        nbytes = failures = 0
        t0 = last = time.monotonic()
        deadline = t0 + plan.run_timeout_s(count)
        delay = 0.0
        while any(n < count for n in nxt) or any(windows):
            now = time.monotonic()
            if now > deadline:
                raise BenchError(f"nixl: repetition still running after {deadline - t0:.0f} s")
            moved = False
            for k, (peer, base) in enumerate(self.peers):
                win = windows[k]
                while (
                    len(win) < w.inflight
                    and nxt[k] < count
                    and (not w.rate or now >= t0 + nxt[k] / w.rate)
                ):
                    i = nxt[k]
                    t_ref = t0 + i / w.rate if w.rate else time.monotonic()
                    src, dst = write_descriptors(
                        layout,
                        self.pool.kv_base,
                        srcs[k][i],
                        base,
                        slots[i % w.inflight],
                        0,
                        w.layers,
                    )
                    xfer, state = self.dp.post_write(peer, src, dst, "DRAM", "DRAM")
                    win.append([xfer, t_ref, time.monotonic() if state == "DONE" else 0.0])
                    nxt[k] += 1
                    moved = True
                for entry in win:
                    if entry[2]:
                        continue
                    state = entry[0].poll()
                    if state == "DONE":
                        entry[2] = time.monotonic()
                        moved = True
                    elif state == "ERR":
                        entry[2] = -1.0
                        moved = True
                while win and win[0][2]:
                    xfer, t_ref, done_at = win.popleft()
                    xfer.release()
                    if done_at < 0:
                        failures += 1
                    else:
                        lat.append(done_at - t_ref)
                        nbytes += w.request_bytes
                        last = max(last, done_at)
            if moved:
                delay = 0.0
            else:  # back off like kvxferd's wait_xfer, but cap lower: this is the limit path
                delay = min(max(delay * 2, 10e-6), 200e-6)
                time.sleep(delay)
        return _result(t0, last, lat, count * len(self.peers), nbytes, failures)

    def close(self) -> None:
        for peer, _ in self.peers:
            self.dp.remove_peer(peer)
        self.dp.close()
        self.pool.close()


class RawRx(_Destination):
    """Registered memory and an agent that a thread progresses every 10 ms (UCX wire-up needs it)."""

    def __init__(self, plan: Plan, dataplane: DataPlaneSettings, index: int) -> None:
        super().__init__(plan, index)
        self.pool, self.dp = _raw_dataplane(f"bench-raw-rx{index}-{plan.tag}", plan, dataplane)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._progress, name="bench-raw-progress", daemon=True
        )
        self._thread.start()

    def _progress(self) -> None:
        while not self._stop.wait(0.01):
            self.dp.progress()

    def kv(self) -> npt.NDArray[np.uint8]:
        return _kv_array(self.pool)

    def info(self) -> dict[str, Any]:
        return {
            "metadata": base64.b64encode(self.dp.metadata()).decode(),
            "kv_base": self.pool.kv_base,
        }

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.dp.close()
        self.pool.close()
