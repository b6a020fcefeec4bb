"""The engine's handle on one fetch: wait for its outcome, cancel it, close it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvxferd.transfer import commands as cmd
from kvxferd.transfer.session import RxGroup, RxOutcome, RxSession

if TYPE_CHECKING:
    from kvxferd.transfer.receiver.core import Receiver


class RxHandle:
    """The engine's handle on one fetch."""

    def __init__(self, receiver: Receiver, session: RxSession | RxGroup) -> None:
        self._receiver = receiver
        self.session = session

    @property
    def fetch_id(self) -> int:
        return self.session.fetch_id

    def wait(self, timeout: float | None = None) -> RxOutcome | None:
        """The outcome once the fetch ended, or None after ``timeout`` seconds."""
        return self.session.completion.wait(timeout)

    async def wait_async(self, timeout: float | None = None) -> RxOutcome | None:
        """Like ``wait``, on the calling task's own event loop."""
        return await self.session.completion.wait_async(timeout)

    def cancel(self) -> None:
        """Tell the sender to stop; the blocks stay fenced until it acknowledges."""
        self._receiver._command(cmd.Cancel(self.session))

    def close(self, timeout: float | None = None) -> bool:
        """Cancel if open; True once the destination blocks are safe to reuse.

        False while the outcome is in doubt. That can change: when the sender later
        answers, the blocks are released and ``close`` returns True (``session.reusable``
        is set then).
        """
        if not self.session.ended:
            self.cancel()
        if timeout is None:
            timeout = self._receiver.settings.deadlines.cancel_fence_ms / 1000 + 1.0
        self.session.fence_done.wait(timeout)
        return self.session.blocks_reusable
