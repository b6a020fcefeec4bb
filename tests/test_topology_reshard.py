"""The reshard mapping, byte-exact against a torch reference, with numpy copies and with real NIXL.

The reference: the full KV cache of a request ``[layers, planes, heads, tokens,
head_size]`` built with torch, sharded as each prefill rank holds it (TP over
heads, PP over layers, copies under replication) and packed into that rank's
pool in its layout; what each decode rank must hold is computed the same way
from the same tensor. The mapping's descriptors then move the bytes (numpy
copies for every case and for random topologies, NIXL WRITEs between agents in
this process for the named sweep) and every byte of every decode pool is
compared, including the blocks no request touched.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxferd.config import DataPlaneSettings, PoolSettings
from kvxferd.errors import Reason, RejectedError
from kvxferd.transfer.dataplane import NixlDataPlane, wait_xfer
from kvxferd.transfer.reshard import (
    InstancePlan,
    block_ranges,
    piece_descriptors,
    plan_rank,
    prepared_indices,
    prepared_list,
)
from kvxferd.transfer.topology import (
    LAYOUT_ORDER,
    LayoutKind,
    Topology,
    compat_hash,
    instance_ranks,
    make_topology,
)

pytestmark = pytest.mark.timeout(60)

TOKENS, HEAD_SIZE, ELEM = 4, 8, 2  # float16
REQ_BLOCKS = 3


@dataclass(frozen=True)
class Case:
    layers: int
    heads: int  # kv_heads_total
    planes: int
    p_tp: int
    p_pp: int
    d_tp: int
    d_pp: int
    p_layout: LayoutKind = "heads_major"
    d_layout: LayoutKind = "heads_major"
    model: str = "m"

    def instance(self, tp: int, pp: int, layout: LayoutKind, **kw: object) -> list[Topology]:
        args: dict[str, object] = dict(
            compat=compat_hash(
                2, self.model, "float16", self.layers, self.heads, HEAD_SIZE, self.planes
            ),
            tp_rank=0,
            tp_size=tp,
            pp_size=pp,
            num_layers=self.layers,
            kv_heads_total=self.heads,
            head_size=HEAD_SIZE,
            tokens_per_block=TOKENS,
            elem_bytes=ELEM,
            kv_planes=self.planes,
            layout=layout,
        )
        args.update(kw)
        return instance_ranks(make_topology(**args))  # type: ignore[arg-type]

    @property
    def prefill(self) -> list[Topology]:
        return self.instance(self.p_tp, self.p_pp, self.p_layout)

    @property
    def decode(self) -> list[Topology]:
        return self.instance(self.d_tp, self.d_pp, self.d_layout)


SWEEP = {
    "1P2D (TP1->TP2)": Case(4, 4, 2, 1, 1, 2, 1),
    "2P1D (TP2->TP1)": Case(4, 4, 2, 2, 1, 1, 1),
    "2P4D": Case(4, 8, 2, 2, 1, 4, 1),
    "4P2D": Case(4, 8, 2, 4, 1, 2, 1),
    "equal TP2": Case(4, 4, 2, 2, 1, 2, 1),
    "PP2->PP1": Case(4, 4, 2, 1, 2, 1, 1),
    "PP1->PP2": Case(4, 4, 2, 1, 1, 1, 2),
    "PP3 TP2 -> PP2 TP1, uneven layers": Case(7, 4, 2, 2, 3, 1, 2),
    "GQA: prefill TP4 over 2 heads -> TP1": Case(4, 2, 2, 4, 1, 1, 1),
    "GQA: TP1 -> decode TP4 over 2 heads": Case(4, 2, 2, 1, 1, 4, 1),
    "GQA: TP4 -> TP8 over 2 heads": Case(4, 2, 2, 4, 1, 8, 1),
    "GQA: TP8 -> TP2 over 2 heads": Case(4, 2, 2, 8, 1, 2, 1),
    "MLA 2->1": Case(4, 1, 1, 2, 1, 1, 1),
    "MLA 1->2": Case(4, 1, 1, 1, 1, 2, 1),
    "MLA 2->4, PP2->PP1": Case(4, 1, 1, 2, 2, 4, 1),
}
LAYOUTS: list[tuple[LayoutKind, LayoutKind]] = [
    ("heads_major", "heads_major"),
    ("tokens_major", "tokens_major"),
    ("heads_planes_tokens", "heads_planes_tokens"),  # vLLM's CPU backend
    ("heads_tokens_planes", "heads_tokens_planes"),  # vLLM's [H, N, 2 * D], K and V side by side
    ("tokens_heads_planes", "tokens_heads_planes"),  # the same, LBNHC
]


def _full(case: Case, seed: int) -> torch.Tensor:
    """The request's whole KV cache, [layers, planes, heads, tokens, head_size], random bits."""
    g = torch.Generator().manual_seed(seed)
    shape = (case.layers, case.planes, case.heads, REQ_BLOCKS * TOKENS, HEAD_SIZE)
    return torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int16).view(torch.float16)


