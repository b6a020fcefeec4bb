"""Loads: the receive side of the worker - remote KV fetched into vLLM's blocks, or released.

One load's states (engine thread unless marked; no lock: the loop reports through
``_Loaded`` items the engine thread applies in :meth:`Loads.finish`)::

    waiting     plan() queued it with a deadline of transfer_timeout_s; start_waiting()
                takes pool blocks in order (a later, smaller load never passes it) and
                fails it once its deadline passed with no room
    in_flight   handed to the loop: one fetch (loop) until its outcome, a cancel (vLLM
                aborted it: ``aborted``) or transfer_timeout_s + call_timeout_s; the
                loop posts a ``_Loaded``
    ended       finish(): copied into vLLM's blocks if it succeeded on the current
                incarnation; reported (Reports.load_ended, failed unless it loaded or was
                cancelled); its pool blocks go back after a close says no write can
                touch them

Every load that ended, loaded or failed (not cancelled), leaves a :class:`Receipt` in
Reports (blocks and bytes the receiver daemon wrote, the prefill instance, the time from
the fetch call to its outcome, or the reason it failed), which the connector hands to
the scheduler side; a failed one counts in ``recomputed`` under policy "recompute".

A load cancelled while waiting is reported at once and never fetched; one cancelled
after it ended was already reported (vLLM frees its blocks on that report). With zero
copy a failed or cancelled load whose handle is still open is closed before it is
reported: vLLM reuses those blocks once told. Each load is counted once: loads,
load_failures or loads_cancelled.

A release (remote KV this worker will not load: an abort, a local prefix hit) fetches
and cancels at once so the sender ends its publish; without pool room it is left to
expire.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvxferd.engine.client import EngineError, EngineRejected
from kvxferd.engine.engine_protocol import Outcome
from kvxferd.integrations.vllm.attachment import Attachment, _Daemon
from kvxferd.integrations.vllm.counters import Stats
from kvxferd.integrations.vllm.io_thread import FETCH_WAIT_S, IoThread
from kvxferd.integrations.vllm.metadata import Load, Receipt, RemoteKv, StepPlan
from kvxferd.integrations.vllm.reports import Reports
from kvxferd.integrations.vllm.settings import ConnectorSettings

log = logging.getLogger("kvxferd.integrations.vllm")


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
    reason: str = ""  # the receipt's reason when there is no outcome (refused, not answered)
    times: tuple[float, float, float] = (0.0, 0.0, 0.0)  # fetch asked, handle, outcome (monotonic)


class Loads:
    """The consumer's loads: waiting for pool room, in flight on the loop, ended."""

    def __init__(
        self,
        settings: ConnectorSettings,
        *,
        attachment: Attachment,
        io: IoThread,
        reports: Reports,
        stats: Stats,
        post: Callable[[_Loaded], None],
        recompute: bool = False,
    ) -> None:
        self.settings = settings
        self.zero_copy = settings.zero_copy
        self.recompute = recompute  # kv_load_failure_policy "recompute" (counts recomputed)
        self._at = attachment
        self._io = io
        self._reports = reports
        self.stats = stats
        self._post = post  # loop -> engine: a fetch that ended
        self.waiting: deque[tuple[Load, float]] = deque()  # loads waiting for pool room
        self.aborted: set[str] = set()  # req ids whose load was cancelled by an abort
        self.in_flight: set[str] = set()  # req ids handed to the io thread, not yet finished

    # -- engine thread -----------------------------------------------------------------------
    def plan(self, plan: StepPlan) -> None:
        """This step's new loads (waiting) and cancelled loads."""
        now = time.monotonic()
        for ld in plan.loads:
            self.waiting.append((ld, now + self.settings.transfer_timeout_s))
        for rid in plan.cancel_loads:
            if any(ld.req_id == rid for ld, _ in self.waiting):
                self.waiting = deque((ld, t) for ld, t in self.waiting if ld.req_id != rid)
                self._reports.load_ended(rid)
                self.stats.add(loads_cancelled=1)
            elif rid in self.in_flight:
                self.aborted.add(rid)
                self._io.cancel_soon(rid)
            # else: it already ended and was reported; vLLM frees its blocks on that report

    def start_waiting(self) -> None:
        d = self._at.daemon
        assert d is not None
        now = time.monotonic()
        batch: list[tuple[Load, list[int]]] = []
        while self.waiting:
            ld, deadline = self.waiting[0]
            if self.zero_copy:  # into vLLM's blocks; scratch for those computed here
                scratch = d.blocks.take(ld.skip)
                ids = None if scratch is None else scratch + list(ld.block_ids[ld.skip :])
            else:
                ids = d.blocks.take(ld.remote.num_blocks)
            if ids is None:
                if now < deadline:
                    break  # in order: a later, smaller load must not starve this one
                self.waiting.popleft()
                self._failed(
                    ld, "no_room", "no room in the receiver's pool before transfer_timeout_s"
                )
                continue
            self.waiting.popleft()
            batch.append((ld, ids))
            self.in_flight.add(ld.req_id)
        if batch:
            self._io.submit(self._fetch_all(d, batch))

    def finish(self, r: _Loaded) -> None:
        """A fetch the loop ended: copy it in, report it, give its blocks back."""
        rid = r.load.req_id
        ok = r.outcome is not None and r.outcome.ok and r.daemon is self._at.daemon
        landed = r.outcome is not None and r.outcome.ok  # done: every write landed, none in flight
        if self.zero_copy and r.handle is not None and not r.closed and not landed:
            # vLLM frees or recomputes these blocks once told: not before a write can no longer land.
            self._io.submit(self._close_then_report(r))
            return
        self.in_flight.discard(rid)
        if rid in self.aborted:
            self._reports.load_ended(rid)
            self.aborted.discard(rid)
            self.stats.add(loads_cancelled=1)
        elif ok:
            self._reports.load_ended(rid)
            geo = self._at.geometry
            assert geo is not None
            skip = r.load.skip
            if not self.zero_copy:
                geo.load(r.daemon.pool, r.pool_ids[skip:], list(r.load.block_ids[skip:]))
            n = len(r.load.block_ids) - skip
            asked, handle, ended = r.times
            remote = r.load.remote
            assert r.outcome is not None
            self._reports.receipt(
                rid,
                Receipt(
                    True,
                    blocks=len(r.load.block_ids),
                    nbytes=r.outcome.nbytes,
                    source=remote.sender,
                    ms=(ended - asked) * 1000,
                    streamed=remote.decode_first and remote.stream,
                ),
            )
            self.stats.add(
                loaded=1,
                loads=1,
                loaded_blocks=n,
                loaded_bytes=n * len(geo.layers) * geo.block_bytes,
                load_fetch_call_us=int((handle - asked) * 1e6),
                load_transfer_us=int((ended - handle) * 1e6),
                load_handoff_us=int((time.monotonic() - ended) * 1e6),
            )
        else:
            reason = r.reason or "not_done"
            if r.outcome is not None and r.outcome.ok:  # landed on an incarnation since replaced
                reason = "daemon_restarted"
            elif r.outcome is not None and r.outcome.reason is not None:
                reason = str(r.outcome.reason)
            self._failed(r.load, reason, r.why, r.times)
        if r.closed:
            return  # its blocks went back with the close
        if r.handle is not None:
            self._io.submit(self._io.close(r.handle, r.daemon, r.pool_ids))
        else:
            r.daemon.blocks.give(r.pool_ids)

    def _failed(
        self, ld: Load, reason: str, why: str, times: tuple[float, float, float] | None = None
    ) -> None:
        """Report ``ld`` failed, with its receipt; vLLM recomputes or fails it (its policy)."""
        self._reports.load_ended(ld.req_id, failed=True)
        ms = (times[2] - times[0]) * 1000 if times and times[2] else 0.0
        self._reports.receipt(
            ld.req_id, Receipt(False, reason=reason, source=ld.remote.sender, ms=ms, detail=why)
        )
        self.stats.add(load_failures=1)
        if self.recompute:
            self.stats.recomputed_for(reason)
        log.warning("request %s: KV load from %s failed: %s", ld.req_id, ld.remote.sender, why)

    def release(self, remote: RemoteKv) -> None:
        """Free remote KV we will not load: fetch it and cancel at once (the sender ends its publish)."""
        d = self._at.daemon
        assert d is not None
        ids = d.blocks.take(remote.num_blocks)
        if ids is None:
            log.info(
                "transfer %s not released (no pool room); the sender expires it", remote.transfer_id
            )
            return
        self._io.submit(self._release_remote(remote, d, ids))

    # -- io thread -----------------------------------------------------------------------------
    async def _fetch_all(self, d: _Daemon, batch: list[tuple[Load, list[int]]]) -> None:
        if not await self._at.same_daemon(d):
            for ld, ids in batch:
                why = "the receiver daemon restarted"
                self._post(_Loaded(ld, d, ids, None, None, why, reason="daemon_restarted"))
            return
        for ld, ids in batch:
            self._io.loop.create_task(self._fetch(ld, d, ids))

    async def _fetch(self, ld: Load, d: _Daemon, ids: list[int]) -> None:
        """One engine call per load: ``fetch_wait`` answers at the outcome, the handle closed
        (issue 22). A fetch still running after ``FETCH_WAIT_S`` is waited for by handle; one
        cancelled meanwhile (vLLM aborted the request) is closed by its key, as a fetch whose
        call was not answered."""
        io = self._io
        cancel = io.cancel_event(ld.req_id)
        r = ld.remote
        asked = time.monotonic()
        budget = self.settings.transfer_timeout_s + self.settings.call_timeout_s
        try:
            try:
                first = await io.first_outcome(
                    io.client.fetch_wait(
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
                why = f"fetch refused: {e}"
                self._post(_Loaded(ld, d, ids, None, None, why, reason=str(e.reason)))
                return
            except EngineError as e:
                why = "cancelled" if cancel.is_set() else f"fetch not answered: {e}"
                na = "cancelled" if cancel.is_set() else "not_answered"
                if self.zero_copy:  # it may run: report once no write can land in vLLM's blocks
                    await io.close_key(r.transfer_id, r.sender, d, ids)
                    self._post(_Loaded(ld, d, [], None, None, why, closed=True, reason=na))
                    return
                self._post(_Loaded(ld, d, [], None, None, why, reason=na))
                await io.close_key(r.transfer_id, r.sender, d, ids)
                return
            h = first.handle_id
            if first.state != "requested":  # ended within the call: all of it was the transfer
                handled = asked
                out: Outcome | None = first
            else:
                handled = time.monotonic()
                out = await io.until_end(h, cancel, budget - (handled - asked))
            if out is None:
                why = "cancelled" if cancel.is_set() else f"not done within {budget:.0f}s"
            else:
                why = f"{out.state}: {out.reason} {out.detail}".strip()
            # A wait that closed the handle leaves nothing to close: no write can touch ids.
            open_h = None if out is not None and out.closed else h
            times = (asked, handled, time.monotonic())
            self._post(_Loaded(ld, d, ids, open_h, out, why, times=times))
        finally:
            io.forget(ld.req_id)

    async def _release_remote(self, r: RemoteKv, d: _Daemon, ids: list[int]) -> None:
        try:
            h = await self._io.client.fetch(
                r.transfer_id,
                r.sender,
                ids,
                want_aux=False,
                token=r.token,
                sender_key=r.sender_key,
                **self._instance(r),
            )
            await self._io.client.cancel(h)
        except EngineError as e:
            log.info("transfer %s not released: %s; the sender expires it", r.transfer_id, e)
            await self._io.close_key(r.transfer_id, r.sender, d, ids)
            return
        self.stats.add(releases=1)
        await self._io.close(h, d, ids)

    def _instance(self, r: RemoteKv) -> dict[str, Any]:
        """Fetch arguments naming the prefill instance, when both sides declared a record."""
        if self._at.topology is None or not r.senders:
            return {}
        n = len(r.senders)
        return {
            "sender_endpoints": r.senders,
            "tokens": [r.token] * n if r.token else [],
            "sender_keys": r.sender_keys if any(r.sender_keys) else [],
        }

    async def _close_then_report(self, r: _Loaded) -> None:
        """Zero copy: close a failed or cancelled fetch, then hand it to the engine thread to report."""
        assert r.handle is not None
        await self._io.close(r.handle, r.daemon, r.pool_ids)
        r.closed = True
        self._post(r)
