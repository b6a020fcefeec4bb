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
                    into pool blocks (saves, after the forward; streamed saves, layer by
                    layer in it) and pool blocks into vLLM blocks (completed loads, between
                    forwards); takes pool blocks.
    kvxferd-vllm-io an asyncio loop with one AsyncClient (its only user): one task per
                    publish or fetch (call, wait, cancel, close); gives pool blocks back
                    once a close says no write can touch them.

They share :class:`PoolBlocks` (its own lock), ``_done`` (a SimpleQueue: io -> engine)
and :class:`Stats` (its own lock). Loop-only state (the cancel table, the restart
check's) is touched only by coroutines and callbacks on the loop.

:class:`WorkerSide` is the facade vLLM's calls reach; it applies ``_done`` on the engine
thread and hands each part its share of a step::

    attachment.py  Attachment  the daemon: geometry and topology checked, pool mapped,
                               a restarted incarnation noticed and adopted
    io_thread.py   IoThread    the loop, its client, the cancel table, waits and closes
    publishes.py   Publishes   the send side: saves copied (or held) and published
    streams.py     Streams     streamed saves: published before the forward, marked per layer
    loads.py       Loads       the receive side: loads waiting, in flight, ended; releases
    reports.py     Reports     the ids owed to vLLM: finished_sending / _recving / failed
    counters.py    Stats       the counters KvxferdConnector.stats() returns

One transfer (Tx = prefill, Rx = decode)::

    Tx  engine: take pool blocks, copy, submit -> io: publish, wait for its end (fetched,
        expired, cancelled by unpublish), close until safe, give the blocks back
    Rx  engine: take pool blocks, submit -> io: fetch, wait (transfer_timeout_s), cancel if
        aborted or late -> engine (_done): copy if it succeeded, report finished (and failed)
        -> io: close until safe, give the blocks back
"""

from __future__ import annotations

import queue
from collections.abc import Collection

import torch

from kvxferd.integrations.vllm.attachment import (
    CONFIRM_S,
    RECHECK_S,
    Attachment,
    PoolBlocks,
    _Daemon,
)
from kvxferd.integrations.vllm.counters import Stats
from kvxferd.integrations.vllm.geometry import KvGeometry, ModelShard
from kvxferd.integrations.vllm.io_thread import FETCH_WAIT_S, MAX_EARLY_CANCELS, RETRY_S, IoThread
from kvxferd.integrations.vllm.loads import Loads, _Loaded
from kvxferd.integrations.vllm.metadata import Receipt, StepPlan
from kvxferd.integrations.vllm.publishes import Publishes, _Sent
from kvxferd.integrations.vllm.reports import Reports
from kvxferd.integrations.vllm.settings import ConnectorSettings
from kvxferd.integrations.vllm.streams import Streams
from kvxferd.transfer.topology import Topology

__all__ = [
    "CONFIRM_S",
    "FETCH_WAIT_S",
    "IDLE_WAIT_S",
    "MAX_EARLY_CANCELS",
    "RECHECK_S",
    "RETRY_S",
    "PoolBlocks",
    "Stats",
    "WorkerSide",
]

# A step with no forward (vLLM only waits for loads) waits this long at most for one of its
# loads in flight to end, so that vLLM learns of it in this step, not one step later.
IDLE_WAIT_S = 0.005


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
        recompute: bool = False,
    ) -> None:
        self.settings = settings
        self.producer = producer
        self.consumer = consumer
        self.role = "sender" if producer else "receiver"
        self.shard = shard
        self.engine_socket = settings.engine_socket_of(shard.rank if shard else 0)
        self.stats = Stats()
        self.zero_copy = settings.zero_copy
        self._done: queue.SimpleQueue[_Loaded | _Daemon | _Sent] = queue.SimpleQueue()
        self._idle_step = False  # this step runs no forward (StepPlan.idle)
        self.io = IoThread(
            settings, self.engine_socket, self.role, on_silence=lambda: self.attachment.recheck()
        )
        self.attachment = Attachment(
            settings,
            producer=producer,
            shard=shard,
            engine_socket=self.engine_socket,
            io=self.io,
            post=self._done.put,
        )
        self.reports = Reports()
        at, io, reports, stats = self.attachment, self.io, self.reports, self.stats
        self.publishes = Publishes(
            attachment=at, io=io, reports=reports, stats=stats, post=self._done.put
        )
        self.loads = Loads(
            settings,
            attachment=at,
            io=io,
            reports=reports,
            stats=stats,
            post=self._done.put,
            recompute=recompute,
        )
        self.streams = Streams(attachment=at, loop=io.loop, stats=stats)

    @property
    def geometry(self) -> KvGeometry | None:
        return self.attachment.geometry

    @property
    def topology(self) -> Topology | None:
        return self.attachment.topology

    @property
    def readers(self) -> int:
        """Producers: decode ranks reading each request of this rank."""
        return self.attachment.readers

    # -- start ---------------------------------------------------------------------------
    def register(
        self, kv_caches: dict[str, torch.Tensor], num_blocks: int, blocks_per_request: int
    ) -> None:
        """Read vLLM's KV layout, check the daemon's pool against it, map the pool, start the io thread."""
        self.attachment.register(kv_caches, num_blocks, blocks_per_request)
        self.io.start()

    # -- engine thread: one step ------------------------------------------------------------
    def start_step(self, plan: StepPlan) -> None:
        """start_load_kv: loads, cancels, releases and unpublishes of this step's plan."""
        self._idle_step = plan.idle
        self._take_done()
        self.loads.plan(plan)
        for tid in plan.unpublish:
            self.publishes.unpublish(tid)
        for remote in plan.release:
            self.loads.release(remote)
        self.loads.start_waiting()

    def begin_step(self, plan: StepPlan) -> None:
        """bind_connector_metadata, before the forward: publish this step's streamed saves."""
        if self.producer and any(s.stream for s in plan.saves):
            self.streams.begin(self.publishes.stream(plan))

    def save_layer(self, layer_name: str) -> None:
        """save_kv_layer: a layer of the forward wrote its KV; streams copy and mark it."""
        self.streams.layer(layer_name)

    def save(self, plan: StepPlan) -> None:
        """wait_for_save: end the step's streams; copy each other completed prompt's blocks
        into the pool and publish them."""
        self.streams.finish()
        self.publishes.save(plan)

    def results(
        self, finished_req_ids: Collection[str] = ()
    ) -> tuple[set[str], set[str], set[str]]:
        """get_transfer_results: (finished_sending, finished_recving, failed_recving) since the last call.

        vLLM accepts a request in finished_sending only once it passed that request
        in ``finished_req_ids`` (this call or an earlier one).
        """
        self._take_done()
        if self._idle_step and self.loads.in_flight and not self.reports.any_recving():
            # Nothing else to do this step: a load that ends within IDLE_WAIT_S is reported
            # now (the engine would otherwise step once more, idle, before it learns of it).
            self._idle_step = False
            self._take_done(IDLE_WAIT_S)
        self.loads.start_waiting()
        return self.reports.take(finished_req_ids)

    def _take_done(self, wait_s: float = 0.0) -> None:
        """Apply what the io thread finished: a new daemon incarnation, ended publishes and
        fetches (waiting up to ``wait_s`` for the first, when none is there yet)."""
        while True:
            try:
                item = self._done.get(timeout=wait_s) if wait_s > 0 else self._done.get_nowait()
            except queue.Empty:
                return
            wait_s = 0.0
            if isinstance(item, _Daemon):
                self.attachment.adopt(item)
            elif isinstance(item, _Sent):
                self.reports.publish_ended(item.req_id)
            else:
                self.loads.finish(item)

    def take_receipts(self) -> dict[str, Receipt]:
        """Receipts of the loads that ended since the last call (for the scheduler side)."""
        return self.reports.take_receipts()

    def take_moved_endpoint(self) -> str | None:
        """The restarted daemon's new endpoint, once (for the scheduler side's params)."""
        return self.attachment.take_moved_endpoint()

    # -- end -----------------------------------------------------------------------------
    def pool_free(self) -> int:
        return self.attachment.pool_free()

    def shutdown(self) -> None:
        self.io.shutdown()