def _packed(t: Topology, full: torch.Tensor) -> torch.Tensor:
    """What rank ``t`` holds of ``full``: [its layers, request block, block bytes] in its layout."""
    h0, h1 = t.head_range
    x = full[t.layer_begin : t.layer_end, :, h0:h1]  # [L, P, h, n*T, D]
    x = x.reshape(x.shape[0], t.kv_planes, h1 - h0, REQ_BLOCKS, TOKENS, HEAD_SIZE)
    dims = {"P": 1, "H": 2, "T": 4}  # [L, P, h, n, T, D] -> [L, n, <its order>, D]
    x = x.permute(0, 3, *(dims[d] for d in LAYOUT_ORDER[t.layout]), 5)
    return x.contiguous().view(torch.uint8).reshape(x.shape[0], REQ_BLOCKS, -1)


class _World:
    """One pool per rank (prefill filled from the reference, decode with noise), ids per rank."""

    def __init__(self, case: Case, seed: int = 0) -> None:
        self.case = case
        self.full = _full(case, seed)
        self.rng = np.random.default_rng(seed)
        self.prefill, self.decode = case.prefill, case.decode
        self.num_blocks = {("p", t.rank): 5 + t.rank for t in self.prefill}
        self.num_blocks.update({("d", t.rank): 7 + 2 * t.rank for t in self.decode})
        self.ids = {
            k: self.rng.permutation(n)[:REQ_BLOCKS].astype(np.int64)
            for k, n in self.num_blocks.items()
        }
        self.want: dict[int, torch.Tensor] = {}

    def shape(self, side: str, t: Topology) -> tuple[int, int, int]:
        return (t.num_stage_layers, self.num_blocks[(side, t.rank)], t.block_bytes)

    def fill(self, side: str, t: Topology, pool: torch.Tensor) -> None:
        """Noise everywhere; a prefill rank's request blocks from the reference; the decode
        rank's expected pool (noise outside the request's blocks) kept in ``want``."""
        g = torch.Generator().manual_seed(2 * t.rank + (side == "p"))
        pool.copy_(torch.randint(0, 256, pool.shape, generator=g, dtype=torch.uint8))
        ids = torch.from_numpy(self.ids[(side, t.rank)])
        if side == "p":
            pool[:, ids] = _packed(t, self.full)
        else:
            want = pool.clone()
            want[:, ids] = _packed(t, self.full)
            self.want[t.rank] = want

    def descriptors(
        self, d: Topology, piece_src_base: dict[int, int], dst_base: int
    ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(prefill rank, src descs, dst descs) of every piece decode rank ``d`` reads."""
        for piece in plan_rank(d, self.prefill).pieces:
            r = piece.prefill_rank
            s, dd = piece_descriptors(
                piece,
                d,
                piece_src_base[r],
                self.num_blocks[("p", r)],
                self.ids[("p", r)],
                dst_base,
                self.num_blocks[("d", d.rank)],
                self.ids[("d", d.rank)],
                0,
                self.case.layers,
            )
            assert s.shape == dd.shape and (s[:, 1] == dd[:, 1]).all()
            yield r, s, dd


def _numpy_reshard(case: Case, seed: int = 0) -> None:
    """Apply every decode rank's plan with numpy copies; compare every decode byte."""
    w = _World(case, seed)
    src = {}
    for t in w.prefill:
        src[t.rank] = torch.empty(w.shape("p", t), dtype=torch.uint8)
        w.fill("p", t, src[t.rank])
    for d in w.decode:
        dst = torch.empty(w.shape("d", d), dtype=torch.uint8)
        w.fill("d", d, dst)
        flat = dst.view(-1).numpy()
        written = []
        for r, s, dd in w.descriptors(d, {t.rank: 0 for t in w.prefill}, 0):
            sflat = src[r].view(-1).numpy()
            for (sa, ln, _), (da, _, _) in zip(s.tolist(), dd.tolist(), strict=True):
                flat[da : da + ln] = sflat[sa : sa + ln]
            written.append(dd)
        _assert_written_once(np.concatenate(written), d)
        assert torch.equal(dst, w.want[d.rank]), f"decode rank {d.rank} differs from the reference"


def _assert_written_once(dd: np.ndarray, d: Topology) -> None:
    """The destination ranges tile the request's blocks exactly: no byte twice, none missed."""
    order = np.argsort(dd[:, 0])
    a, n = dd[order, 0], dd[order, 1]
    assert (a[1:] >= a[:-1] + n[:-1]).all(), "a destination byte is written twice"
    assert int(n.sum()) == d.num_stage_layers * REQ_BLOCKS * d.block_bytes


@pytest.mark.parametrize("layouts", LAYOUTS, ids=lambda x: f"{x[0]}->{x[1]}")
@pytest.mark.parametrize("name", list(SWEEP))
def test_sweep_numpy(name: str, layouts: tuple[LayoutKind, LayoutKind]) -> None:
    """Every decode rank ends up holding exactly the reference's shard, nothing else changed."""
    c = SWEEP[name]
    _numpy_reshard(Case(**{**c.__dict__, "p_layout": layouts[0], "d_layout": layouts[1]}))


def test_whole_head_blocks_cross_layouts() -> None:
    """Ranks holding one head each have the same bytes in both layouts: tokens- to heads-major is served."""
    _numpy_reshard(Case(4, 4, 2, 4, 1, 4, 1, "tokens_major", "heads_major"))
    _numpy_reshard(Case(4, 8, 2, 8, 2, 8, 1, "heads_major", "tokens_major"))


_DIVS = {1: [1], 2: [1, 2, 4], 4: [1, 2, 4, 8], 8: [1, 2, 4, 8]}


@st.composite
def _cases(draw: st.DrawFn) -> Case:
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4, 8]))
    layers = draw(st.integers(1, 6))
    tps = [1, 2, 4] if mla else _DIVS[heads]
    layout = draw(st.sampled_from(["heads_major", "tokens_major"]))
    return Case(
        layers=layers,
        heads=heads,
        planes=1 if mla else 2,
        p_tp=draw(st.sampled_from(tps)),
        p_pp=draw(st.integers(1, min(3, layers))),
        d_tp=draw(st.sampled_from(tps)),
        d_pp=draw(st.integers(1, min(3, layers))),
        p_layout=layout,
        d_layout=layout,
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_cases(), seed=st.integers(0, 1000))
def test_random_topologies_numpy(case: Case, seed: int) -> None:
    """Any (TP, PP, heads, MLA, layout) pair the record allows reshards byte-exact."""
    _numpy_reshard(case, seed)


