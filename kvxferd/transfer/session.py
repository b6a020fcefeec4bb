"""Session state machines, without I/O: what one published request (sender) or one fetch (receiver) may do next.

Sender side, one :class:`TxSession` per published request::

    PUBLISHED --first admitted write--> TRANSFERRING --expected fetches done--> COMPLETE
        |                                   |
        | ttl passes                        +-- a write fails or stalls --> FAILED
        v                                   |
     EXPIRED      engine cancel / peer CANCEL (any non-terminal state) --> CANCELLED
                  the drain ends it (any non-terminal state) --> FAILED/shutting_down

    lock: ``TxSession._lock`` guards state, outcome, writes_in_flight and every slice.

* The terminal outcome is committed once, under the lock; later outcomes never
  overwrite it (a completion never replaces a failure).
* ``admit_write`` runs under the same lock: a write is admitted before any
  ending is visible (then ``writes_in_flight`` > 0 and the session is not
  drained), or refused with the terminal reason. It never reopens an ended session.
* ``writes_in_flight`` rises at admission and falls when the NIXL call returns
  (``finish_write``) or when a write that was never posted gives its admission
  back (``release_admission``). ``drained = ended and writes_in_flight == 0``;
  the source blocks may be reused only once drained.
* A write still in progress past its stall deadline, or one NIXL has not
  released (its status check raised, ``release()`` said False), stays counted
  in flight (``write_in_doubt``): the session fails IN DOUBT and keeps its
  memory until NIXL answers and releases the handle (``finish_write``). The
  sender then tells the receiver with an unsolicited ``CancelAck(in_doubt=false)``.

Each slice (one receiver's fetch) has one final result on every path:
``QUEUED -> WRITING -> DONE | FAILED | IN_DOUBT``; ``take_report`` hands it
out exactly once.

A streamed publish (``streamed=True``) is published before its KV is computed: its
engine marks the sender's pool layers ``[0, layers_ready)`` ready as prefill computes
them (``mark_ready``, monotone; ``num_layers`` ends the stream). Its slices are written
range by range, in layer order (``Slice.next_layer``: the first layer not yet written,
in the slice's own layer ids; the worker owns it). Each range is one admitted write,
counted in flight like any other; between two ranges the slice stays WRITING with no
write in flight, and the session is not drained (it has not ended). A slice reaches
DONE (``slice_written``) only after the write of its last layer ended: never with
layers missing. An ending (cancel, failure, the drain) refuses the next range's
admission like any queued write::

    stream states (under ``_lock``)
    open      --mark_ready(n < num_layers)--> open (more layers ready)
    open      --mark_ready(num_layers)------> complete (a normal publish from now on)
    open      --the session ends------------> aborted: every slice's next range is refused

Receiver side, one :class:`RxSession` per fetch::

    REQUESTED --Result done--> DONE
        |-- Result failed/in_doubt --> FAILED
        |-- kv_transfer_timeout ----> TIMED_OUT  (fence: CANCEL sent, await CancelAck)
        |-- cancel() ---------------> CANCELLED  (fence: CANCEL sent, await CancelAck)
        |-- the drain ends it ------> FAILED/shutting_down  (fence: CANCEL sent, await CancelAck)
        +-- shutdown gave up -------> FAILED/shutting_down (``abandon``; fence IN_DOUBT if sent)

    fence: NONE (no write can come) | FENCED (a write may come) -> RELEASED | IN_DOUBT
           IN_DOUBT -> RELEASED  on CancelAck(in_doubt=false), a late done/failed Result,
                                 or the sender's restart (``release``)

    lock: ``RxSession._lock`` guards state and fence.

The destination blocks are safe to reuse once the fence is NONE or RELEASED; a
fence that passes its deadline without an acknowledgement ends IN_DOUBT, and
an in-doubt fence is resolved (RELEASED) as soon as the sender answers that no
write toward the fetch is in flight, however late (the receiver keeps asking).

A fetch from a prefill instance (several sender ranks, the reshard mapping) is
one :class:`RxGroup` over one RxSession per piece read::

    REQUESTED --every piece DONE--> DONE        (nbytes summed, aux from the piece that has it)
        |-- a piece ends otherwise --> its state, "prefill rank r: ..." (the others are cancelled)
        |-- cancel / the record never came / planning refused --> CANCELLED / TIMED_OUT / FAILED

    lock: ``RxGroup._lock`` guards its state and pieces; a piece's lock is never held
    while the group's is taken (pieces report after their own ``_publish``).

Its fence is its pieces': reusable only when every piece's blocks are; in doubt
when any piece is in doubt. Each piece keeps its own fence and in-doubt rules.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from kvxferd.errors import Reason, RejectedError
from kvxferd.transfer.waiters import Completion, Flag

NONCE_BYTES = 8  # as kvxferd.transfer.protocol.NONCE_BYTES (session.py does no I/O)


class TxState(StrEnum):
    PUBLISHED = "published"
    TRANSFERRING = "transferring"
    COMPLETE = "complete"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


TX_TERMINAL = frozenset({TxState.COMPLETE, TxState.FAILED, TxState.CANCELLED, TxState.EXPIRED})


class SliceState(StrEnum):
    QUEUED = "queued"
    WRITING = "writing"
    DONE = "done"
    FAILED = "failed"
    IN_DOUBT = "in_doubt"


@dataclass(frozen=True, slots=True)
class TxOutcome:
    """How a published request ended."""

    state: TxState
    reason: Reason | None = None
    detail: str = ""
    in_doubt: bool = False

    @property
    def ok(self) -> bool:
        return self.state is TxState.COMPLETE


@dataclass(slots=True)
class Slice:
    """One receiver's fetch of a published request (one REQUEST_DATA)."""

    peer_id: str
    fetch_id: int
    result_endpoint: str
    dst_blocks: np.ndarray
    layer_begin: int
    layer_end: int
    aux_slot: int
    deadline: float  # monotonic: no write starts after it
    state: SliceState = SliceState.QUEUED
    reason: Reason | None = None
    detail: str = ""
    nbytes: int = 0
    writes_in_flight: int = 0
    reported: bool = False
    # The receiver's nonce (RequestData.notify): the slice's last WRITE carries a NIXL
    # notification with it instead of a done Result (worker.py); b"": a done Result.
    notify: bytes = b""
    # Streamed publish: the first layer of this slice not yet posted (worker thread only).
    next_layer: int = -1
    digest: bool = False  # RequestData.digest: its done Result carries the written bytes' digest
    written_digest: bytes = b""  # worker thread only: that digest, computed before slice_written
    posted_at: float = 0.0  # worker thread only: monotonic time its first WRITE was posted
    written_at: float = 0.0  # worker thread only: when its last WRITE was released
    attached_at: float = field(default_factory=time.monotonic)  # readiness and /debug/state

    def __post_init__(self) -> None:
        if self.next_layer < 0:
            self.next_layer = self.layer_begin

    @property
    def key(self) -> tuple[str, int]:
        return (self.peer_id, self.fetch_id)


