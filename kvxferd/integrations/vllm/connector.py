"""KvxferdConnector: vLLM's KVConnectorBase_V1 over the scheduler side and the worker side.

vLLM builds one instance per role: ``SCHEDULER`` (in the engine core; plans,
never touches KV) and ``WORKER`` (in each worker; copies and transfers). This
class only routes vLLM's calls to :class:`SchedulerSide` or :class:`WorkerSide`
and checks at start that the deployment is one it serves:

* ``kv_role`` ``kv_producer`` (a sender daemon) or ``kv_consumer`` (a receiver daemon);
* one KV cache group of full attention (no MLA yet); with tensor or pipeline
  parallelism one daemon per worker (``{rank}`` in ``engine_socket``);
* every worker declares its rank's topology record (geometry.KvGeometry.topology) to
  its daemon, so prefill and decode may shard differently (docs/topology.md);
* the daemon's ``[pool]`` fits the KV tensors vLLM allocated (else ConfigError naming
  the values; ``python -m kvxferd.integrations.vllm pool-config`` prints them);
  with ``zero_copy`` it holds them: vLLM's KV cache is seated on the pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvxferd.engine.client import Client, EngineError
from kvxferd.errors import ConfigError
from kvxferd.integrations.vllm.geometry import ModelShard, blocks_for
from kvxferd.integrations.vllm.metadata import Receipt, StepPlan
from kvxferd.integrations.vllm.metrics import ReceiptPromMetrics, ReceiptStats
from kvxferd.integrations.vllm.scheduler import SchedulerSide
from kvxferd.integrations.vllm.settings import ConnectorSettings, load_settings
from kvxferd.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch

__all__ = ["KvxferdConnector"]


class WorkerNews(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker -> scheduler, one step: sender daemons that restarted on another listen
    endpoint (by rank), and the receipts of the loads that ended (by request)."""

    def __init__(self, moved: dict[int, str], receipts: dict[str, list[Receipt]]) -> None:
        self.moved = moved
        self.receipts = receipts  # every rank's receipt of the request, merged by the scheduler

    def aggregate(self, other: Any) -> Any:
        if not isinstance(other, WorkerNews):
            return self
        receipts = {k: list(v) for k, v in self.receipts.items()}
        for rid, rs in other.receipts.items():
            receipts.setdefault(rid, []).extend(rs)
        # Every worker's move; the latest per rank wins.
        return WorkerNews({**self.moved, **other.moved}, receipts)


class KvxferdConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """Disaggregated prefill/decode through the local kvxferd sender or receiver daemon."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.settings: ConnectorSettings = load_settings(ktc.kv_connector_extra_config)
        producer, consumer = bool(ktc.is_kv_producer), bool(ktc.is_kv_consumer)
        if producer == consumer:
            raise ConfigError(
                f"kv_role = {ktc.kv_role!r}: the kvxferd connector runs as kv_producer (prefill, "
                "with a sender daemon) or kv_consumer (decode, with a receiver daemon)"
            )
        par = vllm_config.parallel_config
        self.tp_size: int = par.tensor_parallel_size
        self.pp_size: int = par.pipeline_parallel_size
        if self.tp_size * self.pp_size > 1 and "{rank}" not in self.settings.engine_socket:
            raise ConfigError(
                f"tensor_parallel_size {self.tp_size} x pipeline_parallel_size {self.pp_size}: "
                "each vLLM worker needs its own kvxferd daemon; put {rank} in "
                "kv_connector_extra_config['engine_socket'] (e.g. "
                "'ipc:///run/kvxferd/engine-{rank}.sock')"
            )
        if vllm_config.model_config.use_mla:
            raise ConfigError("MLA models are not supported by the kvxferd vLLM connector yet")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise ConfigError(
                "the kvxferd connector supports one KV cache group (full attention) only"
            )
        self.block_size: int = vllm_config.cache_config.block_size
        self.blocks_per_request = blocks_for(
            vllm_config.model_config.max_model_len, self.block_size
        )
        recompute = getattr(ktc, "kv_load_failure_policy", "fail") == "recompute"
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            senders = (
                [self._sender_endpoint(r) for r in range(self.tp_size * self.pp_size)]
                if producer
                else []
            )
            self._sched = SchedulerSide(
                producer=producer,
                consumer=consumer,
                block_size=self.block_size,
                sender=senders[0][0] if senders else None,
                zero_copy=self.settings.zero_copy,
                sender_key=senders[0][1] if senders else "",
                senders=[e for e, _ in senders],
                sender_keys=[k for _, k in senders],
                recompute=recompute,
            )
        else:
            self._worker = WorkerSide(
                self.settings,
                producer=producer,
                consumer=consumer,
                shard=_model_shard(vllm_config, self.settings),
                recompute=recompute,
            )

    def _sender_endpoint(self, rank: int) -> tuple[str, str]:
        """Rank ``rank``'s sender daemon's listen endpoint, which decode instances fetch
        from, and its CURVE public key ("" with security off), which they must expect there."""
        socket = self.settings.engine_socket_of(rank)
        client = Client(socket, timeout_s=self.settings.call_timeout_s)
        try:
            info = client.describe()
        except EngineError as e:
            raise ConfigError(
                f"kv_connector_extra_config['engine_socket'] = {socket!r} (rank {rank}): "
                f"no kvxferd sender daemon answers ({e})"
            ) from None
        finally:
            client.close_client()
        if info.role != "sender" or not info.endpoint:
            raise ConfigError(
                f"kv_connector_extra_config['engine_socket'] = {socket!r} is a "
                f"{info.role} daemon; a kv_producer needs a sender"
            )
        return info.endpoint, info.public_key

    def stats(self) -> dict[str, int]:
        """The worker side's counters (loads, loaded_bytes, load_failures, ...) and free pool blocks."""
        w = self._worker
        return {} if w is None else {**w.stats.snapshot(), "pool_free": w.pool_free()}

    # -- vLLM's KV connector stats (metrics.py) -------------------------------------------
    def get_kv_connector_stats(self) -> Any:
        """The receipts counted since the last step: the worker's loads, the scheduler's mismatches."""
        if self._worker is not None:
            counts = self._worker.stats.receipt_delta()
        else:
            assert self._sched is not None
            counts = self._sched.take_counts()
        return ReceiptStats(data=counts) if counts else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return ReceiptStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        return ReceiptPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches, self._kv_cache_config.num_blocks, self.blocks_per_request)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        # vLLM 0.32 binds the plan before the forward on every runner, and calls start_load_kv
        # after it when no load is synchronous: streamed saves are published from here.
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, StepPlan):
            self._worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_step(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete between steps (asynchronous), never inside a forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # After each attention layer (vLLM's maybe_transfer_kv_layer, CPU backend included):
        # streamed saves copy and mark that layer; other saves copy after the forward.
        assert self._worker is not None
        self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.save(self._plan())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, done, failed = self._worker.results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=done, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def build_connector_worker_meta(self) -> Any:
        w = self._worker
        if w is None:
            return None
        moved = w.take_moved_endpoint()
        receipts = w.take_receipts()
        if moved is None and not receipts:
            return None
        rank = w.shard.rank if w.shard is not None else 0
        return WorkerNews(
            {} if moved is None else {rank: moved}, {k: [r] for k, r in receipts.items()}
        )

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepPlan)
        return meta

    # -- scheduler side --------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._sched is not None
        self._sched.bind_kv_cache_manager(kv_cache_manager)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return tuple(self._kv_cache_config.transfer_group_ids)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._sched is not None
        news = getattr(connector_output, "kv_connector_worker_meta", None)
        receipts: dict[str, Receipt] = {}
        if isinstance(news, WorkerNews):
            for rid, rs in news.receipts.items():
                merged = rs[0]
                for r in rs[1:]:
                    merged = merged.merge(r)
                receipts[rid] = merged
        self._sched.update_connector_output(connector_output.finished_recving, receipts)
        if isinstance(news, WorkerNews) and self._sched.producer:
            for rank, endpoint in news.moved.items():  # params of later prefills name it
                self._sched.sender_moved(rank, endpoint)


def _model_shard(vllm_config: Any, settings: ConnectorSettings) -> ModelShard:
    """What vLLM says of the model and of this worker's rank (a worker process)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.distributed.utils import get_pp_indices

    mc, par = vllm_config.model_config, vllm_config.parallel_config
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    tp_rank = pp_stage = 0
    if tp > 1:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank()
    if pp > 1:
        from vllm.distributed.parallel_state import get_pp_group

        pp_stage = get_pp_group().rank_in_group
    layers = mc.get_total_num_hidden_layers()
    bounds = [get_pp_indices(layers, s, pp)[0] for s in range(pp)] + [layers]
    try:
        backend = get_current_attn_backends(vllm_config)[0].get_name()
    except Exception as e:  # noqa: BLE001 - the name only enters the compat hash
        raise ConfigError(f"cannot tell vLLM's attention backend: {e}") from None
    return ModelShard(
        model_id=settings.model_id or str(mc.model),
        backend=str(backend),
        num_layers=layers,
        kv_heads_total=mc.get_total_num_kv_heads(),
        kv_heads=mc.get_num_kv_heads(par),
        head_size=mc.get_head_size(),
        block_size=vllm_config.cache_config.block_size,
        tp_rank=tp_rank,
        tp_size=tp,
        pp_stage=pp_stage,
        pp_size=pp,
        pp_layer_bounds=tuple(bounds),
        zero_copy=settings.zero_copy,
    )
