"""Block content: a random tile, stamped per (layer, block) at head and tail; poison; the check."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvxferd.bench.plan import Plan

if TYPE_CHECKING:
    from kvxferd.transfer.pool import KvPool

STAMP_TAG = 0x4B56  # "KV"


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
