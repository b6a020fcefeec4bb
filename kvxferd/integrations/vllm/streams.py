"""Streams: a prefill's prompt published before the forward that completes it, marked ready layer by layer.

A streamed save (``Save.stream``, asked by ``"kvxferd_stream": true``) begins and ends
within one engine step. Its states, on the engine thread unless marked::

    begin()   bind_connector_metadata, before the forward: copy mode takes the pool
              blocks (no room: save_failures, not published) and builds the step's
              index tensors; zero copy holds vLLM's blocks; the publish (streamed) is
              handed to the loop at once (Publishes.stream)                    -> open
    layer()   save_kv_layer, after attention layer L wrote its KV: copy mode copies
              layer L of every open stream into the pool (one copy for all of them),
              then hands the mark "pool layers [0, ready) ready" to the loop   -> open
    finish()  wait_for_save: layers no save_kv_layer covered are copied, every stream
              is marked whole and told it ended on the engine side          -> ended
    pump      loop: once the publish answered its handle, ``progress(handle, ready)``
              (one-way, no reply) for the latest mark (marks coalesce); it stops after
              the whole mark, or when the publish ended or the daemon is gone

Ordering. Marks only grow and follow their copy. On a CUDA device a mark carries an
event recorded on the current stream after the layer's kernels, and the pump waits for
it (in an executor thread, off the loop) before it sends the mark: the daemon never
reads a layer the GPU is still writing (zero copy; copy mode is CPU only). A stream's
pool blocks go back (Publishes) only once it ended on the engine side: until then the
engine thread may still copy into them. vLLM calls wait_for_save in a ``finally``
after every forward, so a stream always ends with its step.

Cost per layer on the engine thread, with a stream open: one index copy (copy mode) and
one ``call_soon_threadsafe``; no engine round trip (``stream_layer_us`` / ``stream_layers``
in the counters, of which ``stream_mark_us`` the hand-over). With none open,
save_kv_layer returns at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvxferd.engine.client import EngineError
from kvxferd.integrations.vllm.attachment import Attachment, _Daemon
from kvxferd.integrations.vllm.counters import Stats
from kvxferd.integrations.vllm.metadata import Save

log = logging.getLogger("kvxferd.integrations.vllm")

# How long a stream's publish waits for the engine side to end its step before it keeps the
# pool blocks for good (logged): vLLM ends every step, so only a wedged engine gets here.
STREAM_END_S = 600.0


@dataclass(eq=False, slots=True)
class _Stream:
    """One streamed save: what the engine thread copies, and the marks the loop sends."""

    save: Save
    daemon: _Daemon
    pool_ids: list[int]
    num_layers: int  # the daemon's pool layers: the whole mark
    ready: int = 0  # loop: the latest mark handed over
    event: Any = None  # loop: the CUDA event of that mark (None on the CPU)
    sent: int = 0  # loop: the latest mark sent
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # the engine side's step ended

    def mark(self, ready: int, event: Any) -> None:
        """Loop: layers [0, ready) of the pool are ready (once ``event`` completed)."""
        if ready > self.ready:
            self.ready, self.event = ready, event
            self.changed.set()

    def end(self, ready: int, event: Any) -> None:
        """Loop: the engine side's step ended with every layer marked."""
        self.mark(ready, event)
        self.ended.set()

    async def pump(self, client: Any, handle: int, stats: Stats) -> None:
        """Loop: send each new mark to the daemon until the whole one is sent."""
        loop = asyncio.get_running_loop()
        while self.sent < self.num_layers:
            await self.changed.wait()
            self.changed.clear()
            ready, event = self.ready, self.event
            if event is not None:  # the GPU wrote those layers once the event completed
                await loop.run_in_executor(None, event.synchronize)
            if ready > self.sent:
                try:
                    client.progress(handle, ready)  # queued on this loop's connection
                except EngineError as e:  # the publish's outcome says what happened
                    log.info("request %s: stream mark not sent: %s", self.save.req_id, e)
                    return
                self.sent = ready
                stats.add(stream_marks=1, stream_marks_partial=int(ready < self.num_layers))

    async def engine_ended(self) -> bool:
        """Loop: wait until the engine side ended (bounded; False, logged, when it did not)."""
        try:
            await asyncio.wait_for(self.ended.wait(), STREAM_END_S)
        except TimeoutError:
            log.error(
                "request %s: the engine did not end its streamed step in %.0fs; its pool blocks "
                "stay taken",
                self.save.req_id,
                STREAM_END_S,
            )
            return False
        return True


