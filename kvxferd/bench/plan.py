"""The plan both sides derive: pool shape, destination slots and source blocks of every request."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxferd.bench.workload import RUN_TIMEOUT_FLOOR_S, BenchError, MiB, Options, Workload
from kvxferd.config import PoolSettings
from kvxferd.transfer.layout import Layout, write_descriptors

MIN_POOL_BYTES = 64 * MiB  # no pool smaller: small requests should not all sit in L1/L2


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
        requests = max(2 * w.inflight, w.requests or min(opts.max_requests, requests))
        if w.pool_blocks:
            if w.pool_blocks < w.inflight * w.blocks:
                raise BenchError(f"{w.name}: pool_blocks must hold inflight x blocks")
            return Plan(w, requests, w.pool_blocks, opts.seed, tag)
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
        w = d["workload"]
        return Plan(**{**d, "workload": Workload(**{**w, "only": tuple(w.get("only", ()))})})
