"""The raw NIXL paths: prepared descriptor lists, a notification on every WRITE, no control plane.

This is the honest baseline (issue 12): what a program that uses NIXL directly
and well gets. Each side registers its pool once; the initiator prepares one
descriptor list over its own pool and one over each peer's pool (one
descriptor per (layer, block), ``prep_xfer_dlist`` once per peer); a request is
then one ``make_prepped_xfer`` by indices (computed with numpy before the
repetition starts) with its completion notification attached to the WRITE,
one ``transfer`` and polls until DONE (without sleeping for the first 200 us of
no progress, then backing off). Two configurations are measured:

    path           agent                                      UCX
    -------------  -----------------------------------------  ----------------------------------
    nixl           progress thread off, sync mode default     UCX_TLS=shm, error handling none
    nixl-default   nixl_agent_config() as shipped (progress   UCX defaults (all transports,
                   thread on)                                 error handling peer)
"""

from __future__ import annotations

import base64
import os
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxferd.bench.content import _kv_array, fill_source
from kvxferd.bench.plan import Plan
from kvxferd.bench.side import _Destination, _result, _Side
from kvxferd.bench.workload import BenchError
from kvxferd.transfer.layout import prepped_indices
from kvxferd.transfer.pool import KvPool

TUNED_UCX_TLS = "shm"
SPIN_S = 200e-6  # poll without sleeping this long after the last progress, then back off


class _RawAgent:
    """A NIXL agent with a pool registered, configured as ``tuned`` or as NIXL ships it."""

    def __init__(self, name: str, plan: Plan, tuned: bool) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        from kvxferd.transfer.dataplane import _quiet_nixl_logger

        _quiet_nixl_logger()
        self.pool = KvPool(plan.pool_settings(), owner=name)
        agent_name = f"{name}-{os.getpid()}"
        # UCX reads UCX_TLS when the backend creates its context: set it for this agent only.
        saved = os.environ.get("UCX_TLS")
        try:
            if tuned:
                os.environ["UCX_TLS"] = TUNED_UCX_TLS
                self.agent = nixl_agent(
                    agent_name, nixl_agent_config(enable_prog_thread=False, backends=[])
                )
                self.agent.create_backend(
                    "UCX", {"ucx_error_handling_mode": "none", "num_workers": "1"}
                )
            else:
                os.environ.pop("UCX_TLS", None)
                self.agent = nixl_agent(agent_name, nixl_agent_config())
        finally:
            if saved is None:
                os.environ.pop("UCX_TLS", None)
            else:
                os.environ["UCX_TLS"] = saved
        self.regs = [self.agent.register_memory([self.pool.kv], mem_type="DRAM")]

    def prep(self, agent: str, kv_base: int) -> object:
        """A prepared list of every (layer, block) of a pool of this plan's shape at ``kv_base``."""
        lay = self.pool.layout
        n = lay.num_layers * lay.num_blocks
        descs = np.empty((n, 3), dtype=np.int64)
        descs[:, 0] = kv_base + np.arange(n, dtype=np.int64) * lay.block_bytes
        descs[:, 1] = lay.block_bytes
        descs[:, 2] = 0
        return self.agent.prep_xfer_dlist(agent, descs, "DRAM")

    def close(self) -> None:
        for reg in self.regs:
            try:
                self.agent.deregister_memory(reg)
            except Exception:
                pass
        self.pool.close()


