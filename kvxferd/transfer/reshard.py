"""The reshard mapping: which prefill ranks a decode rank reads, which heads and layers, which bytes.

Planning happens once per (decode rank, prefill instance); a request then only
turns block ids into descriptors (numpy broadcasting, no per-block Python)::

    plan_rank(decode, prefill ranks)  -> RankPlan: Pieces, one per prefill rank read
        Piece: the prefill rank, the layers read from it, its head slice, and the
               byte ranges (src offset, dst offset, length) inside one block, merged
    InstancePlan(decode ranks, prefill ranks).readers(prefill rank) -> decode ranks reading it
    piece_descriptors(piece, pools, block ids, layers) -> (n, 3) src and dst arrays
    prepared_list(piece, side, pool) + prepared_indices(piece, block ids, layers)
        the same, for NIXL's prepared lists: the list once per (peer, piece), indices per request

The rules (docs/topology.md has a worked example of each):

* Heads: the decode rank needs ``decode.head_range``. Each of those heads is
  held by one prefill TP rank of a stage (plain TP), or by several (GQA
  replication: ``tp_size > kv_heads_total``; MLA: every rank). Of several
  holders the decode rank reads exactly one, ``holders[decode.tp_rank % len(holders)]``,
  so the decode ranks spread over the copies and a copy nobody picks is not read.
* Layers: from each prefill stage, the intersection of its layers with the
  decode rank's.
* What cannot be served is refused with ``Reason.INCOMPATIBLE`` and a detail
  that names the mismatch (never a silent wrong result): see :func:`check_pair`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvxferd.errors import Reason, RejectedError
from kvxferd.transfer.topology import LAYOUT_ORDER, Topology, instance_ranks

IdArray = npt.NDArray[np.int64]
Descs = npt.NDArray[np.int64]  # shape (n, 3): address, length, device id

# Exact-match fields checked one by one (before the hash) so that the refusal names the field.
_EXACT = (
    "tokens_per_block",
    "kv_planes",
    "head_size",
    "elem_bytes",
    "kv_heads_total",
    "num_layers",
)


@dataclass(frozen=True, slots=True)
class BlockRanges:
    """Byte ranges inside one block: ``src[i] -> dst[i]`` of ``length[i]`` bytes, merged."""

    src: IdArray
    dst: IdArray
    length: IdArray

    def __len__(self) -> int:
        return int(self.src.size)


@dataclass(frozen=True, slots=True)
class Piece:
    """What one decode rank reads from one prefill rank."""

    prefill: Topology
    layer_begin: int  # absolute layer ids read, [layer_begin, layer_end)
    layer_end: int
    src_head: int  # first head inside the prefill rank's block
    dst_head: int  # where it lands inside the decode rank's block
    heads: int  # how many consecutive heads
    ranges: BlockRanges = field(repr=False)

    @property
    def prefill_rank(self) -> int:
        return self.prefill.rank


@dataclass(frozen=True, slots=True)
class RankPlan:
    """One decode rank's reads: a piece per prefill rank it reads (ordered by prefill rank)."""

    decode: Topology
    pieces: tuple[Piece, ...]

    @property
    def sources(self) -> tuple[int, ...]:
        """The prefill ranks read (ranks with no piece are not read by this decode rank)."""
        return tuple(p.prefill_rank for p in self.pieces)


def refuse(detail: str) -> RejectedError:
    return RejectedError(Reason.INCOMPATIBLE, detail)


def declared(
    current: Topology | None, topology: Topology, block_bytes: int, num_layers: int
) -> Topology:
    """The record a daemon keeps when its engine declares ``topology`` (``current``: the one
    it holds); INCOMPATIBLE unless it describes the pool (``block_bytes`` per block, the
    stage's ``num_layers``) and, once set, is the same record (peers were checked against it).
    """
    if (block_bytes, num_layers) != (topology.block_bytes, topology.num_stage_layers):
        raise refuse(
            f"topology does not describe this pool: block_bytes {block_bytes}, "
            f"num_layers {num_layers} != the record's {topology.block_bytes}, "
            f"{topology.num_stage_layers}"
        )
    if current is not None and current != topology:
        raise refuse("a different topology is already declared (set once per daemon)")
    return topology


