"""The data plane: a narrow interface over NIXL (register once, add peers, post WRITEs, poll).

Session and sender logic talk only to :class:`DataPlane`, so race tests can
stand in a controllable double (``kvxferd.testing``); integration tests and
every real process use :class:`NixlDataPlane`.

NIXL facts this wrapper leans on (measured on 2-core hosts, see docs):

* The agent's own progress thread polls with a zero timeout and burns a core;
  it is off by default and the owner drives progress (``progress()``).
* Several threads post on one agent: the agent runs in NIXL's STRICT thread-sync
  mode unless configured otherwise.
* A WRITE cannot be truly cancelled once posted; a handle still in progress is
  never released, and the memory under it is never deregistered.
* Building descriptors per request (``get_xfer_descs`` x2 + ``initialize_xfer``)
  costs tens of µs per small request. KV writes therefore go through
  descriptor lists prepared once: the local pool (one descriptor per (layer,
  block)) at the first ``prepare_peer`` (a receiver, which never writes, holds
  none), each peer's pool at its ``prepare_peer`` (REGISTER); a request is then
  ``make_prepped_xfer`` with indices ``layer * num_blocks + block`` (NIXL merges
  adjacent descriptors itself). Where no list could be prepared (VRAM pools,
  not measured here; pools over ``MAX_PREPPED_DESCS``; a failed prep) the
  caller falls back to ``post_write`` with descriptors it built. AUX payloads
  are shorter than a slot, so they always use ``post_write``.
* A peer read through the reshard mapping (``prepare_piece``: it reads a slice of
  each block, :mod:`kvxferd.transfer.reshard`) gets two lists of its own per path, both
  ``prepared_list`` of its piece: the local pool's ranges it reads (not the shared
  whole-pool list, whose entries are whole blocks) and its pool's ranges they land
  in; a request is then ``prepared_indices`` on both sides (one array per side,
  numpy, paired entry by entry; no merging across blocks on this path). Peers
  reading the same piece each hold their own local list (simpler than sharing;
  preparing a pair took about 1 ms at 33k entries each, 60-155 ms at 532k, see
  docs/topology.md). Over ``MAX_PREPPED_DESCS`` entries on either side, or a failed
  prep, the peer is not prepared and gets per-request descriptors
  (``piece_descriptors`` + ``post_write``), as before.
* A peer's prepared lists are retired when the peer is removed or prepared again,
  and released as soon as no write made from them holds a handle (each
  ``post_blocks`` counts a use until its handle is released), so retired lists
  stay bounded by the writes in flight, not by the peers ever seen. The sender
  removes a peer only once no write toward it is in flight.
* **A failed or stalled transport gets a fresh connection.** UCX does not reopen an
  endpoint that failed (a TCP connection that timed out after a long link cut, a peer
  unreachable): every later WRITE toward that peer is refused, for good. And a TCP
  connection whose data sat in a cut link waits out TCP's retransmission backoff after the
  heal (up to two minutes with kernel defaults) before it carries anything new. So each
  peer has a current *path*: a local NIXL agent with the pool registered (path 0 is the
  agent this process hands out; spare agents ``NAME.pN`` are opened on demand, at most
  ``max_paths`` in all, each serving one peer at a time). A post that raises, a WRITE
  that ends in ERR or whose status check raises marks (peer, path) *broken*; a write still
  in flight past ``stall_s`` (the sender's ``xfer_stall_timeout_ms``) makes its path
  *stalled*. The next post toward such a peer starts a connect thread
  (``kvxferd-dp-connect``) that loads the peer's metadata on a spare path (its own
  agent, reserved: no write, poll or progress touches it meanwhile) and prepares its
  list; NIXL may block there until the peer is reachable again, and only that thread
  waits. Once loaded, the peer's next writes take the fresh path
  (``transport_fresh_paths``). Writes in flight are never pulled from under NIXL: the
  stalled ones stay on their old path (its endpoint is left as it is) until they end,
  and until the move completes writes keep to the old path (failing fast, or waiting
  behind the stall, as before). With ``max_paths`` 1 a broken peer is reloaded in place
  at its next post with none of its writes in flight (``transport_reconnects``).
* **Loading a peer can block for minutes; nothing else must wait for it.** Over UCX TCP,
  ``add_remote_agent`` connects blocking (UCX's ``TCP_CONN_NB`` is off by default): toward an
  address whose packets vanish it returns only when the kernel gives up the connect, 127 s
  of SYN retries with ``tcp_syn_retries`` 6 (measured 133.5 s; 7.1 s with 2), then raises
  ``NIXL_ERR_BACKEND``. Toward a live but SIGSTOPped process it takes 15 ms (the kernel
  accepts the connect), unless that process's accept queue is full (then the kernel drops
  the SYNs: the silent peer of tests/test_dataplane_lock.py). ``UCX_TCP_SYN_CNT`` bounds
  the SYN retries of UCX's own connects. ``remove_remote_agent``, ``prep_xfer_dlist``, posting a WRITE and
  ``check_xfer_state`` toward a silent peer each returned in under 1 ms (measured in network
  namespaces with an nftables drop, docs/hosts.md). And NIXL's own agent lock (sync modes
  strict and rw) holds every call on the agent while ``add_remote_agent`` waits: a WRITE to a
  healthy peer on the same agent waited the full 7.1 s, even with no lock of ours held.

**Locking rule.** ``_lock`` guards the tables (:class:`~kvxferd.transfer.loaded_peers.LoadedPeers`
with ``closed``, :class:`~kvxferd.transfer.routes.Routes`,
:class:`~kvxferd.transfer.dlists.PreparedLists`, the paths), none of which has a lock of its
own; no NIXL call that talks to a peer or prepares a list runs under it. What can block runs
with no lock of ours held:

* ``add_peer`` (every REGISTER) connects first from a *probe agent* (``PeerConnects.probe``,
  :mod:`kvxferd.transfer.peer_connects`: no memory registered, no write; one per concurrent
  caller), then loads the peer on path 0. Only the caller waits out an unreachable peer;
  once the probe connected, path 0's own connect takes milliseconds (a peer cut off in
  between still blocks it). ``add_peer_async`` does the same on a ``kvxferd-tx-connect``
  thread and returns a future at once, which fails with :class:`PeerUnreachable` at its
  deadline even while NIXL still waits (then nothing is loaded): with it no caller waits.
* ``remove_peer`` changes the tables under ``_lock``, then calls ``remove_remote_agent``.
* A reload in place (``max_paths`` 1, :class:`~kvxferd.transfer.path_moves.PathMoves`)
  releases ``_lock`` around its probe, its ``remove_remote_agent``/``add_remote_agent`` and
  its lists, and holds it again to install them; a connect thread (``kvxferd-dp-connect``,
  also PathMoves') works on a path reserved for it.
* Prepared lists (the local pool's, a peer's) are made outside ``_lock`` and installed
  under it; the list that loses a race (two threads preparing, the peer removed or prepared
  again meanwhile, ``close()`` meanwhile) is released by the thread that made it.

Loads and removals of one peer name are serialised by a *claim* (``LoadedPeers.claim``, a
condition on ``_lock``): a second ``add_peer`` of the same agent, a removal, or a post toward
that peer waits for the claim; posts toward other peers never do. A reload whose peer was
removed or prepared again meanwhile (or the plane closed) installs nothing.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import torch

from kvxferd.config import DataPlaneSettings
from kvxferd.transfer.dlists import (
    Args,
    Lists,
    PieceArgs,
    PreparedLists,
    Whole,
    prep_lists,
    prep_whole,
    release,
)
from kvxferd.transfer.layout import Descs, IdArray, Layout, prepped_indices
from kvxferd.transfer.loaded_peers import LoadedPeers
from kvxferd.transfer.path_moves import Path, PathMoves
from kvxferd.transfer.path_moves import PathStalled as PathStalled
from kvxferd.transfer.peer_connects import PeerConnects
from kvxferd.transfer.peer_connects import PeerUnreachable as PeerUnreachable
from kvxferd.transfer.reshard import Piece, prepared_indices
from kvxferd.transfer.routes import Key, Routes
from kvxferd.transfer.topology import Topology

if TYPE_CHECKING:
    from kvxferd.stats import Stats
    from kvxferd.transfer.pool import KvPool

XferState = Literal["DONE", "PROC", "ERR"]

log = logging.getLogger("kvxferd.dataplane")

# Largest pool (layers x blocks) given a prepared list: its (n, 3) int64 build array and
# NIXL's own copy grow with it; beyond this the per-request descriptors are cheaper.
MAX_PREPPED_DESCS = 1 << 21


class Xfer(Protocol):
    """One posted WRITE."""

    def poll(self) -> XferState: ...

    def release(self) -> bool:
        """Free the handle; False when the backend refused (still in progress)."""
        ...


class DataPlane(Protocol):
    """What the sender and receiver need from a data plane."""

    name: str

    def metadata(self) -> bytes: ...

    def add_peer(self, metadata: bytes) -> str: ...

    def add_peer_async(self, metadata: bytes, timeout_s: float) -> Future[str]:
        """``add_peer`` without waiting: the future ends with the peer's name, or fails
        (:class:`PeerUnreachable` when it was not reached within ``timeout_s``)."""
        ...

    def prepare_peer(
        self, peer: str, layout: Layout, kv_base: int, mem_type: str, device_id: int
    ) -> bool:
        """Prepare descriptors over ``peer``'s KV pool; True when ``post_blocks`` serves it.

        False (never raises) means: use ``post_write`` with built descriptors for this peer.
        """
        ...

    def prepare_piece(
        self,
        peer: str,
        piece: Piece,
        decode: Topology,
        kv_base: int,
        num_blocks: int,
        mem_type: str,
        device_id: int,
    ) -> bool:
        """Prepare the lists of a peer read through the reshard mapping: ``piece`` of the
        local pool and of ``peer``'s (``decode``'s record; its pool at ``kv_base``, of
        ``num_blocks`` blocks). True when ``post_blocks`` serves it (by piece indices).

        Replaces whatever ``peer`` was prepared with. False (never raises) means: use
        ``post_write`` with ``piece_descriptors`` for this peer.
        """
        ...

    def post_blocks(
        self,
        peer: str,
        src_blocks: IdArray,
        dst_blocks: IdArray,
        layer_begin: int,
        layer_end: int,
        notif: bytes = b"",
    ) -> tuple[Xfer, XferState]:
        """Post one KV WRITE of checked block ids through the prepared lists (``prepare_peer``
        or ``prepare_piece`` returned True); raises when nothing was posted.

        For a piece the layers are absolute (inside the piece's), the bytes moved those of
        the piece's ranges of each block, as ``piece_descriptors`` would build them.
        ``notif``: a notification NIXL sends the peer once the WRITE is complete; the write
        is DONE only once it was sent."""
        ...

    def remove_peer(self, peer: str) -> None: ...

    def probe_write(
        self, peer: str, dst_base: int, nbytes: int, device_id: int
    ) -> tuple[Xfer, XferState]:
        """Post one link-probe WRITE from the local scratch region into ``peer``'s (the region
        its Register advertised, never its KV pool); raises when nothing was posted."""
        ...

    def post_write(
        self, peer: str, src: Descs, dst: Descs, src_mem: str, dst_mem: str, notif: bytes = b""
    ) -> tuple[Xfer, XferState]:
        """Post one WRITE and return it with its first state; raises when nothing was posted.
        ``notif`` as for ``post_blocks``."""
        ...

    def progress(self) -> None:
        """Drive the transport (a receiver's agent must progress for writes toward it to
        connect); notifications that came meanwhile are dropped."""
        ...

    def notifications(self) -> list[tuple[str, bytes]]:
        """Progress, and take the notifications that came: (sender agent name, payload)."""
        ...

    def close(self) -> None: ...


def wait_xfer(xfer: Xfer, state: XferState, deadline: float) -> XferState | Literal["STALLED"]:
    """Poll ``xfer`` until it leaves PROC or ``deadline`` (monotonic) passes.

    Backs off from 20 µs to 1 ms between polls: on a 2-core host a busy poll
    steals the core the data plane needs.
    """
    delay = 0.0
    while state == "PROC":
        if time.monotonic() >= deadline:
            return "STALLED"
        if delay:
            time.sleep(delay)
        delay = min(max(delay * 2, 20e-6), 1e-3)
        state = xfer.poll()
    return state


def _quiet_nixl_logger() -> None:
    """NIXL's Python logger prints INFO lines to stdout; stdout belongs to the program."""
    nixl_log = logging.getLogger("nixl")
    if "NIXL_LOG_LEVEL" not in os.environ:
        nixl_log.setLevel(logging.WARNING)
    for h in nixl_log.handlers:
        if isinstance(h, logging.StreamHandler) and h.stream is sys.stdout:
            h.setStream(sys.stderr)