@dataclass(frozen=True, slots=True)
class SliceReport:
    """The one final result of a slice, handed out once by ``TxSession.take_report``."""

    fetch_id: int
    peer_id: str
    result_endpoint: str
    status: str  # "done" | "failed" | "in_doubt"
    reason: Reason | None
    detail: str
    nbytes: int


class TxSession:
    """A published request on the sender: its blocks, its slices, its single outcome."""

    def __init__(
        self,
        session_id: int,
        request_id: str,
        block_ids: np.ndarray,
        *,
        expected_fetches: int = 1,
        aux_slot: int = -1,
        aux_len: int = 0,
        ttl_s: float = 120.0,
        on_end: Callable[[TxSession], None] | None = None,
        streamed: bool = False,
        num_layers: int = 0,
    ) -> None:
        self.session_id = session_id  # never reused; the key for this session's state
        self.request_id = request_id
        self.block_ids = block_ids
        self.expected_fetches = expected_fetches
        self.aux_slot = aux_slot
        self.aux_len = aux_len
        self.created = time.monotonic()
        self.ttl_deadline = self.created + ttl_s
        self._lock = threading.Lock()
        self._state = TxState.PUBLISHED
        self._outcome: TxOutcome | None = None
        self._writes_in_flight = 0
        self._done_fetches = 0
        self._slices: dict[tuple[str, int], Slice] = {}
        self.completion: Completion[TxOutcome] = Completion()
        self.drained_event = Flag()
        self.on_end = on_end  # told once, without the lock, after the outcome is committed
        # A streamed publish: layers [0, layers_ready) of the sender's pool hold their KV
        # (see the module docstring); a normal publish has every layer ready.
        self.streamed = streamed
        self.num_layers = num_layers
        self.layers_ready = 0 if streamed else num_layers
        self.progressed_at = self.created  # monotonic: the last mark (or the publish)

    # -- views -----------------------------------------------------------------
    @property
    def state(self) -> TxState:
        return self._state

    @property
    def outcome(self) -> TxOutcome | None:
        return self._outcome

    @property
    def ended(self) -> bool:
        return self._state in TX_TERMINAL

    @property
    def writes_in_flight(self) -> int:
        return self._writes_in_flight

    @property
    def drained(self) -> bool:
        with self._lock:
            return self._drained_locked()

    @property
    def streaming(self) -> bool:
        """A streamed publish still waiting for layers (not ended, not every layer ready)."""
        return self.streamed and self.layers_ready < self.num_layers and not self.ended

    def slice(self, key: tuple[str, int]) -> Slice | None:
        with self._lock:
            return self._slices.get(key)

    def slices(self) -> list[Slice]:
        with self._lock:
            return list(self._slices.values())

    # -- internals (lock held) -------------------------------------------------
    def _drained_locked(self) -> bool:
        return self._state in TX_TERMINAL and self._writes_in_flight == 0

    def _commit_locked(self, outcome: TxOutcome) -> bool:
        """Commit the terminal outcome once; later commits change nothing."""
        if self._state in TX_TERMINAL:
            return False
        self._state, self._outcome = outcome.state, outcome
        return True

    def _after(self, committed: bool) -> None:
        """Publish effects of a transition (called without the lock)."""
        if committed and self._outcome is not None:
            self.completion.set(self._outcome)
            if self.on_end is not None:
                self.on_end(self)
        if self.drained:
            self.drained_event.set()

    def _refusal_reason(self) -> Reason:
        assert self._outcome is not None
        if self._outcome.state is TxState.FAILED:
            # A request the drain ended did not fail because of another slice: say why.
            if self._outcome.reason is Reason.SHUTTING_DOWN:
                return Reason.SHUTTING_DOWN
            return Reason.SESSION_FAILED
        if self._outcome.state is TxState.COMPLETE:
            return Reason.DUPLICATE
        return self._outcome.reason or Reason.CANCELLED

    # -- transitions -----------------------------------------------------------
    def mark_ready(self, layers_ready: int, now: float | None = None) -> str | None:
        """Layers ``[0, layers_ready)`` hold their KV; None, or why the mark is refused:
        ``not_streamed``, ``decreasing``, ``past_end``. A mark on an ended session is
        accepted and changes nothing."""
        with self._lock:
            if not self.streamed:
                return "not_streamed"
            if layers_ready > self.num_layers:
                return "past_end"
            if layers_ready < self.layers_ready:
                return "decreasing"
            if self._state not in TX_TERMINAL:
                self.layers_ready = layers_ready
                self.progressed_at = time.monotonic() if now is None else now
            return None

    def add_slice(self, sl: Slice) -> None:
        """Attach a fetch; RejectedError if the session ended or the fetch is known."""
        with self._lock:
            if self._state in TX_TERMINAL:
                raise RejectedError(self._refusal_reason(), f"request is {self._state}")
            if sl.key in self._slices:
                raise RejectedError(Reason.DUPLICATE, f"fetch {sl.fetch_id} already attached")
            if len(self._slices) >= self.expected_fetches:
                raise RejectedError(
                    Reason.DUPLICATE, f"request expects {self.expected_fetches} fetch(es)"
                )
            self._slices[sl.key] = sl

    def admit_write(self, sl: Slice, now: float | None = None) -> Reason | None:
        """Admit one write of ``sl`` (None) or refuse it with a reason; atomic with endings."""
        with self._lock:
            if self._state in TX_TERMINAL:
                reason = self._refusal_reason()
            elif sl.state not in (SliceState.QUEUED, SliceState.WRITING):
                reason = sl.reason or Reason.SESSION_FAILED
            elif (now if now is not None else time.monotonic()) > sl.deadline:
                reason = Reason.TIMEOUT
            else:
                self._writes_in_flight += 1
                sl.writes_in_flight += 1
                sl.state = SliceState.WRITING
                self._state = TxState.TRANSFERRING
                return None
            detail = "write refused: " + str(reason)
            if self.streamed and self._outcome is not None and self._outcome.detail:
                detail += f" ({self._outcome.detail})"  # why the stream ended, for the receiver
            self._fail_slice_locked(sl, reason, detail)
            committed = False
            if reason is Reason.TIMEOUT:
                # The receiver gave up on this fetch: the request cannot complete any more,
                # so end it now rather than hold its source blocks until the engine closes it.
                committed = self._commit_locked(
                    TxOutcome(TxState.FAILED, Reason.TIMEOUT, "a fetch passed its deadline")
                )
        self._after(committed)
        return reason

    def release_admission(
        self, sl: Slice, detail: str, reason: Reason = Reason.BUILD_FAILED
    ) -> None:
        """A write that was admitted but never posted gives its admission back, then fails."""
        with self._lock:
            self._writes_in_flight -= 1
            sl.writes_in_flight -= 1
            self._fail_slice_locked(sl, reason, detail)
            committed = self._commit_locked(TxOutcome(TxState.FAILED, reason, detail))
        self._after(committed)

    def finish_write(self, sl: Slice, ok: bool, nbytes: int = 0, detail: str = "") -> None:
        """The NIXL call of one admitted write returned (``ok``: its bytes are in place)."""
        committed = False
        with self._lock:
            self._writes_in_flight -= 1
            sl.writes_in_flight -= 1
            if ok:
                sl.nbytes += nbytes
            elif sl.state is SliceState.IN_DOUBT:
                pass  # a stalled write returned late; the slice already reported in doubt
            else:
                self._fail_slice_locked(sl, Reason.TRANSFER_ERROR, detail)
                committed = self._commit_locked(
                    TxOutcome(TxState.FAILED, Reason.TRANSFER_ERROR, detail)
                )
        self._after(committed)

    def write_stalled(self, sl: Slice, detail: str) -> None:
        """A write is still in progress past its stall deadline: in doubt, memory kept."""
        self.write_in_doubt(sl, Reason.STALLED, detail)

    def write_in_doubt(self, sl: Slice, reason: Reason, detail: str) -> None:
        """A write may still land (stalled, status check raised, handle not released).

        It stays counted in flight (memory kept) until ``finish_write``; the slice is
        IN_DOUBT and the session FAILED in doubt.
        """
        with self._lock:
            if sl.state in (SliceState.QUEUED, SliceState.WRITING):
                sl.state, sl.reason, sl.detail = SliceState.IN_DOUBT, reason, detail
            committed = self._commit_locked(
                TxOutcome(TxState.FAILED, reason, detail, in_doubt=True)
            )
        self._after(committed)

    def slice_written(self, sl: Slice) -> None:
        """Every write of ``sl`` returned OK: the slice is done; maybe the session too."""
        committed = False
        with self._lock:
            if sl.state is SliceState.WRITING and sl.writes_in_flight == 0:
                sl.state = SliceState.DONE
                self._done_fetches += 1
                if self._done_fetches >= self.expected_fetches:
                    committed = self._commit_locked(TxOutcome(TxState.COMPLETE))
        self._after(committed)

    def release_unread(self) -> bool:
        """``expected_fetches == 0``: no decode rank reads this prefill rank's copy (GQA or
        MLA replication); the request is complete at once and its blocks free."""
        with self._lock:
            committed = self.expected_fetches == 0 and self._commit_locked(
                TxOutcome(TxState.COMPLETE, None, "released without a read (no expected reader)")
            )
        self._after(committed)
        return committed

    def fail_slice(self, sl: Slice, reason: Reason, detail: str) -> None:
        """A slice fails before any write of it was admitted (e.g. its peer is gone)."""
        with self._lock:
            self._fail_slice_locked(sl, reason, detail)
        self._after(False)

    def _fail_slice_locked(self, sl: Slice, reason: Reason, detail: str) -> None:
        if sl.state in (SliceState.QUEUED, SliceState.WRITING):
            sl.state, sl.reason, sl.detail = SliceState.FAILED, reason, detail

    def fail(self, reason: Reason, detail: str = "") -> bool:
        """Commit FAILED unless the session already ended."""
        with self._lock:
            committed = self._commit_locked(TxOutcome(TxState.FAILED, reason, detail))
        self._after(committed)
        return committed

    def cancel(self, reason: Reason = Reason.CANCELLED, detail: str = "") -> bool:
        """Commit CANCELLED unless the session already ended; queued writes will be refused."""
        with self._lock:
            committed = self._commit_locked(TxOutcome(TxState.CANCELLED, reason, detail))
        self._after(committed)
        return committed

    def expire(self, now: float) -> bool:
        """Commit EXPIRED when the TTL passed and no fetch ever arrived, or (the readers'
        lease) when only some of the expected readers came and none of them is still open."""
        with self._lock:
            if now < self.ttl_deadline:
                return False
            came = len(self._slices)
            detail = "no receiver fetched it in time"
            if came:
                still_open = any(
                    sl.state in (SliceState.QUEUED, SliceState.WRITING)
                    for sl in self._slices.values()
                )
                if came >= self.expected_fetches or still_open:
                    return False
                detail = (
                    f"{came} of {self.expected_fetches} expected readers came before the lease"
                    " (publish_ttl_ms) ended"
                )
            committed = self._commit_locked(TxOutcome(TxState.EXPIRED, Reason.EXPIRED, detail))
        self._after(committed)
        return committed

    def lease_pending(self) -> bool:
        """Some but not all expected readers came and one is still open: ask again later."""
        with self._lock:
            return self._state not in TX_TERMINAL and 0 < len(self._slices) < self.expected_fetches

    def take_report(self, sl: Slice) -> SliceReport | None:
        """The slice's final result, once it has one and only the first time it is asked."""
        with self._lock:
            if sl.reported or sl.state in (SliceState.QUEUED, SliceState.WRITING):
                return None
            if sl.state is SliceState.DONE:
                status = "done"
            elif sl.state is SliceState.IN_DOUBT:
                status = "in_doubt"
            else:
                status = "failed"
            sl.reported = True
            return SliceReport(
                sl.fetch_id, sl.peer_id, sl.result_endpoint, status, sl.reason, sl.detail, sl.nbytes
            )


