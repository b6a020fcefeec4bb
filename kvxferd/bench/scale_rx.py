"""The rx process of ``kvxferd bench --scale`` (scale.py): Receiver and Sender objects driven over JSON lines.

The parent (scale.py) starts ``python -c "...rx_child(spec)"``; this module is
that child: it hosts receivers (each attached to the parent's sender daemon as
discovery would), the receiver-per-link measurement's Sender objects, and the
NIXL cost measurement, and answers one JSON line per command on stdout.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from kvxferd.bench.scale import NIXL_COST_LISTS, _delta, pattern, proc_usage
from kvxferd.bench.workload import BenchError
from kvxferd.config import DataPlaneSettings


class _RxServer:
    """Receivers of one rx process: attach, fetch with a window and check, report usage."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.index = int(spec["index"])
        self.pool = dict(spec["pool"])
        self.dataplane = DataPlaneSettings(**spec["dataplane"])
        self.receivers: dict[int, Any] = {}
        self.tx: list[Any] = []  # Sender objects of the receiver-links measurement
        self.tx_handles: list[Any] = []

    def attach(self, indices: list[int], endpoint: str, timeout: float) -> dict[str, Any]:
        from kvxferd.config import load_receiver_settings
        from kvxferd.discovery import PeerAdded, PeerRecord
        from kvxferd.transfer.receiver import Receiver

        sender = PeerRecord(role="sender", name="scale-tx", endpoints={"listen": endpoint})
        members = []
        for k in indices:
            t0 = time.monotonic()
            settings = load_receiver_settings(
                name=f"scale-rx{k}",
                pool=self.pool,
                dataplane=self.dataplane.model_dump(),
                security={"mode": "off"},  # loopback only
            )
            rx = Receiver(settings).start()
            self.receivers[k] = rx
            t1 = time.monotonic()
            rx.on_peer_event(PeerAdded(sender))  # dial and REGISTER now, as discovery does
            deadline = t1 + timeout
            while rx.stats.get("register_replies_ok") < 1:
                if rx.stats.get("register_replies_refused") or time.monotonic() > deadline:
                    raise BenchError(f"receiver {k} was not registered: {rx.stats.snapshot()}")
                time.sleep(0.0005)
            t2 = time.monotonic()
            members.append(
                {
                    "index": k,
                    "create_s": t1 - t0,
                    "register_s": t2 - t1,
                    "metadata_bytes": len(rx.agents.metadata()),
                }
            )
        return {"members": members}

    def fetch(
        self, work: dict[str, list[list[Any]]], endpoint: str, inflight: int, timeout: float
    ) -> dict[str, Any]:
        results: dict[int, dict[str, Any] | BaseException] = {}

        def drive(k: int, reqs: list[list[Any]]) -> None:
            try:
                results[k] = self._fetch_one(k, reqs, endpoint, inflight, timeout)
            except BaseException as e:  # reported below, on the command's thread
                results[k] = e

        threads = [
            threading.Thread(target=drive, args=(int(k), v), name=f"scale-rx{k}", daemon=True)
            for k, v in work.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 5)
        out = []
        for k in work:
            r = results.get(int(k))
            if not isinstance(r, dict):
                raise BenchError(f"receiver {k} did not finish its fetches: {r!r}")
            out.append(r)
        return {"results": out}

    def _fetch_one(
        self, k: int, reqs: list[list[Any]], endpoint: str, inflight: int, timeout: float
    ) -> dict[str, Any]:
        rx = self.receivers[k]
        kv = rx.pool.kv_bytes_view().numpy()  # [layer, block, byte], no copy
        nbytes = rx.pool.layout.block_bytes
        window: deque[tuple[Any, float, int, int]] = deque()  # handle, t, slot, source block
        lat: list[float] = []
        failures = mismatches = 0
        first = -1.0
        t0 = last = time.monotonic()
        deadline = t0 + timeout

        def finish_oldest() -> None:
            nonlocal failures, mismatches, last, first
            handle, t, slot, src = window.popleft()
            outcome = handle.wait(max(0.0, deadline - time.monotonic()))
            done_at = handle.session.completion.set_at
            if outcome is None or not outcome.ok or done_at is None:
                failures += 1
            else:
                if not np.array_equal(kv[0, slot], pattern(src, nbytes)):
                    mismatches += 1
                lat.append(done_at - t)
                if first < 0:
                    first = done_at - t
                last = max(last, done_at)
            handle.close(timeout=max(0.0, deadline - time.monotonic()))

        for i, (rid, src) in enumerate(reqs):
            while len(window) >= inflight:
                finish_oldest()
            slot = i % inflight
            kv[0, slot, :] = 0xEE  # poison: a fetch that wrote nothing fails the check
            t = time.monotonic()
            h = rx.fetch(rid, endpoint, [slot], want_aux=False)
            window.append((h, t, slot, int(src)))
        while window:
            finish_oldest()
        return {
            "index": k,
            "t0": t0,
            "t1": last,
            "ok": len(lat),
            "failures": failures,
            "mismatches": mismatches,
            "first_us": first * 1e6,
            "lat_us": [round(x * 1e6, 1) for x in lat],
        }

    def nixl_cost(self, descs: list[int]) -> dict[str, Any]:
        """add_remote_agent, prep_xfer_dlist (time, RSS per list) as a sender does per REGISTER."""
        from kvxferd.config import PoolSettings
        from kvxferd.transfer.dataplane import NixlDataPlane
        from kvxferd.transfer.pool import KvPool

        if not self.receivers:
            raise BenchError("nixl_cost needs a receiver in this process")
        rx = next(iter(self.receivers.values()))
        meta = rx.agents.metadata()
        biggest = max(descs)
        # Tiny blocks: a prepared list's cost is per descriptor, not per byte.
        ps = PoolSettings(
            num_layers=1, num_blocks=biggest, block_elems=64, dtype="uint8", aux_slots=1
        )
        pools = [KvPool(ps, owner=f"scale-cost{j}") for j in range(2)]
        dps: list[NixlDataPlane] = []
        try:
            dps = [
                NixlDataPlane(f"scale-cost{j}-{os.getpid()}", self.dataplane, pools[j])
                for j in range(2)
            ]
            tx, remote = dps
            adds, removes = [], []
            for _ in range(3):
                t = time.perf_counter()
                name = tx.add_peer(meta)
                adds.append(time.perf_counter() - t)
                t = time.perf_counter()
                tx.remove_peer(name)
                removes.append(time.perf_counter() - t)
            peer = tx.add_peer(remote.metadata())
            agent = tx._agent
            lists = []
            rng = np.random.default_rng(5)
            for n in sorted(descs):
                for order in ("contiguous", "scattered"):
                    # kvxferd prepares every (layer, block) of a pool in address order
                    # (contiguous); scattered is the same list shuffled: no run to compress.
                    ids = np.arange(n, dtype=np.int64)
                    if order == "scattered":
                        ids = rng.permutation(n)
                    d = np.empty((n, 3), dtype=np.int64)
                    d[:, 0] = pools[1].kv_base + ids * 64
                    d[:, 1] = 64
                    d[:, 2] = 0
                    gc.collect()
                    rss0 = proc_usage(os.getpid())["rss_kib"]
                    handles, times = [], []
                    for _ in range(NIXL_COST_LISTS):
                        t = time.perf_counter()
                        handles.append(agent.prep_xfer_dlist(peer, d, "DRAM"))
                        times.append(time.perf_counter() - t)
                    rss1 = proc_usage(os.getpid())["rss_kib"]
                    for h in handles:
                        agent.release_dlist_handle(h)
                    per_list = max(0.0, (rss1 - rss0) / NIXL_COST_LISTS)
                    lists.append(
                        {
                            "descs": n,
                            "order": order,
                            "prep_ms": statistics.median(times) * 1e3,
                            "rss_kib_per_list": per_list,
                            "bytes_per_desc": per_list * 1024 / n,
                        }
                    )
        finally:
            for dp in dps:
                dp.close()
            for p in pools:
                p.close()
        return {
            "cost": {
                "metadata_bytes": len(meta),
                "add_peer_ms": statistics.median(adds) * 1e3,
                "remove_peer_ms": statistics.median(removes) * 1e3,
                "lists": lists,
            }
        }

    def senders(self, count: int, per: int) -> dict[str, Any]:
        """``count`` Sender objects (default workers), each with ``per`` requests published."""
        from kvxferd.config import load_sender_settings
        from kvxferd.transfer.sender import Sender

        self.close_senders()
        for i in range(count):
            settings = load_sender_settings(
                listen="tcp://127.0.0.1:0",
                name=f"scale-ltx{i}",
                pool=self.pool,
                dataplane=self.dataplane.model_dump(),
                security={"mode": "off"},  # loopback only
            )
            snd = Sender(settings).start()
            self.tx.append(snd)
            nb = snd.pool.layout.num_blocks
            self.tx_handles += [snd.publish(f"l{i}-{j}", [j % nb]) for j in range(per)]
        return {"endpoints": [snd.endpoint for snd in self.tx]}

    def close_senders(self) -> dict[str, Any]:
        failures = 0
        for h in self.tx_handles:
            out = h.wait(5.0)
            failures += out is None or not out.ok
            h.close(timeout=5.0)
        for snd in self.tx:
            snd.shutdown(5.0)
        self.tx, self.tx_handles = [], []
        return {"failures": failures}

    def links(self, endpoints: list[str], per: int, timeout: float) -> dict[str, Any]:
        """A fresh Receiver: this process's fds, sockets, RSS before, after registering with
        every sender, and after fetching ``per`` requests from each; per link."""
        from kvxferd.config import load_receiver_settings
        from kvxferd.discovery import PeerAdded, PeerRecord
        from kvxferd.transfer.receiver import Receiver

        settings = load_receiver_settings(
            name="scale-rx-links",
            pool=self.pool,
            dataplane=self.dataplane.model_dump(),
            security={"mode": "off"},  # loopback only
        )
        rx = Receiver(settings).start()
        try:
            u0 = proc_usage(os.getpid())
            deadline = time.monotonic() + timeout
            for i, ep in enumerate(endpoints):
                rec = PeerRecord(role="sender", name=f"scale-ltx{i}", endpoints={"listen": ep})
                rx.on_peer_event(PeerAdded(rec))
            while rx.stats.get("register_replies_ok") < len(endpoints):
                if time.monotonic() > deadline:
                    raise BenchError(f"the links did not register: {rx.stats.snapshot()}")
                time.sleep(0.002)
            u1 = proc_usage(os.getpid())
            failures = 0
            nb = rx.pool.layout.num_blocks
            for i, ep in enumerate(endpoints):
                hs = [
                    rx.fetch(f"l{i}-{j}", ep, [j % nb], want_aux=False) for j in range(min(per, nb))
                ]
                for h in hs:
                    out = h.wait(max(0.0, deadline - time.monotonic()))
                    failures += out is None or not out.ok
                    h.close(timeout=max(0.0, deadline - time.monotonic()))
            u2 = proc_usage(os.getpid())
        finally:
            rx.shutdown(5.0)
        n = len(endpoints)
        return {
            "links": {
                "links": n,
                "failures": failures,
                "per_link_register": _delta(u0, u1, n),
                "per_link_fetch": _delta(u0, u2, n),
            }
        }

    def close(self) -> None:
        self.close_senders()
        for rx in self.receivers.values():
            try:
                rx.shutdown(timeout=5.0)
            except Exception as e:
                sys.stderr.write(f"scale rx: shutdown failed: {e!r}\n")
        self.receivers = {}