class _NixlXfer:
    __slots__ = ("_agent", "_handle", "_released", "_on_release", "_on_error")

    def __init__(
        self,
        agent: object,
        handle: object,
        on_release: Callable[[], None] | None = None,
        on_error: Callable[[], None] | None = None,
    ) -> None:
        self._agent = agent
        self._handle = handle
        self._released = False
        self._on_release = on_release  # once, after the handle was released
        self._on_error = on_error  # the transport failed this write (ERR, or the check raised)

    def poll(self) -> XferState:
        try:
            state: XferState = self._agent.check_xfer_state(self._handle)  # type: ignore[attr-defined]
        except Exception:
            if self._on_error is not None:
                self._on_error()
            raise
        if state == "ERR" and self._on_error is not None:
            self._on_error()
        return state

    def release(self) -> bool:
        if self._released:
            return True
        try:
            self._agent.release_xfer_handle(self._handle)  # type: ignore[attr-defined]
        except Exception:
            return False
        self._released = True
        if self._on_release is not None:
            self._on_release()
        return True


class Prep:
    """How this data plane prepares lists on a path, and whether it does (``want``).

    ``whole`` and ``lists`` are NIXL calls and hold no lock; ``local`` installs a path's list
    of the local pool under the data plane's lock. ``want`` is True for a DRAM pool until path
    0's local list fails (set False under the lock; never True again).
    """

    def __init__(self, pool: KvPool, want: bool, lock: threading.Lock, peers: LoadedPeers) -> None:
        self._pool = pool
        self.want = want
        self._lock = lock
        self._peers = peers

    def whole(self, agent: Any) -> object | None:
        """``agent``'s list of the whole local pool, or None."""
        pool = self._pool
        return prep_whole(
            agent,
            "NIXL_INIT_AGENT",
            pool.layout,
            pool.kv_base,
            pool.device_id,
            MAX_PREPPED_DESCS,
        )

    def lists(self, path: Path, peer: str, args: Args) -> Lists | None:
        return prep_lists(path.agent, path.local, peer, args, self._pool, MAX_PREPPED_DESCS)

    def local(self, path: Path) -> bool:
        """The path's list of the local pool, prepared once; False turns prepping off.

        Prepared without the lock (a large pool takes 60-155 ms); of two threads preparing
        it at once, the first to install wins and the other releases its own.
        """
        with self._lock:
            if path.local is not None or not self.want or self._peers.closed:
                return path.local is not None
        local = self.whole(path.agent)
        with self._lock:
            if local is None:
                if path.index == 0:
                    self.want = False
                return path.local is not None
            if path.local is None and not self._peers.closed:
                path.local = local
                return True
        release([(path.agent, local)])
        return path.local is not None


