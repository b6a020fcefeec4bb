"""Attachment: the local daemon as one vLLM worker sees it - its pool mapped here, checked against vLLM's KV.

At start (:meth:`Attachment.register`, engine thread) the worker reads vLLM's KV
geometry, checks the daemon's pool against it, declares its rank's topology record
and maps the pool; with zero copy vLLM's KV tensors are seated on it.

One incarnation of the daemon (:class:`_Daemon`) at a time is current::

    register()      engine  the first incarnation becomes ``daemon``
    recheck()       loop    a call nobody answered: at most one describe() per RECHECK_S
    check_daemon()  loop    a new daemon_id whose pool fits (and which took the topology
                            record again) is mapped and posted to the engine thread, once
                            (``_posted_id``)
    adopt()         engine  between forwards: it becomes ``daemon`` (zero copy: vLLM's KV
                            moves onto its pool); a new endpoint is kept in ``_moved``
                            until take_moved_endpoint() reports it, once

``daemon`` is written by the engine thread only; the loop reads it. A transfer holds the
incarnation it began on: its blocks go back to that incarnation's :class:`PoolBlocks`.
``_last_check``, ``_posted_id`` and ``_confirmed_*`` are the loop's only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvxferd.engine.client import Client, EngineError, EngineRejected, attach_pool
from kvxferd.engine.engine_protocol import PoolInfo
from kvxferd.errors import ConfigError, RejectedError
from kvxferd.integrations.vllm.geometry import KvGeometry, ModelShard
from kvxferd.integrations.vllm.io_thread import IoThread
from kvxferd.integrations.vllm.settings import ConnectorSettings
from kvxferd.transfer.reshard import readers_for
from kvxferd.transfer.topology import Topology, make_topology

log = logging.getLogger("kvxferd.integrations.vllm")

RECHECK_S = 1.0  # at most one describe() per this long to notice a restarted daemon
CONFIRM_S = 0.5  # a new transfer trusts a describe() this recent (a daemon starts in seconds)


class PoolBlocks:
    """The connector's pool blocks ``[first, num_blocks)``: a free list shared by both threads.

    With zero copy, ids below ``first`` are vLLM's own blocks: ``give`` ignores them.
    """

    def __init__(self, num_blocks: int, first: int = 0) -> None:
        self._lock = threading.Lock()
        self._free = list(range(num_blocks - 1, first - 1, -1))
        self.first = first
        self.num_blocks = num_blocks - first

    def take(self, n: int) -> list[int] | None:
        with self._lock:
            if n > len(self._free):
                return None
            taken = self._free[-n:] if n else []
            del self._free[len(self._free) - n :]
        return taken[::-1]

    def give(self, ids: list[int]) -> None:
        first = self.first
        with self._lock:
            self._free.extend(i for i in reversed(ids) if i >= first)

    def free(self) -> int:
        with self._lock:
            return len(self._free)


@dataclass(slots=True)
class _Daemon:
    """One incarnation of the local daemon: its pool mapped here and the blocks we own in it."""

    info: PoolInfo
    pool: torch.Tensor
    blocks: PoolBlocks


class Attachment:
    """This worker's daemon: the geometry and topology checked against it, its current incarnation.

    ``shard``: what vLLM says of the model and of this worker's rank; the worker
    declares its topology record (``KvGeometry.topology``) to its daemon at start, a
    producer publishes each request for the decode ranks that read this rank
    (``readers_for``).
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        *,
        producer: bool,
        shard: ModelShard | None,
        engine_socket: str,
        io: IoThread,
        post: Callable[[_Daemon], None],
    ) -> None:
        self.settings = settings
        self.producer = producer
        self.role = "sender" if producer else "receiver"
        self.shard = shard
        self.engine_socket = engine_socket
        self.zero_copy = settings.zero_copy
        self.topology: Topology | None = None
        self.readers = 1  # producers: decode ranks reading each request of this rank
        self.geometry: KvGeometry | None = None
        self.daemon: _Daemon | None = None
        self._io = io
        self._post = post  # io -> engine: a new incarnation
        self._moved: str | None = None  # a restarted daemon's new endpoint, not yet reported
        self._last_check = 0.0  # loop only
        self._posted_id = ""  # loop only: the daemon incarnation last handed to the engine thread
        self._confirmed_id, self._confirmed_at = "", 0.0  # loop only: last describe() that matched

    # -- engine thread -----------------------------------------------------------------------
    def register(
        self, kv_caches: dict[str, torch.Tensor], num_blocks: int, blocks_per_request: int
    ) -> None:
        """Read vLLM's KV layout, check the daemon's pool against it, map the pool."""
        self.geometry = KvGeometry(kv_caches, num_blocks)
        info = self._describe_once()
        if self.zero_copy:
            self.geometry.check_resident(info, self.role)
        else:
            self.geometry.check_pool(info, blocks_per_request, self.role)
        if self.shard is not None:
            self.topology = self.geometry.topology(self.shard)
            if self.producer:
                self.readers = self._readers(self.topology)
            info = self._describe_once(self.topology)
        self.daemon = self.attach(info)
        if self.zero_copy:
            self.geometry.seat(self.daemon.pool, info.layout.num_blocks)
        self._blocks_per_request = blocks_per_request
        t = self.topology
        log.info(
            "kvxferd connector (%s, %s) on %s: %s; pool of %d blocks; %s",
            "producer" if self.producer else "consumer",
            "zero copy" if self.zero_copy else "copy",
            self.engine_socket,
            self.geometry.describe(),
            info.layout.num_blocks,
            "no topology record"
            if t is None
            else f"rank {t.rank} (TP {t.tp_rank}/{t.tp_size}, PP {t.pp_stage}/{t.pp_size}), "
            f"layers [{t.layer_begin}, {t.layer_end}), heads {list(t.head_range)}, {t.layout}"
            + (f", {self.readers} decode reader(s) per request" if self.producer else ""),
        )

    def _readers(self, mine: Topology) -> int:
        """How many decode ranks read each request of this prefill rank (the decode instance
        is ``decode_tp_size`` x ``decode_pp_size`` ranks of the same model and layout)."""
        s = self.settings
        try:
            decode = make_topology(
                compat=mine.compat,
                tp_rank=0,
                tp_size=s.decode_tp_size or mine.tp_size,
                pp_size=s.decode_pp_size,
                num_layers=mine.num_layers,
                kv_heads_total=mine.kv_heads_total,
                head_size=mine.head_size,
                tokens_per_block=mine.tokens_per_block,
                elem_bytes=mine.elem_bytes,
                kv_planes=mine.kv_planes,
                layout=mine.layout,
            )
            return readers_for(decode, mine)
        except (ValueError, RejectedError) as e:
            raise ConfigError(
                f"kv_connector_extra_config decode_tp_size / decode_pp_size: no decode instance "
                f"of that shape can read this one: {e}"
            ) from None

    def _describe_once(self, topology: Topology | None = None) -> PoolInfo:
        """The daemon's description (and, with ``topology``, declare this rank's record)."""
        client = Client(self.engine_socket, timeout_s=self.settings.call_timeout_s)
        try:
            info = client.describe(topology=topology)
        except EngineRejected as e:
            raise ConfigError(
                f"the {self.role} daemon at {self.engine_socket!r} refused this worker's "
                f"topology record: {e}"
            ) from None
        except EngineError as e:
            raise ConfigError(
                f"kv_connector_extra_config['engine_socket'] = {self.engine_socket!r}: "
                f"no kvxferd {self.role} daemon answers ({e})"
            ) from None
        finally:
            client.close_client()
        if info.role != self.role:
            raise ConfigError(
                f"kv_connector_extra_config['engine_socket'] = {self.engine_socket!r} is a "
                f"{info.role} daemon; a {'kv_producer' if self.producer else 'kv_consumer'} needs a {self.role}"
            )
        return info

    def attach(self, info: PoolInfo) -> _Daemon:
        geo = self.geometry
        assert geo is not None
        first = geo.num_blocks if self.zero_copy else 0  # zero copy: vLLM's blocks come first
        return _Daemon(info, attach_pool(info), PoolBlocks(info.layout.num_blocks, first))

    def adopt(self, item: _Daemon) -> None:
        """A new incarnation the io thread mapped becomes the current one (between forwards)."""
        if self.zero_copy:
            self._reseat(item)
        old, self.daemon = self.daemon, item
        if old is not None and item.info.endpoint != old.info.endpoint:
            self._moved = item.info.endpoint

    def _reseat(self, d: _Daemon) -> None:
        """Zero copy, a restarted daemon: move vLLM's KV cache onto its new pool (between forwards)."""
        geo = self.geometry
        assert geo is not None
        if d.pool.device.type != "cpu":  # pragma: no cover - needs a GPU; see docs/gpu.md
            raise RuntimeError(
                f"the {self.role} daemon holding this engine's KV cache restarted; its CUDA memory "
                "went with it: restart this engine with its daemon"
            )
        geo.seat(d.pool, d.info.layout.num_blocks)  # the old pages stay mapped until now

    def take_moved_endpoint(self) -> str | None:
        """The restarted daemon's new endpoint, once (for the scheduler side's params)."""
        moved, self._moved = self._moved, None
        return moved

    # -- io thread -----------------------------------------------------------------------------
    async def same_daemon(self, d: _Daemon) -> bool:
        """Whether ``d`` is still the daemon that answers (a describe at most every CONFIRM_S).

        A restarted daemon has a new pool: a transfer started on it with blocks of the old
        mapping would move the wrong memory. A daemon takes seconds to start (it imports
        torch and NIXL and creates its agent), so an answer of the same daemon less than
        CONFIRM_S old proves that no new one has taken the socket since. A daemon that does
        not answer counts as the same one here; its calls fail on their own.
        """
        if (
            d.info.daemon_id == self._confirmed_id
            and time.monotonic() - self._confirmed_at < CONFIRM_S
        ):
            return True
        asked = time.monotonic()
        try:
            info = await self._io.client.describe()
        except EngineError:
            return True
        if info.daemon_id == d.info.daemon_id:
            self._confirmed_id, self._confirmed_at = info.daemon_id, asked
            return True
        await self._check_daemon()
        return False

    def recheck(self) -> None:
        """Ask (at most once per RECHECK_S) whether the daemon restarted; if so, map its new pool."""
        now = time.monotonic()
        if now - self._last_check >= RECHECK_S:
            self._last_check = now
            self._io.loop.create_task(self._check_daemon())

    async def _check_daemon(self) -> None:
        d = self.daemon
        try:
            info = await self._io.client.describe()
        except EngineError:
            return
        if d is None or info.daemon_id in (d.info.daemon_id, self._posted_id):
            return
        geo = self.geometry
        assert geo is not None
        try:
            if self.zero_copy:
                geo.check_resident(info, self.role)
            else:
                geo.check_pool(info, self._blocks_per_request, self.role)
        except ConfigError as e:
            log.error("the restarted %s daemon's pool does not fit: %s", self.role, e)
            return
        if self.topology is not None:  # a new daemon knows no record: declare it again
            try:
                info = await self._io.client.describe(topology=self.topology)
            except EngineError as e:
                log.error("the restarted %s daemon refused this rank's topology: %s", self.role, e)
                return
        log.warning("the %s daemon restarted (%s); mapping its new pool", self.role, info.daemon_id)
        self._posted_id = info.daemon_id
        self._post(self.attach(info))

    # -- end -----------------------------------------------------------------------------------
    def pool_free(self) -> int:
        d = self.daemon
        return 0 if d is None else d.blocks.free()
