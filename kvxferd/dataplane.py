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
* A peer's prepared list is retired when the peer is removed or prepared again,
  and released as soon as no write made from it holds a handle (each
  ``post_blocks`` counts a use until its handle is released), so retired lists
  stay bounded by the writes in flight, not by the peers ever seen. The sender
  removes a peer only once no write toward it is in flight.
* **A failed transport is reconnected.** UCX does not reopen an endpoint that failed (a
  TCP connection that timed out after a long link cut, a peer unreachable): every later
  WRITE toward that peer is refused, for good. A post that raises, a WRITE that ends in
  ERR or whose status check raises marks its peer *broken*; the next post toward a broken
  peer with no write of its own in flight (posted and not released) drops the remote
  agent, loads it again from the metadata ``add_peer`` was given and prepares its list
  again, so UCX opens a fresh endpoint (``peer_reconnects``). Writes in flight are never
  pulled from under NIXL: a peer with a write still in flight keeps its broken endpoint
  (and its posts fail fast) until that write ends. A write that merely stalls (TCP
  retransmitting into a cut link) does not mark its peer: it may still land.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np

from kvxferd.config import DataPlaneSettings
from kvxferd.layout import Descs, IdArray, Layout, prepped_indices

if TYPE_CHECKING:
    from kvxferd.pool import KvPool

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

    def prepare_peer(
        self, peer: str, layout: Layout, kv_base: int, mem_type: str, device_id: int
    ) -> bool:
        """Prepare descriptors over ``peer``'s KV pool; True when ``post_blocks`` serves it.

        False (never raises) means: use ``post_write`` with built descriptors for this peer.
        """
        ...

    def post_blocks(
        self,
        peer: str,
        src_blocks: IdArray,
        dst_blocks: IdArray,
        layer_begin: int,
        layer_end: int,
    ) -> tuple[Xfer, XferState]:
        """Post one KV WRITE of checked block ids through the prepared lists (``prepare_peer``
        returned True); raises when nothing was posted."""
        ...

    def remove_peer(self, peer: str) -> None: ...

    def post_write(
        self, peer: str, src: Descs, dst: Descs, src_mem: str, dst_mem: str
    ) -> tuple[Xfer, XferState]:
        """Post one WRITE and return it with its first state; raises when nothing was posted."""
        ...

    def progress(self) -> None: ...

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