class RxState(StrEnum):
    REQUESTED = "requested"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


RX_TERMINAL = frozenset({RxState.DONE, RxState.FAILED, RxState.CANCELLED, RxState.TIMED_OUT})


class Fence(StrEnum):
    NONE = "none"  # no write toward our blocks can come (final result seen, or never asked)
    FENCED = "fenced"  # a write may still come; waiting for a CancelAck
    RELEASED = "released"  # the sender acknowledged: nothing in flight
    IN_DOUBT = "in_doubt"  # no acknowledgement in time, or the sender said in doubt


@dataclass(frozen=True, slots=True)
class RxOutcome:
    """How a fetch ended, as the engine sees it."""

    state: RxState
    reason: Reason | None = None
    detail: str = ""
    nbytes: int = 0
    aux: bytes | None = None

    @property
    def ok(self) -> bool:
        return self.state is RxState.DONE


@dataclass(slots=True)
class RxSession:
    """One fetch on the receiver: a request's KV into our blocks."""

    fetch_id: int
    request_id: str
    sender_endpoint: str
    dst_blocks: np.ndarray
    layer_begin: int
    layer_end: int
    aux_slot: int
    deadline: float  # monotonic
    started: float = field(default_factory=time.monotonic)
    token: str = ""  # the publisher's fetch token, passed on in every RequestData
    # Sent in RequestData; the notification of the sender's last WRITE must carry it.
    nonce: bytes = field(default_factory=lambda: os.urandom(NONCE_BYTES))
    sender_key: str = ""  # the identity its Results must come from ("" with security off)
    sent: bool = False  # REQUEST_DATA has left (a write may come from now on)
    sent_to: str = ""  # the sender incarnation (sender_id) it was last sent to
    agent_gen: int = -1  # the receiver's NIXL agent (link_agents.py) it was last sent through
    state: RxState = RxState.REQUESTED
    fence: Fence = Fence.NONE
    fence_deadline: float = 0.0
    outcome: RxOutcome | None = None
    retry_at: float = 0.0  # io thread only: next Cancel re-send while in doubt
    retry_every: float = 0.0  # io thread only: its current interval (doubles, bounded)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    completion: Completion[RxOutcome] = field(default_factory=Completion)
    # Told once, without the lock, after the outcome is committed (the receiver's journal).
    on_end: Callable[[RxSession], None] | None = None
    # Told after every transition, without the lock (a group's piece: RxGroup.piece_changed).
    on_change: Callable[[RxSession], None] | None = None
    # A group's piece: the prefill rank (and instance) its sender must be, else -1.
    prefill_rank: int = -1
    prefill_compat: str = ""
    # Asks its sender for a digest; done only once what landed matches it (receiver/digests.py).
    digest: bool = False
    hops: int = 0  # how many times a moved Result sent it to another sender (receiver/moved.py)
    fence_done: Flag = field(default_factory=Flag)
    # Set once blocks_reusable is true (maybe long after the outcome: an in-doubt fence resolved).
    reusable: Flag = field(default_factory=Flag)

    @property
    def ended(self) -> bool:
        return self.state in RX_TERMINAL

    @property
    def blocks_reusable(self) -> bool:
        """True once no write toward our blocks can still come."""
        return self.ended and self.fence in (Fence.NONE, Fence.RELEASED)

    def _finish(self, outcome: RxOutcome) -> bool:
        if self.state in RX_TERMINAL:
            return False
        self.state, self.outcome = outcome.state, outcome
        return True

    def _publish(self, committed: bool) -> None:
        if committed and self.outcome is not None:
            self.completion.set(self.outcome)
            if self.on_end is not None:
                self.on_end(self)
        if self.state in RX_TERMINAL and self.fence is not Fence.FENCED:
            self.fence_done.set()
        if self.blocks_reusable:
            self.reusable.set()
        if self.on_change is not None:
            self.on_change(self)

    def mark_sent(self, sender_id: str = "") -> None:
        with self._lock:
            self.sent, self.sent_to = True, sender_id

    def redirect(self, endpoint: str, sender_key: str) -> None:
        """Its sender answered ``moved`` (nothing written): send it to ``endpoint`` instead."""
        with self._lock:
            self.sender_endpoint, self.sender_key = endpoint, sender_key
            self.sent, self.sent_to, self.hops = False, "", self.hops + 1

    def on_result(
        self, status: str, reason: Reason | None, detail: str, nbytes: int, aux: bytes | None
    ) -> bool:
        """The sender's final result for this fetch; True if it decided the outcome."""
        with self._lock:
            if status == "done":
                committed = self._finish(RxOutcome(RxState.DONE, None, "", nbytes, aux))
            else:
                committed = self._finish(
                    RxOutcome(RxState.FAILED, reason or Reason.TRANSFER_ERROR, detail)
                )
            # A final result means the sender's writes for this fetch returned,
            # except an in-doubt one, which only a CancelAck can clear. A done/failed
            # Result that comes after the fence went in doubt resolves it.
            if status == "in_doubt":
                if self.fence is not Fence.IN_DOUBT:
                    self.fence = Fence.FENCED if self.fence is Fence.FENCED else Fence.IN_DOUBT
            elif self.fence in (Fence.FENCED, Fence.IN_DOUBT):
                self.fence = Fence.RELEASED
        self._publish(committed)
        return committed

    def end_locally(self, state: RxState, reason: Reason, detail: str, fence_s: float) -> bool:
        """Cancel or time out; if a write may still come, fence the blocks until acknowledged."""
        with self._lock:
            committed = self._finish(RxOutcome(state, reason, detail))
            if committed and self.sent:
                self.fence = Fence.FENCED
                self.fence_deadline = time.monotonic() + fence_s
        self._publish(committed)
        return committed

    def fail(self, reason: Reason, detail: str) -> bool:
        """Fail before any write could start (never sent, or the sender refused it)."""
        with self._lock:
            committed = self._finish(RxOutcome(RxState.FAILED, reason, detail))
        self._publish(committed)
        return committed

    def abandon(self, reason: Reason, detail: str) -> bool:
        """End a fetch nobody will hear about any more (shutdown); in doubt if it was sent."""
        with self._lock:
            committed = self._finish(RxOutcome(RxState.FAILED, reason, detail))
            if self.sent and (committed or self.fence is Fence.FENCED):
                self.fence = Fence.IN_DOUBT
        self._publish(committed)
        return committed

    def on_cancel_ack(self, in_doubt: bool) -> None:
        """The sender's CancelAck, solicited or not, in time or late."""
        with self._lock:
            if self.fence is Fence.FENCED:
                self.fence = Fence.IN_DOUBT if in_doubt else Fence.RELEASED
            elif self.fence is Fence.IN_DOUBT and not in_doubt:
                self.fence = Fence.RELEASED
        self._publish(False)

    def release(self) -> bool:
        """The sender this fetch was sent to is gone (a new incarnation answered): no write can come."""
        with self._lock:
            if self.state not in RX_TERMINAL or self.fence not in (Fence.FENCED, Fence.IN_DOUBT):
                return False
            self.fence = Fence.RELEASED
        self._publish(False)
        return True

    def fence_expired(self, now: float) -> bool:
        with self._lock:
            if self.fence is not Fence.FENCED or now < self.fence_deadline:
                return False
            self.fence = Fence.IN_DOUBT
        self._publish(False)
        return True


