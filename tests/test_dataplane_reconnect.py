"""The data plane reconnects a peer whose transport failed, against real NIXL (no root needed).

A WRITE toward a peer that raises marks the peer broken; the next post with no write in
flight loads its remote agent again (a fresh UCX endpoint) and prepares its list again.
tests/test_hosts.py shows the same on a UCX TCP connection that died in a link cut.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.test_dataplane import _expected, _Pair, _wait


@pytest.fixture
def pair() -> Iterator[_Pair]:
    p = _Pair(16, 16)
    yield p
    p.close()


def _fail_a_post(p: _Pair) -> None:
    """A WRITE NIXL refuses: its remote descriptor lies outside the peer's registered pool."""
    src = np.array([[p.src.kv_base, 512, 0]], dtype=np.int64)
    dst = np.array([[p.dst.kv_base + (1 << 40), 512, 0]], dtype=np.int64)
    with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
        p.tx.post_write(p.peer, src, dst, "DRAM", "DRAM")


def test_a_failed_post_reconnects_the_peer_at_the_next_post(pair: _Pair) -> None:
    """After a post toward a peer raised, the next post reconnects it once and writes byte-exact."""
    src, dst = np.array([1, 5], dtype=np.int64), np.array([2, 9], dtype=np.int64)
    _wait(pair, pair.tx.post_blocks(pair.peer, src, dst, 0, 1))
    assert pair.tx.reconnects == 0
    _fail_a_post(pair)
    want = _expected(pair, src, dst, 0, 3)
    _wait(pair, pair.tx.post_blocks(pair.peer, src, dst, 0, 3))
    assert pair.tx.reconnects == 1
    assert torch.equal(pair.dst.kv.view(torch.uint8), want.view(torch.uint8))
    _wait(pair, pair.tx.post_blocks(pair.peer, src, dst, 0, 3))  # healthy: no second reconnect
    assert pair.tx.reconnects == 1


def test_a_removed_peer_is_never_reconnected(pair: _Pair) -> None:
    """A peer the sender removed stays removed, even if its last post had failed."""
    _fail_a_post(pair)
    pair.tx.remove_peer(pair.peer)
    with pytest.raises(RuntimeError, match="no prepared"):
        pair.tx.post_blocks(pair.peer, np.array([0]), np.array([0]), 0, 1)
    assert pair.tx.reconnects == 0