def new_agent(name: str, settings: DataPlaneSettings) -> Any:
    """A NIXL agent with ``settings``' backend and options, no memory registered."""
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    sync = {
        "strict": nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        "rw": nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        "none": nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE,
        "default": nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT,
    }[settings.sync_mode]
    agent = nixl_agent(
        name,
        nixl_agent_config(enable_prog_thread=settings.progress_thread, backends=[], sync_mode=sync),
    )
    agent.create_backend(
        settings.backend,
        {
            "ucx_error_handling_mode": settings.ucx_error_handling_mode,
            "num_workers": str(settings.ucx_num_workers),
        },
    )
    return agent


def scratch_region(nbytes: int) -> torch.Tensor:
    """The link probe's scratch region (``link_probe_bytes``): plain memory, never a KV block,
    filled with ``i % 251`` (a pattern a test recognises where a probe WRITE landed)."""
    return torch.arange(nbytes, dtype=torch.int32).remainder_(251).to(torch.uint8)


def _remove_remote(peer: str, agents: list[Any]) -> None:
    """``remove_remote_agent`` on each agent; the first error is raised after the rest ran."""
    error: Exception | None = None
    for agent in agents:
        try:
            agent.remove_remote_agent(peer)
        except Exception as e:
            error = error or e
    if error is not None:
        raise error


