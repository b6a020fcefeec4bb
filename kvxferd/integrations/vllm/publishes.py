"""Publishes: the send side of the worker - a prefill's finished prompt published to its decode readers.

One save, from wait_for_save to the blocks' return::

    save()              engine  copy: take pool blocks and copy vLLM's into them (no room:
                                save_failures, not published); zero copy: the request's
                                own blocks, held (Reports.hold)
    stream()            engine  a streamed save, before the forward: the same blocks, nothing
                                copied yet (streams.py copies and marks layer by layer)
    _publish_all()      loop    the daemon restarted since: not published (save_failures)
    _publish()          loop    publish for ``readers`` fetches and wait for its end
                                (fetched, expired, or cancelled by an unpublish); streamed:
                                the handle at once, its marks pumped (_Stream.pump)
    close / close_key   loop    until no read can touch the blocks; then they go back
    _Sent               loop -> engine, zero copy: exactly once per save handed to the
                                loop, after its blocks went back (Reports.publish_ended)

A save's pool blocks go back once, to the incarnation they were taken from; a streamed
save's only once its step ended on the engine thread too (it copies into them until then).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvxferd.engine.client import EngineError, EngineRejected
from kvxferd.engine.engine_protocol import Outcome
from kvxferd.integrations.vllm.attachment import Attachment, _Daemon
from kvxferd.integrations.vllm.counters import Stats
from kvxferd.integrations.vllm.io_thread import FETCH_WAIT_S, IoThread
from kvxferd.integrations.vllm.metadata import Save, StepPlan
from kvxferd.integrations.vllm.reports import Reports
from kvxferd.integrations.vllm.streams import _Stream

log = logging.getLogger("kvxferd.integrations.vllm")


@dataclass(slots=True)
class _Sent:
    """Zero copy: a prefill request whose publish ended and whose blocks no read can touch."""

    req_id: str


class Publishes:
    """The producer's saves: copied (or held) on the engine thread, published on the loop."""

    def __init__(
        self,
        *,
        attachment: Attachment,
        io: IoThread,
        reports: Reports,
        stats: Stats,
        post: Callable[[_Sent], None],
    ) -> None:
        self.zero_copy = attachment.zero_copy
        self._at = attachment
        self._io = io
        self._reports = reports
        self.stats = stats
        self._post = post  # loop -> engine: a held request's publish ended

    # -- engine thread -----------------------------------------------------------------------
    def save(self, plan: StepPlan) -> None:
        """wait_for_save: copy each completed prompt's blocks into the pool and publish them
        (streamed saves were published before the forward: streams.py)."""
        d, geo = self._at.daemon, self._at.geometry
        assert d is not None and geo is not None
        batch: list[tuple[Save, list[int], _Stream | None]] = []
        for s in plan.saves:
            if s.stream:
                continue
            ids = self._blocks_for(s, d)
            if ids is None:
                continue
            if not self.zero_copy:
                geo.save(d.pool, list(s.block_ids), ids)
            batch.append((s, ids, None))
        if batch:
            self._io.submit(self._publish_all(d, batch))

    def stream(self, plan: StepPlan) -> list[_Stream]:
        """Before the forward: publish this step's streamed saves now; their layers follow."""
        d = self._at.daemon
        assert d is not None
        batch: list[tuple[Save, list[int], _Stream | None]] = []
        streams = []
        for s in plan.saves:
            if not s.stream:
                continue
            ids = self._blocks_for(s, d)
            if ids is None:
                continue
            st = _Stream(s, d, ids, d.pool.shape[0])
            streams.append(st)
            batch.append((s, ids, st))
        if batch:
            self._io.submit(self._publish_all(d, batch))
        return streams

    def _blocks_for(self, s: Save, d: _Daemon) -> list[int] | None:
        """The blocks ``s`` publishes: vLLM's own, held (zero copy), or pool blocks taken."""
        if self.zero_copy:  # the daemon reads vLLM's blocks themselves
            self._reports.hold(s.req_id)
            return list(s.block_ids)
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
        return ids

    def unpublish(self, transfer_id: str) -> None:
        """vLLM aborted the request: end its publish (a fetch in progress is cut short)."""
        self._io.cancel_soon(transfer_id)

    # -- io thread -----------------------------------------------------------------------------
    async def _publish_all(
        self, d: _Daemon, batch: list[tuple[Save, list[int], _Stream | None]]
    ) -> None:
        if not await self._at.same_daemon(d):
            for s, ids, st in batch:
                self.stats.add(save_failures=1)
                log.error("request %s: not published: the sender daemon restarted", s.req_id)
                if st is None or await st.engine_ended():
                    d.blocks.give(ids)
                self._sent_one(s)
            return
        for s, ids, st in batch:
            self._io.loop.create_task(self._publish(s, d, ids, st))

    def _sent_one(self, s: Save) -> None:
        """Zero copy: ``s``'s blocks are vLLM's to free (engine thread reports them)."""
        if self.zero_copy:
            self._post(_Sent(s.req_id))

    async def _publish(self, s: Save, d: _Daemon, ids: list[int], st: _Stream | None) -> None:
        try:
            if st is None:
                await self._publish_until_closed(s, d, ids, ids, None)
            else:  # the engine thread may copy into ids until its step ended
                await self._publish_until_closed(s, d, ids, [], st)
                if await st.engine_ended():
                    d.blocks.give(ids)
        finally:
            self._sent_one(s)

    async def _publish_until_closed(
        self, s: Save, d: _Daemon, ids: list[int], back: list[int], st: _Stream | None
    ) -> None:
        """Publish ``ids`` (streamed: at once, then its marks), wait for the end, close until
        safe; then ``back`` (the blocks the caller does not give back itself) go back."""
        cancel = self._io.cancel_event(s.transfer_id)
        client = self._io.client
        first: Outcome | None = None
        pump: asyncio.Task[None] | None = None
        try:
            try:
                if st is not None:  # a handle at once: the layers are marked as they come
                    if s.token:
                        h = (
                            await client.publish_for(
                                s.transfer_id,
                                ids,
                                token=s.token,
                                expected_fetches=self._at.readers,
                                streamed=True,
                            )
                        ).handle_id
                    else:
                        h = await client.publish(
                            s.transfer_id, ids, expected_fetches=self._at.readers, streamed=True
                        )
                    pump = self._io.loop.create_task(st.pump(client, h, self.stats))
                elif s.token:
                    h = (
                        await client.publish_for(
                            s.transfer_id, ids, token=s.token, expected_fetches=self._at.readers
                        )
                    ).handle_id
                else:  # one call, answered at the outcome (issue 22)
                    first = await self._io.first_outcome(
                        client.publish_wait(
                            s.transfer_id,
                            ids,
                            FETCH_WAIT_S,
                            close=True,
                            expected_fetches=self._at.readers,
                        ),
                        cancel,
                    )
                    h = first.handle_id
            except EngineRejected as e:
                self.stats.add(save_failures=1)
                log.error("request %s: publish refused: %s", s.req_id, e)
                d.blocks.give(back)
                return
            except EngineError as e:  # no answer: it may have run; find it by key and close it
                if cancel.is_set():  # unpublished (vLLM aborted it) while the call ran
                    log.info("request %s: publish cancelled while it ran", s.req_id)
                else:
                    self.stats.add(save_failures=1)
                    log.error("request %s: publish not answered: %s", s.req_id, e)
                await self._io.close_key(s.transfer_id, None, d, back)
                return
            self.stats.add(saves=1)
            if first is not None and first.state != "published":  # ended within the call
                out: Outcome | None = first
            else:
                out = await self._io.until_end(h, cancel, None)
            if out is not None and out.closed:  # the wait closed it: no read can touch ids
                d.blocks.give(back)
            else:
                await self._io.close(h, d, back)
        finally:
            if pump is not None:
                pump.cancel()
            self._io.forget(s.transfer_id)
