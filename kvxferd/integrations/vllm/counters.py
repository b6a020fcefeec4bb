"""Stats: what the worker side did, counted by both of its threads (``KvxferdConnector.stats()``).

Each side counts its own outcomes: Publishes the saves, Loads the loads and releases.
The counters only grow; :meth:`Stats.snapshot` reads them all under the one lock.
A decode request's fate is counted once: ``loaded`` (its KV was put into vLLM's
blocks), ``recomputed`` with ``recomputed{<reason>}`` (its load failed and vLLM
prefills it locally, policy "recompute"), or only ``load_failures`` (policy "fail").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(slots=True)
class Stats:
    """What the connector did, for tests and logs (``KvxferdConnector.stats()``)."""

    saves: int = 0
    save_failures: int = 0  # no pool room or the publish failed: the decode side will fail to load
    loads: int = 0  # loads that put the remote KV into vLLM's blocks
    loaded: int = 0  # the same count, under the receipt's name
    recomputed: int = 0  # failed loads vLLM prefills locally (policy "recompute"), by reason:
    recomputed_reasons: dict[str, int] = field(default_factory=dict)  # -> recomputed{<reason>}
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
    # Streamed saves (streams.py): how many, the layers save_kv_layer marked, and the time
    # those calls took on the engine thread inside the forward (copy and hand-off; of which
    # the hand-off); the progress marks the loop sent, and those that left layers to come.
    streams: int = 0
    stream_layers: int = 0
    stream_layer_us: int = 0
    stream_mark_us: int = 0
    stream_marks: int = 0
    stream_marks_partial: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _reported: dict[str, int] = field(default_factory=dict, repr=False)  # receipt_delta's last

    def receipt_delta(self) -> dict[str, int]:
        """``loaded``, ``recomputed`` and ``recomputed{<reason>}`` since the last call
        (vLLM's KV connector stats, each step); empty when nothing changed."""
        with self.lock:
            now = {"loaded": self.loaded, "recomputed": self.recomputed}
            now.update({f"recomputed{{{r}}}": n for r, n in self.recomputed_reasons.items()})
            delta = {k: n - self._reported.get(k, 0) for k, n in now.items()}
            self._reported = now
        return {k: n for k, n in delta.items() if n}

    def add(self, **counts: int) -> None:
        with self.lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def recomputed_for(self, reason: str) -> None:
        with self.lock:
            self.recomputed += 1
            self.recomputed_reasons[reason] = self.recomputed_reasons.get(reason, 0) + 1

    def snapshot(self) -> dict[str, int]:
        skip = ("lock", "recomputed_reasons", "_reported")
        with self.lock:
            out = {k: getattr(self, k) for k in self.__slots__ if k not in skip}  # type: ignore[attr-defined]
            out.update({f"recomputed{{{r}}}": n for r, n in self.recomputed_reasons.items()})
            return out
