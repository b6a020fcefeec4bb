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

from kvxferd.transfer.dataplane import PathStalled
from tests.support.conditions import wait_until
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


def test_a_failed_post_moves_the_peer_to_a_fresh_connection(pair: _Pair) -> None:
    """After a post toward a peer raised, the next post starts a connect thread that loads the peer
    on a fresh path; later writes go there, byte-exact, and a healthy peer is not moved again."""
    src, dst = np.array([1, 5], dtype=np.int64), np.array([2, 9], dtype=np.int64)
    _wait(pair, pair.tx.post_blocks(pair.peer, src, dst, 0, 1))
    assert pair.tx.fresh_paths == 0 and pair.tx.paths() == 1
    _fail_a_post(pair)
    # This post still takes the old path (here it works: the "failure" was a bad descriptor).
    _wait(pair, pair.tx.post_blocks(pair.peer, src, dst, 0, 1))
    wait_until(lambda: pair.tx.fresh_paths == 1, 10, "the peer moved to a fresh path")
    assert pair.tx.paths() == 2 and pair.tx.reconnects == 0
    want = _expected(pair, src, dst, 0, 3)
    _wait(pair, pair.tx.post_blocks(pair.peer, src, dst, 0, 3))
    assert torch.equal(pair.dst.kv.view(torch.uint8), want.view(torch.uint8))
    _wait(pair, pair.tx.post_blocks(pair.peer, src, dst, 0, 3))  # healthy: not moved again
    assert pair.tx.fresh_paths == 1 and pair.tx.paths() == 2


def test_with_one_path_a_failed_post_reconnects_in_place() -> None:
    """max_paths = 1: the next post after a failure loads the peer again on its one path (once)."""
    p = _Pair(16, 16)
    p.tx.settings = p.tx.settings.model_copy(update={"max_paths": 1})
    try:
        src, dst = np.array([1, 5], dtype=np.int64), np.array([2, 9], dtype=np.int64)
        _fail_a_post(p)
        want = _expected(p, src, dst, 0, 3)
        _wait(p, p.tx.post_blocks(p.peer, src, dst, 0, 3))
        assert p.tx.reconnects == 1 and p.tx.paths() == 1
        assert torch.equal(p.dst.kv.view(torch.uint8), want.view(torch.uint8))
        _wait(p, p.tx.post_blocks(p.peer, src, dst, 0, 3))  # healthy: no second reconnect
        assert p.tx.reconnects == 1
    finally:
        p.close()


def test_a_removed_peer_is_never_reconnected(pair: _Pair) -> None:
    """A peer the sender removed stays removed, even if its last post had failed."""
    _fail_a_post(pair)
    pair.tx.remove_peer(pair.peer)
    with pytest.raises(RuntimeError, match="no prepared"):
        pair.tx.post_blocks(pair.peer, np.array([0]), np.array([0]), 0, 1)
    assert pair.tx.reconnects == 0


def test_a_peer_whose_write_stalls_is_moved_to_a_fresh_connection() -> None:
    """A write toward a peer still in flight past the stall bound: the next post is refused (nothing
    posted) and a connect thread opens a fresh connection (another local agent); the stalled write
    is left to end, the next writes take the fresh path, and every byte lands."""
    p = _Pair(16, 16, stall_s=0.0)  # every write still in flight counts as stalled
    try:
        first = p.tx.post_blocks(p.peer, np.array([1, 2]), np.array([3, 4]), 0, 3)
        with pytest.raises(PathStalled):  # not posted behind the stalled write
            p.tx.post_blocks(p.peer, np.array([6]), np.array([8]), 0, 3)
        wait_until(lambda: p.tx.fresh_paths == 1, 10, "the peer moved to a fresh path")
        assert p.tx.paths() == 2
        third = p.tx.post_blocks(p.peer, np.array([7]), np.array([9]), 0, 3)  # the fresh path
        want = _expected(p, np.array([1, 2, 7]), np.array([3, 4, 9]), 0, 3)
        _wait(p, third)  # does not wait behind the first
        _wait(p, first)
        assert torch.equal(p.dst.kv.view(torch.uint8), want.view(torch.uint8))
        # With no write in flight the peer stays where it is.
        _wait(p, p.tx.post_blocks(p.peer, np.array([5]), np.array([6]), 0, 1))
        assert p.tx.paths() == 2 and p.tx.fresh_paths == 1
    finally:
        p.close()


def test_with_one_path_a_stalled_peer_keeps_its_connection() -> None:
    """max_paths = 1 turns fresh connections off: the next write is posted behind the stall."""
    p = _Pair(16, 16, stall_s=0.0)
    p.tx.settings = p.tx.settings.model_copy(update={"max_paths": 1})
    try:
        first = p.tx.post_blocks(p.peer, np.array([1]), np.array([3]), 0, 1)
        second = p.tx.post_blocks(p.peer, np.array([2]), np.array([4]), 0, 1)
        assert p.tx.paths() == 1 and p.tx.fresh_paths == 0
        _wait(p, first)
        _wait(p, second)
    finally:
        p.close()
