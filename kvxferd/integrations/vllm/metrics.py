"""The receipts' counts in vLLM's own KV connector stats: its periodic log line and its Prometheus metrics.

Each step the worker side hands vLLM the counts since the last step (a
:class:`ReceiptStats`, ``data`` a flat dict of ints: ``loaded``, ``recomputed`` and
``recomputed{<reason>}``); the scheduler side adds the decode requests it let compute
locally (``recomputed{mismatch}``). vLLM sums the workers' and the scheduler's
(:meth:`ReceiptStats.aggregate`), logs them every interval (``KV Transfer metrics:
loaded=16, recomputed=0``) and records them in Prometheus (:class:`ReceiptPromMetrics`)::

    vllm:kvxferd_kv_loaded_total                 decode requests whose KV was loaded
    vllm:kvxferd_kv_recomputed_total{reason}     decode requests recomputed, by reason

With TP or PP every worker counts its own loads: the counts are per worker, as
``KvxferdConnector.stats()`` are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

RECOMPUTED_PREFIX = "recomputed{"


@dataclass
class ReceiptStats(KVConnectorStats):  # type: ignore[misc]
    """Counts since the last step (vLLM's KVConnectorStats; ``data`` must stay serializable)."""

    def reset(self) -> None:
        self.data = dict[str, int]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + int(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {"loaded": 0, "recomputed": 0, **self.data}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class ReceiptPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """``vllm:kvxferd_kv_loaded`` and ``vllm:kvxferd_kv_recomputed{reason}``, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        loaded = self._counter_cls(
            name="vllm:kvxferd_kv_loaded",
            documentation="Decode requests whose prompt KV the kvxferd connector loaded.",
            labelnames=labelnames,
        )
        self.loaded = create_metric_per_engine(loaded, per_engine_labelvalues)
        self.recomputed = self._counter_cls(
            name="vllm:kvxferd_kv_recomputed",
            documentation="Decode requests whose KV load failed and that vLLM prefilled "
            "locally, by the failure's reason.",
            labelnames=[*labelnames, "reason"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        if n := transfer_stats_data.get("loaded"):
            self.loaded[engine_idx].inc(n)
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        for key, n in transfer_stats_data.items():
            if key.startswith(RECOMPUTED_PREFIX) and n:
                self.recomputed.labels(*labels, key[len(RECOMPUTED_PREFIX) : -1]).inc(n)
