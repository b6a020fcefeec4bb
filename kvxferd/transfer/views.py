"""What the service shell reads of the transfer core: frozen views the core objects take of themselves.

The probe port (kvxferd/service: ``/readyz``, ``/metrics``, ``/debug/state``) never
reads a private attribute of the core and never takes its locks; it formats what
``view()`` returns. Each object takes its own view, so it alone knows which lock
guards what::

    object                    view()                    taken how
    ------------------------  ------------------------  ---------------------------------------
    Sender                    SenderView                locked: the registry lock while it copies
                                                        sessions, peers, parked fetches and the
                                                        ownership table; then each session under
                                                        its own lock (never the registry lock
                                                        inside a session's). ``locked=False``:
                                                        the same copies without any lock
      published sessions      TxSessionView             (their slices: SliceView)
      peers                   PeerView                  + the listener's last-heard time (its
                                                        own table: never locked) and the writes
                                                        in flight (peer_agents.py's lock)
      identities              IdentityView              the ownership table (registry lock)
      retiring NIXL agents    RetiringView              peer_agents.py's own lock
      parked fetches          ParkedView                registry lock
      links' speeds           LinkSpeedView             link_probes.py's own lock
    Worker                    WorkerView                no lock: its tables are its thread's;
                                                        sizes read by len()
    Receiver                  ReceiverView              locked: ``_lock`` while it copies the
                                                        fetch table, the in-doubt table and its
                                                        counts; ``locked=False``: without it
      fetches                 RxFetchView               each fetch's fields, read one by one
      in-doubt table          InDoubtView               (count, and the fetches still asked about)
      links                   LinkView                  io thread only: always copied unlocked
      link agents             ReceiverView.dataplane_closed  (link_agents.py: the pool deregistered)

``locked=False`` is for the hang dump (``/debug/state``) and the probes that must
answer while a stuck thread holds a lock (readiness, liveness): best effort, each
copy of a table another thread changes is retried (:func:`copied`), and values
may be a moment apart from each other. ``/metrics`` takes the locked view.

Times are ``time.monotonic()`` seconds as the core keeps them; the service turns
them into ages. Nothing here holds a reference to a live core object.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kvxferd.errors import Reason
from kvxferd.transfer.session import (
    Fence,
    RxSession,
    RxState,
    Slice,
    SliceState,
    TxOutcome,
    TxSession,
    TxState,
)
from kvxferd.transfer.topology import Topology

if TYPE_CHECKING:
    from kvxferd.transfer.worker import Peer

_T = TypeVar("_T")

# -- the sender ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SliceView:
    """One receiver's fetch of a published request (session.Slice)."""

    receiver_id: str
    result_endpoint: str
    fetch_id: int
    state: SliceState
    attached_at: float
    posted_at: float  # its first WRITE posted; 0.0: not yet
    deadline: float  # no write starts after it
    nbytes: int
    writes_in_flight: int
    reason: Reason | None
    lane: int | None  # while a write is in flight: its worker's index (-1: inline), else None

    @classmethod
    def of(cls, sl: Slice, lane: int | None) -> SliceView:
        return cls(
            sl.peer_id,
            sl.result_endpoint,
            sl.fetch_id,
            sl.state,
            sl.attached_at,
            sl.posted_at,
            sl.deadline,
            sl.nbytes,
            sl.writes_in_flight,
            sl.reason,
            lane,
        )


@dataclass(frozen=True, slots=True)
class TxSessionView:
    """A published request (session.TxSession) and its slices."""

    session_id: int
    request_id: str
    state: TxState
    ended: bool
    created: float
    writes_in_flight: int
    expected_fetches: int
    ttl_deadline: float
    aux_slot: int
    outcome: TxOutcome | None
    slices: tuple[SliceView, ...]
    layers_ready: int | None = None  # a streamed publish: the layers marked so far