class TestPlan:
    def test_1p2d_slices_one_prefill_rank(self) -> None:
        """TP1->TP2: each decode rank reads half of the one prefill rank's heads."""
        c = SWEEP["1P2D (TP1->TP2)"]
        plans = InstancePlan(c.decode, c.prefill)
        got = [
            (p.prefill_rank, p.src_head, p.dst_head, p.heads)
            for d in (0, 1)
            for p in plans.ranks[d].pieces
        ]
        assert got == [(0, 0, 0, 2), (0, 2, 0, 2)]
        assert plans.readers(0) == 2

    def test_2p1d_gathers(self) -> None:
        """TP2->TP1: the decode rank gathers both prefill ranks' heads, each read once."""
        c = SWEEP["2P1D (TP2->TP1)"]
        plans = InstancePlan(c.decode, c.prefill)
        assert [
            (p.prefill_rank, p.src_head, p.dst_head, p.heads) for p in plans.ranks[0].pieces
        ] == [
            (0, 0, 0, 2),
            (1, 0, 2, 2),
        ]
        assert (plans.readers(0), plans.readers(1)) == (1, 1)

    def test_pp_layers_intersect(self) -> None:
        """PP2->PP1: one piece per prefill stage, each with that stage's layers."""
        c = SWEEP["PP2->PP1"]
        plan = plan_rank(c.decode[0], c.prefill)
        assert [(p.prefill_rank, p.layer_begin, p.layer_end) for p in plan.pieces] == [
            (0, 0, 2),
            (1, 2, 4),
        ]

    def test_gqa_one_copy_read(self) -> None:
        """GQA TP4 over 2 heads -> TP1: one copy of each head is read, the other copies have no reader."""
        c = SWEEP["GQA: prefill TP4 over 2 heads -> TP1"]
        plans = InstancePlan(c.decode, c.prefill)
        assert plans.ranks[0].sources == (0, 2)
        assert [plans.readers(r) for r in range(4)] == [1, 0, 1, 0]

    def test_gqa_decode_ranks_spread_over_copies(self) -> None:
        """TP4 -> TP8 over 2 heads: the decode ranks sharing a head spread over its copies."""
        c = SWEEP["GQA: TP4 -> TP8 over 2 heads"]
        plans = InstancePlan(c.decode, c.prefill)
        assert [plans.ranks[d].sources for d in range(8)] == [
            (0,),
            (1,),
            (0,),
            (1,),
            (2,),
            (3,),
            (2,),
            (3,),
        ]
        assert [plans.readers(r) for r in range(4)] == [2, 2, 2, 2]

    def test_mla_one_rank_read_others_released(self) -> None:
        """MLA 2->1: exactly one prefill rank is read; the other's readers is 0 (release unread)."""
        c = SWEEP["MLA 2->1"]
        plans = InstancePlan(c.decode, c.prefill)
        assert plans.ranks[0].sources == (0,)
        assert (plans.readers(0), plans.readers(1)) == (1, 0)
        with pytest.raises(KeyError):
            plans.readers(2)

    def test_plan_computed_once(self) -> None:
        """The same (decode rank, prefill instance) returns the same plan object (ranges built once)."""
        c = SWEEP["2P4D"]
        assert plan_rank(c.decode[1], c.prefill) is plan_rank(
            c.decode[1], list(reversed(c.prefill))
        )


