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
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Literal, Protocol

from kvxferd.config import DataPlaneSettings
from kvxferd.layout import Descs

if TYPE_CHECKING:
    from kvxferd.pool import KvPool

XferState = Literal["DONE", "PROC", "ERR"]


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
    __slots__ = ("_agent", "_handle", "_released")

    def __init__(self, agent: object, handle: object) -> None:
        self._agent = agent
        self._handle = handle
        self._released = False

    def poll(self) -> XferState:
        return self._agent.check_xfer_state(self._handle)  # type: ignore[attr-defined,no-any-return]

    def release(self) -> bool:
        if self._released:
            return True
        try:
            self._agent.release_xfer_handle(self._handle)  # type: ignore[attr-defined]
        except Exception:
            return False
        self._released = True
        return True


class NixlDataPlane:
    """A NIXL agent with the pool registered once; WRITEs from this process's memory."""

    def __init__(self, name: str, settings: DataPlaneSettings, pool: KvPool) -> None:
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
        self._lock = threading.Lock()  # guards _peers and _closed
        self._peers: set[str] = set()
        self._closed = False

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()  # type: ignore[no-any-return]

    def add_peer(self, metadata: bytes) -> str:
        with self._lock:
            name = self._agent.add_remote_agent(metadata)
            peer = name.decode() if isinstance(name, bytes) else str(name)
            self._peers.add(peer)
            return peer

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            if peer in self._peers:
                self._peers.discard(peer)
                self._agent.remove_remote_agent(peer)

    def post_write(
        self, peer: str, src: Descs, dst: Descs, src_mem: str, dst_mem: str
    ) -> tuple[Xfer, XferState]:
        """Post one WRITE; raises on a build or post error (nothing in flight then)."""
        agent = self._agent
        local = agent.get_xfer_descs(src, src_mem)
        remote = agent.get_xfer_descs(dst, dst_mem)
        handle = agent.initialize_xfer("WRITE", local, remote, peer)
        xfer = _NixlXfer(agent, handle)
        state = agent.transfer(handle)
        if state == "ERR":
            xfer.release()
            raise RuntimeError("NIXL refused to post the WRITE")
        return xfer, state

    def progress(self) -> None:
        self._agent.get_new_notifs()

    def close(self) -> None:
        """Deregister the pool. The caller guarantees no write is in flight."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for reg in self._regs:
            try:
                self._agent.deregister_memory(reg)
            except Exception:
                pass
