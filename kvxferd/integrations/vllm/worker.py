"""The worker side of the connector: copies between vLLM's blocks and the pool, publishes, fetches.

Two modes (``zero_copy`` in kv_connector_extra_config):

* **copy** (default, CPU only): the daemon's pool is the connector's staging
  area. vLLM's own KV memory is never registered with NIXL nor written by a
  daemon, so a failed, late or cancelled transfer can only ever touch pool
  blocks, never a vLLM block.
* **zero copy** (CPU and CUDA): vLLM's KV tensors are seated on the pool
  (geometry.KvGeometry.seat), vLLM block ``b`` is pool block ``b``, and the
  daemons move vLLM's blocks themselves. vLLM then must not free or reuse a
  block a daemon may still touch, so the connector holds them: a prefill
  request's blocks are freed late (``request_finished`` returns True) and
  reported in ``finished_sending`` once its publish ended and a close said no
  read of them is in flight; a failed or cancelled load is reported only once a
  close said no write can land in its blocks. A daemon that does not answer a
  close for ``transfer_timeout_s + close_timeout_s`` is given up on (logged):
  no write starts after a fetch's deadline, so by then only a write already
  stalled inside the data plane could still land. The pool blocks past vLLM's
  are the connector's scratch (prefix-cache hits, releases).

Threads and what they own::

    engine thread   vLLM's model-runner thread: every connector call. Copies vLLM blocks
                    into pool blocks (saves, after the forward) and pool blocks into vLLM
                    blocks (completed loads, between forwards); takes pool blocks.
    kvxferd-vllm-io an asyncio loop with one AsyncClient (its only user): one task per
                    publish or fetch (call, wait, cancel, close); gives pool blocks back
                    once a close says no write can touch them.

They share :class:`PoolBlocks` (its own lock), ``_done`` (a SimpleQueue: io -> engine)
and :class:`Stats` (its own lock). Loop-only state (``_cancels``, ``_early_cancels``)
is touched only by coroutines and callbacks on the loop.

One transfer (Tx = prefill, Rx = decode)::

    Tx  engine: take pool blocks, copy, submit -> io: publish, wait for its end (fetched,
        expired, cancelled by unpublish), close until safe, give the blocks back
    Rx  engine: take pool blocks, submit -> io: fetch, wait (transfer_timeout_s), cancel if
        aborted or late -> engine (_done): copy if it succeeded, report finished (and failed)
        -> io: close until safe, give the blocks back
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Collection, Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch

from kvxferd.engine.client import AsyncClient, Client, EngineError, EngineRejected, attach_pool
from kvxferd.engine.engine_protocol import EngineReason, Outcome, PoolInfo
from kvxferd.errors import ConfigError, RejectedError
from kvxferd.integrations.vllm.geometry import KvGeometry, ModelShard
from kvxferd.integrations.vllm.metadata import Load, RemoteKv, Save, StepPlan
from kvxferd.integrations.vllm.settings import ConnectorSettings
from kvxferd.transfer.reshard import readers_for
from kvxferd.transfer.topology import Topology, make_topology

log = logging.getLogger("kvxferd.integrations.vllm")

RETRY_S = 0.5  # a close or wait the daemon did not answer is asked again this often
FETCH_WAIT_S = 60.0  # a publish_wait / fetch_wait: how long one call waits for the outcome
# A step with no forward (vLLM only waits for loads) waits this long at most for one of its
# loads in flight to end, so that vLLM learns of it in this step, not one step later.
IDLE_WAIT_S = 0.005
RECHECK_S = 1.0  # at most one describe() per this long to notice a restarted daemon
MAX_EARLY_CANCELS = 4096  # cancels kept for tasks not started yet
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
class Stats:
    """What the connector did, for tests and logs (``KvxferdConnector.stats()``)."""

    saves: int = 0
    save_failures: int = 0  # no pool room or the publish failed: the decode side will fail to load
    loads: int = 0  # loads that put the remote KV into vLLM's blocks
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_failures: int = 0
    loads_cancelled: int = 0
    releases: int = 0  # remote KV freed without loading it (abort, local hit)
    # Where a successful load's time went, summed over ``loads`` (microseconds): the fetch
    # call to the receiver daemon, the transfer until the outcome came back (wait), and
    # the hand-off until vLLM's engine thread took the result (the next step's results()).
    load_fetch_call_us: int = 0
    load_transfer_us: int = 0
    load_handoff_us: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {k: getattr(self, k) for k in self.__slots__ if k != "lock"}  # type: ignore[attr-defined]


@dataclass(slots=True)
class _Daemon:
    """One incarnation of the local daemon: its pool mapped here and the blocks we own in it."""

    info: PoolInfo
    pool: torch.Tensor
    blocks: PoolBlocks


@dataclass(slots=True)
class _Loaded:
    """A fetch that ended (io -> engine); ``closed``: a close said no write can touch its blocks."""

    load: Load
    daemon: _Daemon
    pool_ids: list[int]
    handle: int | None
    outcome: Outcome | None
    why: str
    closed: bool = False
    times: tuple[float, float, float] = (0.0, 0.0, 0.0)  # fetch asked, handle, outcome (monotonic)


@dataclass(slots=True)
class _Sent:
    """Zero copy: a prefill request whose publish ended and whose blocks no read can touch."""

    req_id: str


class WorkerSide:
    """The connector's worker half for one vLLM worker (one daemon per worker).

    ``shard``: what vLLM says of the model and of this worker's rank; the worker
    declares its topology record (``KvGeometry.topology``) to its daemon at start, a
    producer publishes each request for the decode ranks that read this rank
    (``readers_for``), a consumer fetches naming the prefill instance.
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        *,
        producer: bool,
        consumer: bool,
        shard: ModelShard | None = None,
    ) -> None:
        self.settings = settings
        self.producer = producer
        self.consumer = consumer
        self.role = "sender" if producer else "receiver"
        self.shard = shard
        self.engine_socket = settings.engine_socket_of(shard.rank if shard else 0)
        self.topology: Topology | None = None
        self.readers = 1  # producers: decode ranks reading each request of this rank
        self.stats = Stats()
        self.geometry: KvGeometry | None = None
        self.zero_copy = settings.zero_copy
        # Zero copy: how long a close nobody answers is retried before it is given up on.
        self._give_up_s = (
            settings.transfer_timeout_s + settings.close_timeout_s if settings.zero_copy else None
        )
        self._daemon: _Daemon | None = None
        self._done: queue.SimpleQueue[_Loaded | _Daemon | _Sent] = queue.SimpleQueue()
        # Zero copy, engine thread only: req ids whose blocks a publish holds (saved, not yet
        # reported), those whose publish ended, and those vLLM said finished; a request is
        # reported in finished_sending once it is in both of the last two.
        self._holding: set[str] = set()
        self._sent: set[str] = set()
        self._finished: set[str] = set()
        self._waiting: deque[tuple[Load, float]] = deque()  # loads waiting for pool room
        self._aborted: set[str] = set()  # req ids whose load was cancelled by an abort
        self._in_flight: set[str] = set()  # req ids handed to the io thread, not yet finished
        self._idle_step = False  # this step runs no forward (StepPlan.idle)
        self._moved: str | None = None  # a restarted daemon's new endpoint, not yet reported
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._cancels: dict[str, asyncio.Event] = {}  # loop only: transfer/req id -> cancel
        # loop only: cancelled before its task began (or after it ended), oldest first, bounded
        self._early_cancels: dict[str, None] = {}
        self._last_check = 0.0  # loop only
        self._posted_id = ""  # loop only: the daemon incarnation last handed to the engine thread
        self._confirmed_id, self._confirmed_at = "", 0.0  # loop only: last describe() that matched
        self._loop = asyncio.new_event_loop()
        self._client = AsyncClient(self.engine_socket, timeout_s=settings.call_timeout_s)
        self._io = threading.Thread(
            target=self._loop.run_forever, name="kvxferd-vllm-io", daemon=True
        )

    # -- start ---------------------------------------------------------------------------
    def register(
        self, kv_caches: dict[str, torch.Tensor], num_blocks: int, blocks_per_request: int
    ) -> None:
        """Read vLLM's KV layout, check the daemon's pool against it, map the pool, start the io thread."""
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
        self._daemon = self._attach(info)
        if self.zero_copy:
            self.geometry.seat(self._daemon.pool, info.layout.num_blocks)
        self._blocks_per_request = blocks_per_request
        self._io.start()
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

    def _attach(self, info: PoolInfo) -> _Daemon:
        geo = self.geometry
        assert geo is not None
        first = geo.num_blocks if self.zero_copy else 0  # zero copy: vLLM's blocks come first
        return _Daemon(info, attach_pool(info), PoolBlocks(info.layout.num_blocks, first))

    def _submit(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop)

    # -- engine thread: one step ------------------------------------------------------------
    def start_step(self, plan: StepPlan) -> None:
        """start_load_kv: loads, cancels, releases and unpublishes of this step's plan."""
        self._idle_step = plan.idle
        self._take_done()
        now = time.monotonic()
        for ld in plan.loads:
            self._waiting.append((ld, now + self.settings.transfer_timeout_s))
        for rid in plan.cancel_loads:
            if any(ld.req_id == rid for ld, _ in self._waiting):
                self._waiting = deque((ld, t) for ld, t in self._waiting if ld.req_id != rid)
                self._finished_recving.add(rid)
                self.stats.add(loads_cancelled=1)
            elif rid in self._in_flight:
                self._aborted.add(rid)
                self._loop.call_soon_threadsafe(self._cancel, rid)
            # else: it already ended and was reported; vLLM frees its blocks on that report
        for tid in plan.unpublish:
            self._loop.call_soon_threadsafe(self._cancel, tid)
        for remote in plan.release:
            self._release(remote)
        self._start_waiting()

    def save(self, plan: StepPlan) -> None:
        """wait_for_save: copy each completed prompt's blocks into the pool and publish them."""
        d, geo = self._daemon, self.geometry
        assert d is not None and geo is not None
        batch: list[tuple[Save, list[int]]] = []
        for s in plan.saves:
            if self.zero_copy:  # the daemon reads vLLM's blocks themselves
                batch.append((s, list(s.block_ids)))
                self._holding.add(s.req_id)
                continue
            ids = d.blocks.take(len(s.block_ids))
            if ids is None:
                self.stats.add(save_failures=1)
                log.error(
                    "request %s: no room in the sender's pool for %d blocks (%d of %d free); its "
                    "decode will fail to load: raise [pool] num_blocks",
                    s.req_id,
                    len(s.block_ids),
                    d.blocks.free(),
                    d.blocks.num_blocks,
                )
                continue
            geo.save(d.pool, list(s.block_ids), ids)
            batch.append((s, ids))
        if batch:
            self._submit(self._publish_all(d, batch))

    def results(
        self, finished_req_ids: Collection[str] = ()
    ) -> tuple[set[str], set[str], set[str]]:
        """get_transfer_results: (finished_sending, finished_recving, failed_recving) since the last call.

        vLLM accepts a request in finished_sending only once it passed that request
        in ``finished_req_ids`` (this call or an earlier one).
        """
        self._take_done()
        if (
            self._idle_step
            and self._in_flight
            and not (self._finished_recving or self._failed_recving)
        ):
            # Nothing else to do this step: a load that ends within IDLE_WAIT_S is reported
            # now (the engine would otherwise step once more, idle, before it learns of it).
            self._idle_step = False
            self._take_done(IDLE_WAIT_S)
        self._start_waiting()
        holding = self._holding
        self._finished.update(r for r in finished_req_ids if r in holding)
        sending = self._sent & self._finished
        self._sent -= sending
        self._finished -= sending
        holding -= sending
        done, failed = self._finished_recving, self._failed_recving
        self._finished_recving, self._failed_recving = set(), set()
        return sending, done, failed

    def _start_waiting(self) -> None:
        d = self._daemon
        assert d is not None
        now = time.monotonic()
        batch: list[tuple[Load, list[int]]] = []
        while self._waiting:
            ld, deadline = self._waiting[0]
            if self.zero_copy:  # into vLLM's blocks; scratch for those computed here
                scratch = d.blocks.take(ld.skip)
                ids = None if scratch is None else scratch + list(ld.block_ids[ld.skip :])
            else:
                ids = d.blocks.take(ld.remote.num_blocks)
            if ids is None:
                if now < deadline:
                    break  # in order: a later, smaller load must not starve this one
                self._waiting.popleft()
                self._fail(ld, "no room in the receiver's pool before transfer_timeout_s")
                continue
            self._waiting.popleft()
            batch.append((ld, ids))
            self._in_flight.add(ld.req_id)
        if batch:
            self._submit(self._fetch_all(d, batch))

    def _take_done(self, wait_s: float = 0.0) -> None:
        """Apply what the io thread finished: a new daemon incarnation, ended fetches
        (waiting up to ``wait_s`` for the first, when none is there yet)."""
        while True:
            try:
                item = self._done.get(timeout=wait_s) if wait_s > 0 else self._done.get_nowait()
            except queue.Empty:
                return
            wait_s = 0.0
            if isinstance(item, _Daemon):
                if self.zero_copy:
                    self._reseat(item)
                old, self._daemon = self._daemon, item
                if old is not None and item.info.endpoint != old.info.endpoint:
                    self._moved = item.info.endpoint
            elif isinstance(item, _Sent):
                self._sent.add(item.req_id)
            else:
                self._finish_load(item)

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

    def _finish_load(self, r: _Loaded) -> None:
        rid = r.load.req_id
        ok = r.outcome is not None and r.outcome.ok and r.daemon is self._daemon
        landed = r.outcome is not None and r.outcome.ok  # done: every write landed, none in flight
        if self.zero_copy and r.handle is not None and not r.closed and not landed:
            # vLLM frees or recomputes these blocks once told: not before a write can no longer land.
            self._submit(self._close_then_report(r))
            return
        self._in_flight.discard(rid)
        self._finished_recving.add(rid)
        if rid in self._aborted:
            self._aborted.discard(rid)
            self.stats.add(loads_cancelled=1)
        elif ok:
            geo = self.geometry
            assert geo is not None
            skip = r.load.skip
            if not self.zero_copy:
                geo.load(r.daemon.pool, r.pool_ids[skip:], list(r.load.block_ids[skip:]))
            n = len(r.load.block_ids) - skip
            asked, handle, ended = r.times
            self.stats.add(
                loads=1,
                loaded_blocks=n,
                loaded_bytes=n * len(geo.layers) * geo.block_bytes,
                load_fetch_call_us=int((handle - asked) * 1e6),
                load_transfer_us=int((ended - handle) * 1e6),
                load_handoff_us=int((time.monotonic() - ended) * 1e6),
            )
        else:
            self._failed_recving.add(rid)
            self.stats.add(load_failures=1)
            log.warning("request %s: KV load from %s failed: %s", rid, r.load.remote.sender, r.why)
        if r.closed:
            return  # its blocks went back with the close
        if r.handle is not None:
            self._submit(self._close(r.handle, r.daemon, r.pool_ids))
        else:
            r.daemon.blocks.give(r.pool_ids)

    def take_moved_endpoint(self) -> str | None:
        """The restarted daemon's new endpoint, once (for the scheduler side's params)."""
        moved, self._moved = self._moved, None
        return moved

    def _fail(self, ld: Load, why: str) -> None:
        self._finished_recving.add(ld.req_id)
        self._failed_recving.add(ld.req_id)
        self.stats.add(load_failures=1)
        log.warning("request %s: KV load from %s failed: %s", ld.req_id, ld.remote.sender, why)

    def _release(self, remote: RemoteKv) -> None:
        """Free remote KV we will not load: fetch it and cancel at once (the sender ends its publish)."""
        d = self._daemon
        assert d is not None
        ids = d.blocks.take(remote.num_blocks)
        if ids is None:
            log.info(
                "transfer %s not released (no pool room); the sender expires it", remote.transfer_id
            )
            return
        self._submit(self._release_remote(remote, d, ids))

    # -- io thread -----------------------------------------------------------------------
    def _cancel(self, key: str) -> None:
        ev = self._cancels.get(key)
        if ev is None:
            self._early_cancels[key] = None
            if len(self._early_cancels) > MAX_EARLY_CANCELS:  # those of ended tasks
                del self._early_cancels[next(iter(self._early_cancels))]
        else:
            ev.set()

    def _cancel_event(self, key: str) -> asyncio.Event:
        ev = self._cancels[key] = asyncio.Event()
        if self._early_cancels.pop(key, 0) is None:
            ev.set()
        return ev

    async def _same_daemon(self, d: _Daemon) -> bool:
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
            info = await self._client.describe()
        except EngineError:
            return True
        if info.daemon_id == d.info.daemon_id:
            self._confirmed_id, self._confirmed_at = info.daemon_id, asked
            return True
        await self._check_daemon()
        return False

    async def _publish_all(self, d: _Daemon, batch: list[tuple[Save, list[int]]]) -> None:
        if not await self._same_daemon(d):
            for s, ids in batch:
                self.stats.add(save_failures=1)
                log.error("request %s: not published: the sender daemon restarted", s.req_id)
                d.blocks.give(ids)
                self._sent_one(s)
            return
        for s, ids in batch:
            self._loop.create_task(self._publish(s, d, ids))

    async def _fetch_all(self, d: _Daemon, batch: list[tuple[Load, list[int]]]) -> None:
        if not await self._same_daemon(d):
            for ld, ids in batch:
                self._done.put(_Loaded(ld, d, ids, None, None, "the receiver daemon restarted"))
            return
        for ld, ids in batch:
            self._loop.create_task(self._fetch(ld, d, ids))

    def _sent_one(self, s: Save) -> None:
        """Zero copy: ``s``'s blocks are vLLM's to free (engine thread reports them)."""
        if self.zero_copy:
            self._done.put(_Sent(s.req_id))

    async def _publish(self, s: Save, d: _Daemon, ids: list[int]) -> None:
        try:
            await self._publish_until_closed(s, d, ids)
        finally:
            self._sent_one(s)

    async def _publish_until_closed(self, s: Save, d: _Daemon, ids: list[int]) -> None:
        cancel = self._cancel_event(s.transfer_id)
        first: Outcome | None = None
        try:
            try:
                if s.token:
                    h = (
                        await self._client.publish_for(
                            s.transfer_id, ids, token=s.token, expected_fetches=self.readers
                        )
                    ).handle_id
                else:  # one call, answered at the outcome (issue 22)
                    first = await self._first_outcome(
                        self._client.publish_wait(
                            s.transfer_id,
                            ids,
                            FETCH_WAIT_S,
                            close=True,
                            expected_fetches=self.readers,
                        ),
                        cancel,
                    )
                    h = first.handle_id
            except EngineRejected as e:
                self.stats.add(save_failures=1)
                log.error("request %s: publish refused: %s", s.req_id, e)
                d.blocks.give(ids)
                return
            except EngineError as e:  # no answer: it may have run; find it by key and close it
                if cancel.is_set():  # unpublished (vLLM aborted it) while the call ran
                    log.info("request %s: publish cancelled while it ran", s.req_id)
                else:
                    self.stats.add(save_failures=1)
                    log.error("request %s: publish not answered: %s", s.req_id, e)
                await self._close_key(s.transfer_id, None, d, ids)
                return
            self.stats.add(saves=1)
            if first is not None and first.state != "published":  # ended within the call
                out: Outcome | None = first
            else:
                out = await self._until_end(h, cancel, None)
            if out is not None and out.closed:  # the wait closed it: no read can touch ids
                d.blocks.give(ids)
            else:
                await self._close(h, d, ids)
        finally:
            self._cancels.pop(s.transfer_id, None)

    async def _fetch(self, ld: Load, d: _Daemon, ids: list[int]) -> None:
        """One engine call per load: ``fetch_wait`` answers at the outcome, the handle closed
        (issue 22). A fetch still running after ``FETCH_WAIT_S`` is waited for by handle; one
        cancelled meanwhile (vLLM aborted the request) is closed by its key, as a fetch whose
        call was not answered."""
        cancel = self._cancel_event(ld.req_id)
        r = ld.remote
        asked = time.monotonic()
        budget = self.settings.transfer_timeout_s + self.settings.call_timeout_s
        try:
            try:
                first = await self._first_outcome(
                    self._client.fetch_wait(
                        r.transfer_id,
                        r.sender,
                        ids,
                        min(budget, FETCH_WAIT_S),
                        close=True,
                        timeout_ms=int(self.settings.transfer_timeout_s * 1000),
                        want_aux=False,
                        token=r.token,
                        sender_key=r.sender_key,
                        **self._instance(r),
                    ),
                    cancel,
                )
            except EngineRejected as e:
                self._done.put(_Loaded(ld, d, ids, None, None, f"fetch refused: {e}"))
                return
            except EngineError as e:
                why = "cancelled" if cancel.is_set() else f"fetch not answered: {e}"
                if self.zero_copy:  # it may run: report once no write can land in vLLM's blocks
                    await self._close_key(r.transfer_id, r.sender, d, ids)
                    self._done.put(_Loaded(ld, d, [], None, None, why, closed=True))
                    return
                self._done.put(_Loaded(ld, d, [], None, None, why))
                await self._close_key(r.transfer_id, r.sender, d, ids)
                return
            h = first.handle_id
            if first.state != "requested":  # ended within the call: all of it was the transfer
                handled = asked
                out: Outcome | None = first
            else:
                handled = time.monotonic()
                out = await self._until_end(h, cancel, budget - (handled - asked))
            if out is None:
                why = "cancelled" if cancel.is_set() else f"not done within {budget:.0f}s"
            else:
                why = f"{out.state}: {out.reason} {out.detail}".strip()
            # A wait that closed the handle leaves nothing to close: no write can touch ids.
            open_h = None if out is not None and out.closed else h
            times = (asked, handled, time.monotonic())
            self._done.put(_Loaded(ld, d, ids, open_h, out, why, times=times))
        finally:
            self._cancels.pop(ld.req_id, None)

    async def _first_outcome(self, call: Awaitable[Outcome], cancel: asyncio.Event) -> Outcome:
        """The answer of a ``publish_wait`` / ``fetch_wait`` call, unless ``cancel`` comes
        first: then EngineError (its handle is not known yet; the caller closes by key)."""
        waiter = asyncio.ensure_future(call)
        stop = asyncio.ensure_future(cancel.wait())
        await asyncio.wait({waiter, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not waiter.done():
            waiter.cancel()
            raise EngineError(EngineReason.CANCELLED, "cancelled while the call ran")
        return waiter.result()

    async def _release_remote(self, r: RemoteKv, d: _Daemon, ids: list[int]) -> None:
        try:
            h = await self._client.fetch(
                r.transfer_id,
                r.sender,
                ids,
                want_aux=False,
                token=r.token,
                sender_key=r.sender_key,
                **self._instance(r),
            )
            await self._client.cancel(h)
        except EngineError as e:
            log.info("transfer %s not released: %s; the sender expires it", r.transfer_id, e)
            await self._close_key(r.transfer_id, r.sender, d, ids)
            return
        self.stats.add(releases=1)
        await self._close(h, d, ids)

    def _instance(self, r: RemoteKv) -> dict[str, Any]:
        """Fetch arguments naming the prefill instance, when both sides declared a record."""
        if self.topology is None or not r.senders:
            return {}
        n = len(r.senders)
        return {
            "sender_endpoints": r.senders,
            "tokens": [r.token] * n if r.token else [],
            "sender_keys": r.sender_keys if any(r.sender_keys) else [],
        }

    async def _until_end(
        self, h: int, cancel: asyncio.Event, budget: float | None
    ) -> Outcome | None:
        """The handle's outcome; None when cancelled or past ``budget`` seconds (it is cancelled then).

        The wait also closes the handle once it ended (``outcome.closed``), saving a close
        call per transfer; when writes are still in flight the caller closes as before.
        """
        deadline = None if budget is None else time.monotonic() + budget
        while not cancel.is_set():
            left = 3600.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                break
            waiter = asyncio.ensure_future(self._client.wait(h, min(left, 60.0), close=True))
            stop = asyncio.ensure_future(cancel.wait())
            await asyncio.wait({waiter, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not waiter.done():
                waiter.cancel()
                break
            try:
                out = waiter.result()
            except (
                EngineRejected
            ) as e:  # unknown_handle: the daemon restarted, the transfer is gone
                log.warning("handle %d: %s", h, e)
                self._recheck()
                return None
            except EngineError:  # not answered: ask again
                self._recheck()
                await asyncio.sleep(RETRY_S)
                continue
            if out is not None:
                return out
        try:
            await self._client.cancel(h)
        except EngineError:
            pass
        return None

    async def _close_then_report(self, r: _Loaded) -> None:
        """Zero copy: close a failed or cancelled fetch, then hand it to the engine thread to report."""
        assert r.handle is not None
        await self._close(r.handle, r.daemon, r.pool_ids)
        r.closed = True
        self._done.put(r)

    def _gave_up(self, since: float, what: str) -> bool:
        """Zero copy: whether a close nobody answered has been retried long enough (logged once)."""
        if self._give_up_s is None or time.monotonic() - since < self._give_up_s:
            return False
        log.warning(
            "%s: the %s daemon did not answer for %.0fs; releasing its blocks (no write starts "
            "after a fetch's deadline)",
            what,
            self.role,
            self._give_up_s,
        )
        return True

    async def _close(self, h: int, d: _Daemon, ids: list[int]) -> None:
        """Close until the daemon says no write can touch ``ids``; then give them back."""
        since = time.monotonic()
        while True:
            try:
                if await self._client.close(h, self.settings.close_timeout_s):
                    break
            except EngineRejected as e:
                if e.reason is EngineReason.UNKNOWN_HANDLE:  # gone with a restarted daemon
                    break
                log.warning("close of handle %d: %s", h, e)
            except EngineError:
                self._recheck()
                if self._gave_up(since, f"close of handle {h}"):
                    break
            await asyncio.sleep(RETRY_S)
        d.blocks.give(ids)

    async def _close_key(self, tid: str, sender: str | None, d: _Daemon, ids: list[int]) -> None:
        """After a call nobody answered: close whatever runs under its key, then give ``ids`` back."""
        since = time.monotonic()
        while True:
            try:
                if await self._client.close_request(
                    tid, self.settings.close_timeout_s, sender_endpoint=sender
                ):
                    break
            except EngineError:
                self._recheck()
                if self._gave_up(since, f"close of transfer {tid}"):
                    break
            await asyncio.sleep(RETRY_S)
        d.blocks.give(ids)

    def _recheck(self) -> None:
        """Ask (at most once per RECHECK_S) whether the daemon restarted; if so, map its new pool."""
        now = time.monotonic()
        if now - self._last_check >= RECHECK_S:
            self._last_check = now
            self._loop.create_task(self._check_daemon())

    async def _check_daemon(self) -> None:
        d = self._daemon
        try:
            info = await self._client.describe()
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
                info = await self._client.describe(topology=self.topology)
            except EngineError as e:
                log.error("the restarted %s daemon refused this rank's topology: %s", self.role, e)
                return
        log.warning("the %s daemon restarted (%s); mapping its new pool", self.role, info.daemon_id)
        self._posted_id = info.daemon_id
        self._done.put(self._attach(info))

    # -- end -----------------------------------------------------------------------------
    def pool_free(self) -> int:
        d = self._daemon
        return 0 if d is None else d.blocks.free()

    def shutdown(self) -> None:
        if self._io.is_alive():
            self._client.close_client()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._io.join(5.0)
