"""Prepared descriptor lists: how they are made, and the table of those in use.

The functions make lists with NIXL (``prep_xfer_dlist`` on one path's agent) and hold no
lock: a large pool takes 60-155 ms (docs/topology.md). The data plane's docstring says which
lists exist (the local pool's per path, each peer's whole pool or piece per path).

:class:`PreparedLists` is a table with no lock of its own: **the caller holds the data
plane's lock.** It keeps each (peer, path)'s current lists, what each peer was prepared with
(a fresh path prepares it again), how many writes made from each list set still hold a
handle, and the retired sets some write still uses. A list set goes::

    installed --replaced, its peer removed or moved off the path--> retired (writes use it)
                                                                 |-> released (none does)
    retired --its last write released--> released

Releasing is NIXL's ``release_dlist_handle``, done by the caller after it let go of the
lock (:func:`release`). ``counts`` counts ``installed``, ``retired`` and ``released``.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvxferd.transfer.layout import Descs, Layout
from kvxferd.transfer.reshard import Piece, prepared_list
from kvxferd.transfer.topology import Topology

if TYPE_CHECKING:
    from kvxferd.transfer.pool import KvPool

log = logging.getLogger("kvxferd.dataplane")

Key = tuple[str, int]  # (peer, path index)
Handles = list[tuple[Any, object]]  # (agent, list handle) pairs to release


@dataclass(frozen=True, slots=True)
class Whole:
    """What ``prepare_peer`` was given: the peer's whole pool, one entry per (layer, block)."""

    layout: Layout
    kv_base: int
    device_id: int


@dataclass(frozen=True, slots=True)
class PieceArgs:
    """What ``prepare_piece`` was given: one piece of the local pool and of the peer's."""

    piece: Piece
    decode: Topology
    kv_base: int
    num_blocks: int
    device_id: int


Args = Whole | PieceArgs


class Lists:
    """A peer's prepared lists on one path, retired and released together.

    ``remote``: its pool's list; ``local``: for a piece, the piece's list of the local pool
    (None: the path's shared whole-pool list); ``num_blocks``: the peer pool's.
    """

    __slots__ = ("remote", "num_blocks", "local", "piece")

    def __init__(
        self,
        remote: object,
        num_blocks: int,
        local: object | None = None,
        piece: Piece | None = None,
    ) -> None:
        self.remote = remote
        self.num_blocks = num_blocks
        self.local = local
        self.piece = piece

    def handles(self, agent: Any) -> Handles:
        """What releasing these lists frees (the shared whole-pool list is not theirs)."""
        own: Handles = [(agent, self.remote)]
        if self.local is not None:
            own.append((agent, self.local))
        return own


def prep_whole(
    agent: Any, name: str, layout: Layout, kv_base: int, device_id: int, max_descs: int
) -> object | None:
    """A prepared list of every (layer, block) of a DRAM KV pool, or None."""
    n = layout.num_layers * layout.num_blocks
    if n > max_descs:
        return None
    descs = np.empty((n, 3), dtype=np.int64)
    descs[:, 0] = kv_base + np.arange(n, dtype=np.int64) * layout.block_bytes
    descs[:, 1] = layout.block_bytes
    descs[:, 2] = device_id
    return prep_descs(agent, name, descs)


def prep_descs(agent: Any, name: str, descs: Descs) -> object | None:
    try:
        return agent.prep_xfer_dlist(name, descs, "DRAM")  # type: ignore[no-any-return]
    except Exception as e:
        log.warning("no prepared descriptor list for %s (%s); building per request", name, e)
        return None


