"""A sender worker thread, the tasks it takes, and the peers it writes to.

Each ``kvxferd-worker-i`` owns its queue, its writes in flight, and one DEALER
(with an outbox) per receiver result endpoint. It never waits on one peer:

* **Lanes.** Tasks are kept in one FIFO lane per receiver. A lane starts its
  next task only when it has no write in progress on this worker, so one
  receiver's results keep their order (and a CancelAck goes out after the same
  fetch's Result), while the other lanes go on. A write also waits while
  another write of the same request is in progress on this worker (a failure of
  the first refuses it instead of writing bytes for a failed request).
* **Writes in flight.** A :class:`WriteTask` is admitted through its session
  (or refused), posted, and kept in the worker's in-flight set; every turn polls
  every write in flight while new tasks keep arriving. At most
  ``limits.max_writes_in_flight_per_worker`` writes hold a lane at once (writes in
  doubt aside). KV first, then AUX, one after the other. A write that could not be
  posted gives its admission back before its Result is queued.
* **Stall deadline.** A write still in progress past ``xfer_stall_timeout_ms``
  makes its slice IN_DOUBT (the Result says so) and frees its lane; the write
  stays counted in flight and is polled every turn (every ``TICK_S`` once only
  writes in doubt are left).

A write's states on the worker (all owned by the worker thread)::

    POSTED (holds its lane) --DONE/ERR + released--> ENDED (finish_write; next write or Result)
       |  past stall deadline, status check raised with release refused,
       |  or release refused                 --> IN DOUBT (Result in_doubt; lane freed)
    IN DOUBT --DONE/ERR + released--> ENDED (finish_write; CancelAck in_doubt=false)

* **Not finished until released.** A write counts as finished only when NIXL
  gave a terminal state (DONE/ERR) *and* released its handle. A status check
  that raises, or a ``release()`` that says False, leaves the write in flight
  and its slice in doubt; the worker tries to release it again every turn (the
  session stays undrained, its source blocks fenced). When an in-doubt write
  finally ends, the worker sends that fetch's receiver an unsolicited
  ``CancelAck(in_doubt=false)``: the receiver may release its blocks.
* **Outboxes.** Results and CancelAcks are sent without blocking: each goes into
  its endpoint's FIFO outbox and is sent when the DEALER can take it (retried
  each turn) until its own deadline (``worker_send_timeout_ms``), then dropped
  and counted (``send_timeouts``). A receiver that stops reading delays only
  its own messages.

The listener and API callers (kvxferd/transfer/sender.py) only enqueue. What the worker
needs from the sender is the narrow :class:`WorkerHost` (no import of sender.py).
Each turn's body is guarded: an unexpected exception is logged and counted
(``Guard.caught``) and the worker goes on with the next turn.

A :class:`ReplyTask` is a Result decided elsewhere (a parked fetch refused at
publish); a :class:`ForgetTask` closes the DEALER to an evicted peer. On STOP
the worker refuses what is queued (sessions are ended by then), waits for its
writes until each ends or stalls, flushes its outboxes within their deadlines,
and closes its DEALERs with a bounded linger. Writes still in doubt then keep
their memory registered (the sender's shutdown says so).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import zmq

from kvxferd.config import SenderSettings
from kvxferd.errors import Reason, SendTimeout
from kvxferd.stats import Stats
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.control import SocketLimits, connect_dealer, send_bounded
from kvxferd.transfer.dataplane import DataPlane, PathStalled, Xfer
from kvxferd.transfer.guard import Guard
from kvxferd.transfer.journal import Ending, Journal
from kvxferd.transfer.layout import Layout, aux_descriptors, write_descriptors
from kvxferd.transfer.pool import KvPool
from kvxferd.transfer.reshard import Piece, piece_descriptors
from kvxferd.transfer.session import Slice, SliceState, TxSession
from kvxferd.transfer.topology import Topology
from kvxferd.transfer.views import WorkerView

log = logging.getLogger("kvxferd.sender")
jlog = logging.getLogger("kvxferd.journal")  # per-request lines: fields in extra (logs.py)

TICK_S = 0.05  # listener/worker housekeeping period
STOP = object()  # a worker's last task
_POLL_MIN_S, _POLL_MAX_S = 20e-6, 1e-3  # back-off between polls of writes in flight
MAX_COALESCED = 32  # slices one coalesced WRITE serves at most (see Worker._coalesce)


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


@dataclass(slots=True)
class _Write:
    """One posted WRITE and where it stands; it serves one slice, or several coalesced."""

    parts: list[tuple[WriteTask, int]]  # (the slice's task, its bytes in this WRITE)
    kind: str  # "kv" | "aux"
    xfer: Xfer
    state: str  # last polled: "PROC" | "DONE" | "ERR"
    stall_at: float  # monotonic; past it the slices are in doubt
    lane_held: bool = True  # still holds its lane (not stalled, not in doubt)
    doubt: str = ""  # why it is in doubt (a raise, a refused release), "" when not
    error: str = ""
    over: bool = False  # NIXL released it: settled (or being settled) by _ended

    @property
    def task(self) -> WriteTask:
        return self.parts[0][0]


@dataclass(slots=True)
class _Outgoing:
    frame: bytes
    deadline: float
    tag: str
    fetch_id: int


class Worker:
    """One sender worker: its queue, lanes, writes in flight and outboxes.

    A thread of its own (``kvxferd-worker-i``), or, with ``inline``, no thread: the
    sender's listener drives it (``step`` each turn, ``finish`` at the end), so a small
    write is posted by the thread that read its RequestData, with no hand-off.
    """

    def __init__(
        self, host: WorkerHost, index: int, *, inline: bool = False, wake: Any = None
    ) -> None:
        self.host = host
        self.index = index
        self.inline = inline
        self._wake = wake  # inline: wakes the thread that drives it (a put from elsewhere)
        self.queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        # Everything below is owned by this worker's thread only.
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._outbox: dict[str, deque[_Outgoing]] = {}
        self._server_keys: dict[str, str] = {}  # endpoint -> the key its server presents
        self._lanes: dict[str, deque[object]] = {}  # receiver id -> tasks in arrival order
        self._busy_lanes: set[str] = set()  # receiver ids with a write holding their lane
        self._busy_sessions: dict[int, int] = {}  # session id -> writes holding a lane
        self._writes: list[_Write] = []  # every write in flight, stalled ones included
        self._stopping = False
        self._again = False  # a lane may be startable now: run the next turn without waiting
        self._poll_delay = _POLL_MIN_S
        self._max_writes = host.settings.limits.max_writes_in_flight_per_worker
        self.last_progress = time.monotonic()
        self.name = "kvxferd-listener (inline writes)" if inline else f"kvxferd-worker-{index}"
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def put(self, task: object) -> None:
        """Queue a task (any thread); an inline worker's driver is woken if it is elsewhere."""
        self.queue.put(task)
        if self._wake is not None:
            self._wake()

    def view(self) -> WorkerView:
        """What the probes read (views.py); no lock: sizes of this thread's tables by len()."""
        return WorkerView(
            self.index,
            self.inline,
            self.thread.is_alive(),
            self.queue.qsize(),
            len(self._busy_lanes),
            len(self._dealers),
            self.last_progress,
        )

    def _lane_writes(self) -> int:
        """Writes in progress that hold a lane (the ones the per-worker bound counts)."""
        return len(self._busy_lanes)

    # -- the loop ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._finished():
                try:
                    self._turn(self._wait_s())
                except Exception:
                    self.host.guard.caught(self.name)
                    self._again = True  # whatever was half done gets another turn
        finally:
            self._close_dealers()

    def _close_dealers(self) -> None:
        # A bounded linger lets the last Results still queued reach their receivers.
        linger_ms = self.host.settings.deadlines.worker_send_timeout_ms
        for sock in self._dealers.values():
            sock.close(linger=linger_ms)
        self._dealers.clear()

    # -- an inline worker: driven by the listener ------------------------------------------
    def step(self) -> float:
        """One turn without waiting; seconds until it wants the next (inline worker)."""
        try:
            self._turn(0.0)
        except Exception:
            self.host.guard.caught(self.name)
            self._again = True
        return self._wait_s()

    def finish(self) -> None:
        """After STOP: turns until finished (each write ends or stalls, outboxes flush within
        their deadlines), then close the DEALERs; what the worker thread does at its end."""
        try:
            while not self._finished():
                wait = self.step()
                if wait > 0:
                    time.sleep(min(wait, TICK_S))
        finally:
            self._close_dealers()

    def _finished(self) -> bool:
        """After STOP: nothing queued, no write holding a lane, every outbox empty."""
        return (
            self._stopping
            and not any(self._lanes.values())
            and not any(w.lane_held for w in self._writes)
            and not any(self._outbox.values())
        )

    def _turn(self, wait_s: float) -> None:
        took = self._take(wait_s)
        self.last_progress = time.monotonic()
        progressed = self._poll_writes()
        # A lane can become startable only when a task arrived or a write ended or fell
        # in doubt; otherwise a turn is just a poll (cheap: small requests are CPU-bound).
        if took or progressed or self._again:
            self._again = False
            if self._start_ready():
                progressed = True
                # A small write is often done at once: report it this turn (and if that
                # frees a lane, start its next task next turn without waiting).
                self._again = self._poll_writes()
        if self._outbox:
            self._flush()
        self._poll_delay = _POLL_MIN_S if progressed else min(self._poll_delay * 2, _POLL_MAX_S)

    def _wait_s(self) -> float:
        if self._again:
            return 0.0
        if self._busy_lanes:  # writes in progress
            return self._poll_delay
        if any(self._outbox.values()):
            return 0.005
        return TICK_S  # idle, or only writes in doubt (NIXL is not hurried for those)

    def _take(self, wait_s: float) -> bool:
        """Move every queued task into its lane (waiting up to ``wait_s`` for the first)."""
        try:
            task = self.queue.get(timeout=wait_s) if wait_s > 0 else self.queue.get_nowait()
        except queue.Empty:
            return False
        while True:
            self._intake(task)
            try:
                task = self.queue.get_nowait()
            except queue.Empty:
                return True

    def _intake(self, task: object) -> None:
        if task is STOP:
            self._stopping = True
        elif isinstance(task, ForgetTask):
            self._forget(task.endpoint, drop=task.drop)
            if task.shared:
                self.host.forget_shared(task.endpoint)
        elif isinstance(task, WriteTask | AckTask | ReplyTask):
            self._lanes.setdefault(task.peer.receiver_id, deque()).append(task)

    # -- starting work -----------------------------------------------------------------
    def _start_ready(self) -> bool:
        limit = self._max_writes
        started = False
        for rid in list(self._lanes):
            lane = self._lanes[rid]
            while lane and rid not in self._busy_lanes:
                task = lane[0]
                if isinstance(task, WriteTask):
                    if task.session.session_id in self._busy_sessions:
                        break
                    if self._lane_writes() >= limit and not self._stopping:
                        break
                    lane.popleft()
                    batch = self._coalesce(task, lane)
                    if batch:
                        self._guarded([task, *batch])
                    else:
                        self._guarded(task)
                elif isinstance(task, AckTask):
                    lane.popleft()
                    self._guarded(task)
                else:
                    assert isinstance(task, ReplyTask)
                    lane.popleft()
                    self._enqueue(task.peer, task.msg)
                started = True
            if not lane:
                del self._lanes[rid]
        return started

    def _coalesce(self, first: WriteTask, lane: deque[object]) -> list[WriteTask]:
        """The WriteTasks right behind ``first`` in its lane that one WRITE can serve with it.

        Small requests of one receiver queue up while others are written; posting them as
        one NIXL transfer (one post, one status, one release) carrying one done notification
        for all of them costs what one request cost (issue 22). Only plain slices coalesce:
        prepared whole-pool lists, the same layers, no aux, each its own session.
        """
        if not self._plain(first):
            return []
        out: list[WriteTask] = []
        sessions = {first.session.session_id}
        while lane and len(out) < MAX_COALESCED - 1:
            nxt = lane[0]
            if not (
                isinstance(nxt, WriteTask)
                and self._plain(nxt)
                and nxt.slice.layer_begin == first.slice.layer_begin
                and nxt.slice.layer_end == first.slice.layer_end
                and nxt.session.session_id not in sessions
                and nxt.session.session_id not in self._busy_sessions
            ):
                break
            out.append(lane.popleft())  # type: ignore[arg-type]
            sessions.add(nxt.session.session_id)
        return out

    @staticmethod
    def _plain(task: WriteTask) -> bool:
        peer, s = task.peer, task.session
        return (
            peer.prepped
            and (peer.piece is None or peer.topology is None)
            and not (s.aux_len > 0 and task.slice.aux_slot >= 0)
        )

    def _post_many(self, tasks: list[WriteTask]) -> None:
        """Admit plain slices of one receiver and post them as one KV WRITE (``_coalesce``)."""
        host, peer = self.host, tasks[0].peer
        admitted: list[WriteTask] = []
        for task in tasks:
            s, sl = task.session, task.slice
            if s.admit_write(sl) is not None:
                host.stats.add("writes_refused")
                self._slice_over(task)
            elif not host.peer_write_started(peer):
                s.release_admission(
                    sl, f"receiver {peer.receiver_id} restarted", Reason.PEER_RESTARTED
                )
                host.stats.add("writes_refused_peer_gone")
                self._slice_over(task)
            else:
                admitted.append(task)
        if not admitted:
            return
        lb, le = admitted[0].slice.layer_begin, admitted[0].slice.layer_end
        src = np.concatenate([t.session.block_ids for t in admitted])
        dst = np.concatenate([t.slice.dst_blocks for t in admitted])
        per_block = host.pool.layout.block_bytes * (le - lb)
        parts = [(t, int(t.session.block_ids.size) * per_block) for t in admitted]
        try:
            xfer, state = host.dataplane.post_blocks(
                peer.nixl_name, src, dst, lb, le, self._notification(parts)
            )
        except Exception as e:  # nothing was posted: give every admission back first
            stalled = isinstance(e, PathStalled)
            for task in admitted:
                task.session.release_admission(
                    task.slice,
                    f"kv write not posted: {e}",
                    Reason.PEER_LOST if stalled else Reason.BUILD_FAILED,
                )
                host.peer_write_ended(peer)
            host.stats.add(
                "writes_refused_stalled_path" if stalled else "writes_build_failed", len(admitted)
            )
            if not stalled:
                host.peer_failed(peer, f"kv write not posted: {e}")
            for task in admitted:
                self._slice_over(task)
            return
        host.stats.add("writes_coalesced", len(admitted) - 1)
        now = time.monotonic()
        for task in admitted:
            if not task.slice.posted_at:
                task.slice.posted_at = now
            sid = task.session.session_id
            self._busy_sessions[sid] = self._busy_sessions.get(sid, 0) + 1
        stall_at = now + host.settings.deadlines.xfer_stall_timeout_ms / 1000
        self._writes.append(_Write(parts, "kv", xfer, state, stall_at))
        self._busy_lanes.add(peer.receiver_id)

    def _guarded(self, task: WriteTask | AckTask | list[WriteTask]) -> None:
        try:
            if isinstance(task, list):
                self._post_many(task)
            elif isinstance(task, WriteTask):
                self._begin_slice(task)
            else:
                self._ack_cancel(task)
        except Exception:
            self.host.guard.caught(f"{self.name}: task")
            for t in task if isinstance(task, list) else [task]:
                if isinstance(t, WriteTask):  # the slice still gets its one final result
                    t.session.fail_slice(t.slice, Reason.TRANSFER_ERROR, "internal error")
                    t.session.fail(Reason.TRANSFER_ERROR, "internal error")
                    self._report(t)

    def _begin_slice(self, task: WriteTask) -> None:
        if not self._post(task, "kv"):
            self._slice_over(task)

    def _post(self, task: WriteTask, kind: str) -> bool:
        """Admit and post one WRITE; True when it is in flight (the slice goes on later)."""
        host, s, sl, peer = self.host, task.session, task.slice, task.peer
        if s.admit_write(sl) is not None:
            host.stats.add("writes_refused")
            return False
        # Counted before the post: a peer retired meanwhile waits for this write to end
        # instead of losing its NIXL remote agent under it; a replaced one gets no write.
        if not host.peer_write_started(peer):
            s.release_admission(sl, f"receiver {peer.receiver_id} restarted", Reason.PEER_RESTARTED)
            host.stats.add("writes_refused_peer_gone")
            return False
        nixl = False  # the exception (if any) came from NIXL, not from our descriptors
        try:
            # Prepared lists (the whole pool, or a mapped peer's piece): indices, no descriptors
            # The slice's last write (KV with no aux after it, else the aux one) carries its
            # done notification.
            last = kind == "aux" or not (s.aux_len > 0 and sl.aux_slot >= 0)
            if kind == "kv" and peer.prepped:
                per_block = (
                    host.pool.layout.block_bytes
                    if peer.piece is None or peer.topology is None
                    else int(peer.piece.ranges.length.sum())  # a slice of each block
                )
                nbytes = s.block_ids.size * per_block * (sl.layer_end - sl.layer_begin)
                nixl = True
                xfer, state = host.dataplane.post_blocks(
                    peer.nixl_name,
                    s.block_ids,
                    sl.dst_blocks,
                    sl.layer_begin,
                    sl.layer_end,
                    self._notification([(task, nbytes)]) if last else b"",
                )
            else:
                src, dst, src_mem, dst_mem, nbytes = self._build(task, kind)
                nixl = True
                xfer, state = host.dataplane.post_write(
                    peer.nixl_name,
                    src,
                    dst,
                    src_mem,
                    dst_mem,
                    self._notification([(task, nbytes)]) if last else b"",
                )
        except PathStalled as e:  # nothing posted: its connection is stalled (dataplane.py)
            s.release_admission(sl, f"{kind} write not posted: {e}", Reason.PEER_LOST)
            host.peer_write_ended(peer)
            host.stats.add("writes_refused_stalled_path")
            return False
        except Exception as e:  # nothing was posted: give the admission back first
            s.release_admission(sl, f"{kind} write not built: {e}")
            host.peer_write_ended(peer)
            host.stats.add("writes_build_failed")
            if nixl:  # e.g. NIXL_ERR_REMOTE_DISCONNECT: its next fetch registers afresh
                host.peer_failed(peer, f"{kind} write not posted: {e}")
            return False
        now = time.monotonic()
        if not sl.posted_at:
            sl.posted_at = now
        stall_at = now + host.settings.deadlines.xfer_stall_timeout_ms / 1000
        self._writes.append(_Write([(task, nbytes)], kind, xfer, state, stall_at))
        self._busy_lanes.add(peer.receiver_id)
        self._busy_sessions[s.session_id] = self._busy_sessions.get(s.session_id, 0) + 1
        return True

    def _build(self, task: WriteTask, kind: str) -> tuple[np.ndarray, np.ndarray, str, str, int]:
        host, s, sl, peer = self.host, task.session, task.slice, task.peer
        pool = host.pool
        if kind == "kv" and peer.topology is not None:
            assert peer.piece is not None  # a fetch without a piece is refused at attach
            src, dst = piece_descriptors(
                peer.piece,
                peer.topology,
                pool.kv_base,
                pool.layout.num_blocks,
                s.block_ids,
                peer.kv_base,
                peer.layout.num_blocks,
                sl.dst_blocks,
                sl.layer_begin,
                sl.layer_end,
                src_dev=pool.device_id,
                dst_dev=peer.device_id,
            )
            return src, dst, pool.mem_type, peer.mem_type, int(src[:, 1].sum())
        if kind == "kv":
            src, dst = write_descriptors(
                pool.layout,
                pool.kv_base,
                s.block_ids,
                peer.kv_base,
                sl.dst_blocks,
                sl.layer_begin,
                sl.layer_end,
                src_dev=pool.device_id,
                dst_dev=peer.device_id,
                dst_layer_stride=peer.layout.layer_stride,
            )
            return src, dst, pool.mem_type, peer.mem_type, int(src[:, 1].sum())
        src, dst = aux_descriptors(
            pool.layout,
            pool.aux_base,
            s.aux_slot,
            peer.layout,
            peer.aux_base,
            sl.aux_slot,
            s.aux_len,
        )
        return src, dst, "DRAM", "DRAM", s.aux_len

    # -- writes in flight ----------------------------------------------------------------
    def _poll_writes(self) -> bool:
        """Poll every write in flight once; settle those that ended. True if any changed."""
        writes, self._writes = self._writes, []
        now = time.monotonic()
        changed = False
        for w in writes:  # each write is put back into self._writes unless it ended
            try:
                changed |= self._poll_one(w, now)
            except Exception:
                self.host.guard.caught(f"{self.name}: write")
                changed = True
                if not w.over and w not in self._writes:  # never lose a write NIXL may hold
                    self._writes.append(w)
                elif w.over:
                    self._free_lane(w)
        return changed

    def _poll_one(self, w: _Write, now: float) -> bool:
        """Poll ``w`` once; True when something changed (it ended, stalled, fell in doubt)."""
        if w.state == "PROC":
            try:
                w.state = w.xfer.poll()
            except Exception as e:  # nixl raises its typed errors here: not an answer
                w.error = f": {e}"
                return self._try_release(w, "NIXL status check raised" + w.error)
        if w.state != "PROC":
            return self._try_release(w, "")
        self._writes.append(w)
        if w.lane_held and now >= w.stall_at:
            self._in_doubt(w, Reason.STALLED, f"{w.kind} write in progress past xfer_stall_timeout")
            self.host.stats.add("writes_stalled")
            for task, nbytes in w.parts:
                jlog.warning(  # when it stalls, not only when it is given up
                    "write stalled",
                    extra={
                        "request_id": task.session.request_id,
                        "role": "sender",
                        "peer": task.peer.result_endpoint,
                        "fetch_id": task.slice.fetch_id,
                        "write": w.kind,
                        "bytes": nbytes,
                        "blocks": int(task.slice.dst_blocks.size),
                        "stalled_ms": round((now - task.slice.posted_at) * 1000, 3),
                    },
                )
            return True
        return False

    def _try_release(self, w: _Write, doubt: str) -> bool:
        """Release a write NIXL answered for; in doubt (and kept) while it will not let go."""
        try:
            released = w.xfer.release()
        except Exception:
            released = False
        if released:
            self._ended(w, ok=w.state == "DONE" and not doubt)
            return True
        w.state = "PROC"  # ask again next turn
        self._writes.append(w)
        if w.doubt:
            return False
        w.doubt = doubt or f"NIXL did not release the {w.kind} write handle"
        self.host.stats.add("writes_in_doubt")
        if w.lane_held:
            self._in_doubt(w, Reason.TRANSFER_ERROR, w.doubt)
        return True

    def _in_doubt(self, w: _Write, reason: Reason, detail: str) -> None:
        """The write may still land: report its slices in doubt and free its lane."""
        for task, _ in w.parts:
            task.session.write_in_doubt(task.slice, reason, detail)
        self._free_lane(w)
        for task, _ in w.parts:
            self._report(task)
            if task.session.drained:  # pragma: no cover - in doubt means still in flight
                self.host.session_drained(task.session)

    def _free_lane(self, w: _Write) -> None:
        if not w.lane_held:
            return
        w.lane_held = False
        self._busy_lanes.discard(w.task.peer.receiver_id)
        for task, _ in w.parts:
            sid = task.session.session_id
            n = self._busy_sessions.get(sid, 0) - 1
            if n > 0:
                self._busy_sessions[sid] = n
            else:
                self._busy_sessions.pop(sid, None)

    def _ended(self, w: _Write, ok: bool) -> None:
        """NIXL released the write: it is over, one way or the other, for each of its slices."""
        w.over = True
        host = self.host
        held = w.lane_held
        detail = "" if ok else f"NIXL reported an error ({w.kind}){w.error}"
        now = time.monotonic()
        was_doubt = []
        for task, nbytes in w.parts:
            s, sl = task.session, task.slice
            was_doubt.append(sl.state is SliceState.IN_DOUBT)
            sl.written_at = now
            s.finish_write(sl, ok, nbytes if ok else 0, detail)
            host.stats.add("bytes_written" if ok else "writes_failed", nbytes if ok else 1)
            host.peer_write_ended(task.peer)
        if not ok and w.state == "ERR":  # NIXL's answer: the transport toward it failed
            host.peer_failed(w.task.peer, detail)
        if not held:  # it had been reported in doubt: tell the receiver it is over
            for (task, _), doubted in zip(w.parts, was_doubt, strict=True):
                s, sl = task.session, task.slice
                if doubted and sl.writes_in_flight == 0:
                    host.stats.add("in_doubt_resolved")
                    self._enqueue(
                        task.peer,
                        wire.CancelAck(
                            request_id=s.request_id, fetch_id=sl.fetch_id, in_doubt=False
                        ),
                    )
                if s.drained:
                    host.session_drained(s)
            return
        self._free_lane(w)
        for task, _ in w.parts:
            s, sl = task.session, task.slice
            if ok and w.kind == "kv" and s.aux_len > 0 and sl.aux_slot >= 0:
                if not self._post(task, "aux"):
                    self._slice_over(task)
                continue
            if ok:
                s.slice_written(sl)
            self._slice_over(task)

    def _slice_over(self, task: WriteTask) -> None:
        self._report(task)
        if task.session.drained:
            self.host.session_drained(task.session)

    # -- results -----------------------------------------------------------------------
    def _dealer(self, endpoint: str) -> zmq.Socket[bytes]:
        sock = self._dealers.get(endpoint)
        if sock is None:
            # SNDTIMEO 0: a send never waits; a message the socket cannot take stays queued.
            key = self._server_keys.get(endpoint, "")
            sock = connect_dealer(endpoint, self.host.socket_limits, 0, server_key=key)
            self._dealers[endpoint] = sock
        return sock

    def _forget(self, endpoint: str, drop: bool = False) -> None:
        self._outbox.pop(endpoint, None)
        self._server_keys.pop(endpoint, None)
        sock = self._dealers.pop(endpoint, None)
        if sock is not None:  # a Result still queued gets the usual bounded linger
            sock.close(linger=0 if drop else self.host.settings.deadlines.worker_send_timeout_ms)

    def _enqueue(self, peer: Peer, msg: wire.Result | wire.CancelAck) -> None:
        if self.host.peer_gone(peer):
            # Its endpoint now belongs to a newer incarnation, which never sent this fetch.
            self.host.stats.add("messages_dropped_peer_gone")
            return
        endpoint = peer.result_endpoint
        self._server_keys[endpoint] = peer.identity  # its result ROUTER presents that key
        deadline = time.monotonic() + self.host.settings.deadlines.worker_send_timeout_ms / 1000
        tag = msg.__struct_config__.tag
        out = _Outgoing(wire.encode(msg), deadline, str(tag), msg.fetch_id)
        self._outbox.setdefault(endpoint, deque()).append(out)
        self._flush_one(endpoint)

    def _flush(self) -> None:
        for endpoint in [e for e, box in self._outbox.items() if box]:
            self._flush_one(endpoint)

    def _flush_one(self, endpoint: str) -> None:
        """Send what ``endpoint``'s DEALER takes now, in order; drop what passed its deadline."""
        box = self._outbox.get(endpoint)
        stats = self.host.stats
        now = time.monotonic()
        while box:
            out = box[0]
            if now >= out.deadline:
                box.popleft()
                stats.add("send_timeouts")
                log.warning(
                    "%s for fetch %d not delivered to the receiver's result endpoint %s before"
                    " its deadline: the receiver is not reading, or its result ROUTER never"
                    " completed the handshake (with CURVE it must serve the key it registered"
                    " with, docs/protocol.md section 1)",
                    out.tag,
                    out.fetch_id,
                    endpoint,
                )
                continue
            try:
                sock = self._dealer(endpoint)
                if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:
                    return  # full: try again next turn
                send_bounded(sock, out.frame)
            except SendTimeout:
                return
            except zmq.ZMQError as e:
                box.popleft()
                stats.add("send_errors")
                log.warning("%s for fetch %d dropped: %s", out.tag, out.fetch_id, e)
                # The next message gets a fresh DEALER (a new connection), not this one.
                broken = self._dealers.pop(endpoint, None)
                if broken is not None:
                    broken.close(linger=0)
                continue
            box.popleft()
            stats.add(f"sent_{out.tag}")
        if box is not None and not box:
            del self._outbox[endpoint]

    def _report(self, task: WriteTask) -> None:
        rep = task.session.take_report(task.slice)
        if rep is None:
            return
        stats = self.host.stats
        now = time.monotonic()
        stats.add(f"slices_{rep.status}")
        stats.observe("slice_seconds", now - task.queued_at)
        stats.add("inline_slices" if self.inline else f"worker_{self.index}_slices")
        sl = task.slice
        self.host.journal.record(
            Ending(
                role="sender",
                kind="slice",
                request_id=task.session.request_id,
                outcome=rep.status,
                reason=rep.reason.value if rep.reason else None,
                detail=rep.detail,
                peer=rep.result_endpoint,
                fetch_id=rep.fetch_id,
                duration_s=now - task.queued_at,
                nbytes=rep.nbytes,
                blocks=int(sl.dst_blocks.size),
                post_s=sl.posted_at - task.queued_at if sl.posted_at else None,
                transfer_s=sl.written_at - sl.posted_at if sl.written_at and sl.posted_at else None,
            )
        )
        if rep.status == "done" and sl.notify:
            # Its last WRITE carried the done notification (``_notification``): no Result.
            stats.add("slices_done_notified")
            return
        self._enqueue(
            task.peer,
            wire.Result(
                request_id=task.session.request_id,
                fetch_id=rep.fetch_id,
                status=rep.status,  # type: ignore[arg-type]
                reason=rep.reason,
                detail=rep.detail[:1024],
                nbytes=rep.nbytes,
                aux_bytes=task.session.aux_len
                if rep.status == "done" and task.slice.aux_slot >= 0
                else 0,
            ),
        )

    @staticmethod
    def _notification(parts: list[tuple[WriteTask, int]]) -> bytes:
        """The done notification a slice's last WRITE carries (protocol.py), b"" when none.

        NIXL sends it once the WRITE is complete (and reports the WRITE DONE only then),
        so its arrival means the bytes are in place; the receiver's nonce authenticates
        it. One notification covers every slice of a coalesced WRITE.
        """
        records = []
        for task, nbytes in parts:
            sl, s = task.slice, task.session
            if sl.notify:
                aux = s.aux_len if sl.aux_slot >= 0 else 0
                records.append((sl.fetch_id, sl.notify, sl.nbytes + nbytes, aux))
        return wire.encode_notification(records) if records else b""

    def _ack_cancel(self, task: AckTask) -> None:
        sl = task.session.slice((task.peer.receiver_id, task.fetch_id))
        in_doubt = sl is not None and sl.writes_in_flight > 0
        self._enqueue(
            task.peer,
            wire.CancelAck(
                request_id=task.session.request_id, fetch_id=task.fetch_id, in_doubt=in_doubt
            ),
        )
