"""``kvxferd bench``: kvxferd against raw NIXL and a plain ZMQ copy, on the same KV-shaped workloads.

Three paths move the same requests (same pools, same block ids, same window)::

    path      how the bytes move                                  who times a request
    --------  --------------------------------------------------  --------------------------------
    kvxferd   Receiver.fetch -> REQUEST_DATA -> Sender listener,   the receiver: fetch() to the
              admission, worker, NIXL WRITE -> Result              Result (completion.set_at)
    nixl      NixlDataPlane.post_write with the descriptors        the initiator: post to the
              kvxferd builds (layout.write_descriptors); no        first poll that says DONE
              control plane at all: the data-plane limit
    zmq       zero-copy ZMQ frames over tcp://127.0.0.1, copied    the sender: send to its ack
              into the destination blocks, one ack per request

Processes. One ``tx`` child and one ``rx`` child per receiver, started once with
``python -m kvxferd _bench-tx|_bench-rx SPEC_JSON`` and reused for every
workload; each child hosts its side of all three paths (a path that is not
being measured sits idle). The parent writes one JSON command per line to a
child's stdin and reads one JSON reply per line from its stdout; NIXL metadata
travels as base64 inside JSON. Nothing is pickled. Everything a library prints
on a child's stdout is moved to stderr, so the reply stream stays clean.

A workload runs as: set up (new pools and NIXL agents, a new Sender and
Receivers), one warm-up repetition per path (connections, registration), then
repetitions alternating kvxferd, nixl, zmq, kvxferd, ... so that drift of the
machine falls on all three alike. One repetition of one path is::

    prepare   tx: kvxferd publishes its first requests (an engine thread keeps
                  publishing and closing, a window ahead of the receivers)
              rx: poison the head and tail stamps of every destination block
    run       the driver (kvxferd: each receiver; nixl, zmq: the tx child)
              keeps ``inflight`` requests per receiver in flight, oldest first,
              and times each one
    finish    tx: kvxferd joins its engine thread and counts failed requests
              rx: verify the blocks the last request of each slot wrote

Every source block of layer ``l``, block ``b`` holds a random tile with an 8-byte
stamp ``f(l, b)`` at its head and ``~f(l, b)`` at its tail, so a block written
to the wrong place, half written or not written at all fails the check.
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import math
import os
import platform
import select
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import IO, TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import ValidationError

from kvxferd.config import DataPlaneSettings, PoolSettings
from kvxferd.layout import Layout, write_descriptors

if TYPE_CHECKING:
    import zmq

    from kvxferd.dataplane import NixlDataPlane
    from kvxferd.pool import KvPool
    from kvxferd.receiver import Receiver, RxHandle
    from kvxferd.sender import Sender, TxHandle

Path_ = Literal["kvxferd", "nixl", "zmq"]
PATHS: tuple[Path_, ...] = ("kvxferd", "nixl", "zmq")
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# Bounds. Every wait below has one of these deadlines, every loop a count or a deadline.
SETUP_TIMEOUT_S = 120.0  # one workload's pools, agents, Sender and Receivers
STEP_TIMEOUT_S = 60.0  # one prepare / finish / connect / teardown step
RUN_TIMEOUT_FLOOR_S = 60.0  # one repetition, plus 1 s per 50 MB (a 0.05 GB/s floor)
CHILD_START_TIMEOUT_S = 120.0  # imports (torch, nixl) on a loaded 2-core machine
MIN_POOL_BYTES = 64 * MiB  # no pool smaller: small requests should not all sit in L1/L2
STAMP_TAG = 0x4B56  # "KV"


class BenchError(RuntimeError):
    """The benchmark could not run (a child failed, timed out, or a setting is unusable)."""


# -- workloads -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """One KV-shaped workload: ``blocks`` blocks of ``block_kib`` KiB per layer per request."""

    name: str
    block_kib: int
    blocks: int
    layers: int = 1
    scattered: bool = True  # block ids drawn at random; else one contiguous run per request
    threads: int = 4  # kvxferd sender worker threads
    receivers: int = 1
    inflight: int = 4  # requests in flight per receiver
    rate: float = 0.0  # requests/s per receiver (open loop, paced); 0 = closed loop
    target: str = ""  # the target this workload is evidence for, if any

    @property
    def block_bytes(self) -> int:
        return self.block_kib * KiB

    @property
    def request_bytes(self) -> int:
        return self.layers * self.blocks * self.block_bytes

    def label(self) -> str:
        ids = "scattered" if self.scattered else "contiguous"
        pace = f", paced {self.rate:g}/s" if self.rate else ""
        layers = f" x {self.layers} layers" if self.layers > 1 else ""
        return (
            f"{_size(self.block_bytes)} blocks x {self.blocks}{layers}"
            f" = {_size(self.request_bytes)}, {ids}, {self.threads} thr, {self.receivers} rx, "
            f"{self.inflight} in flight{pace}"
        )


def _size(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KiB"
    return f"{n} B"


W = Workload
QUICK: tuple[Workload, ...] = (
    W("bulk-1m-contig", 1024, 64, scattered=False, target="bulk"),
    W("bulk-256k-scat", 256, 256, target="bulk"),
    W("scat-16k-64m", 16, 4096, target="scatter16k"),
    W("mid-64k-4m-2rx", 64, 64, receivers=2, inflight=8),
    W("small-4k-w16", 4, 1, inflight=16, target="small4k-rate"),
    W("small-4k-paced", 4, 1, inflight=16, rate=5000, target="small4k-latency"),
)
FULL: tuple[Workload, ...] = (
    W("bulk-1m-contig", 1024, 64, scattered=False, target="bulk"),
    W("bulk-1m-scat", 1024, 64, target="bulk"),
    W("bulk-256k-contig", 256, 256, scattered=False, target="bulk"),
    W("bulk-256k-scat", 256, 256, target="bulk"),
    W("bulk-256k-16m-2rx", 256, 64, receivers=2),
    W("contig-16k-64m", 16, 4096, scattered=False),
    W("scat-16k-64m", 16, 4096, target="scatter16k"),
    W("scat-16k-64m-8layers", 16, 512, layers=8),
    W("scat-4k-16m", 4, 4096),
    W("mid-64k-4m-t1", 64, 64, threads=1, inflight=8),
    W("mid-64k-4m-t2", 64, 64, threads=2, inflight=8),
    W("mid-64k-4m-t4", 64, 64, threads=4, inflight=8),
    W("mid-64k-4m-2rx", 64, 64, receivers=2, inflight=8),
    W("single-1m-w8", 1024, 1, inflight=8),
    W("small-16k-w16", 16, 1, inflight=16),
    W("small-4k-w16", 4, 1, inflight=16, target="small4k-rate"),
    W("small-4k-w16-2rx", 4, 1, receivers=2, inflight=16),
    W("small-4k-w1", 4, 1, inflight=1),
    W("small-4k-paced", 4, 1, inflight=16, rate=5000, target="small4k-latency"),
)
del W

PRESETS = {
    # rep_bytes: bytes per repetition (all receivers); max_requests: per receiver per repetition
    "quick": dict(workloads=QUICK, reps=3, rep_bytes=256 * MiB, max_requests=2000, rep_seconds=0.4),
    "full": dict(workloads=FULL, reps=5, rep_bytes=1 * GiB, max_requests=6000, rep_seconds=1.0),
}


@dataclass(frozen=True)
class Options:
    """What one ``kvxferd bench`` run measures, and with which NIXL configuration."""

    preset: str = "quick"
    workloads: tuple[Workload, ...] = QUICK
    reps: int = 3
    rep_bytes: int = 256 * MiB
    max_requests: int = 2000
    rep_seconds: float = 0.4  # length of one paced repetition
    dataplane: DataPlaneSettings = field(default_factory=DataPlaneSettings)
    seed: int = 1
    child_module: str = "kvxferd"  # children run as ``python -m <child_module> _bench-tx|rx``
    timeout_s: float = 3600.0  # the whole run


# -- the plan both sides derive ----------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Pool shape, destination slots and source blocks of every request; identical in every process.

    Receiver ``k``'s request ``i`` of a repetition writes source blocks ``src[i]``
    into its slot ``i % inflight``. Slots are disjoint, so the ``inflight``
    requests in flight never share a destination block.
    """

    workload: Workload
    requests: int  # per receiver per repetition
    num_blocks: int
    seed: int
    tag: int  # the workload's index; part of every request id

    @staticmethod
    def make(w: Workload, opts: Options, tag: int) -> Plan:
        if w.rate:
            requests = int(w.rate * opts.rep_seconds)
        else:
            requests = math.ceil(opts.rep_bytes / (w.request_bytes * w.receivers))
        requests = max(2 * w.inflight, min(opts.max_requests, requests))
        min_blocks = math.ceil(MIN_POOL_BYTES / (w.layers * w.block_bytes))
        return Plan(w, requests, max(2 * w.inflight * w.blocks, min_blocks), opts.seed, tag)

    def pool_settings(self) -> PoolSettings:
        w = self.workload
        return PoolSettings(
            num_layers=w.layers,
            num_blocks=self.num_blocks,
            block_elems=w.block_bytes,
            dtype="uint8",
            aux_slots=4,
            aux_slot_bytes=64,
        )

    @property
    def layout(self) -> Layout:
        w = self.workload
        return Layout(w.layers, self.num_blocks, w.block_bytes, "uint8", 4, 64)

    def slots(self) -> npt.NDArray[np.int64]:
        """Destination blocks of each slot, shape ``(inflight, blocks)``."""
        w = self.workload
        ids = np.arange(self.num_blocks, dtype=np.int64)
        if w.scattered:
            ids = np.random.default_rng([self.seed, self.tag, 7]).permutation(ids)
        return ids[: w.inflight * w.blocks].reshape(w.inflight, w.blocks)

    def sources(self, rep: int, k: int) -> npt.NDArray[np.int64]:
        """Source blocks of receiver ``k``'s requests in repetition ``rep``, shape ``(requests, blocks)``."""
        w, n, nb = self.workload, self.workload.blocks, self.num_blocks
        rng = np.random.default_rng([self.seed, self.tag, rep + 1000, k])
        starts = rng.integers(0, nb - n + 1 if not w.scattered else nb, size=self.requests)
        if not w.scattered:
            return (starts[:, None] + np.arange(n, dtype=np.int64)[None, :]).astype(np.int64)
        # A fixed random permutation, read from a random offset: distinct ids, scattered, cheap.
        perm = np.random.default_rng([self.seed, self.tag, 11]).permutation(nb).astype(np.int64)
        return perm[(starts[:, None] + np.arange(n)[None, :]) % nb]

    def request_id(self, rep: int, k: int, i: int) -> str:
        return f"bench{self.tag}.r{rep}.k{k}.i{i}"

    def descs_per_request(self) -> int:
        src, _ = write_descriptors(
            self.layout, 0, self.sources(0, 0)[0], 0, self.slots()[0], 0, self.workload.layers
        )
        return int(src.shape[0])

    def run_timeout_s(self, count: int) -> float:
        return RUN_TIMEOUT_FLOOR_S + count * self.workload.request_bytes / 50e6

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "workload": asdict(self.workload)}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Plan:
        return Plan(**{**d, "workload": Workload(**d["workload"])})