class RxGroup:
    """One fetch from a prefill instance: a piece (RxSession) per prefill rank read.

    Created unplanned (the instance's record may not be known yet); ``plan`` gives it
    its pieces once, or it ends before that (``fail`` / ``end_locally``). See the
    module docstring for the states.
    """

    def __init__(
        self,
        fetch_id: int,
        request_id: str,
        sender_endpoints: list[str],
        dst_blocks: np.ndarray,
        layer_begin: int,
        layer_end: int,
        aux_slot: int,
        deadline: float,
        tokens: list[str],
        sender_keys: list[str],
        on_failed: Callable[[list[RxSession]], None],
    ) -> None:
        self.fetch_id = fetch_id
        self.request_id = request_id
        self.sender_endpoints = sender_endpoints
        self.sender_endpoint = sender_endpoints[0]
        self.dst_blocks = dst_blocks
        self.layer_begin, self.layer_end = layer_begin, layer_end  # local to this rank's pool
        self.aux_slot = aux_slot  # handed to the piece that fetches aux when planned
        self.deadline = deadline
        self.tokens, self.sender_keys = tokens, sender_keys
        self.started = time.monotonic()
        self.state = RxState.REQUESTED
        self.outcome: RxOutcome | None = None
        self.pieces: list[RxSession] = []
        self.planned = False
        self.digest = False  # each piece asks its sender for a digest (receiver/digests.py)
        self._on_failed = on_failed  # cancels the pieces still open (the receiver's io thread)
        self._lock = threading.Lock()
        self.completion: Completion[RxOutcome] = Completion()
        self.fence_done = Flag()
        self.reusable = Flag()

    @property
    def ended(self) -> bool:
        return self.state in RX_TERMINAL

    @property
    def fence(self) -> Fence:
        """IN_DOUBT if a piece is, FENCED if a piece is, else RELEASED (or NONE: no piece)."""
        fences = {p.fence for p in self.pieces}
        for f in (Fence.IN_DOUBT, Fence.FENCED, Fence.RELEASED):
            if f in fences:
                return f
        return Fence.NONE

    @property
    def blocks_reusable(self) -> bool:
        """True once no write of any piece can still land in our blocks."""
        return self.ended and all(p.blocks_reusable for p in self.pieces)

    def plan(self, pieces: list[RxSession]) -> bool:
        """Give the group its pieces (once); False if it ended meanwhile (start none)."""
        with self._lock:
            if self.ended or self.planned:
                return False
            self.pieces, self.planned = pieces, True
            if pieces:
                self.aux_slot = -1  # now owned by the piece that carries it
        if not pieces:  # the asked layers hold nothing to read: done at once
            self._commit(RxOutcome(RxState.DONE))
        return True

    def fail(self, reason: Reason, detail: str) -> bool:
        """End before or instead of planning (no piece was started by it)."""
        return self._commit(RxOutcome(RxState.FAILED, reason, detail))

    def end_locally(self, state: RxState, reason: Reason, detail: str) -> list[RxSession]:
        """Cancel or time out the group; the pieces still open (for the receiver to cancel)."""
        if not self._commit(RxOutcome(state, reason, detail)):
            return []
        return [p for p in self.pieces if not p.ended]

    def piece_changed(self, piece: RxSession) -> None:
        """A piece moved (outcome or fence): maybe the group's outcome, maybe its fence."""
        with self._lock:
            pieces = list(self.pieces)
        if not self.ended and piece.outcome is not None:
            if piece.state is not RxState.DONE:
                o = piece.outcome
                rank = pieces.index(piece) if piece in pieces else -1
                where = f"piece {rank} ({piece.sender_endpoint})"
                if self._commit(RxOutcome(o.state, o.reason, f"{where}: {o.detail}"[:1024])):
                    self._on_failed([p for p in pieces if not p.ended])
            elif pieces and all(p.state is RxState.DONE for p in pieces):
                outs = [p.outcome for p in pieces if p.outcome is not None]
                aux = next((o.aux for o in outs if o.aux is not None), None)
                self._commit(RxOutcome(RxState.DONE, None, "", sum(o.nbytes for o in outs), aux))
        self._settle()

    def _commit(self, outcome: RxOutcome) -> bool:
        with self._lock:
            if self.ended:
                return False
            self.state, self.outcome = outcome.state, outcome
        self.completion.set(outcome)
        self._settle()
        return True

    def _settle(self) -> None:
        if self.ended and all(p.ended and p.fence_done.is_set() for p in self.pieces):
            self.fence_done.set()
        if self.blocks_reusable:
            self.reusable.set()
