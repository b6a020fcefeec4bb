"""What a run measures: the paths, the workloads and presets, a run's options and bounds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvxferd.config import DataPlaneSettings

# kvxferd-digest: the kvxferd path, each fetch checking the per-request digest (--digest).
Path_ = Literal["kvxferd", "kvxferd-digest", "engine", "nixl", "nixl-default", "zmq"]
# Library workloads: kvxferd's Sender/Receiver in the bench children. Engine workloads: real
# daemons driven through kvxferd.engine.client. Both against the two raw-NIXL baselines (nixl_path.py).
LIBRARY_PATHS: tuple[Path_, ...] = ("kvxferd", "nixl", "nixl-default", "zmq")
ENGINE_PATHS: tuple[Path_, ...] = ("engine", "nixl", "nixl-default")
PATHS: tuple[Path_, ...] = ("kvxferd", "engine", "nixl", "nixl-default", "zmq")
SPINNING_PATHS: tuple[Path_, ...] = ("nixl-default",)  # a progress thread that spins a core
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# Bounds. Every wait of the bench has one of these deadlines, every loop a count or a deadline.
SETUP_TIMEOUT_S = 120.0  # one workload's pools, agents, Sender and Receivers
STEP_TIMEOUT_S = 60.0  # one prepare / finish / connect / teardown step
RUN_TIMEOUT_FLOOR_S = 60.0  # one repetition, plus 1 s per 50 MB (a 0.05 GB/s floor)
CHILD_START_TIMEOUT_S = 120.0  # imports (torch, nixl) on a loaded 2-core machine


class BenchError(RuntimeError):
    """The benchmark could not run (a child failed, timed out, or a setting is unusable)."""


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
    engine: bool = False  # the engine path (daemons + kvxferd.engine.client) instead of the library
    only: tuple[Path_, ...] = ()  # measure just these paths (curves: kvxferd and tuned NIXL)
    pool_blocks: int = 0  # blocks per pool; 0 = the plan's default (at least 64 MiB)
    rx_procs: int = 0  # rx processes hosting the receivers; 0 = one process per receiver
    requests: int = 0  # per receiver per repetition; 0 = from the preset's bytes and rate
    keep_daemons: bool = False  # engine path: reuse the previous workload's daemons (same pool)

    @property
    def paths(self) -> tuple[Path_, ...]:
        return self.only or (ENGINE_PATHS if self.engine else LIBRARY_PATHS)

    @property
    def procs(self) -> int:
        """Receiver processes: receiver ``k`` lives in process ``k % procs``."""
        return min(self.receivers, self.rx_procs) if self.rx_procs else self.receivers

    def hosted_by(self, proc: int) -> list[int]:
        """The receivers that rx process ``proc`` hosts."""
        return list(range(proc, self.receivers, self.procs))

    @property
    def kvxferd_path(self) -> Path_:
        """The path that is kvxferd in this workload (ratios divide it by the others)."""
        return "engine" if self.engine else "kvxferd"

    @property
    def block_bytes(self) -> int:
        return self.block_kib * KiB

    @property
    def request_bytes(self) -> int:
        return self.layers * self.blocks * self.block_bytes

    def label(self) -> str:
        ids = "scattered" if self.scattered else "contiguous"
        if self.engine:
            ids += ", engine path"
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
# The engine path (issue 12): 16 KiB blocks, 1 and 4 per request, 1 to 64 requests in flight.
ENGINE_QUICK: tuple[Workload, ...] = tuple(
    W(f"engine-16k-x1-w{n}", 16, 1, inflight=n, engine=True, target=f"engine-w{n}")
    for n in (1, 4, 16, 64)
)
ENGINE_FULL: tuple[Workload, ...] = ENGINE_QUICK + tuple(
    W(f"engine-16k-x4-w{n}", 16, 4, inflight=n, engine=True, target=f"engine-w{n}")
    for n in (1, 4, 16, 64)
)
QUICK: tuple[Workload, ...] = (
    W("bulk-1m-contig", 1024, 64, scattered=False, target="bulk"),
    W("bulk-256k-scat", 256, 256, target="bulk"),
    W("scat-16k-64m", 16, 4096, target="scatter16k"),
    W("mid-64k-4m-2rx", 64, 64, receivers=2, inflight=8),
    W("small-4k-w16", 4, 1, inflight=16, target="small4k-rate"),
    W("small-4k-w1", 4, 1, inflight=1, target="small4k-latency"),
    W("small-4k-paced", 4, 1, inflight=16, rate=5000, target="small4k-loaded"),
    *ENGINE_QUICK,
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
    W("small-4k-w1", 4, 1, inflight=1, target="small4k-latency"),
    W("small-4k-paced", 4, 1, inflight=16, rate=5000, target="small4k-loaded"),
    *ENGINE_FULL,
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