def tx_session_view(
    session: TxSession, locked: bool, lane: Callable[[TxSession, str], int]
) -> TxSessionView:
    """``session``'s view; its slices under its lock, or (``locked=False``) copied without it.

    ``lane(session, receiver_id)`` names the worker of a slice with a write in flight.
    """
    # session.py keeps the slices behind its lock; the hang dump may not wait on it.
    slices = session.slices() if locked else copied_values(session._slices)
    return TxSessionView(
        session.session_id,
        session.request_id,
        session.state,
        session.ended,
        session.created,
        session.writes_in_flight,
        session.expected_fetches,
        session.ttl_deadline,
        session.aux_slot,
        session.outcome,
        tuple(
            SliceView.of(sl, lane(session, sl.peer_id) if sl.writes_in_flight > 0 else None)
            for sl in slices
        ),
        session.layers_ready if session.streamed else None,
    )


@dataclass(frozen=True, slots=True)
class PeerView:
    """A registered receiver incarnation (worker.Peer)."""

    receiver_id: str
    result_endpoint: str
    nixl_name: str
    last_heard: float | None  # the listener's last message from it; None: not known
    writes_in_flight: int  # toward its NIXL agent (peer_agents.py)
    prepped: bool
    identity: str  # the CURVE key that registered it; "" with security off
    decode_rank: int | None  # its topology record's rank when it reads through the mapping
    version: int  # the wire version negotiated at its Register

    @classmethod
    def of(cls, p: Peer, last_heard: float | None, writes_in_flight: int) -> PeerView:
        rank = None if p.topology is None else p.topology.rank
        return cls(
            p.receiver_id,
            p.result_endpoint,
            p.nixl_name,
            last_heard,
            writes_in_flight,
            p.prepped,
            p.identity,
            rank,
            p.version,
        )


@dataclass(frozen=True, slots=True)
class IdentityView:
    """What one identity holds (ownership.Usage)."""

    identity: str
    peers: int
    fetches: int
    parked: int
    receiver_ids: int


@dataclass(frozen=True, slots=True)
class RetiringView:
    """A replaced or evicted peer's NIXL agent, kept until its last write ends."""

    nixl_name: str
    writes_in_flight: int


@dataclass(frozen=True, slots=True)
class ParkedView:
    """A RequestData waiting for its request to be published."""

    request_id: str
    receiver_id: str
    fetch_id: int
    parked_at: float
    deadline: float  # parked until then

    @classmethod
    def of(cls, p: Any) -> ParkedView:  # p: parked.Parked
        return cls(p.msg.request_id, p.peer.receiver_id, p.msg.fetch_id, p.parked_at, p.deadline)


@dataclass(frozen=True, slots=True)
class LinkSpeedView:
    """A link's latest probe (link_probes.LinkFigure): ``gbps`` None while probing or failed."""

    peer: str  # the receiver's result endpoint
    receiver_id: str
    state: str  # probing | ok | failed | timeout
    gbps: float | None
    transport: str  # what UCX was asked for (UCX_TLS): NIXL does not say what it picked
    nbytes: int  # bytes per timed WRITE
    writes: int
    measured_at: float  # Unix time
    measured_mono: float  # monotonic
    detail: str

    @classmethod
    def of(cls, f: Any) -> LinkSpeedView:  # f: link_probes.LinkFigure
        return cls(
            f.peer,
            f.receiver_id,
            f.state,
            f.gbps,
            f.transport,
            f.nbytes,
            f.writes,
            f.measured_at,
            f.measured_mono,
            f.detail,
        )


@dataclass(frozen=True, slots=True)
class WorkerView:
    """A sender worker (worker.Worker): a thread, or the listener's inline one."""

    index: int  # -1: the inline worker
    inline: bool
    alive: bool  # its thread runs (False for the inline worker: it has none)
    queue_depth: int
    lanes_busy: int
    dealers: int  # its DEALERs, one per receiver result endpoint
    last_progress: float