def prep_lists(
    agent: Any, local: object | None, peer: str, args: Args, pool: KvPool, max_descs: int
) -> Lists | None:
    """``peer``'s lists on a path (``agent``; a whole pool needs the path's list of the local
    pool, ``local``, first), or None."""
    if isinstance(args, Whole):
        if local is None:
            return None
        handle = prep_whole(agent, peer, args.layout, args.kv_base, args.device_id, max_descs)
        return None if handle is None else Lists(handle, args.layout.num_blocks)
    piece, mine = args.piece, pool.layout
    entries = (piece.layer_end - piece.layer_begin) * len(piece.ranges)
    if entries * max(args.num_blocks, mine.num_blocks) > max_descs:
        return None
    try:
        src = prepared_list(
            piece, args.decode, "src", pool.kv_base, mine.num_blocks, dev=pool.device_id
        )
        dst = prepared_list(
            piece, args.decode, "dst", args.kv_base, args.num_blocks, dev=args.device_id
        )
    except Exception:
        log.warning("no piece lists for %s; building per request", peer, exc_info=True)
        return None
    local_piece = prep_descs(agent, "NIXL_INIT_AGENT", src)
    if local_piece is None:
        return None
    remote = prep_descs(agent, peer, dst)
    if remote is None:
        release([(agent, local_piece)])
        return None
    return Lists(remote, args.num_blocks, local_piece, piece)


def release(handles: Handles) -> None:
    """Release prepared lists (no lock held: NIXL calls)."""
    for agent, h in handles:
        try:
            agent.release_dlist_handle(h)
        except Exception:
            log.warning("releasing a prepared descriptor list failed", exc_info=True)


class PreparedLists:
    """Each (peer, path)'s lists, each peer's preparation, the retired lists still in use.

    No lock of its own: the caller holds the data plane's lock. Methods that let lists go
    add what to release to ``free``; the caller releases it after unlocking.
    """

    def __init__(self) -> None:
        self.current: dict[Key, Lists] = {}  # (peer, path) -> its lists; replaced whole
        self.args: dict[str, Args] = {}  # peer -> what it was prepared with
        self._uses: dict[int, int] = {}  # id(Lists) -> writes holding a handle made from them
        self._retired: dict[int, tuple[Any, Lists]] = {}  # id -> (agent, retired lists in use)
        self.counts: Counter[str] = Counter()

    @property
    def retired(self) -> int:
        """Retired list sets some write still uses (bounded by the writes in flight)."""
        return len(self._retired)

    def install(self, key: Key, lists: Lists) -> None:
        self.current[key] = lists
        self.counts["installed"] += 1

    def retire(self, key: Key, agent: Any, free: Handles) -> None:
        """Retire ``key``'s lists, if any: released now if no write uses them (into ``free``),
        else when the last ends."""
        lists = self.current.pop(key, None)
        if lists is None:
            return
        self.counts["retired"] += 1
        if self._uses.get(id(lists), 0) > 0:
            self._retired[id(lists)] = (agent, lists)
        else:
            self.counts["released"] += 1
            free.extend(lists.handles(agent))

    def used(self, lists: Lists) -> None:
        """A write made from ``lists`` holds a handle now."""
        self._uses[id(lists)] = self._uses.get(id(lists), 0) + 1

    def used_by_one_less(self, lists: Lists, closed: bool) -> Handles:
        """A write made from ``lists`` released its handle; what to release now."""
        key = id(lists)
        left = self._uses.get(key, 0) - 1
        if left > 0:
            self._uses[key] = left
            return []
        self._uses.pop(key, None)
        retired = self._retired.pop(key, None)
        if retired is None or closed:
            return []
        self.counts["released"] += 1
        return retired[1].handles(retired[0])

    def clear(self, agents: list[Any]) -> Handles:
        """Everything (``close``): every list set, current or retired; ``agents[i]`` is path
        ``i``'s agent."""
        handles: Handles = []
        for agent, retired in self._retired.values():
            handles.extend(retired.handles(agent))
        for (_peer, i), mine in self.current.items():
            handles.extend(mine.handles(agents[i]))
        self.counts["released"] += len(self._retired) + len(self.current)
        self.current.clear()
        self._retired.clear()
        return handles
