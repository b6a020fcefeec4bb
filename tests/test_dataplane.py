"""The data plane's prepared descriptor lists and the cheaper block checks, against real NIXL.

Two agents in one process write between two DRAM pools; every byte of the
destination is compared with what the unprepped path (descriptors built per
request) must produce.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvxferd.config import (
    DataPlaneSettings,
    PoolSettings,
    load_receiver_settings,
    load_sender_settings,
)
from kvxferd.errors import Reason, RejectedError
from kvxferd.stats import Stats
from kvxferd.testing import ControlledDataPlane
from kvxferd.transfer.dataplane import NixlDataPlane, wait_xfer
from kvxferd.transfer.layout import Layout, check_blocks, prepped_indices, write_descriptors
from kvxferd.transfer.pool import KvPool
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.sender import Sender
from kvxferd.transfer.session import RxState
from kvxferd.transfer.views import dataplane_closed

LAYERS, BLOCK_ELEMS = 3, 256  # 512-byte blocks of float16


def _layout(num_blocks: int) -> Layout:
    return Layout(LAYERS, num_blocks, 512, "float16", 4, 256)


class TestCheckBlocks:
    @pytest.mark.parametrize("num_blocks", [8, 64, 100_000])
    def test_repeats_rejected_at_every_size(self, num_blocks: int) -> None:
        """Both the counting pass (ids dense in the pool) and the sort (sparse) find a repeat."""
        lay = _layout(num_blocks)
        rng = np.random.default_rng(1)
        for n in (2, 3, min(num_blocks, 50), min(num_blocks, 4096)):
            ids = rng.choice(num_blocks, n, replace=False).astype(np.int64)
            check_blocks(lay, ids, "x")
            dup = ids.copy()
            dup[-1] = dup[0]
            with pytest.raises(RejectedError, match="repeated"):
                check_blocks(lay, dup, "x")

    def test_bounds_and_empty(self) -> None:
        lay = _layout(16)
        check_blocks(lay, np.array([15], dtype=np.int64), "x")
        for bad in ([16], [-1], [0, 16], []):
            with pytest.raises(RejectedError):
                check_blocks(lay, np.array(bad, dtype=np.int64), "x")


def test_prepped_indices_are_layer_major() -> None:
    blocks = np.array([5, 2, 7], dtype=np.int64)
    assert prepped_indices(blocks, 0, 1, 10).tolist() == [5, 2, 7]
    assert prepped_indices(blocks, 2, 3, 10).tolist() == [25, 22, 27]
    assert prepped_indices(blocks, 1, 3, 10).tolist() == [15, 12, 17, 25, 22, 27]


def _pool(tag: str, num_blocks: int) -> KvPool:
    return KvPool(
        PoolSettings(
            num_layers=LAYERS,
            num_blocks=num_blocks,
            block_elems=BLOCK_ELEMS,
            dtype="float16",
            aux_slots=4,
            aux_slot_bytes=256,
        ),
        owner=tag,
    )


class _Pair:
    def __init__(self, src_blocks: int, dst_blocks: int, stall_s: float | None = None) -> None:
        self.src = _pool("dptest-tx", src_blocks)
        self.dst = _pool("dptest-rx", dst_blocks)
        tag = f"{time.monotonic_ns()}"
        self.tx = NixlDataPlane(
            f"dptest-tx-{tag}", DataPlaneSettings(), self.src, stall_s=stall_s, stats=Stats()
        )
        self.rx = NixlDataPlane(f"dptest-rx-{tag}", DataPlaneSettings(), self.dst)
        self.peer = self.tx.add_peer(self.rx.metadata())
        self.prepared = self.tx.prepare_peer(
            self.peer, self.dst.layout, self.dst.kv_base, "DRAM", 0
        )
        src_bytes = self.src.kv_bytes_view()
        src_bytes.copy_(torch.randint(0, 256, src_bytes.shape, dtype=torch.uint8))

    def close(self) -> None:
        self.tx.close()
        self.rx.close()
        self.src.close()
        self.dst.close()


@pytest.fixture
def pair() -> Iterator[_Pair]:
    p = _Pair(64, 40)
    yield p
    p.close()


def _wait(p: _Pair, xfer_state: tuple) -> None:  # type: ignore[type-arg]
    """Wait for DONE, progressing the target agent too (progress threads are off; wire-up
    needs the target to progress)."""
    xfer, state = xfer_state
    deadline = time.monotonic() + 10
    while state == "PROC" and time.monotonic() < deadline:
        p.rx.progress()
        state = wait_xfer(xfer, state, time.monotonic() + 0.001)
        state = xfer.poll() if state == "STALLED" else state
    assert state == "DONE"
    assert xfer.release()


def _expected(p: _Pair, src: np.ndarray, dst: np.ndarray, lb: int, le: int) -> torch.Tensor:
    """The destination pool as the unprepped path leaves it, computed with torch."""
    want = p.dst.kv.clone()
    for layer in range(lb, le):
        want[layer, torch.from_numpy(dst)] = p.src.kv[layer, torch.from_numpy(src)]
    return want


CASES = {
    "one block": ([9], [3], 0, 1),
    "scattered": ([1, 17, 4, 60, 33], [39, 0, 12, 5, 6], 0, LAYERS),
    "contiguous (merged by NIXL)": (list(range(10, 30)), list(range(5, 25)), 0, LAYERS),
    "runs on one side only": ([0, 1, 2, 3], [7, 8, 20, 21], 1, 3),
    "last layer, last blocks": ([62, 63], [38, 39], LAYERS - 1, LAYERS),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prepped_write_is_byte_exact(pair: _Pair, case: str) -> None:
    """post_blocks writes exactly the bytes the descriptors built per request would."""
    assert pair.tx.prepped and pair.prepared
    s, d, lb, le = CASES[case]
    src, dst = np.array(s, dtype=np.int64), np.array(d, dtype=np.int64)
    want = _expected(pair, src, dst, lb, le)
    _wait(pair, pair.tx.post_blocks(pair.peer, src, dst, lb, le))
    assert torch.equal(pair.dst.kv.view(torch.uint8), want.view(torch.uint8))
    # and the unprepped path agrees, over a zeroed destination
    pair.dst.kv.zero_()
    want = _expected(pair, src, dst, lb, le)
    sd, dd = write_descriptors(
        pair.src.layout,
        pair.src.kv_base,
        src,
        pair.dst.kv_base,
        dst,
        lb,
        le,
        dst_layer_stride=pair.dst.layout.layer_stride,
    )
    _wait(pair, pair.tx.post_write(pair.peer, sd, dd, "DRAM", "DRAM"))
    assert torch.equal(pair.dst.kv.view(torch.uint8), want.view(torch.uint8))


def test_unprepared_peer_is_refused_and_falls_back(pair: _Pair) -> None:
    """A peer with another block size gets no list: post_blocks raises, nothing is posted."""
    other = Layout(LAYERS, 40, 1024, "float16", 4, 256)
    assert not pair.tx.prepare_peer(pair.peer, other, pair.dst.kv_base, "DRAM", 0)
    assert not pair.tx.prepare_peer(pair.peer, pair.dst.layout, pair.dst.kv_base, "VRAM", 0)
    with pytest.raises(RuntimeError, match="no prepared"):
        pair.tx.post_blocks(pair.peer, np.array([0]), np.array([0]), 0, 1)


def test_prepped_off_by_choice() -> None:
    pool = _pool("dptest-off", 8)
    dp = NixlDataPlane(
        f"dptest-off-{time.monotonic_ns()}", DataPlaneSettings(), pool, prepped=False
    )
    try:
        assert not dp.prepped
        assert not dp.prepare_peer("x", pool.layout, pool.kv_base, "DRAM", 0)
    finally:
        dp.close()
        pool.close()


def test_a_closed_data_plane_says_so_to_the_probes() -> None:
    """Once a NixlDataPlane is closed the views say so (``/readyz``'s data_plane_closed)."""
    pool = _pool("dptest-closed", 8)
    dp = NixlDataPlane(f"dptest-closed-{time.monotonic_ns()}", DataPlaneSettings(), pool)
    try:
        assert not dataplane_closed(dp)
        dp.close()
        assert dataplane_closed(dp)
    finally:
        dp.close()
        pool.close()


def test_controlled_double_implements_both_paths() -> None:
    dp = ControlledDataPlane("c", prepped=True)
    peer = dp.add_peer(b"rx")
    assert dp.prepare_peer(peer, _layout(8), 0, "DRAM", 0)
    x, state = dp.post_blocks(peer, np.array([1]), np.array([2]), 0, 1)
    assert state == "PROC" and dp.wait_posted(1) is x and x.kind == "blocks"
    assert not ControlledDataPlane("d").prepare_peer(peer, _layout(8), 0, "DRAM", 0)


class TestSenderOnPreparedLists:
    """The sender's KV writes go through post_blocks once the peer is prepared; AUX never."""

    POOL = dict(num_layers=2, num_blocks=16, block_elems=16, aux_slots=4, aux_slot_bytes=64)

    @pytest.fixture
    def pair(self) -> Iterator[tuple[Sender, ControlledDataPlane, Receiver]]:
        sx_settings = load_sender_settings(
            name="prep-tx", listen="tcp://127.0.0.1:0", num_threads=1, pool=self.POOL
        )
        dp = ControlledDataPlane("prep-tx", prepped=True)
        sx = Sender(sx_settings, dataplane=dp).start()
        dp.notify_as = sx.sender_id  # a real sender's NIXL agent is named after its id
        rx_settings = load_receiver_settings(
            name="prep-rx", result_endpoint="tcp://127.0.0.1:0", pool=self.POOL
        )
        rx = Receiver(rx_settings, dataplane=ControlledDataPlane("prep-rx")).start()
        try:
            yield sx, dp, rx
        finally:
            for x in list(dp.xfers):
                if x.state == "PROC":
                    x.finish(True)
            rx.shutdown(timeout=3)
            sx.shutdown(timeout=3)

    def test_kv_by_block_index_aux_by_descriptor(
        self, pair: tuple[Sender, ControlledDataPlane, Receiver]
    ) -> None:
        sx, dp, rx = pair
        hd = sx.publish("p-1", [3, 4, 5], aux=b"aux-payload")
        f = rx.fetch("p-1", sx.endpoint, [7, 1, 2])
        kv = dp.wait_posted(1)
        assert kv.kind == "blocks" and kv.layers == (0, 2) and "prep-rx" in dp.prepared
        assert kv.src.tolist() == [3, 4, 5] and kv.dst.tolist() == [7, 1, 2]
        kv.finish(True)
        aux = dp.wait_posted(2)
        assert aux.kind == "descs" and int(aux.src[0, 1]) == len(b"aux-payload")
        aux.finish(True)
        out = f.wait(5)
        assert out is not None and out.state is RxState.DONE, out
        assert out.nbytes == 3 * 2 * sx.pool.layout.block_bytes + len(b"aux-payload")
        assert hd.close(5)

    def test_failed_post_gives_the_admission_back(
        self, pair: tuple[Sender, ControlledDataPlane, Receiver]
    ) -> None:
        sx, dp, rx = pair
        hd = sx.publish("p-2", [3])
        dp.fail_next_post = RuntimeError("boom")
        out = rx.fetch("p-2", sx.endpoint, [9]).wait(5)
        assert out is not None and (out.state, out.reason) == (RxState.FAILED, Reason.BUILD_FAILED)
        assert hd.session.writes_in_flight == 0 and hd.close(5)