def check_pair(prefill: Topology, decode: Topology) -> None:
    """Raise INCOMPATIBLE unless a prefill rank's blocks can be mapped into a decode rank's."""
    for name in _EXACT:
        a, b = getattr(prefill, name), getattr(decode, name)
        if a != b:
            raise refuse(f"{name}: prefill {a} != decode {b}")
    if prefill.compat != decode.compat:
        raise refuse(
            f"compat hash: prefill {prefill.compat} != decode {decode.compat} "
            "(protocol version, model or dtype differ)"
        )
    if prefill.effective_order(decode) != decode.effective_order(prefill):
        lp, ld = prefill.layout, decode.layout
        raise refuse(
            f"layout: prefill {lp} -> decode {ld} is not served "
            f"(one descriptor per plane, head and token; permute after the transfer instead)"
        )


def _check_instance(prefill: Sequence[Topology]) -> dict[tuple[int, int], Topology]:
    """The prefill ranks by (stage, TP rank); raise unless they form one instance."""
    if not prefill:
        raise refuse("no prefill rank given")
    first = prefill[0]
    by_pos: dict[tuple[int, int], Topology] = {}
    for t in prefill:
        for name in ("compat", "tp_size", "pp_size", "pp_layer_bounds", "layout", *_EXACT):
            if getattr(t, name) != getattr(first, name):
                raise refuse(
                    f"prefill ranks disagree on {name}: rank {first.rank} has "
                    f"{getattr(first, name)}, rank {t.rank} has {getattr(t, name)}"
                )
        if (t.pp_stage, t.tp_rank) in by_pos:
            raise refuse(f"prefill rank {t.rank} given twice")
        by_pos[(t.pp_stage, t.tp_rank)] = t
    return by_pos