class NixlDataPlane:
    """A NIXL agent with the pool registered once; WRITEs from this process's memory."""

    def __init__(
        self, name: str, settings: DataPlaneSettings, pool: KvPool, *, prepped: bool = True
    ) -> None:
        if settings.ucx_tls:
            os.environ["UCX_TLS"] = settings.ucx_tls
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        _quiet_nixl_logger()

        sync = {
            "strict": nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            "rw": nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
            "none": nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE,
            "default": nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT,
        }[settings.sync_mode]
        self.name = name
        self.settings = settings
        self._agent = nixl_agent(
            name,
            nixl_agent_config(
                enable_prog_thread=settings.progress_thread, backends=[], sync_mode=sync
            ),
        )
        self._agent.create_backend(
            settings.backend,
            {
                "ucx_error_handling_mode": settings.ucx_error_handling_mode,
                "num_workers": str(settings.ucx_num_workers),
            },
        )
        self._regs = [
            self._agent.register_memory([pool.kv], mem_type=pool.mem_type),
            self._agent.register_memory([pool.aux], mem_type="DRAM"),
        ]
        self._lock = threading.Lock()  # guards _peers, _remote, _uses, _retired and _closed
        self._peers: set[str] = set()
        self._closed = False
        self._layout = pool.layout
        # peer -> (its prepared KV list, its num_blocks); replaced whole, read without the lock
        self._remote: dict[str, tuple[object, int]] = {}
        self._uses: dict[int, int] = {}  # id(remote list) -> writes holding a handle made from it
        self._retired: dict[int, object] = {}  # id -> retired list still used by a write
        # Reconnecting a peer whose transport failed (see the module docstring); under _lock.
        self._meta: dict[str, bytes] = {}  # peer -> the metadata add_peer loaded
        self._prep_args: dict[str, tuple[Layout, int, int]] = {}  # peer -> prepare_peer's
        self._inflight: dict[str, int] = {}  # peer -> writes posted and not released
        self._broken: set[str] = set()
        self.reconnects = 0  # peers reconnected so far
        # The local list is prepared at the first prepare_peer (a receiver never needs one).
        self._pool = pool
        self._want_prepped = prepped and pool.mem_type == "DRAM"
        self._local: object | None = None

    def _prep(self, agent: str, layout: Layout, kv_base: int, device_id: int) -> object | None:
        """A prepared list of every (layer, block) of a DRAM KV pool, or None."""
        n = layout.num_layers * layout.num_blocks
        if n > MAX_PREPPED_DESCS:
            return None
        descs = np.empty((n, 3), dtype=np.int64)
        descs[:, 0] = kv_base + np.arange(n, dtype=np.int64) * layout.block_bytes
        descs[:, 1] = layout.block_bytes
        descs[:, 2] = device_id
        try:
            return self._agent.prep_xfer_dlist(agent, descs, "DRAM")  # type: ignore[no-any-return]
        except Exception as e:
            log.warning("no prepared descriptor list for %s (%s); building per request", agent, e)
            return None

    @property
    def prepped(self) -> bool:
        """True when prepared lists are in use (``prepare_peer`` can succeed)."""
        return self._want_prepped

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()  # type: ignore[no-any-return]

    def add_peer(self, metadata: bytes) -> str:
        with self._lock:
            name = self._agent.add_remote_agent(metadata)
            peer = name.decode() if isinstance(name, bytes) else str(name)
            self._peers.add(peer)
            self._meta[peer] = metadata
            self._broken.discard(peer)
            return peer

    def prepare_peer(
        self, peer: str, layout: Layout, kv_base: int, mem_type: str, device_id: int
    ) -> bool:
        mine = self._layout
        if self._want_prepped and self._local is None:
            with self._lock:  # once, at the first REGISTER; a failure turns prepping off
                if self._local is None and not self._closed:
                    pool = self._pool
                    local = self._prep("NIXL_INIT_AGENT", mine, pool.kv_base, pool.device_id)
                    self._local, self._want_prepped = local, local is not None
        usable = (
            self._local is not None
            and mem_type == "DRAM"
            and layout.block_bytes == mine.block_bytes
            and layout.num_layers == mine.num_layers
        )
        handle = self._prep(peer, layout, kv_base, device_id) if usable else None
        free: list[object] = []
        with self._lock:  # a peer prepared again (or refused now) loses its old list
            if usable:
                self._prep_args[peer] = (layout, kv_base, device_id)
            else:
                self._prep_args.pop(peer, None)
            old = self._remote.pop(peer, None)
            if old is not None:
                self._retire_locked(old[0], free)
            ok = handle is not None and peer in self._peers and not self._closed
            if ok:
                self._remote[peer] = (handle, layout.num_blocks)
            elif handle is not None:
                free.append(handle)
        self._release_lists(free)
        return ok

    def _retire_locked(self, handle: object, free: list[object]) -> None:
        """Release ``handle`` now if no write uses it (into ``free``), else when the last ends."""
        if self._uses.get(id(handle), 0) > 0:
            self._retired[id(handle)] = handle
        else:
            free.append(handle)

    def _used_by_one_less(self, handle: object) -> None:
        free: list[object] = []
        with self._lock:
            key = id(handle)
            left = self._uses.get(key, 0) - 1
            if left > 0:
                self._uses[key] = left
                return
            self._uses.pop(key, None)
            retired = self._retired.pop(key, None)
            if retired is not None and not self._closed:
                free.append(retired)
        self._release_lists(free)

    def _release_lists(self, lists: list[object]) -> None:
        for h in lists:
            try:
                self._agent.release_dlist_handle(h)
            except Exception:
                log.warning("releasing a prepared descriptor list failed", exc_info=True)

    def retired_lists(self) -> int:
        """Prepared lists retired but still used by a write (bounded by writes in flight)."""
        with self._lock:
            return len(self._retired)

    def post_blocks(
        self,
        peer: str,
        src_blocks: IdArray,
        dst_blocks: IdArray,
        layer_begin: int,
        layer_end: int,
    ) -> tuple[Xfer, XferState]:
        """Post one KV WRITE by block indices; raises on a build or post error (nothing in flight)."""
        free: list[object] = []
        with self._lock:  # the list is counted as used before NIXL sees it
            self._reconnect_if_broken_locked(peer, free)
            remote = self._remote.get(peer)
            if remote is None or self._local is None:
                self._release_lists(free)
                raise RuntimeError(f"no prepared descriptor list for peer {peer}")
            handle_r, dst_num_blocks = remote
            self._uses[id(handle_r)] = self._uses.get(id(handle_r), 0) + 1
            self._inflight[peer] = self._inflight.get(peer, 0) + 1
        self._release_lists(free)
        agent = self._agent

        def released() -> None:
            self._used_by_one_less(handle_r)
            self._write_released(peer)

        try:
            local_idx = prepped_indices(src_blocks, layer_begin, layer_end, self._layout.num_blocks)
            remote_idx = prepped_indices(dst_blocks, layer_begin, layer_end, dst_num_blocks)
            handle = agent.make_prepped_xfer("WRITE", self._local, local_idx, handle_r, remote_idx)
        except Exception:
            self._mark_broken(peer)
            released()
            raise
        return self._start(handle, peer, released)

    def _start(
        self, handle: object, peer: str, on_release: Callable[[], None]
    ) -> tuple[Xfer, XferState]:
        agent = self._agent
        xfer = _NixlXfer(agent, handle, on_release, lambda: self._mark_broken(peer))
        try:
            state = agent.transfer(handle)
        except Exception:
            self._mark_broken(peer)
            xfer.release()
            raise
        if state == "ERR":
            self._mark_broken(peer)
            xfer.release()
            raise RuntimeError("NIXL refused to post the WRITE")
        return xfer, state

    # -- reconnecting a failed transport (module docstring) ----------------------------
    def _mark_broken(self, peer: str) -> None:
        with self._lock:
            if peer in self._peers and peer not in self._broken:
                self._broken.add(peer)
                log.warning(
                    "transport to %s failed: reconnecting it once no write is in flight", peer
                )

    def _write_released(self, peer: str) -> None:
        with self._lock:
            left = self._inflight.get(peer, 0) - 1
            if left > 0:
                self._inflight[peer] = left
            else:
                self._inflight.pop(peer, None)

    def _reconnect_if_broken_locked(self, peer: str, free: list[object]) -> None:
        """Load a broken peer's remote agent again (fresh UCX endpoint) if none of its writes
        is in flight; its prepared list too. Called with _lock held; lists to free go to ``free``."""
        if peer not in self._broken or self._inflight.get(peer, 0) or self._closed:
            return
        meta = self._meta.get(peer)
        if meta is None:
            return
        t0 = time.monotonic()
        old = self._remote.pop(peer, None)
        if old is not None:
            self._retire_locked(old[0], free)
        try:
            self._agent.remove_remote_agent(peer)
        except Exception:
            log.warning("removing the failed remote agent %s raised", peer, exc_info=True)
        try:
            self._agent.add_remote_agent(meta)
        except Exception:
            log.warning("reconnecting %s failed; next post tries again", peer, exc_info=True)
            return
        self._broken.discard(peer)
        self.reconnects += 1
        args = self._prep_args.get(peer)
        if args is not None and self._local is not None:
            layout, kv_base, device_id = args
            handle = self._prep(peer, layout, kv_base, device_id)
            if handle is not None:
                self._remote[peer] = (handle, layout.num_blocks)
        log.warning(
            "transport to %s reconnected (a fresh endpoint) in %.1f ms",
            peer,
            (time.monotonic() - t0) * 1000,
        )

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer``; the caller guarantees no write toward it is in flight."""
        free: list[object] = []
        with self._lock:
            if peer in self._peers:
                self._peers.discard(peer)
                self._meta.pop(peer, None)
                self._prep_args.pop(peer, None)
                self._broken.discard(peer)
                self._inflight.pop(peer, None)
                old = self._remote.pop(peer, None)
                if old is not None:
                    self._retire_locked(old[0], free)
                self._agent.remove_remote_agent(peer)
        self._release_lists(free)

    def post_write(
        self, peer: str, src: Descs, dst: Descs, src_mem: str, dst_mem: str
    ) -> tuple[Xfer, XferState]:
        """Post one WRITE; raises on a build or post error (nothing in flight then)."""
        free: list[object] = []
        with self._lock:
            self._reconnect_if_broken_locked(peer, free)
            self._inflight[peer] = self._inflight.get(peer, 0) + 1
        self._release_lists(free)
        agent = self._agent
        try:
            local = agent.get_xfer_descs(src, src_mem)
            remote = agent.get_xfer_descs(dst, dst_mem)
            handle = agent.initialize_xfer("WRITE", local, remote, peer)
        except Exception:
            self._mark_broken(peer)
            self._write_released(peer)
            raise
        return self._start(handle, peer, lambda: self._write_released(peer))

    def progress(self) -> None:
        self._agent.get_new_notifs()

    def close(self) -> None:
        """Deregister the pool. The caller guarantees no write is in flight."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            lists = [h for h, _ in self._remote.values()] + list(self._retired.values())
            if self._local is not None:
                lists.append(self._local)
            self._remote.clear()
            self._retired.clear()
            self._local = None
        for h in lists:
            try:
                self._agent.release_dlist_handle(h)
            except Exception:
                pass
        for reg in self._regs:
            try:
                self._agent.deregister_memory(reg)
            except Exception:
                pass