class Streams:
    """The producer's streamed saves of the current step (engine thread only)."""

    def __init__(
        self, *, attachment: Attachment, loop: asyncio.AbstractEventLoop, stats: Stats
    ) -> None:
        self._at = attachment
        self._loop = loop
        self.stats = stats
        self.open: list[_Stream] = []
        self._src: torch.Tensor | None = None  # copy mode: the open streams' vLLM blocks
        self._dst: torch.Tensor | None = None  # and their pool blocks, same order
        self._next = 0  # vLLM layers marked in this step
        self._planes = 1  # pool layers per vLLM layer (zero copy on CUDA backends: K and V)
        self._layer_ns = 0  # this step's time in layer(), copies included
        self._mark_ns = 0  # of which handing the marks over
        self._layers = 0

    def begin(self, saves: list[_Stream]) -> None:
        """Before the forward: these streams are open (their publish is on its way)."""
        if self.open:  # a step that never ended (no wait_for_save): end it now
            self.finish()
        geo = self._at.geometry
        assert geo is not None
        self.open = saves
        self._next = 0
        self._planes = saves[0].num_layers // len(geo.layers) if saves else 1
        if not self._at.zero_copy:
            self._src = torch.tensor(
                [b for st in saves for b in st.save.block_ids], dtype=torch.long
            )
            self._dst = torch.tensor([b for st in saves for b in st.pool_ids], dtype=torch.long)

    def layer(self, name: str) -> None:
        """save_kv_layer: layer ``name`` of this step's forward wrote its KV."""
        if not self.open:
            return
        t0 = time.perf_counter_ns()
        geo = self._at.geometry
        assert geo is not None
        i = geo.index.get(name)
        if i is None or i < self._next:
            return  # not one of this worker's KV layers, or marked already
        self._copy_up_to(i + 1)
        t1 = time.perf_counter_ns()
        self._hand_over(_Stream.mark)
        t2 = time.perf_counter_ns()
        self._layer_ns += t2 - t0
        self._mark_ns += t2 - t1
        self._layers += 1

    def finish(self) -> None:
        """wait_for_save: copy what no save_kv_layer covered, mark every stream whole, end the step."""
        if not self.open:
            return
        geo = self._at.geometry
        assert geo is not None
        self._copy_up_to(len(geo.layers))
        self._hand_over(_Stream.end)
        self.stats.add(
            streams=len(self.open),
            stream_layers=self._layers,
            stream_layer_us=self._layer_ns // 1000,
            stream_mark_us=self._mark_ns // 1000,
        )
        self.open, self._src, self._dst = [], None, None
        self._layer_ns = self._mark_ns = self._layers = 0

    def _copy_up_to(self, end: int) -> None:
        """Copy mode: vLLM layers [_next, end) of every open stream into the pool."""
        if self._src is not None and self._dst is not None and len(self._src):
            geo, pool = self._at.geometry, self.open[0].daemon.pool
            assert geo is not None
            for layer in range(self._next, end):
                geo.save_layer(pool, layer, self._src, self._dst)
        self._next = max(self._next, end)

    def _hand_over(self, step: Any) -> None:
        """Hand the mark of layers [0, _next) to the loop (with an event on a CUDA device)."""
        event = None
        geo = self._at.geometry
        assert geo is not None
        if geo.layers[0].kv.device.type == "cuda":  # pragma: no cover - needs a GPU
            event = torch.cuda.Event()
            event.record()  # after this layer's kernels on the current stream
        ready = self._next * self._planes
        self._loop.call_soon_threadsafe(_apply, list(self.open), step, ready, event)


def _apply(streams: list[_Stream], step: Any, ready: int, event: Any) -> None:
    for st in streams:
        step(st, ready, event)