# -- block content -----------------------------------------------------------------------------
def _stamps(layers: int, blocks: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Head stamp of each (layer, block): shape ``(layers, len(blocks))``."""
    layer = np.arange(layers, dtype=np.int64)[:, None]
    return (STAMP_TAG << 48) | (layer << 32) | blocks[None, :]


def _tile(plan: Plan) -> npt.NDArray[np.uint8]:
    rng = np.random.default_rng([plan.seed, plan.tag, 3])
    return rng.integers(0, 256, size=plan.workload.block_bytes, dtype=np.uint8)


def _kv_array(pool: KvPool) -> npt.NDArray[np.uint8]:
    """The pool's KV region as a numpy ``[layer, block, byte]`` view (no copy)."""
    return pool.kv_bytes_view().numpy()  # type: ignore[no-any-return]


def fill_source(kv: npt.NDArray[np.uint8], plan: Plan) -> None:
    """Every block: the tile, its head stamp and its tail stamp."""
    layers, nb, _ = kv.shape
    kv[:] = _tile(plan)
    head = _stamps(layers, np.arange(nb, dtype=np.int64))
    kv[:, :, :8] = head.view(np.uint8).reshape(layers, nb, 8)
    kv[:, :, -8:] = (~head).view(np.uint8).reshape(layers, nb, 8)


def poison(kv: npt.NDArray[np.uint8], slots: npt.NDArray[np.int64]) -> None:
    """Zero the head and tail stamps of every destination block, so a missing write shows."""
    ids = slots.ravel()
    kv[:, ids, :8] = 0
    kv[:, ids, -8:] = 0


def verify(
    kv: npt.NDArray[np.uint8], plan: Plan, src: npt.NDArray[np.int64], count: int
) -> tuple[bool, int, str]:
    """Check the blocks the last request of each slot wrote; (ok, blocks checked, what was wrong)."""
    w, slots, tile = plan.workload, plan.slots(), _tile(plan)
    checked = 0
    for j in range(min(w.inflight, count)):
        last = j + ((count - 1 - j) // w.inflight) * w.inflight
        s, d = src[last], slots[j]
        want = _stamps(w.layers, s)
        head = np.ascontiguousarray(kv[:, d, :8]).view(np.int64)[..., 0]
        tail = np.ascontiguousarray(kv[:, d, -8:]).view(np.int64)[..., 0]
        if not np.array_equal(head, want) or not np.array_equal(tail, ~want):
            bad = int(np.count_nonzero((head != want) | (tail != ~want)))
            return False, checked, f"slot {j} (request {last}): {bad} blocks with wrong stamps"
        sample = d[np.linspace(0, d.size - 1, num=min(d.size, 64)).astype(np.int64)]
        if not np.array_equal(
            kv[:, sample, 8:-8],
            np.broadcast_to(tile[8:-8], (w.layers, sample.size, tile.size - 16)),
        ):
            return False, checked, f"slot {j} (request {last}): block body differs from the source"
        checked += d.size * w.layers
    return True, checked, ""


# -- one side of one path, inside a child ------------------------------------------------------
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


# kvxferd --------------------------------------------------------------------------------------
class KvxTx(_Side):
    """kvxferd's Sender, and an engine thread that publishes a window ahead and closes what ended."""

    def __init__(self, plan: Plan, dataplane: DataPlaneSettings) -> None:
        from kvxferd.config import load_sender_settings
        from kvxferd.sender import Sender

        self.plan = plan
        settings = load_sender_settings(
            listen="tcp://127.0.0.1:0",
            num_threads=plan.workload.threads,
            name=f"bench-tx-{plan.tag}",
            pool=plan.pool_settings().model_dump(),
            dataplane=dataplane.model_dump(),
        )
        self.sender: Sender | None = Sender(settings).start()
        fill_source(_kv_array(self.sender.pool), plan)
        self._engine: threading.Thread | None = None
        self._failures = 0
        self._published = threading.Event()

    def info(self) -> dict[str, Any]:
        assert self.sender is not None
        return {"endpoint": self.sender.endpoint}

    def prepare(self, rep: int, count: int) -> dict[str, Any]:
        self._failures = 0
        self._published.clear()
        self._engine = threading.Thread(
            target=self._publish_and_close, args=(rep, count), name="bench-engine", daemon=True
        )
        self._engine.start()
        if not self._published.wait(STEP_TIMEOUT_S):
            raise BenchError("the first requests were not published in time")
        return {}

    def _publish_and_close(self, rep: int, count: int) -> None:
        """What an engine does: publish finished requests, close each once it ended."""
        assert self.sender is not None
        sender, plan, w = self.sender, self.plan, self.plan.workload
        srcs = [plan.sources(rep, k) for k in range(w.receivers)]
        order = [(i, k) for i in range(count) for k in range(w.receivers)]
        lead = 2 * w.inflight * w.receivers  # published ahead of the receivers' fetches
        deadline = time.monotonic() + plan.run_timeout_s(count) + STEP_TIMEOUT_S
        handles: deque[TxHandle] = deque()
        nxt = 0
        try:
            while nxt < min(lead, len(order)):
                i, k = order[nxt]
                handles.append(sender.publish(plan.request_id(rep, k, i), srcs[k][i]))
                nxt += 1
            self._published.set()
            while handles:
                h = handles.popleft()
                out = h.wait(max(0.0, deadline - time.monotonic()))
                if out is None or not out.ok:
                    self._failures += 1
                h.close(timeout=max(0.0, deadline - time.monotonic()))
                if nxt < len(order):
                    i, k = order[nxt]
                    handles.append(sender.publish(plan.request_id(rep, k, i), srcs[k][i]))
                    nxt += 1
        except Exception as e:  # reported by finish(); the receivers time out on their own
            sys.stderr.write(f"bench engine thread: {e!r}\n")
            self._failures += len(order) - nxt + len(handles) + 1
            self._published.set()

    def finish(self, rep: int, count: int) -> dict[str, Any]:
        if self._engine is not None:
            self._engine.join(self.plan.run_timeout_s(count) + STEP_TIMEOUT_S)
            if self._engine.is_alive():
                raise BenchError("the engine thread did not finish")
        assert self.sender is not None
        return {"failures": self._failures, "stats": self.sender.stats.snapshot()}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.shutdown()
            self.sender = None


class KvxRx(_Destination):
    """kvxferd's Receiver, fetching with a window of ``inflight`` and timing each fetch."""

    def __init__(self, plan: Plan, dataplane: DataPlaneSettings, index: int) -> None:
        from kvxferd.config import load_receiver_settings
        from kvxferd.receiver import Receiver

        super().__init__(plan, index)
        settings = load_receiver_settings(
            name=f"bench-rx{index}-{plan.tag}",
            pool=plan.pool_settings().model_dump(),
            dataplane=dataplane.model_dump(),
        )
        self.receiver: Receiver | None = Receiver(settings).start()
        self.endpoint = ""

    def kv(self) -> npt.NDArray[np.uint8]:
        assert self.receiver is not None
        return _kv_array(self.receiver.pool)

    def connect(self, peers: list[dict[str, Any]]) -> None:
        self.endpoint = peers[0]["endpoint"]

    def run(self, rep: int, count: int) -> dict[str, Any]:
        assert self.receiver is not None
        rx, plan, w = self.receiver, self.plan, self.plan.workload
        window: deque[tuple[RxHandle, float]] = deque()
        lat: list[float] = []
        nbytes = failures = 0
        t0 = last = time.monotonic()
        deadline = t0 + plan.run_timeout_s(count)

        def finish_oldest() -> None:
            nonlocal nbytes, failures, last
            handle, t_ref = window.popleft()
            out = handle.wait(max(0.0, deadline - time.monotonic()))
            done_at = handle.session.completion.set_at
            if out is None or not out.ok or done_at is None:
                failures += 1
            else:
                lat.append(done_at - t_ref)
                nbytes += out.nbytes
                last = max(last, done_at)
            handle.close(timeout=max(0.0, deadline - time.monotonic()))

        for i in range(count):
            while len(window) >= w.inflight:
                finish_oldest()
            t_ref = _pace(t0, i, w.rate)
            try:
                h = rx.fetch(
                    plan.request_id(rep, self.index, i),
                    self.endpoint,
                    self.slots[i % w.inflight],
                    want_aux=False,
                )
            except Exception as e:
                sys.stderr.write(f"bench: fetch refused: {e!r}\n")
                failures += 1
                continue
            window.append((h, t_ref))
        while window:
            finish_oldest()
        return _result(t0, last, lat, count, nbytes, failures)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.shutdown()
            self.receiver = None


def _pace(t0: float, i: int, rate: float) -> float:
    """Closed loop: now. Paced: sleep until request ``i``'s slot and time from it, even if late."""
    now = time.monotonic()
    if not rate:
        return now
    at = t0 + i / rate
    if at > now:
        time.sleep(at - now)
    return at


# raw NIXL -------------------------------------------------------------------------------------
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


# plain ZMQ ------------------------------------------------------------------------------------
def _offsets(plan: Plan, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64]) -> tuple[Any, Any]:
    """Byte offsets and lengths of each run, on both sides (the same runs NIXL would get)."""
    s, d = write_descriptors(plan.layout, 0, src, 0, dst, 0, plan.workload.layers)
    return s[:, :2].tolist(), d[:, :2].tolist()


class ZmqTx(_Side):
    """One DEALER per receiver; each request is a header plus one zero-copy frame per run of blocks."""

    def __init__(self, plan: Plan) -> None:
        from kvxferd.pool import KvPool

        self.plan = plan
        self.pool = KvPool(plan.pool_settings(), owner=f"bench-zmq-tx{plan.tag}")
        self.buf = _kv_array(self.pool).reshape(-1).data  # a memoryview: frames are slices of it
        fill_source(_kv_array(self.pool), plan)
        self.dealers: list[zmq.Socket[bytes]] = []

    def connect(self, peers: list[dict[str, Any]]) -> None:
        import zmq

        from kvxferd.control import process_context

        for p in peers:
            sock = process_context().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(STEP_TIMEOUT_S * 1000))
            sock.connect(p["endpoint"])
            self.dealers.append(sock)

    def run(self, rep: int, count: int) -> dict[str, Any]:
        import zmq

        plan, w = self.plan, self.plan.workload
        slots = plan.slots()
        srcs = [plan.sources(rep, k) for k in range(len(self.dealers))]
        poller = zmq.Poller()
        for sock in self.dealers:
            poller.register(sock, zmq.POLLIN)
        sent: list[dict[int, float]] = [{} for _ in self.dealers]  # request -> t_ref
        nxt = [0] * len(self.dealers)
        lat: list[float] = []
        nbytes = failures = 0
        t0 = last = time.monotonic()
        deadline = t0 + plan.run_timeout_s(count)
        while any(n < count for n in nxt) or any(sent):
            now = time.monotonic()
            if now > deadline:
                raise BenchError(f"zmq: repetition still running after {deadline - t0:.0f} s")
            for k, sock in enumerate(self.dealers):
                while (
                    len(sent[k]) < w.inflight
                    and nxt[k] < count
                    and (not w.rate or now >= t0 + nxt[k] / w.rate)
                ):
                    i = nxt[k]
                    t_ref = t0 + i / w.rate if w.rate else time.monotonic()
                    runs, _ = _offsets(plan, srcs[k][i], slots[i % w.inflight])
                    frames = [self.buf[off : off + n] for off, n in runs]
                    sock.send_multipart([json.dumps([rep, i]).encode(), *frames], copy=False)
                    sent[k][i] = t_ref
                    nxt[k] += 1
            wait_ms = 100
            if w.rate and any(n < count for n in nxt):
                wait_ms = 0 if any(len(s) < w.inflight for s in sent) else 100
            events = dict(poller.poll(wait_ms))
            if not events and wait_ms == 0:
                time.sleep(50e-6)  # paced and idle: zmq_poll counts in whole milliseconds
            for k, sock in enumerate(self.dealers):
                if sock not in events:
                    continue
                for _ in range(w.inflight):
                    try:
                        ack = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    done_at = time.monotonic()
                    ok, i = json.loads(ack)
                    t_ref = sent[k].pop(i)
                    if ok:
                        lat.append(done_at - t_ref)
                        nbytes += w.request_bytes
                        last = max(last, done_at)
                    else:
                        failures += 1
        return _result(t0, last, lat, count * len(self.dealers), nbytes, failures)

    def close(self) -> None:
        for sock in self.dealers:
            sock.close(linger=0)
        try:
            self.buf.release()
        except BufferError:  # zmq may still hold a zero-copy frame; the mapping dies with it
            pass
        self.pool.close()