class NixlDataPlane:
    """NIXL agents with the pool registered once each; WRITEs from this process's memory.

    ``stall_s``: a write toward a peer still in progress this long makes the next post
    toward that peer go through a fresh connection (another path), if ``max_paths`` allows.
    Its state lives in tables guarded by ``_lock``: :class:`LoadedPeers` (``_peers``),
    :class:`Routes` (``_routes``), :class:`PreparedLists` (``_lists``), the paths; moves to
    fresh paths and reloads in place are :class:`PathMoves`' (``_moves``).
    """

    def __init__(
        self,
        name: str,
        settings: DataPlaneSettings,
        pool: KvPool,
        *,
        prepped: bool = True,
        stall_s: float | None = None,
        stats: Stats | None = None,
        heard_from: Callable[[str], float] | None = None,
    ) -> None:
        if settings.ucx_tls:
            os.environ["UCX_TLS"] = settings.ucx_tls
        _quiet_nixl_logger()
        self.name = name
        self.settings = settings
        self._pool = pool
        # The link probe's scratch region, registered on every path: a sender's probe WRITEs
        # from it (link_probes.py), a receiver advertises it in its Register.
        self.scratch = scratch_region(settings.link_probe_bytes)
        self.scratch_bytes = self.scratch.numel()
        self.scratch_base = int(self.scratch.data_ptr()) if self.scratch_bytes else 0
        self._paths: list[Path] = []  # appended under _lock, never removed before close
        self._agent_seq = itertools.count(1)  # names of spare agents
        self._paths.append(self._open_path(0))
        self._agent = self._paths[0].agent  # the agent peers know (metadata, progress)
        self._lock = threading.Lock()  # guards every table below
        self._peers = LoadedPeers(self._lock)  # known peers, their claims, closed
        self._layout = pool.layout
        self._lists = PreparedLists()  # each (peer, path)'s prepared lists, the retired ones
        self._routes = Routes()  # each peer's path, writes in flight, broken transports
        self._connects = PeerConnects(name, self._new_agent)  # probe agents, connect threads
        self._prep = Prep(pool, prepped and pool.mem_type == "DRAM", self._lock, self._peers)
        self._moves = PathMoves(
            self._lock,
            self._routes,
            self._peers,
            self._lists,
            self._connects,
            self._paths,
            self._open_path,
            self._prep,
            stall_s=stall_s,
            heard_from=heard_from,
            stats=stats,
        )
        # KV writes posted so far, by how: "blocks" (whole-pool lists), "piece" (a piece's
        # lists), "descs" (post_write: descriptors built per request, and AUX)
        self.posts = {"blocks": 0, "piece": 0, "descs": 0}

    @property
    def closed(self) -> bool:
        """True once ``close()`` began: the pool is (being) deregistered."""
        return self._peers.closed

    @property
    def reconnects(self) -> int:
        """Failed transports reconnected in place so far."""
        return self._moves.reconnects

    @property
    def fresh_paths(self) -> int:
        """Peers moved to a fresh connection so far."""
        return self._moves.fresh_paths

    def _open_path(self, index: int) -> Path:
        """A NIXL agent (``name`` for path 0, ``name.pN`` after: N counts the agents opened,
        the path's index is set where it is added) with the pool registered."""
        agent = self._new_agent(
            self.name if index == 0 else f"{self.name}.p{next(self._agent_seq)}"
        )
        pool = self._pool
        regs = [
            agent.register_memory([pool.kv], mem_type=pool.mem_type),
            agent.register_memory([pool.aux], mem_type="DRAM"),
        ]
        if self.scratch.numel():
            regs.append(agent.register_memory([self.scratch], mem_type="DRAM"))
        return Path(index, agent, regs)

    def _new_agent(self, name: str) -> Any:
        return new_agent(name, self.settings)

    def on_new_path(self, callback: Callable[[str], object]) -> None:
        """Call ``callback(peer)`` once a peer's transport is fresh (a move to a fresh path, a
        reload in place); it runs under the data plane's lock and must not block."""
        self._moves.on_moved = callback

    @property
    def prepped(self) -> bool:
        """True when prepared lists are in use (``prepare_peer`` can succeed)."""
        return self._prep.want

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()  # type: ignore[no-any-return]

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata on path 0 (every REGISTER); raises when NIXL cannot.

        A probe agent connects first (``PeerConnects.probe``: it may block for the whole TCP
        connect toward an unreachable peer, and only the caller waits); path 0 loads the peer
        once the probe connected, which then takes milliseconds.
        """
        known = self._known(metadata)
        if known is not None:
            return known
        peer = self._connects.probe(metadata)
        with self._lock:
            self._peers.claim(peer)
        return self._load_claimed(metadata, peer)

    def add_peer_async(self, metadata: bytes, timeout_s: float) -> Future[str]:
        """``add_peer`` on a ``kvxferd-tx-connect`` thread; returns at once (the caller never
        waits for NIXL). The future ends with the peer's name once it is loaded on path 0, or
        fails with :class:`PeerUnreachable` (the probe failed, or ``timeout_s`` passed while
        it still waited: nothing is loaded then, even if the connect succeeds later) or with
        the load's error. Callbacks run on the connect thread (or the deadline's timer)."""
        known = self._known(metadata)
        if known is not None:
            done: Future[str] = Future()
            done.set_result(known)
            return done
        return self._connects.start(metadata, timeout_s, self._load_peer)

    def _known(self, metadata: bytes) -> str | None:
        """The peer already loaded with exactly ``metadata`` (a Register sent again), or None.

        Such a Register connects nothing: path 0 holds the peer already, and a probe toward
        it could fail where the load never would (an agent its receiver has torn down since
        the Register left: the reply tells it to register again with a fresh one)."""
        with self._lock:
            return next((p for p, m in self._peers.meta.items() if m == metadata), None)

    def _load_peer(self, metadata: bytes, peer: str) -> str:
        """``add_peer_async``'s load, on its connect thread once the probe reached ``peer``."""
        with self._lock:
            if self._peers.closed:
                raise PeerUnreachable("the data plane is closed")
            self._peers.claim(peer)
        return self._load_claimed(metadata, peer)

    def _load_claimed(self, metadata: bytes, peer: str) -> str:
        """Load ``peer`` (claimed by the caller; its probe reached it) on path 0; unclaim it."""
        loaded = False
        try:
            self._agent.add_remote_agent(metadata)
            loaded = True
        finally:
            with self._lock:
                self._peers.unclaim(peer)
                if loaded:
                    self._peers.add(peer, metadata)
                    self._routes.added(peer)
        return peer

    def _usable(self, layout: Layout, mem_type: str) -> bool:
        mine = self._layout
        return (
            self._prep.want
            and mem_type == "DRAM"
            and layout.block_bytes == mine.block_bytes
            and layout.num_layers == mine.num_layers
        )

    def prepare_peer(
        self, peer: str, layout: Layout, kv_base: int, mem_type: str, device_id: int
    ) -> bool:
        with self._lock:
            path = self._paths[self._routes.path_of(peer)]
        # The local list once per path; a failure on path 0 turns prepping off.
        usable = self._usable(layout, mem_type) and self._prep.local(path)
        usable = usable and self._usable(layout, mem_type)
        args = Whole(layout, kv_base, device_id)
        lists = self._prep.lists(path, peer, args) if usable else None
        return self._install(peer, path, args if usable else None, lists)

    def prepare_piece(
        self,
        peer: str,
        piece: Piece,
        decode: Topology,
        kv_base: int,
        num_blocks: int,
        mem_type: str,
        device_id: int,
    ) -> bool:
        try:
            with self._lock:
                path = self._paths[self._routes.path_of(peer)]
                usable = self._prep.want and mem_type == "DRAM" and not self._peers.closed
            args = PieceArgs(piece, decode, kv_base, num_blocks, device_id)
            lists = self._prep.lists(path, peer, args) if usable else None
            # Only a peer whose lists were made has them made again on a fresh path.
            return self._install(peer, path, args if lists is not None else None, lists)
        except Exception:  # the protocol says False, never raises
            log.warning("preparing the piece lists of %s failed", peer, exc_info=True)
            return False

    def _install(self, peer: str, path: Path, args: Args | None, lists: Lists | None) -> bool:
        """Make ``lists`` ``peer``'s on ``path`` (None: it has none now); True when they are."""
        free: list[tuple[Any, object]] = []
        key = (peer, path.index)
        with self._lock:  # a peer prepared again (or refused now) loses its old lists
            if args is not None:
                self._lists.args[peer] = args
            else:
                self._lists.args.pop(peer, None)
            self._lists.retire(key, path.agent, free)
            ok = lists is not None and self._peers.live(peer)
            if lists is not None:
                if ok:
                    self._lists.install(key, lists)
                else:
                    free.extend(lists.handles(path.agent))
        release(free)
        return ok

    def _used_by_one_less(self, lists: Lists) -> None:
        with self._lock:
            free = self._lists.used_by_one_less(lists, self._peers.closed)
        release(free)

    def retired_lists(self) -> int:
        """Peers' prepared lists retired but still used by a write (bounded by writes in flight)."""
        with self._lock:
            return self._lists.retired

    def paths(self) -> int:
        """Local agents (connections per peer) opened so far: 1 until a write stalls."""
        with self._lock:
            return len(self._paths)

    def post_blocks(
        self,
        peer: str,
        src_blocks: IdArray,
        dst_blocks: IdArray,
        layer_begin: int,
        layer_end: int,
        notif: bytes = b"",
    ) -> tuple[Xfer, XferState]:
        """Post one KV WRITE by block indices; raises on a build or post error (nothing in flight)."""
        free: list[tuple[Any, object]] = []
        with self._lock:  # the list is counted as used before NIXL sees it
            path = self._moves.route_locked(peer, free, self.settings.max_paths)
            key = (peer, path.index)
            lists = self._lists.current.get(key)
            local = None if lists is None else path.local if lists.local is None else lists.local
            if lists is not None and local is not None:
                self._lists.used(lists)
                wid = self._routes.posted(key)
                self.posts["blocks" if lists.piece is None else "piece"] += 1
        release(free)
        if lists is None or local is None:
            raise RuntimeError(f"no prepared descriptor list for peer {peer}")

        def released() -> None:
            self._used_by_one_less(lists)
            self._write_released(key, wid)

        try:
            num_blocks = self._layout.num_blocks
            if lists.piece is None:
                local_idx = prepped_indices(src_blocks, layer_begin, layer_end, num_blocks)
                remote_idx = prepped_indices(dst_blocks, layer_begin, layer_end, lists.num_blocks)
            else:  # the same layers and ranges on both sides: the arrays pair entry by entry
                local_idx = prepared_indices(
                    lists.piece, num_blocks, src_blocks, layer_begin, layer_end
                )
                remote_idx = prepared_indices(
                    lists.piece, lists.num_blocks, dst_blocks, layer_begin, layer_end
                )
            handle = path.agent.make_prepped_xfer(
                "WRITE", local, local_idx, lists.remote, remote_idx, notif
            )
        except Exception:
            self._moves.mark_broken(key)
            released()
            raise
        return self._start(path, handle, key, released)

    def _start(
        self, path: Path, handle: object, key: Key, on_release: Callable[[], None]
    ) -> tuple[Xfer, XferState]:
        agent = path.agent
        xfer = _NixlXfer(agent, handle, on_release, lambda: self._moves.mark_broken(key))
        try:
            state = agent.transfer(handle)
        except Exception:
            self._moves.mark_broken(key)
            xfer.release()
            raise
        if state == "ERR":
            self._moves.mark_broken(key)
            xfer.release()
            raise RuntimeError("NIXL refused to post the WRITE")
        return xfer, state

    def _write_released(self, key: Key, wid: int) -> None:
        with self._lock:
            self._routes.released(key, wid)

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer``; the caller guarantees no write toward it is in flight.

        The tables change under ``_lock``; NIXL's ``remove_remote_agent`` runs after, with
        the peer claimed (a load of the same name waits for it, and it for a load).
        """
        free: list[tuple[Any, object]] = []
        agents: list[Any] = []
        claimed = False
        with self._lock:
            if peer in self._peers:
                self._peers.claim(peer)
                claimed = True
            if self._peers.remove(peer):
                self._lists.args.pop(peer, None)
                for path in self._paths:
                    self._lists.retire((peer, path.index), path.agent, free)
                held = self._routes.remove(peer, [path.index for path in self._paths])
                agents.extend(self._paths[i].agent for i in held)
        try:
            _remove_remote(peer, agents)
        finally:
            if claimed:
                with self._lock:
                    self._peers.unclaim(peer)
            release(free)

    def post_write(
        self, peer: str, src: Descs, dst: Descs, src_mem: str, dst_mem: str, notif: bytes = b""
    ) -> tuple[Xfer, XferState]:
        """Post one WRITE; raises on a build or post error (nothing in flight then)."""
        free: list[tuple[Any, object]] = []
        with self._lock:
            path = self._moves.route_locked(peer, free, self.settings.max_paths)
            key = (peer, path.index)
            wid = self._routes.posted(key)
            self.posts["descs"] += 1
        release(free)
        agent = path.agent
        try:
            local = agent.get_xfer_descs(src, src_mem)
            remote = agent.get_xfer_descs(dst, dst_mem)
            handle = agent.initialize_xfer("WRITE", local, remote, peer, notif)
        except Exception:
            self._moves.mark_broken(key)
            self._write_released(key, wid)
            raise
        return self._start(path, handle, key, lambda: self._write_released(key, wid))

    def probe_write(
        self, peer: str, dst_base: int, nbytes: int, device_id: int
    ) -> tuple[Xfer, XferState]:
        """A link-probe WRITE on ``peer``'s current path (protocol); not counted in ``posts``."""
        if not 0 < nbytes <= self.scratch_bytes:
            raise ValueError(f"a probe of {nbytes} bytes, scratch of {self.scratch_bytes}")
        free: list[tuple[Any, object]] = []
        with self._lock:
            path = self._moves.route_locked(peer, free, self.settings.max_paths)
            key = (peer, path.index)
            wid = self._routes.posted(key)
        release(free)
        agent = path.agent
        try:
            src = np.array([[self.scratch_base, nbytes, 0]], dtype=np.int64)
            local = agent.get_xfer_descs(src, "DRAM")
            dst = np.array([[dst_base, nbytes, device_id]], dtype=np.int64)
            remote = agent.get_xfer_descs(dst, "DRAM")
            handle = agent.initialize_xfer("WRITE", local, remote, peer, b"")
        except Exception:
            self._moves.mark_broken(key)
            self._write_released(key, wid)
            raise
        return self._start(path, handle, key, lambda: self._write_released(key, wid))

    def progress(self) -> None:
        self.notifications()

    def notifications(self) -> list[tuple[str, bytes]]:
        got: list[tuple[str, bytes]] = []
        for path in list(self._paths):  # appended under the lock, never removed before close
            if not path.connecting:
                for agent, msgs in path.agent.get_new_notifs().items():
                    got.extend((agent, m) for m in msgs)
        return got

    def close(self) -> None:
        """Deregister the pool on every path. The caller guarantees no write is in flight."""
        self._connects.close()
        with self._lock:
            if self._peers.closed:
                return
            self._peers.closed = True
            lists = self._lists.clear([p.agent for p in self._paths])
            for path in self._paths:
                if path.local is not None:
                    lists.append((path.agent, path.local))
                    path.local = None
        for agent, h in lists:
            try:
                agent.release_dlist_handle(h)
            except Exception:
                pass
        for path in self._paths:
            for reg in path.regs:
                try:
                    path.agent.deregister_memory(reg)
                except Exception:
                    pass
