"""What a call to the daemon raises on the engine side: the reason, and whether the daemon refused or never answered."""

from __future__ import annotations

from kvxferd.engine.engine_protocol import EngineReason
from kvxferd.errors import KvxferdError


class EngineError(KvxferdError):
    """A call to the daemon did not succeed; ``reason`` says why."""

    def __init__(self, reason: EngineReason, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else str(reason))
        self.reason = reason
        self.detail = detail


class EngineRejected(EngineError):
    """The daemon refused the call (its Error reply)."""


class EngineUnavailable(EngineError):
    """No reply in time (TIMEOUT), or the connection is closed or not reading (PEER_LOST)."""