class TestRanges:
    def _pair(self, layout: LayoutKind) -> tuple[Topology, Topology]:
        c = Case(4, 4, 2, 1, 1, 2, 1, layout, layout)
        return c.prefill[0], c.decode[1]

    def test_heads_major_slice_is_one_range_per_plane(self) -> None:
        """A head slice of a heads-major block is one range per plane."""
        p, d = self._pair("heads_major")
        r = block_ranges(p, d, 2, 0, 2)
        row = TOKENS * HEAD_SIZE * ELEM
        assert r.src.tolist() == [2 * row, 6 * row] and r.dst.tolist() == [0, 2 * row]
        assert r.length.tolist() == [2 * row, 2 * row]

    def test_tokens_major_slice_is_one_range_per_plane_and_token(self) -> None:
        """A head slice of a tokens-major block is planes * tokens ranges."""
        p, d = self._pair("tokens_major")
        r = block_ranges(p, d, 2, 0, 2)
        assert len(r) == 2 * TOKENS and set(r.length.tolist()) == {2 * HEAD_SIZE * ELEM}

    @pytest.mark.parametrize("layout", ["heads_major", "tokens_major"])
    def test_whole_block_is_one_range(self, layout: LayoutKind) -> None:
        """Equal TP: the whole block is one range, and consecutive blocks merge per request."""
        c = Case(4, 4, 2, 2, 1, 2, 1, layout, layout)
        piece = plan_rank(c.decode[0], c.prefill).pieces[0]
        assert len(piece.ranges) == 1 and int(piece.ranges.length[0]) == c.decode[0].block_bytes
        s, d = piece_descriptors(
            piece, c.decode[0], 0, 16, np.array([3, 4, 5, 9]), 0, 32, np.array([7, 8, 9, 1]), 0, 4
        )
        bb = piece.prefill.block_bytes
        assert s.shape == (4 * 2, 3)  # per layer: [3,4,5]->[7,8,9] merged, 9->1
        assert s[:, 1].tolist() == [3 * bb, bb] * 4 and (d[:, 1] == s[:, 1]).all()

    def test_layer_window(self) -> None:
        """Only the piece's layers inside the requested range move; outside it nothing does."""
        c = SWEEP["PP2->PP1"]
        d = c.decode[0]
        plan = plan_rank(d, c.prefill)
        ids = np.array([0], dtype=np.int64)
        counts = [
            piece_descriptors(p, d, 0, 4, ids, 0, 4, ids, 1, 3)[0].shape[0] for p in plan.pieces
        ]
        assert counts == [1, 1]
        assert piece_descriptors(plan.pieces[1], d, 0, 4, ids, 0, 4, ids, 0, 2)[0].shape == (0, 3)