class RawTx(_Side):
    """One thread posting prepared WRITEs with a notification each; times post -> DONE."""

    def __init__(self, plan: Plan, tuned: bool) -> None:
        self.plan = plan
        self.raw = _RawAgent(f"bench-raw{'' if tuned else 'd'}-tx{plan.tag}", plan, tuned)
        fill_source(_kv_array(self.raw.pool), plan)
        self.local = self.raw.prep("NIXL_INIT_AGENT", self.raw.pool.kv_base)
        self.peers: list[tuple[str, object]] = []  # (NIXL name, prepared remote list)

    def connect(self, peers: list[dict[str, Any]]) -> None:
        for p in peers:
            name = self.raw.agent.add_remote_agent(base64.b64decode(p["metadata"]))
            peer = name.decode() if isinstance(name, bytes) else str(name)
            self.peers.append((peer, self.raw.prep(peer, int(p["kv_base"]))))

    def _indices(self, rep: int, count: int) -> list[tuple[list[Any], list[Any]]]:
        """Per receiver, per request: (local, remote) indices into the prepared lists."""
        plan, w = self.plan, self.plan.workload
        nb = plan.num_blocks
        slots = plan.slots()
        out: list[tuple[list[Any], list[Any]]] = []
        for k in range(len(self.peers)):
            src = plan.sources(rep, k)
            out.append(
                (
                    [prepped_indices(src[i], 0, w.layers, nb) for i in range(count)],
                    [prepped_indices(slots[i % w.inflight], 0, w.layers, nb) for i in range(count)],
                )
            )
        return out

    def run(self, rep: int, count: int) -> dict[str, Any]:
        plan, w, agent = self.plan, self.plan.workload, self.raw.agent
        idx = self._indices(rep, count)
        notif = f"bench{plan.tag}".encode()
        windows: list[deque[list[Any]]] = [deque() for _ in self.peers]  # [xfer, t_ref, done_at]
        nxt = [0] * len(self.peers)
        lat: list[float] = []
        nbytes = failures = 0
        t0 = last = idle_since = time.monotonic()
        deadline = t0 + plan.run_timeout_s(count)
        delay = 0.0
        while any(n < count for n in nxt) or any(windows):
            now = time.monotonic()
            if now > deadline:
                raise BenchError(f"nixl: repetition still running after {deadline - t0:.0f} s")
            moved = False
            for k, (_, remote) in enumerate(self.peers):
                win = windows[k]
                local_idx, remote_idx = idx[k]
                while (
                    len(win) < w.inflight
                    and nxt[k] < count
                    and (not w.rate or now >= t0 + nxt[k] / w.rate)
                ):
                    i = nxt[k]
                    t_ref = t0 + i / w.rate if w.rate else time.monotonic()
                    handle = agent.make_prepped_xfer(
                        "WRITE", self.local, local_idx[i], remote, remote_idx[i], notif
                    )
                    state = agent.transfer(handle)
                    if state == "ERR":
                        agent.release_xfer_handle(handle)
                        failures += 1
                    else:
                        win.append([handle, t_ref, time.monotonic() if state == "DONE" else 0.0])
                    nxt[k] += 1
                    moved = True
                for entry in win:
                    if entry[2]:
                        continue
                    state = agent.check_xfer_state(entry[0])
                    if state == "DONE":
                        entry[2] = time.monotonic()
                        moved = True
                    elif state == "ERR":
                        entry[2] = -1.0
                        moved = True
                while win and win[0][2]:
                    handle, t_ref, done_at = win.popleft()
                    agent.release_xfer_handle(handle)
                    if done_at < 0:
                        failures += 1
                    else:
                        lat.append(done_at - t_ref)
                        nbytes += w.request_bytes
                        last = max(last, done_at)
            if moved:
                delay, idle_since = 0.0, now
            elif now - idle_since > SPIN_S:  # the limit path polls without sleeping at first:
                # a sleep of 10 us lasts 60-80 us here (timer slack), longer than a small WRITE
                delay = min(max(delay * 2, 10e-6), 200e-6)
                time.sleep(delay)
        return _result(t0, last, lat, count * len(self.peers), nbytes, failures)

    def close(self) -> None:
        agent = self.raw.agent
        for peer, remote in self.peers:
            for h in (remote,):
                try:
                    agent.release_dlist_handle(h)
                except Exception:
                    pass
            agent.remove_remote_agent(peer)
        try:
            agent.release_dlist_handle(self.local)
        except Exception:
            pass
        self.raw.close()


class RawRx(_Destination):
    """Registered memory, an agent whose notifications a thread drains every 10 ms (wire-up too)."""

    def __init__(self, plan: Plan, index: int, tuned: bool) -> None:
        super().__init__(plan, index)
        self.raw = _RawAgent(f"bench-raw{'' if tuned else 'd'}-rx{index}-{plan.tag}", plan, tuned)
        self.notifs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._progress, name="bench-raw-progress", daemon=True
        )
        self._thread.start()

    def _progress(self) -> None:
        while not self._stop.wait(0.01):
            for msgs in self.raw.agent.get_new_notifs().values():
                self.notifs += len(msgs)

    def kv(self) -> npt.NDArray[np.uint8]:
        return _kv_array(self.raw.pool)

    def info(self) -> dict[str, Any]:
        return {
            "metadata": base64.b64encode(self.raw.agent.get_agent_metadata()).decode(),
            "kv_base": self.raw.pool.kv_base,
        }

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.raw.close()