class ZmqRx(_Destination):
    """A ROUTER thread that copies each request's frames into the destination blocks and acks it."""

    def __init__(self, plan: Plan, index: int) -> None:
        import zmq

        from kvxferd.control import process_context
        from kvxferd.pool import KvPool

        super().__init__(plan, index)
        self.pool = KvPool(plan.pool_settings(), owner=f"bench-zmq-rx{index}-{plan.tag}")
        self.router = process_context().socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
        self._sources: tuple[int, npt.NDArray[np.int64]] | None = None
        self._stop = threading.Event()
        # Owns self.router from here on; the main thread touches the pool only between repetitions.
        self._thread = threading.Thread(target=self._serve, name="bench-zmq-rx", daemon=True)
        self._thread.start()

    def kv(self) -> npt.NDArray[np.uint8]:
        return _kv_array(self.pool)

    def info(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint}

    def _serve(self) -> None:
        import zmq

        flat = _kv_array(self.pool).reshape(-1)
        slots, inflight = self.slots, self.plan.workload.inflight
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(50):
                    continue
                for _ in range(256):
                    try:
                        ident, header, *data = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    rep, i = json.loads(header.bytes)
                    if self._sources is None or self._sources[0] != rep:
                        self._sources = (rep, self.plan.sources(rep, self.index))
                    _, runs = _offsets(self.plan, self._sources[1][i], slots[i % inflight])
                    ok = len(runs) == len(data)
                    for (off, n), frame in zip(runs, data, strict=False):
                        buf = np.frombuffer(frame.buffer, dtype=np.uint8)
                        ok = ok and buf.size == n
                        flat[off : off + min(n, buf.size)] = buf[:n]
                    self.router.send_multipart([ident.bytes, json.dumps([ok, i]).encode()])
        finally:
            self.router.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.pool.close()