class TestRefusals:
    BASE = Case(4, 4, 2, 2, 1, 1, 1)

    def _refused(self, decode: Topology, prefill: list[Topology], text: str) -> None:
        with pytest.raises(RejectedError, match=text) as e:
            plan_rank(decode, prefill)
        assert e.value.reason is Reason.INCOMPATIBLE

    @pytest.mark.parametrize(
        "change, text",
        [
            ({"tokens_per_block": 8}, "tokens_per_block: prefill 4 != decode 8"),
            ({"head_size": 16}, "head_size: prefill 8 != decode 16"),
            ({"elem_bytes": 4}, "elem_bytes: prefill 2 != decode 4"),
        ],
    )
    def test_geometry_mismatch(self, change: dict[str, object], text: str) -> None:
        """A block geometry the mapping cannot reconcile is refused, naming the field and both values."""
        d = self.BASE.instance(1, 1, "heads_major", **change)[0]
        self._refused(d, self.BASE.prefill, text)

    def test_planes_mismatch(self) -> None:
        """K/V (2 planes) into MLA's latent (1 plane) is refused."""
        d = Case(4, 4, 1, 1, 1, 1, 1).decode[0]
        self._refused(d, self.BASE.prefill, "kv_planes: prefill 2 != decode 1")

    def test_heads_and_layers_mismatch(self) -> None:
        """A different total head count or layer count is refused by name."""
        self._refused(
            Case(4, 8, 2, 1, 1, 1, 1).decode[0],
            self.BASE.prefill,
            "kv_heads_total: prefill 4 != decode 8",
        )
        self._refused(
            Case(6, 4, 2, 1, 1, 1, 1).decode[0],
            self.BASE.prefill,
            "num_layers: prefill 4 != decode 6",
        )

    def test_compat_mismatch(self) -> None:
        """Same geometry, another model: the compatibility hash refuses it."""
        d = Case(4, 4, 2, 1, 1, 1, 1, model="other").decode[0]
        self._refused(d, self.BASE.prefill, "compat hash: prefill [0-9a-f]{32} != decode")

    def test_layout_pair(self) -> None:
        """Heads-major into tokens-major with several heads per block is refused, not moved row by row."""
        d = Case(4, 4, 2, 1, 1, 1, 1, d_layout="tokens_major").decode[0]
        self._refused(
            d, self.BASE.prefill, "layout: prefill heads_major -> decode tokens_major is not served"
        )

    def test_layers_not_covered(self) -> None:
        """A prefill instance missing a rank the decode rank needs is refused, naming the head and layers."""
        c = SWEEP["PP2->PP1"]
        self._refused(c.decode[0], c.prefill[:1], r"layers not covered: head 0 of layers \[2, 4\)")

    def test_missing_copy_is_fine(self) -> None:
        """Under replication a missing copy is not a refusal: another copy is read."""
        c = SWEEP["GQA: prefill TP4 over 2 heads -> TP1"]
        assert plan_rank(c.decode[0], c.prefill[1:]).sources == (1, 2)

    def test_prefill_instance_inconsistent(self) -> None:
        """Prefill ranks of different instances, a rank given twice, or none at all are refused."""
        p = self.BASE.prefill
        other = Case(4, 4, 2, 4, 1, 1, 1).prefill[1]
        self._refused(self.BASE.decode[0], [p[0], other], "prefill ranks disagree on tp_size")
        self._refused(self.BASE.decode[0], [p[0], p[0]], "given twice")
        self._refused(self.BASE.decode[0], [], "no prefill rank given")