@dataclass(frozen=True, slots=True)
class SenderView:
    """A sender at one moment (transfer.sender.Sender)."""

    sender_id: str
    endpoint: str
    draining: bool
    topology: Topology | None
    listener_alive: bool
    listener_progress: float
    workers: tuple[WorkerView, ...]
    inline: WorkerView | None  # the listener's own writes, or None when it makes none
    sessions: tuple[TxSessionView, ...]  # every session not yet removed, oldest first
    peers: tuple[PeerView, ...]
    identities: tuple[IdentityView, ...]  # by identity
    retiring: tuple[RetiringView, ...]  # by name
    parked_count: int
    parked: tuple[ParkedView, ...]  # oldest first
    aux_free: int
    shared_dealers: int  # the shared pool's DEALERs (control.SharedDealerPool)
    dataplane_closed: bool  # the pool is no longer registered with NIXL
    links: tuple[LinkSpeedView, ...] = ()  # by peer


# -- the receiver ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RxFetchView:
    """One fetch (session.RxSession)."""

    fetch_id: int
    request_id: str
    state: RxState
    fence: Fence
    ended: bool
    started: float
    sender_endpoint: str
    sent: bool
    sent_to: str  # the sender incarnation it was last sent to
    deadline: float
    fence_deadline: float  # 0.0: no fence
    aux_slot: int
    blocks: int
    reason: Reason | None  # its outcome's, once it ended
    retry_at: float  # in doubt: its next Cancel

    @classmethod
    def of(cls, f: RxSession) -> RxFetchView:
        return cls(
            f.fetch_id,
            f.request_id,
            f.state,
            f.fence,
            f.ended,
            f.started,
            f.sender_endpoint,
            f.sent,
            f.sent_to,
            f.deadline,
            f.fence_deadline,
            f.aux_slot,
            int(f.dst_blocks.size),
            f.outcome.reason if f.outcome is not None else None,
            f.retry_at,
        )


@dataclass(frozen=True, slots=True)
class InDoubtView:
    """The receiver's in-doubt table: fetches ended with a write possibly still landing."""

    count: int  # ended in doubt and not resolved, asked about or not any more
    tracked: tuple[RxFetchView, ...]  # still asked about (bounded), oldest first


@dataclass(frozen=True, slots=True)
class LinkView:
    """The receiver's connection to one sender endpoint (receiver/links.py: Link)."""

    endpoint: str
    ready: bool
    sender_id: str  # the incarnation that answered its Register
    waiting: int  # fetches queued until it registers
    ever_connected: bool
    disconnected: bool
    down: bool
    register_deadline: float
    version: int  # the wire version it speaks (negotiated at Register)

    @classmethod
    def of(cls, link: Any) -> LinkView:  # link: receiver.links.Link
        return cls(
            link.endpoint,
            link.ready,
            link.sender_id,
            len(link.waiting),
            link.ever_connected,
            link.disconnected,
            link.down,
            link.register_deadline,
            link.version,
        )


@dataclass(frozen=True, slots=True)
class ReceiverView:
    """A receiver at one moment (transfer.receiver.Receiver)."""

    receiver_id: str
    result_endpoint: str
    draining: bool
    io_alive: bool
    io_progress: float
    fetches: tuple[
        RxFetchView, ...
    ]  # the fetch table (open, or ended with the fence up), oldest first
    in_doubt: InDoubtView
    links: tuple[LinkView, ...]
    commands_queued: int
    aux_free: int
    aux_quarantined: int  # held by fetches in doubt
    dataplane_closed: bool  # the pool is no longer registered with NIXL (link_agents.py)


# -- reading without a lock ------------------------------------------------------------------


def copied(make: Callable[[], _T], empty: Callable[[], _T]) -> _T:
    """A copy of containers another thread changes, taken without their lock: ``make()``,
    retried while it races a change; ``empty()`` if it never settles."""
    for _ in range(10):
        try:
            return make()
        except RuntimeError:  # changed size while copying: try again
            continue
    return empty()


def copied_values(d: dict[Any, _T]) -> list[_T]:
    """The values of a dict another thread changes, without its lock (retried; [] if it never settles)."""
    return copied(lambda: list(d.values()), list)


def oldest_first(items: Iterable[_T], key: Callable[[_T], float]) -> tuple[_T, ...]:
    return tuple(sorted(items, key=key))


def dataplane_closed(dataplane: Any) -> bool:
    """True once the data plane deregistered the pool.

    NixlDataPlane and the test double (kvxferd.testing) both say it in ``closed``.
    """
    return bool(getattr(dataplane, "closed", False))