# -- a child process ---------------------------------------------------------------------------
class _LineReader:
    """Whole lines from a file descriptor, each read bounded by a timeout (no buffered-IO surprises)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = b""

    def readline(self, timeout: float) -> bytes | None:
        """The next line without its newline; None after ``timeout``; EOFError once the peer closed."""
        deadline = time.monotonic() + timeout
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                line, self._buf = self._buf[:nl], self._buf[nl + 1 :]
                return line
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                chunk = os.read(self.fd, 1 << 20)
                if not chunk:
                    raise EOFError
                self._buf += chunk


class _ChildServer:
    """The command loop of a ``_bench-tx`` / ``_bench-rx`` child; replies on a private stdout."""

    def __init__(self, role: str, spec: dict[str, Any], out: IO[str]) -> None:
        self.role, self.out = role, out
        self.index = int(spec.get("index", 0))
        self.dataplane = DataPlaneSettings(**spec["dataplane"])
        self.sides: dict[str, _Side] = {}
        self.parent = os.getppid()

    def emit(self, event: str, **fields: Any) -> None:
        self.out.write(json.dumps({"event": event, **fields}) + "\n")
        self.out.flush()

    def serve(self, max_s: float) -> int:
        self.emit("hello", role=self.role, pid=os.getpid())
        commands = _LineReader(sys.stdin.fileno())
        deadline = time.monotonic() + max_s
        while time.monotonic() < deadline:
            if os.getppid() != self.parent:  # the parent died: nobody will read us
                break
            try:
                line = commands.readline(1.0)
            except EOFError:
                break
            if line is None:
                continue
            cmd = json.loads(line)
            if cmd["cmd"] == "exit":
                break
            try:
                self.emit("ok", **self.handle(cmd))
            except Exception as e:
                self.emit("error", detail=f"{self.role}[{self.index}] {cmd['cmd']}: {e!r}"[:2000])
        self.teardown()
        return 0

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        what = cmd["cmd"]
        if what == "setup":
            self.teardown()
            plan = Plan.from_json(cmd["plan"])
            self.sides = self._make_sides(plan)
            return {"info": {p: s.info() for p, s in self.sides.items()}}
        if what == "teardown":
            self.teardown()
            return {}
        side = self.sides[cmd["path"]]
        if what == "connect":
            side.connect(cmd["peers"])
            return {}
        rep, count = int(cmd["rep"]), int(cmd["count"])
        step = {"prepare": side.prepare, "run": side.run, "finish": side.finish}[what]
        return step(rep, count)

    def _make_sides(self, plan: Plan) -> dict[str, _Side]:
        dp = self.dataplane
        if self.role == "tx":
            return {"kvxferd": KvxTx(plan, dp), "nixl": RawTx(plan, dp), "zmq": ZmqTx(plan)}
        k = self.index
        return {"kvxferd": KvxRx(plan, dp, k), "nixl": RawRx(plan, dp, k), "zmq": ZmqRx(plan, k)}

    def teardown(self) -> None:
        for side in self.sides.values():
            try:
                side.close()
            except Exception as e:
                sys.stderr.write(f"bench {self.role}: close failed: {e!r}\n")
        self.sides = {}
        gc.collect()  # drop NIXL agents and pool mappings before the next workload


def run_child(role: str, spec_json: str) -> int:
    """Entry of ``python -m kvxferd _bench-tx|_bench-rx SPEC_JSON``."""
    # Our replies get a private copy of stdout; whatever a library prints to fd 1 goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    spec = json.loads(spec_json)
    return _ChildServer(role.removeprefix("_bench-"), spec, out).serve(
        float(spec.get("max_s", 7200))
    )


# -- the parent --------------------------------------------------------------------------------
class _Child:
    """A child process: commands in as JSON lines on stdin, replies out as JSON lines on stdout."""

    def __init__(self, module: str, role: str, spec: dict[str, Any]) -> None:
        self.name = f"{role}{spec.get('index', '')}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, f"_bench-{role}", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        self._lines = _LineReader(self.proc.stdout.fileno())

    def send(self, cmd: str, **fields: Any) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"cmd": cmd, **fields}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise BenchError(f"child {self.name} exited (code {self.proc.poll()})") from None

    def reply(self, timeout: float) -> dict[str, Any]:
        """The next JSON line; other lines go to stderr. BenchError on error, exit or timeout."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.readline(max(0.0, deadline - time.monotonic()))
            except EOFError:
                raise BenchError(f"child {self.name} exited (code {self.proc.wait(5)})") from None
            if line is None:
                raise BenchError(f"child {self.name}: no reply within {timeout:.0f} s")
            if not line.startswith(b"{"):
                sys.stderr.buffer.write(line + b"\n")
                continue
            msg: dict[str, Any] = json.loads(line)
            if msg.get("event") == "error":
                raise BenchError(msg.get("detail", "child error"))
            return msg

    def ask(self, timeout: float, cmd: str, **fields: Any) -> dict[str, Any]:
        self.send(cmd, **fields)
        return self.reply(timeout)

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send("exit")
                self.proc.wait(20)
        except (BenchError, subprocess.TimeoutExpired, OSError):
            self.proc.kill()
            self.proc.wait(10)