def rx_child(spec_json: str) -> int:
    """Entry of an rx process: JSON commands in on stdin, one JSON reply each on stdout."""
    from kvxferd.bench.child import _LineReader

    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever a library prints goes to stderr; replies stay clean
    spec = json.loads(spec_json)
    server = _RxServer(spec)
    parent = os.getppid()
    reader = _LineReader(sys.stdin.fileno())
    out.write(json.dumps({"event": "hello", "pid": os.getpid()}) + "\n")
    deadline = time.monotonic() + float(spec.get("max_s", 600))
    try:
        while time.monotonic() < deadline and os.getppid() == parent:
            try:
                line = reader.readline(1.0)
            except EOFError:
                break
            if line is None:
                continue
            cmd = json.loads(line)
            what = cmd.get("cmd")
            if what == "exit":
                break
            try:
                if what == "attach":
                    reply = server.attach(
                        [int(k) for k in cmd["indices"]], str(cmd["endpoint"]), 30.0
                    )
                elif what == "fetch":
                    reply = server.fetch(
                        cmd["work"],
                        str(cmd["endpoint"]),
                        int(cmd["inflight"]),
                        float(cmd["timeout_s"]),
                    )
                elif what == "nixl_cost":
                    reply = server.nixl_cost([int(n) for n in cmd["descs"]])
                elif what == "senders":
                    reply = server.senders(int(cmd["count"]), int(cmd["per"]))
                elif what == "close_senders":
                    reply = server.close_senders()
                elif what == "links":
                    reply = server.links([str(e) for e in cmd["endpoints"]], int(cmd["per"]), 30.0)
                else:
                    raise BenchError(f"unknown command {what!r}")
                out.write(json.dumps({"event": "ok", **reply}) + "\n")
            except Exception as e:
                detail = f"rx{server.index} {what}: {e!r}"[:2000]
                out.write(json.dumps({"event": "error", "detail": detail}) + "\n")
    finally:
        server.close()
    return 0
