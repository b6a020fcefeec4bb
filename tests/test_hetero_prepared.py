"""A peer read through the reshard mapping writes through NIXL lists prepared once per piece.

On real daemons (``tests/test_hetero.py``'s harness) every KV write of a mapped peer
goes through its piece's prepared lists (``DataPlane.prepare_piece`` at REGISTER,
``post_blocks`` by piece indices), byte-exact against the torch reference; a piece
whose lists are too big or whose prep fails falls back to per-request descriptors,
still byte-exact. On a pair of data planes (real NIXL, in this process) the piece's
lists follow the peer to a fresh connection and are released with the writes that
use them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import kvxferd.transfer.dataplane
from kvxferd.config import DataPlaneSettings
from kvxferd.transfer.dataplane import NixlDataPlane
from kvxferd.transfer.reshard import Piece, plan_rank, readers_for
from kvxferd.transfer.sender import Sender
from kvxferd.transfer.topology import LayoutKind, Topology
from tests.support.conditions import wait_until
from tests.test_hetero import Daemons, _run_case
from tests.test_hetero import daemons as daemons  # the fixture
from tests.test_topology_reshard import REQ_BLOCKS, SWEEP, Case, _kvpool, _wait, _World

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _case(name: str, layout: LayoutKind) -> Case:
    c = SWEEP[name]
    return Case(**{**c.__dict__, "p_layout": layout, "d_layout": layout})


def _posts(s: Sender) -> dict[str, int]:
    dp = s.dataplane
    assert isinstance(dp, NixlDataPlane)
    return dict(dp.posts)


def _bytes_written(daemons: Daemons, case: Case) -> int:
    """What the senders counted as written; each decode rank's request blocks, every layer of
    its stage, land exactly once, so it must be ``REQ_BLOCKS`` whole blocks per its layer."""
    got = sum(s.stats.get("bytes_written") for s in daemons.senders)
    want = sum(REQ_BLOCKS * d.num_stage_layers * d.block_bytes for d in case.decode)
    assert got == want, (got, want)
    return got


def _by_rank(daemons: Daemons, case: Case) -> list[tuple[Topology, Sender]]:
    """Each prefill rank's record with its sender (started in rank order by ``_run_case``)."""
    return list(zip(case.prefill, daemons.senders, strict=True))


CASES: list[tuple[str, LayoutKind]] = [
    ("1P2D (TP1->TP2)", "tokens_major"),
    ("2P1D (TP2->TP1)", "heads_major"),
    ("PP3 TP2 -> PP2 TP1, uneven layers", "tokens_major"),
    ("GQA: TP1 -> decode TP4 over 2 heads", "heads_major"),
    ("MLA 2->1", "heads_major"),
]


@pytest.mark.parametrize("name, layout", CASES)
def test_mapped_peers_write_through_prepared_piece_lists(
    daemons: Daemons, name: str, layout: LayoutKind
) -> None:
    """Every piece a decode rank reads is one WRITE through that piece's prepared lists (no
    descriptors built per request), every decode byte equals the reference's reshard, and the
    bytes counted as written are the decode ranks' blocks."""
    case = _case(name, layout)
    _run_case(daemons, case, seed=5)
    _bytes_written(daemons, case)
    for t, s in _by_rank(daemons, case):
        readers = readers_for(case.decode[0], t)
        assert _posts(s) == {"blocks": 0, "piece": readers, "descs": 0}, (t.rank, readers)