def _ask_all(
    children: Sequence[_Child], timeout: float, cmd: str, **fields: Any
) -> list[dict[str, Any]]:
    """Send to every child first, then collect: the children work in parallel."""
    for c in children:
        c.send(cmd, **fields)
    return [c.reply(timeout) for c in children]


@dataclass
class Rep:
    """One repetition of one path."""

    path: str
    rep: int
    requests: int
    bytes: int
    elapsed_s: float
    failures: int
    verified: bool
    detail: str
    lat_us: list[float]
    sender_stats: dict[str, int] = field(default_factory=dict)  # kvxferd only: Sender counters

    @property
    def gbps(self) -> float:
        return self.bytes / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0

    @property
    def rps(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s > 0 else 0.0


class _Runner:
    """Starts the children once, then runs each workload's repetitions in alternation."""

    def __init__(self, opts: Options, progress: IO[str]) -> None:
        self.opts, self.progress = opts, progress
        self.tty = progress.isatty()
        self.children: list[_Child] = []

    def say(self, text: str, final: bool = True) -> None:
        if self.tty:
            self.progress.write("\r\x1b[2K" + text + ("\n" if final else ""))
        else:
            self.progress.write(text + "\n")
        self.progress.flush()

    def run(self) -> dict[str, Any]:
        opts = self.opts
        started = time.time()
        deadline = time.monotonic() + opts.timeout_s
        nrx = max(w.receivers for w in opts.workloads)
        spec = {"dataplane": opts.dataplane.model_dump(), "max_s": opts.timeout_s + 600}
        self.say(f"bench: starting 1 tx and {nrx} rx processes")
        try:
            self.children = [_Child(opts.child_module, "tx", spec)] + [
                _Child(opts.child_module, "rx", {**spec, "index": k}) for k in range(nrx)
            ]
            for c in self.children:
                c.reply(CHILD_START_TIMEOUT_S)
            results = []
            for n, w in enumerate(opts.workloads):
                if time.monotonic() > deadline:
                    raise BenchError(f"the run passed its {opts.timeout_s:.0f} s bound")
                results.append(self._workload(n, w))
        finally:
            for c in self.children:
                c.stop()
        return build_report(opts, results, started)

    def _workload(self, n: int, w: Workload) -> dict[str, Any]:
        opts = self.opts
        plan = Plan.make(w, opts, n)
        tx, rxs = self.children[0], self.children[1 : 1 + w.receivers]
        head = f"bench [{n + 1}/{len(opts.workloads)}] {w.name}"
        self.say(
            f"{head}: setting up ({w.label()}; {plan.requests} requests/rep/receiver)", final=False
        )
        infos = [
            r["info"] for r in _ask_all([tx, *rxs], SETUP_TIMEOUT_S, "setup", plan=plan.to_json())
        ]
        tx_info, rx_infos = infos[0], infos[1:]
        for path in PATHS:
            tx.ask(STEP_TIMEOUT_S, "connect", path=path, peers=[i[path] for i in rx_infos])
            _ask_all(rxs, STEP_TIMEOUT_S, "connect", path=path, peers=[tx_info[path]])
        warmup = min(plan.requests, 2 * w.inflight)
        for path in PATHS:
            self._rep(plan, path, -1, warmup)
        reps: dict[str, list[Rep]] = {p: [] for p in PATHS}
        for r in range(opts.reps):
            for path in PATHS:
                reps[path].append(self._rep(plan, path, r, plan.requests))
            figures = ", ".join(f"{p} {reps[p][-1].gbps:.2f} GB/s" for p in PATHS)
            self.say(f"{head}: rep {r + 1}/{opts.reps}: {figures}", final=r == opts.reps - 1)
        _ask_all(rxs, STEP_TIMEOUT_S, "teardown")  # receivers first: nothing is in flight now
        tx.ask(STEP_TIMEOUT_S, "teardown")
        return summarize_workload(plan, reps)

    def _rep(self, plan: Plan, path: str, rep: int, count: int) -> Rep:
        w = plan.workload
        tx, rxs = self.children[0], self.children[1 : 1 + w.receivers]
        everyone = [tx, *rxs]
        step = dict(path=path, rep=rep, count=count)
        _ask_all(everyone, STEP_TIMEOUT_S, "prepare", **step)
        drivers = rxs if path == "kvxferd" else [tx]
        runs = _ask_all(drivers, plan.run_timeout_s(count) + STEP_TIMEOUT_S, "run", **step)
        finals = _ask_all(everyone, plan.run_timeout_s(count) + STEP_TIMEOUT_S, "finish", **step)
        bad = [f["detail"] for f in finals[1:] if not f["verified"]]
        return Rep(
            path=path,
            rep=rep,
            requests=sum(r["requests"] for r in runs),
            bytes=sum(r["bytes"] for r in runs),
            elapsed_s=max(r["t1"] for r in runs) - min(r["t0"] for r in runs),
            failures=sum(r["failures"] for r in runs) + int(finals[0].get("failures", 0)),
            verified=not bad,
            detail="; ".join(bad),
            lat_us=[x for r in runs for x in r["lat_us"]],
            sender_stats=finals[0].get("stats", {}),
        )


# -- figures, targets, report ------------------------------------------------------------------
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
                {k: v for k, v in asdict(r).items() if k not in ("lat_us", "sender_stats")}
                | {"gbps": r.gbps, "rps": r.rps}
                for r in rs
            ],
        }
        if rs and rs[-1].sender_stats:  # cumulative over the workload's repetitions
            paths[path]["sender_stats"] = rs[-1].sender_stats
        if not paths[path]["verified"]:
            paths[path]["detail"] = "; ".join(r.detail for r in rs if r.detail)

    def ratio(a: str, b: str) -> float:
        den = paths[b]["gbps"]["median"]
        return paths[a]["gbps"]["median"] / den if den > 0 else float("inf")

    return {
        **asdict(w),
        "block_bytes": w.block_bytes,
        "request_bytes": w.request_bytes,
        "descs_per_request": plan.descs_per_request(),
        "requests_per_rep": plan.requests,
        "pool_blocks": plan.num_blocks,
        "paths": paths,
        "ratio_kvxferd_nixl": ratio("kvxferd", "nixl"),
        "ratio_kvxferd_zmq": ratio("kvxferd", "zmq"),
    }


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

    ratio_target(
        "bulk", "bulk", "64 MiB requests of >= 256 KiB blocks: kvxferd >= 0.95x raw NIXL", 0.95
    )
    ratio_target(
        "scatter16k",
        "scatter16k",
        "64 MiB of 16 KiB scattered blocks (one descriptor per block): kvxferd >= 1.0x raw NIXL",
        1.0,
    )
    rate, paced = tagged("small4k-rate"), tagged("small4k-latency")
    if rate and paced:
        r, p = rate[0]["paths"]["kvxferd"], paced[0]["paths"]["kvxferd"]
        lat, rps = p["latency_ms"], r["rps"]["median"]
        met = lat["p50"] < 0.5 and lat["p99"] < 2.0 and rps >= 5000
        detail = (
            f"{rps:.0f} req/s closed loop with 16 in flight ({rate[0]['name']}); "
            f"p50 {lat['p50']:.3f} ms, p99 {lat['p99']:.3f} ms at {paced[0]['rate']:g} req/s offered "
            f"({paced[0]['name']})"
        )
    else:
        met, detail = None, "not run"
    out.append(
        {
            "target": "small4k",
            "text": "4 KiB single-block requests, 16 in flight: p50 < 0.5 ms, p99 < 2 ms, >= 5000 req/s",
            "met": met,
            "detail": detail,
        }
    )
    behind = [w["name"] for w in workloads if w["ratio_kvxferd_zmq"] <= 1.0]
    out.append(
        {
            "target": "zmq",
            "text": "kvxferd ahead of the ZMQ-copy path on every workload",
            "met": not behind if workloads else None,
            "detail": ("behind on " + ", ".join(behind)) if behind else "ahead on all",
        }
    )
    return out


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
        "version": 1,
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
    """Markdown tables: throughput and ratios, then latency and request rate, then targets."""
    m = report["machine"]
    lines = [
        f"kvxferd bench, {report['preset']} preset, {report['reps']} repetitions per path "
        f"(alternating), {report['elapsed_s']:.0f} s",
        f"machine: {m['nproc']} CPUs ({m['cpu_model']}), {m['mem_gib']} GiB, kernel {m['kernel']}, "
        f"nixl {m['nixl']}, pyzmq {m['pyzmq']}",
        f"data plane (kvxferd and raw NIXL alike): {report['dataplane_text']}",
        "",
        "| workload | request | descs | kvxferd GB/s | raw NIXL GB/s | ZMQ copy GB/s | kvxferd/NIXL | kvxferd/ZMQ |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]

    def gb(p: dict[str, Any]) -> str:
        g = p["gbps"]
        flag = "" if p["verified"] and not p["failures"] else " (!)"
        return f"{g['median']:.2f} [{g['min']:.2f}-{g['max']:.2f}]{flag}"

    for w in report["workloads"]:
        p = w["paths"]
        req = f"{_size(w['block_bytes'])} x {w['blocks']}" + (
            f" x {w['layers']}L" if w["layers"] > 1 else ""
        )
        lines.append(
            f"| {w['name']} | {req} {'scat' if w['scattered'] else 'contig'} | {w['descs_per_request']} "
            f"| {gb(p['kvxferd'])} | {gb(p['nixl'])} | {gb(p['zmq'])} "
            f"| {w['ratio_kvxferd_nixl']:.2f} | {w['ratio_kvxferd_zmq']:.2f} |"
        )
    lines += [
        "",
        "| workload | thr | rx | in flight | kvxferd p50 / p99 ms | NIXL p50 / p99 ms | ZMQ p50 / p99 ms | kvxferd req/s | NIXL req/s | ZMQ req/s |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for w in report["workloads"]:
        p = w["paths"]
        lat = [f"{p[x]['latency_ms']['p50']:.3f} / {p[x]['latency_ms']['p99']:.3f}" for x in PATHS]
        rps = [f"{p[x]['rps']['median']:.0f}" for x in PATHS]
        inflight = f"{w['inflight']}" + (f" @ {w['rate']:g}/s" if w["rate"] else "")
        lines.append(
            f"| {w['name']} | {w['threads']} | {w['receivers']} | {inflight} | "
            + " | ".join(lat + rps)
            + " |"
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


def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plot(report: dict[str, Any], path: str) -> None:
    """Grouped bars: median GB/s (min-max whiskers) of the three paths for every workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = report["workloads"]
    x = np.arange(len(ws))
    width = 0.27
    fig, ax = plt.subplots(figsize=(max(8.0, 0.75 * len(ws) + 3), 5.5))
    for j, (name, label) in enumerate(zip(PATHS, ("kvxferd", "raw NIXL", "ZMQ copy"), strict=True)):
        g = [w["paths"][name]["gbps"] for w in ws]
        med = np.array([v["median"] for v in g])
        err = np.array([[v["median"] - v["min"] for v in g], [v["max"] - v["median"] for v in g]])
        ax.bar(x + (j - 1) * width, med, width, yerr=err, capsize=2, label=label)
    labels = [
        f"{w['name']}\n{_size(w['block_bytes'])} x {w['blocks']}"
        + (f" x {w['layers']}L" if w["layers"] > 1 else "")
        + f" = {_size(w['request_bytes'])}"
        for w in ws
    ]
    ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (median of repetitions; whiskers min-max)")
    ax.set_title(
        f"kvxferd bench ({report['preset']} preset)\n{report['dataplane_text']}", fontsize=8
    )
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- command line ------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``kvxferd bench`` (and of ``python -m kvxferd.bench``)."""
    p.add_argument(
        "--quick", action="store_true", help="the quick preset (about a minute on 2 cores)"
    )
    p.add_argument(
        "--json", dest="json_path", metavar="PATH", help="write every figure as JSON here"
    )
    p.add_argument(
        "--plot", dest="plot_path", metavar="PATH", help="write a PNG chart here (needs matplotlib)"
    )
    p.add_argument(
        "--reps", type=int, help="repetitions per path and workload (default: the preset's)"
    )
    p.add_argument(
        "--only", metavar="NAMES", help="comma-separated workload names of the preset to run"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ucx-tls", dest="ucx_tls", help="UCX_TLS for every agent, e.g. 'shm'")
    p.add_argument(
        "--ucx-error-handling-mode", dest="ucx_error_handling_mode", choices=["peer", "none"]
    )
    p.add_argument("--ucx-num-workers", dest="ucx_num_workers", type=int)
    p.add_argument("--sync-mode", dest="sync_mode", choices=["strict", "rw", "none", "default"])
    p.add_argument(
        "--timeout", dest="timeout_s", type=float, default=3600.0, help="bound on the whole run (s)"
    )


def options_from_args(args: argparse.Namespace, child_module: str = "kvxferd") -> Options:
    preset = "quick" if args.quick else "full"
    base: dict[str, Any] = dict(PRESETS[preset])
    workloads: tuple[Workload, ...] = base.pop("workloads")
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        known = {w.name: w for w in (*FULL, *QUICK)}
        missing = [n for n in names if n not in known]
        if missing:
            raise BenchError(f"unknown workload(s) {missing}; known: {sorted(known)}")
        workloads = tuple(known[n] for n in names)
    dp_fields = ("ucx_tls", "ucx_error_handling_mode", "ucx_num_workers", "sync_mode")
    try:
        dp = DataPlaneSettings(
            **{f: getattr(args, f) for f in dp_fields if getattr(args, f, None) is not None}
        )
    except ValidationError as e:
        raise BenchError(f"invalid data-plane setting: {e.errors()[0]['msg']}") from None
    if args.reps is not None:
        if args.reps < 1:
            raise BenchError("--reps must be >= 1")
        base["reps"] = args.reps
    return Options(
        preset=preset,
        workloads=workloads,
        dataplane=dp,
        seed=args.seed,
        child_module=child_module,
        timeout_s=args.timeout_s,
        **base,
    )


def run_bench(opts: Options, progress: IO[str] | None = None) -> dict[str, Any]:
    """Run every workload of ``opts`` and return the report (what ``--json`` writes)."""
    return _Runner(opts, progress or sys.stderr).run()


def main_bench(args: argparse.Namespace, child_module: str = "kvxferd") -> int:
    """``kvxferd bench``: run, print the tables, write --json / --plot. 0 ok, 1 failed, 2 bad usage."""
    if args.plot_path and not plot_available():
        print(
            "kvxferd bench: --plot needs matplotlib; install it with pip install 'kvxferd[bench]'",
            file=sys.stderr,
        )
        return 2
    try:
        opts = options_from_args(args, child_module)
        print(f"kvxferd bench: {dataplane_description(opts.dataplane)}", file=sys.stderr)
        report = run_bench(opts)
    except BenchError as e:
        print(f"kvxferd bench: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(format_report(report))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot_path:
        write_plot(report, args.plot_path)
    ok = all(
        p["verified"] and not p["failures"]
        for w in report["workloads"]
        for p in w["paths"].values()
    )
    return 0 if ok else 1


def _main(argv: list[str] | None = None) -> int:
    """``python -m kvxferd.bench [flags]``, and the child roles ``_bench-tx|_bench-rx SPEC``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("_bench-tx", "_bench-rx"):
        return run_child(argv[0], argv[1])
    p = argparse.ArgumentParser(prog="python -m kvxferd.bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    return main_bench(p.parse_args(argv), child_module="kvxferd.bench")


__all__ = [
    "FULL",
    "QUICK",
    "BenchError",
    "Options",
    "Plan",
    "Workload",
    "add_arguments",
    "format_report",
    "main_bench",
    "run_bench",
    "run_child",
    "write_plot",
]

if __name__ == "__main__":
    raise SystemExit(_main())