# --- real NIXL: the prefill ranks' agents WRITE into the decode ranks' pools -------------

NIXL_CASES = [
    ("1P2D (TP1->TP2)", "heads_major"),
    ("2P1D (TP2->TP1)", "heads_major"),
    ("2P4D", "tokens_major"),
    ("4P2D", "heads_major"),
    ("PP3 TP2 -> PP2 TP1, uneven layers", "tokens_major"),
    ("GQA: TP4 -> TP8 over 2 heads", "heads_major"),
    ("MLA 2->1", "heads_major"),
    ("1P2D (TP1->TP2)", "tokens_major"),
]


def _kvpool(tag: str, shape: tuple[int, int, int]):  # type: ignore[no-untyped-def]
    from kvxferd.transfer.pool import KvPool

    layers, blocks, block_bytes = shape
    settings = PoolSettings(
        num_layers=layers,
        num_blocks=blocks,
        block_elems=block_bytes // ELEM,
        dtype="float16",
        aux_slots=1,
        aux_slot_bytes=64,
    )
    return KvPool(settings, owner=tag)


@pytest.mark.integration
@pytest.mark.parametrize("name, layout", NIXL_CASES)
def test_sweep_nixl(name: str, layout: LayoutKind) -> None:
    """Real NIXL WRITEs with the mapping's descriptors leave each decode pool equal to the reference."""
    c = SWEEP[name]
    w = _World(Case(**{**c.__dict__, "p_layout": layout, "d_layout": layout}), seed=7)
    tag = f"{time.monotonic_ns()}"
    pools, planes = {}, {}
    try:
        for side, ranks in (("p", w.prefill), ("d", w.decode)):
            for t in ranks:
                pool = _kvpool(f"rs{side}{t.rank}", w.shape(side, t))
                pools[(side, t.rank)] = pool
                w.fill(side, t, pool.kv_bytes_view())
                planes[(side, t.rank)] = NixlDataPlane(
                    f"rs-{side}{t.rank}-{tag}", DataPlaneSettings(), pool
                )
        base = {t.rank: pools[("p", t.rank)].kv_base for t in w.prefill}
        for d in w.decode:
            rx = planes[("d", d.rank)]
            for r, s, dd in w.descriptors(d, base, pools[("d", d.rank)].kv_base):
                tx = planes[("p", r)]
                peer = tx.add_peer(rx.metadata())
                _wait(rx, tx.post_write(peer, s, dd, "DRAM", "DRAM"))
            got = pools[("d", d.rank)].kv_bytes_view()
            assert torch.equal(got, w.want[d.rank]), (
                f"decode rank {d.rank} differs from the reference"
            )
    finally:
        for dp in planes.values():
            dp.close()
        for pool in pools.values():
            pool.close()


