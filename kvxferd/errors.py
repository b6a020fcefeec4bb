"""Errors and the reason codes that travel on the wire.

The exception tree::

    KvxferdError
    ├── ConfigError            settings that cannot start a process
    ├── ProtocolError          a frame that is not a valid kvxferd message (has .reason)
    ├── RejectedError          a request refused by this process (has .reason)
    ├── TransferError          a transfer that ended without its bytes (has .reason, .in_doubt)
    │   └── TransferTimeout    the receiver's kv_transfer_timeout passed
    └── SendTimeout            a ZMQ send did not finish within its deadline

Every error a peer can cause maps to a :class:`Reason`; reasons are counted
and sent to the peer, so a failure always says why.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Why a message was rejected or a transfer failed (wire values, stable)."""

    # Rejections of a message.
    MALFORMED = "malformed"  # not decodable, wrong frame count, field out of bounds
    UNKNOWN_MESSAGE = "unknown_message"  # a tag this version does not know
    UNSUPPORTED_VERSION = "unsupported_version"  # header magic/version mismatch
    TOO_LARGE = "too_large"  # frame or block list over its limit
    INCOMPATIBLE = "incompatible"  # layout/dtype/block size/protocol mismatch at REGISTER
    UNKNOWN_PEER = "unknown_peer"  # a message from a peer that never registered
    BAD_BLOCKS = "bad_blocks"  # block ids or layer range outside a pool
    DUPLICATE = "duplicate"  # a live request id or fetch id used twice
    BUSY = "busy"  # a bounded table (peers, pending fetches, sessions) is full
    DRAINING = (
        "draining"  # the process is draining: no new request, fetch or peer; in-flight ones go on
    )
    SHUTTING_DOWN = (
        "shutting_down"  # the process is stopping: work still open at the drain deadline
    )
    # Outcomes of a transfer.
    CANCELLED = "cancelled"  # cancelled by the engine or by the peer
    EXPIRED = (
        "expired"  # a published request nobody fetched, or a fetch for a request never published
    )
    TIMEOUT = "timeout"  # the receiver's kv_transfer_timeout passed
    TRANSFER_ERROR = "transfer_error"  # NIXL reported an error for the write
    BUILD_FAILED = "build_failed"  # the write could not be built (descriptors, peer)
    STALLED = "stalled"  # NIXL still in progress past xfer_stall_timeout: outcome in doubt
    SESSION_FAILED = "session_failed"  # another slice of the same request failed first
    PEER_LOST = "peer_lost"  # the peer's connection is gone
    PEER_RESTARTED = "peer_restarted"  # the sender restarted (new incarnation); fetch not re-sent
    BAD_ENDPOINT = "bad_endpoint"  # an endpoint kvxferd will not connect to (see endpoints.py)
    NOT_AUTHORIZED = "not_authorized"  # the peer's identity may not do this (ownership.py, auth.py)
    BAD_PROGRESS = "bad_progress"  # a streamed publish's progress mark was refused (local only)
    STREAM_STALLED = "stream_stalled"  # no progress mark for stream_stall_timeout_ms (local only)
    DIGEST_MISMATCH = "digest_mismatch"  # what landed is not what the sender wrote (digest.py)
    MOVED = "moved"  # a draining sender handed the request to another one (Result.moved_to)


class KvxferdError(Exception):
    """Base of every error kvxferd raises."""


class ConfigError(KvxferdError):
    """Settings that cannot start a process; the message names the setting."""


class ProtocolError(KvxferdError):
    """A frame that is not a valid kvxferd message."""

    def __init__(self, reason: Reason, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else str(reason))
        self.reason = reason
        self.detail = detail


class RejectedError(KvxferdError):
    """A request this process refused (a full table, a duplicate id, draining...)."""

    def __init__(self, reason: Reason, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else str(reason))
        self.reason = reason
        self.detail = detail


class TransferError(KvxferdError):
    """A transfer that ended without all of its bytes in place.

    ``in_doubt`` is true when a write may still touch the destination blocks:
    the engine must not reuse them.
    """

    def __init__(self, reason: Reason, detail: str = "", *, in_doubt: bool = False) -> None:
        super().__init__(f"{reason}: {detail}" if detail else str(reason))
        self.reason = reason
        self.detail = detail
        self.in_doubt = in_doubt


class TransferTimeout(TransferError):
    """The receiver waited kv_transfer_timeout without a result."""


class SendTimeout(KvxferdError):
    """A ZMQ send did not complete within its deadline (the peer is not reading)."""
