"""What a sender worker is handed, the receiver each task goes to, and what it needs from its sender.

The listener and API callers (kvxferd/transfer/sender/) put tasks on a
worker's queue (kvxferd/transfer/worker.py); the worker keeps each in its
receiver's lane (kvxferd/transfer/worker_lanes.py) until it can start it:

    WriteTask   write one slice of a published request to a receiver (admitted through
                its session, or refused)
    AckTask     answer a receiver's Cancel with a CancelAck, in that receiver's lane
    ReplyTask   a Result decided off the worker (a parked fetch refused at publish)
    ForgetTask  a peer was evicted: close the worker's DEALER to its result endpoint
    STOP        the worker's last task

What the worker needs from the sender is the narrow :class:`WorkerHost`, so
nothing here or in the worker's modules imports the sender package.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from kvxferd.config import SenderSettings
from kvxferd.stats import Stats
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.control import SocketLimits
from kvxferd.transfer.dataplane import DataPlane
from kvxferd.transfer.guard import Guard
from kvxferd.transfer.journal import Journal
from kvxferd.transfer.layout import Layout
from kvxferd.transfer.pool import KvPool
from kvxferd.transfer.reshard import Piece
from kvxferd.transfer.session import Slice, TxSession
from kvxferd.transfer.topology import Topology

STOP = object()  # a worker's last task


@dataclass(frozen=True, slots=True)
class Peer:
    """A registered receiver."""

    receiver_id: str
    routing_id: bytes
    result_endpoint: str
    nixl_name: str
    layout: Layout
    kv_base: int
    aux_base: int
    mem_type: str
    device_id: int
    # The data plane holds prepared lists for it (post_blocks): of its KV pool, or with a
    # topology, of its piece of both pools (prepare_piece).
    prepped: bool = False
    identity: str = ""  # the authenticated key that registered it ("" with security off)
    # Both sides declared a topology: the receiver's record and what it reads from this
    # rank (None: nothing); writes then follow the reshard mapping (reshard.py).
    topology: Topology | None = None
    piece: Piece | None = None
    # The wire version negotiated at its Register (protocol.negotiate): every frame and
    # notification toward it is encoded in it.
    version: int = wire.PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class WriteTask:
    session: TxSession
    slice: Slice
    peer: Peer
    queued_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, slots=True)
class AckTask:
    session: TxSession
    peer: Peer
    fetch_id: int


@dataclass(frozen=True, slots=True)
class ReplyTask:
    """A Result decided off the worker (a parked fetch refused at publish), sent in its lane."""

    peer: Peer
    msg: wire.Result


@dataclass(slots=True)
class ForgetTask:
    """A peer was evicted: close this worker's DEALER to its result endpoint (and, for one
    worker, the shared pool's: that close may wait for a bounded send, which a worker may).

    ``drop``: the peer's process is gone (a new incarnation took its endpoint): what is
    queued for it is dropped (no linger), so none of it reaches the new process.
    """

    endpoint: str
    shared: bool = False
    drop: bool = False


class WorkerHost(Protocol):
    """What a worker needs from its sender (kvxferd.transfer.sender.Sender provides it)."""

    settings: SenderSettings
    stats: Stats
    guard: Guard
    journal: Journal
    pool: KvPool
    dataplane: DataPlane
    socket_limits: SocketLimits
    topology: Topology | None  # this rank's record (a mapped peer's layers are absolute)

    def session_drained(self, session: TxSession) -> None:
        """A session's last write ended (maybe forget it)."""
        ...

    def peer_write_started(self, peer: Peer) -> bool:
        """Count a write toward ``peer``; False when a newer incarnation replaced it."""
        ...

    def peer_write_ended(self, peer: Peer) -> None:
        """A write toward ``peer`` ended; a removal deferred for it may run now."""
        ...

    def peer_gone(self, peer: Peer) -> bool:
        """True when a newer incarnation replaced ``peer``: nothing is sent to it."""
        ...

    def peer_failed(self, peer: Peer, detail: str) -> None:
        """A transport error toward ``peer``: its next fetch registers it afresh."""
        ...

    def forget_shared(self, endpoint: str) -> None: ...
