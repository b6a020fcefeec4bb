"""The sender's data plane against real NIXL: retired prepared descriptor lists stay bounded."""

from __future__ import annotations

import numpy as np

from tests.test_dataplane import _Pair, _wait


def test_a_list_replaced_under_a_write_is_released_when_the_write_is() -> None:
    """A peer prepared again while a write made from its old list holds a handle keeps that list until the handle is released, then frees it; with no write it is freed at once."""
    p = _Pair(64, 40)
    try:
        assert p.prepared
        dst = p.dst.layout
        blocks = np.array([1, 2, 3], dtype=np.int64)
        posted = p.tx.post_blocks(p.peer, blocks, blocks, 0, dst.num_layers)
        assert p.tx.prepare_peer(p.peer, dst, p.dst.kv_base, "DRAM", 0)
        assert p.tx.retired_lists() == 1  # the write still holds a handle made from it
        _wait(p, posted)  # waits for DONE and releases the handle
        assert p.tx.retired_lists() == 0
        for _ in range(3):  # re-prepared with nothing in flight: nothing is kept
            assert p.tx.prepare_peer(p.peer, dst, p.dst.kv_base, "DRAM", 0)
        assert p.tx.retired_lists() == 0
        _wait(p, p.tx.post_blocks(p.peer, blocks, blocks, 0, dst.num_layers))
    finally:
        p.close()