def _holders(t: Topology, head: int) -> range:
    """The TP ranks of ``t``'s instance (any stage) that hold ``head``."""
    if t.mla:
        return range(t.tp_size)
    if t.tp_size > t.kv_heads_total:
        r = t.replicas
        return range(head * r, (head + 1) * r)
    return range(head // t.kv_heads, head // t.kv_heads + 1)


def plan_rank(decode: Topology, prefill: Sequence[Topology]) -> RankPlan:
    """The reads of one decode rank from one prefill instance (cached: computed once per pair)."""
    return _plan_cached(decode, tuple(sorted(prefill, key=lambda t: t.rank)))


@functools.lru_cache(maxsize=1024)
def _plan_cached(decode: Topology, prefill: tuple[Topology, ...]) -> RankPlan:
    by_pos = _check_instance(prefill)
    first = prefill[0]
    check_pair(first, decode)
    d_h0, d_h1 = decode.head_range
    pieces: list[Piece] = []
    for stage in range(first.pp_size):
        s_lb, s_le = first.pp_layer_bounds[stage], first.pp_layer_bounds[stage + 1]
        lb, le = max(s_lb, decode.layer_begin), min(s_le, decode.layer_end)
        if lb >= le:
            continue
        # head -> the one TP rank of this stage it is read from
        chosen: list[int] = []
        for h in range(d_h0, d_h1):
            present = [r for r in _holders(first, h) if (stage, r) in by_pos]
            if not present:
                raise refuse(
                    f"layers not covered: head {h} of layers [{lb}, {le}) is held by no "
                    f"prefill rank given (stage {stage}, TP ranks {list(_holders(first, h))})"
                )
            chosen.append(present[decode.tp_rank % len(present)])
        h = d_h0
        while h < d_h1:  # consecutive heads from one rank make one piece
            src_rank = chosen[h - d_h0]
            end = h + 1
            while end < d_h1 and chosen[end - d_h0] == src_rank:
                end += 1
            src = by_pos[(stage, src_rank)]
            p_h0 = src.head_range[0]
            pieces.append(
                Piece(
                    prefill=src,
                    layer_begin=lb,
                    layer_end=le,
                    src_head=h - p_h0,
                    dst_head=h - d_h0,
                    heads=end - h,
                    ranges=block_ranges(src, decode, h - p_h0, h - d_h0, end - h),
                )
            )
            h = end
    pieces.sort(key=lambda p: p.prefill_rank)
    return RankPlan(decode, tuple(pieces))


class InstancePlan:
    """Every decode rank's plan against one prefill instance, and who reads each prefill rank."""

    def __init__(self, decode: Sequence[Topology], prefill: Sequence[Topology]) -> None:
        self.prefill = tuple(sorted(prefill, key=lambda t: t.rank))
        self.ranks = {d.rank: plan_rank(d, self.prefill) for d in decode}
        self._readers = {t.rank: 0 for t in self.prefill}
        for plan in self.ranks.values():
            for r in set(plan.sources):
                self._readers[r] += 1

    def readers(self, prefill_rank: int) -> int:
        """How many decode ranks read ``prefill_rank`` (0: release its blocks without a read)."""
        if prefill_rank not in self._readers:
            raise KeyError(f"prefill rank {prefill_rank} is not in this instance")
        return self._readers[prefill_rank]


def _rows(t: Topology, head0: int, heads: IdArray, planes: IdArray, tokens: IdArray) -> IdArray:
    """Index of the head_size-long row (plane, head0 + head, token) in ``t``'s block."""
    st = t.row_strides()
    return planes * st["P"] + (head0 + heads) * st["H"] + tokens * st["T"]


def block_ranges(
    src: Topology, dst: Topology, src_head: int, dst_head: int, heads: int
) -> BlockRanges:
    """The byte ranges moving ``heads`` heads of every plane and token between two blocks.

    Rows of ``head_size`` elements are enumerated in the destination's order and
    runs contiguous on both sides merged: a whole block in one layout is one range;
    a head slice is one range per plane (heads-major) or one per plane and token
    (tokens-major: ``planes * tokens`` ranges).
    """
    sizes = {"P": dst.kv_planes, "H": heads, "T": dst.tokens_per_block}
    order = LAYOUT_ORDER[dst.layout]
    grid = np.meshgrid(*(np.arange(sizes[d]) for d in order), indexing="ij")
    idx = {d: a.ravel().astype(np.int64) for d, a in zip(order, grid, strict=True)}
    p, h, t = idx["P"], idx["H"], idx["T"]
    s, d = _rows(src, src_head, h, p, t), _rows(dst, dst_head, h, p, t)
    starts = np.flatnonzero(np.concatenate(([True], (np.diff(s) != 1) | (np.diff(d) != 1))))
    row = dst.head_size * dst.elem_bytes
    runs = np.diff(np.append(starts, s.size))
    return BlockRanges(s[starts] * row, d[starts] * row, runs.astype(np.int64) * row)


def piece_descriptors(
    piece: Piece,
    decode: Topology,
    src_base: int,
    src_num_blocks: int,
    src_blocks: IdArray,
    dst_base: int,
    dst_num_blocks: int,
    dst_blocks: IdArray,
    layer_begin: int,
    layer_end: int,
    *,
    src_dev: int = 0,
    dst_dev: int = 0,
) -> tuple[Descs, Descs]:
    """Source and destination descriptors of one piece for one request.

    ``src_blocks[i]`` (the prefill rank's pool) lands in ``dst_blocks[i]`` (the
    decode rank's); only the piece's layers inside ``[layer_begin, layer_end)``
    (absolute ids) move. Each pool's layer ``l`` (local to its stage) and block
    ``b`` is at ``base + (l * num_blocks + b) * block_bytes``, as in
    :mod:`kvxferd.transfer.layout`. Ids must already be bounds-checked. Ranges that
    continue each other on both sides (whole blocks i, i+1 on both) are merged.
    """
    lb, le = max(layer_begin, piece.layer_begin), min(layer_end, piece.layer_end)
    if lb >= le or src_blocks.size == 0:
        empty = np.empty((0, 3), dtype=np.int64)
        return empty, empty.copy()
    pre = piece.prefill
    layers = np.arange(lb, le, dtype=np.int64)[:, None, None]
    r = piece.ranges
    s_addr = (
        src_base
        + ((layers - pre.layer_begin) * src_num_blocks + src_blocks[None, :, None])
        * pre.block_bytes
        + r.src[None, None, :]
    ).ravel()
    d_addr = (
        dst_base
        + ((layers - decode.layer_begin) * dst_num_blocks + dst_blocks[None, :, None])
        * decode.block_bytes
        + r.dst[None, None, :]
    ).ravel()
    lens = np.broadcast_to(r.length[None, None, :], (le - lb, src_blocks.size, len(r))).ravel()
    if s_addr.size > 1:
        ends_s, ends_d = s_addr[:-1] + lens[:-1], d_addr[:-1] + lens[:-1]
        cont = (s_addr[1:] == ends_s) & (d_addr[1:] == ends_d)
        starts = np.flatnonzero(np.concatenate(([True], ~cont)))
        s_addr, d_addr = s_addr[starts], d_addr[starts]
        lens = np.add.reduceat(lens, starts)
    src = np.empty((s_addr.size, 3), dtype=np.int64)
    dst = np.empty((d_addr.size, 3), dtype=np.int64)
    src[:, 0], src[:, 1], src[:, 2] = s_addr, lens, src_dev
    dst[:, 0], dst[:, 1], dst[:, 2] = d_addr, lens, dst_dev
    return src, dst


def prepared_list(
    piece: Piece,
    decode: Topology,
    side: Literal["src", "dst"],
    base: int,
    num_blocks: int,
    *,
    dev: int = 0,
) -> Descs:
    """Every (layer, block, range) of one side's pool for a piece, for ``prep_xfer_dlist`` once.

    ``side``: ``"src"`` the prefill rank's pool (a sender's local list), ``"dst"`` the
    decode rank's (its remote list). Entry ``((l - piece.layer_begin) * num_blocks + b) * R + k``
    is range ``k`` of block ``b`` of absolute layer ``l``, ``R = len(piece.ranges)``, on
    both sides alike: :func:`prepared_indices` is then the same array for both lists.
    """
    r = piece.ranges
    t, offs = (piece.prefill, r.src) if side == "src" else (decode, r.dst)
    layers = np.arange(piece.layer_begin, piece.layer_end, dtype=np.int64)[:, None, None]
    blocks = np.arange(num_blocks, dtype=np.int64)[None, :, None]
    addr = base + ((layers - t.layer_begin) * num_blocks + blocks) * t.block_bytes + offs
    out = np.empty((addr.size, 3), dtype=np.int64)
    out[:, 0] = addr.ravel()
    out[:, 1] = np.broadcast_to(r.length, addr.shape).ravel()
    out[:, 2] = dev
    return out


def prepared_indices(
    piece: Piece, num_blocks: int, blocks: IdArray, layer_begin: int, layer_end: int
) -> IdArray:
    """Indices into a :func:`prepared_list` of ``num_blocks`` blocks for one request's blocks.

    Call once with the source pool's ``num_blocks`` and ids and once with the
    destination's: the two index arrays pair entry by entry (no merging on this path).
    """
    lb, le = max(layer_begin, piece.layer_begin), min(layer_end, piece.layer_end)
    if lb >= le:
        return np.empty(0, dtype=np.int64)
    nr = len(piece.ranges)
    layers = np.arange(lb - piece.layer_begin, le - piece.layer_begin, dtype=np.int64)
    idx = (layers[:, None, None] * num_blocks + blocks[None, :, None]) * nr
    return (idx + np.arange(nr, dtype=np.int64)[None, None, :]).ravel()


def piece_for(decode: Topology, prefill: Topology) -> Piece | None:
    """What ``decode`` reads from the one prefill rank ``prefill`` (None: nothing).

    The sender's side of the plan: the decode rank plans against the whole prefill
    instance, derived from this one record (``instance_ranks``), so both sides agree.
    """
    for piece in plan_rank(decode, instance_ranks(prefill)).pieces:
        if piece.prefill_rank == prefill.rank:
            return piece
    return None


def readers_for(decode: Topology, prefill: Topology) -> int:
    """How many ranks of ``decode``'s instance read the prefill rank ``prefill``.

    A prefill rank publishes each request with this as ``expected_fetches`` (0: no
    decode rank reads it; the request is released at publish without a read). Both
    instances are derived from one record each (``instance_ranks``); cached per pair.
    """
    return _readers_cached(decode, prefill)


@functools.lru_cache(maxsize=1024)
def _readers_cached(decode: Topology, prefill: Topology) -> int:
    return InstancePlan(instance_ranks(decode), instance_ranks(prefill)).readers(prefill.rank)