def _wait(rx: NixlDataPlane, xfer_state: tuple) -> None:  # type: ignore[type-arg]
    """Wait for DONE, progressing the target agent (progress threads are off)."""
    xfer, state = xfer_state
    deadline = time.monotonic() + 10
    while state == "PROC" and time.monotonic() < deadline:
        rx.progress()
        state = wait_xfer(xfer, state, time.monotonic() + 0.001)
        state = xfer.poll() if state == "STALLED" else state
    assert state == "DONE"
    assert xfer.release()


@pytest.mark.parametrize(
    "name, layout",
    [
        ("1P2D (TP1->TP2)", "tokens_major"),
        ("PP3 TP2 -> PP2 TP1, uneven layers", "heads_major"),
        ("GQA: TP8 -> TP2 over 2 heads", "tokens_major"),
        ("MLA 2->4, PP2->PP1", "heads_major"),
    ],
)
def test_prepared_lists_and_indices(name: str, layout: LayoutKind) -> None:
    """Copies driven by indices into the once-prepared lists leave each decode pool equal to the
    reference, and cover the same bytes as piece_descriptors (which merges)."""
    c = SWEEP[name]
    w = _World(Case(**{**c.__dict__, "p_layout": layout, "d_layout": layout}), seed=3)
    src = {}
    for t in w.prefill:
        src[t.rank] = torch.empty(w.shape("p", t), dtype=torch.uint8)
        w.fill("p", t, src[t.rank])
    for d in w.decode:
        dst = torch.empty(w.shape("d", d), dtype=torch.uint8)
        w.fill("d", d, dst)
        for piece in plan_rank(d, w.prefill).pieces:
            r = piece.prefill_rank
            ns, nd = w.num_blocks[("p", r)], w.num_blocks[("d", d.rank)]
            sb, db = w.ids[("p", r)], w.ids[("d", d.rank)]
            src_list = prepared_list(piece, d, "src", 0, ns)
            dst_list = prepared_list(piece, d, "dst", 0, nd)
            si = prepared_indices(piece, ns, sb, 0, c.layers)
            di = prepared_indices(piece, nd, db, 0, c.layers)
            s, dd = piece_descriptors(piece, d, 0, ns, sb, 0, nd, db, 0, c.layers)
            assert _covered(src_list[si]) == _covered(s) and _covered(dst_list[di]) == _covered(dd)
            sflat, dflat = src[r].view(-1).numpy(), dst.view(-1).numpy()
            for (sa, ln, _), (da, _, _) in zip(
                src_list[si].tolist(), dst_list[di].tolist(), strict=True
            ):
                dflat[da : da + ln] = sflat[sa : sa + ln]
        assert torch.equal(dst, w.want[d.rank]), f"decode rank {d.rank} differs from the reference"
    piece = plan_rank(w.decode[0], w.prefill).pieces[0]
    assert prepared_indices(piece, 8, np.array([1]), c.layers, c.layers + 1).size == 0


def _covered(descs: np.ndarray) -> list[tuple[int, int]]:
    """The bytes a descriptor array covers, as sorted and merged (start, end) runs."""
    out: list[tuple[int, int]] = []
    for a, b in sorted((int(a), int(a + n)) for a, n, _ in descs.tolist()):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
