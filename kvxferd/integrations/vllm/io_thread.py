"""IoThread: the worker side's ``kvxferd-vllm-io`` thread, its daemon client and its cancels.

The thread runs one asyncio loop; the loop's :class:`AsyncClient` to the local
daemon has no other user. The engine thread reaches the loop only through
:meth:`IoThread.submit` (a coroutine) and :meth:`IoThread.cancel_soon` (a key).

The cancel table (loop only, no lock)::

    key         a publish's transfer id or a fetch's request id
    _cancels    key -> Event of a task that runs: cancel_event() adds it when the
                task begins, the task pops it in its ``finally``
    _early      keys cancelled with no task running (not begun yet, or ended),
                oldest first, at most MAX_EARLY_CANCELS: a task that begins with
                its key there starts cancelled (the key leaves the table)

Closing (:meth:`close`, :meth:`close_key`) gives a transfer's pool blocks back only
once the daemon says no read or write can touch them; a close nobody answers is asked
again every RETRY_S. With zero copy, one nobody answers for ``transfer_timeout_s +
close_timeout_s`` is given up on (logged): no write starts after a fetch's deadline.
A call nobody answered calls ``on_silence`` (the attachment asks whether the daemon
restarted).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from kvxferd.engine.client import AsyncClient, EngineError, EngineRejected
from kvxferd.engine.engine_protocol import EngineReason, Outcome
from kvxferd.integrations.vllm.settings import ConnectorSettings

if TYPE_CHECKING:
    from kvxferd.integrations.vllm.attachment import _Daemon

log = logging.getLogger("kvxferd.integrations.vllm")

STOP_TASKS_S = 2.0  # at shutdown: how long the cancelled tasks get to end
RETRY_S = 0.5  # a close or wait the daemon did not answer is asked again this often
FETCH_WAIT_S = 60.0  # a publish_wait / fetch_wait: how long one call waits for the outcome
MAX_EARLY_CANCELS = 4096  # cancels kept for tasks not started yet


class IoThread:
    """The io thread: one asyncio loop, the AsyncClient it alone uses, the cancel table."""

    def __init__(
        self,
        settings: ConnectorSettings,
        engine_socket: str,
        role: str,
        on_silence: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.role = role
        self._on_silence = on_silence
        # Zero copy: how long a close nobody answers is retried before it is given up on.
        self._give_up_s = (
            settings.transfer_timeout_s + settings.close_timeout_s if settings.zero_copy else None
        )
        self._cancels: dict[str, asyncio.Event] = {}  # loop only: transfer/req id -> cancel
        # loop only: cancelled before its task began (or after it ended), oldest first, bounded
        self._early_cancels: dict[str, None] = {}
        self.loop = asyncio.new_event_loop()
        self.client = AsyncClient(engine_socket, timeout_s=settings.call_timeout_s)
        self._io = threading.Thread(target=self._run, name="kvxferd-vllm-io", daemon=True)

    # -- any thread ----------------------------------------------------------------------
    def start(self) -> None:
        self._io.start()

    def submit(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop)

    def cancel_soon(self, key: str) -> None:
        """Cancel ``key``'s task, or the task that begins under ``key`` later."""
        self.loop.call_soon_threadsafe(self._cancel, key)

    def shutdown(self) -> None:
        if self._io.is_alive():
            self.client.close_client()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._io.join(5.0)

    def _run(self) -> None:
        """The loop until :meth:`shutdown` stops it; then its tasks still pending are
        cancelled and given ``STOP_TASKS_S`` to end, and the loop is closed (no task is left
        to be destroyed pending by the garbage collector)."""
        try:
            self.loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.wait(pending, timeout=STOP_TASKS_S))
            if not any(not t.done() for t in pending):
                self.loop.close()

    # -- loop only: the cancel table -------------------------------------------------------
    def _cancel(self, key: str) -> None:
        ev = self._cancels.get(key)
        if ev is None:
            self._early_cancels[key] = None
            if len(self._early_cancels) > MAX_EARLY_CANCELS:  # those of ended tasks
                del self._early_cancels[next(iter(self._early_cancels))]
        else:
            ev.set()

    def cancel_event(self, key: str) -> asyncio.Event:
        ev = self._cancels[key] = asyncio.Event()
        if self._early_cancels.pop(key, 0) is None:
            ev.set()
        return ev

    def forget(self, key: str) -> None:
        """``key``'s task ended (its ``finally``)."""
        self._cancels.pop(key, None)

    # -- loop only: waits and closes ---------------------------------------------------------
    async def first_outcome(self, call: Awaitable[Outcome], cancel: asyncio.Event) -> Outcome:
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

    async def until_end(
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
            waiter = asyncio.ensure_future(self.client.wait(h, min(left, 60.0), close=True))
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
                self._on_silence()
                return None
            except EngineError:  # not answered: ask again
                self._on_silence()
                await asyncio.sleep(RETRY_S)
                continue
            if out is not None:
                return out
        try:
            await self.client.cancel(h)
        except EngineError:
            pass
        return None

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

    async def close(self, h: int, d: _Daemon, ids: list[int]) -> None:
        """Close until the daemon says no write can touch ``ids``; then give them back."""
        since = time.monotonic()
        while True:
            try:
                if await self.client.close(h, self.settings.close_timeout_s):
                    break
            except EngineRejected as e:
                if e.reason is EngineReason.UNKNOWN_HANDLE:  # gone with a restarted daemon
                    break
                log.warning("close of handle %d: %s", h, e)
            except EngineError:
                self._on_silence()
                if self._gave_up(since, f"close of handle {h}"):
                    break
            await asyncio.sleep(RETRY_S)
        d.blocks.give(ids)

    async def close_key(self, tid: str, sender: str | None, d: _Daemon, ids: list[int]) -> None:
        """After a call nobody answered: close whatever runs under its key, then give ``ids`` back."""
        since = time.monotonic()
        while True:
            try:
                if await self.client.close_request(
                    tid, self.settings.close_timeout_s, sender_endpoint=sender
                ):
                    break
            except EngineError:
                self._on_silence()
                if self._gave_up(since, f"close of transfer {tid}"):
                    break
            await asyncio.sleep(RETRY_S)
        d.blocks.give(ids)