def test_a_piece_over_the_list_bound_falls_back_to_descriptors(
    daemons: Daemons, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A piece whose lists would exceed MAX_PREPPED_DESCS gets no lists: its write is built per
    request (piece descriptors) and every decode byte is still the reference's."""
    monkeypatch.setattr(kvxferd.transfer.dataplane, "MAX_PREPPED_DESCS", 8)
    case = _case("2P1D (TP2->TP1)", "tokens_major")
    _run_case(daemons, case, seed=6)
    _bytes_written(daemons, case)
    for _t, s in _by_rank(daemons, case):
        assert _posts(s) == {"blocks": 0, "piece": 0, "descs": 1}


@pytest.mark.parametrize("which", ["local", "remote"])
def test_a_failed_piece_prep_falls_back_to_descriptors(
    daemons: Daemons, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    """NIXL refusing to prepare either list of a piece (this pool's or the peer's) leaves the peer
    unprepared, never failed: its write is built per request and every byte is exact."""
    from nixl._api import nixl_agent

    real = nixl_agent.prep_xfer_dlist
    local = "NIXL_INIT_AGENT"

    def refusing(self: Any, agent_name: str, *args: Any, **kw: Any) -> Any:
        if (agent_name == local) == (which == "local"):
            raise RuntimeError(f"NIXL_ERR_TEST: no {which} list")
        return real(self, agent_name, *args, **kw)

    monkeypatch.setattr(nixl_agent, "prep_xfer_dlist", refusing)
    case = _case("1P2D (TP1->TP2)", "heads_major")
    _run_case(daemons, case, seed=7)
    _bytes_written(daemons, case)
    for _t, s in _by_rank(daemons, case):
        assert _posts(s) == {"blocks": 0, "piece": 0, "descs": 2}
        assert s.stats.get("writes_build_failed") == 0


# --- one prefill rank's data plane writing one decode rank's piece ----------------------


class _PiecePair:
    """Prefill rank 0 and decode rank 1 of 1P2D tokens-major (one piece: a head slice)."""

    def __init__(self) -> None:
        self.w = _World(_case("1P2D (TP1->TP2)", "tokens_major"), seed=9)
        self.p, self.d = self.w.prefill[0], self.w.decode[1]
        (self.piece,) = plan_rank(self.d, self.w.prefill).pieces
        self.src = _kvpool("pp-src", self.w.shape("p", self.p))
        self.dst = _kvpool("pp-dst", self.w.shape("d", self.d))
        self.w.fill("p", self.p, self.src.kv_bytes_view())
        self.w.fill("d", self.d, self.dst.kv_bytes_view())
        tag = time.monotonic_ns()
        self.tx = NixlDataPlane(f"pp-tx-{tag}", DataPlaneSettings(), self.src)
        self.rx = NixlDataPlane(f"pp-rx-{tag}", DataPlaneSettings(), self.dst)
        self.peer = self.tx.add_peer(self.rx.metadata())

    def prepare(self, piece: Piece | None = None) -> bool:
        return self.tx.prepare_piece(
            self.peer,
            piece or self.piece,
            self.d,
            self.dst.kv_base,
            self.w.num_blocks[("d", self.d.rank)],
            "DRAM",
            0,
        )

    def post(self) -> tuple[Any, Any]:
        return self.tx.post_blocks(
            self.peer,
            self.w.ids[("p", 0)],
            self.w.ids[("d", self.d.rank)],
            self.piece.layer_begin,
            self.piece.layer_end,
        )

    def exact(self) -> bool:
        return torch.equal(self.dst.kv_bytes_view(), self.w.want[self.d.rank])

    def close(self) -> None:
        self.tx.close()
        self.rx.close()
        self.src.close()
        self.dst.close()


@pytest.fixture
def pp() -> Iterator[_PiecePair]:
    p = _PiecePair()
    yield p
    p.close()


def test_a_piece_is_written_by_indices_into_its_lists(pp: _PiecePair) -> None:
    """post_blocks on a peer prepared by piece moves exactly the piece's ranges of each block."""
    assert len(pp.piece.ranges) > 1  # a head slice: several ranges per block
    assert pp.prepare()
    _wait(pp.rx, pp.post())
    assert pp.exact()
    assert pp.tx.posts == {"blocks": 0, "piece": 1, "descs": 0}


def test_piece_lists_retired_under_a_write_are_released_with_it(
    pp: _PiecePair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A piece prepared again while a write uses its lists keeps both (this pool's and the
    peer's) until the write's handle is released, then releases both; unused ones at once."""
    agent = pp.tx._paths[0].agent
    released: list[object] = []
    real = agent.release_dlist_handle
    monkeypatch.setattr(agent, "release_dlist_handle", lambda h: (released.append(h), real(h)))
    assert pp.prepare()
    posted = pp.post()
    assert pp.prepare()
    assert pp.tx.retired_lists() == 1 and released == []
    _wait(pp.rx, posted)
    assert pp.tx.retired_lists() == 0 and len(released) == 2
    assert pp.prepare()  # nothing in flight: the old two go at once
    assert len(released) == 4
    _wait(pp.rx, pp.post())
    assert pp.exact()


def test_piece_lists_follow_the_peer_to_a_fresh_connection(pp: _PiecePair) -> None:
    """After a failed post the peer moves to a fresh path with its piece lists prepared there:
    the next writes go by piece indices on that path, byte-exact."""
    assert pp.prepare()
    bad = np.array([[pp.dst.kv_base + (1 << 40), 512, 0]], dtype=np.int64)
    with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
        pp.tx.post_write(pp.peer, bad, bad, "DRAM", "DRAM")
    _wait(pp.rx, pp.post())  # still the old path; it starts the move
    wait_until(lambda: pp.tx.fresh_paths == 1, 10, "the peer moved to a fresh path")
    pp.w.fill("d", pp.d, pp.dst.kv_bytes_view())
    _wait(pp.rx, pp.post())
    assert pp.exact() and pp.tx.paths() == 2
    assert pp.tx.posts["piece"] == 2 and pp.tx._routes.at[pp.peer] == 1


def test_with_one_path_a_piece_peer_reconnects_in_place_with_its_lists(pp: _PiecePair) -> None:
    """max_paths = 1: a failed piece peer is loaded again on its one path with its piece lists
    prepared again, and the next write goes by piece indices, byte-exact."""
    pp.tx.settings = pp.tx.settings.model_copy(update={"max_paths": 1})
    assert pp.prepare()
    bad = np.array([[pp.dst.kv_base + (1 << 40), 512, 0]], dtype=np.int64)
    with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
        pp.tx.post_write(pp.peer, bad, bad, "DRAM", "DRAM")
    _wait(pp.rx, pp.post())
    assert pp.tx.reconnects == 1 and pp.exact()
    assert pp.tx.posts["piece"] == 1


def test_a_piece_over_the_bound_is_refused_and_post_blocks_raises(
    pp: _PiecePair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over MAX_PREPPED_DESCS prepare_piece answers False (no raise) and drops an earlier list:
    post_blocks then raises and nothing is posted."""
    assert pp.prepare()
    monkeypatch.setattr(kvxferd.transfer.dataplane, "MAX_PREPPED_DESCS", 4)
    assert not pp.prepare()
    with pytest.raises(RuntimeError, match="no prepared"):
        pp.post()
    assert pp.tx.posts == {"blocks": 0, "piece": 0, "descs": 0}
