"""vLLM v1 KV connector: prefill and decode instances move KV through the kvxferd daemons.

vLLM loads it with ``kv_connector="KvxferdConnector"`` and
``kv_connector_module_path="kvxferd.integrations.vllm"`` (docs/vllm.md)::

    settings.py   the connector's own settings, read from kv_connector_extra_config
    metadata.py   kv_transfer_params keys, scheduler -> worker plans, worker -> scheduler reports
    geometry.py   vLLM's KV tensors (read from their strides) <-> the daemon's pool; pool-config
    scheduler.py  the scheduler side: which requests save or load, and their params
    worker.py     the worker side: copies, publishes, fetches, completions (an io thread)
    attachment.py the worker's daemon: its pool checked against vLLM's KV and mapped; restarts
    io_thread.py  the worker's io thread: its loop and client, cancels, waits, closes
    publishes.py  the worker's send side: saves copied (or held) and published
    streams.py    the worker's streamed saves: published before the forward, marked layer by layer
    loads.py      the worker's receive side: loads waiting, in flight, ended; releases
    reports.py    the request ids the worker owes vLLM (finished / failed)
    counters.py   the worker's counters (KvxferdConnector.stats())
    metrics.py    the receipts' counts in vLLM's KV connector stats (log line, Prometheus)
    connector.py  KvxferdConnector: vLLM's KVConnectorBase_V1 over the two sides
    proxy.py      an example P/D proxy: prefill-first (kv_transfer_params forwarded) or
                  decode-first (both requests at once); a log line per request's receipt
    __main__.py   python -m kvxferd.integrations.vllm pool-config ...

vLLM is imported only when ``KvxferdConnector`` is first looked up, so
``pool-config`` and the unit tests run without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvxferdConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvxferdConnector":
        from kvxferd.integrations.vllm.connector import KvxferdConnector

        return KvxferdConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
