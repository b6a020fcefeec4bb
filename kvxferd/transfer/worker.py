"""A sender worker thread: it takes tasks from its queue, starts what its lanes allow, settles its writes.

Each ``kvxferd-worker-i`` owns its queue and three tables no other thread
writes (so none has a lock), each with its state machine in its module:

    worker_lanes.py   one FIFO lane per receiver; which task starts next
    worker_writes.py  the writes it posted: polling, stall deadline, in doubt, release
    worker_outbox.py  one DEALER and FIFO box per result endpoint, each message with
                      its deadline (a receiver that stops reading delays only itself)

The tasks it takes and what it needs from the sender (the narrow
:class:`WorkerHost`, so nothing here imports the sender package) are in worker_tasks.py;
the listener and API callers (kvxferd/transfer/sender/) only enqueue. One turn::

    take     move every queued task into its lane (waiting up to the next poll)
    poll     every write in flight once; settle what changed: a write that ended
             goes on (its AUX write, then its Result), one stalled or in doubt has
             its slices reported in_doubt, one in doubt that ends sends its
             receiver an unsolicited CancelAck(in_doubt=false): it may release
             its blocks
    start    what the lanes allow (only when a task arrived or a write changed)
    flush    the outbox

A streamed publish's slice (session.py, sender/streams.py) is written range by range:
each WriteTask writes the layers ready and not yet written (``_ready_range``; none: it
is dropped without holding the lane, the next mark queues another); a range's write is
admitted and counted in flight like any write, and its end frees the lane without a
Result unless it was the slice's last layer (then its AUX write, then its one Result or
the notification its last WRITE carried). A stream that ended has its next task refused
at admission: its failed Result goes out once its writes in flight ended (its lane was
busy until then).

Each turn's body is guarded: an unexpected exception is logged and counted
(``Guard.caught``) and the worker goes on with the next turn; a task that raised
still gets its slice's one final Result. On STOP the worker refuses what is
queued (sessions are ended by then), waits for its writes until each ends or
stalls, flushes its outboxes within their deadlines, and closes its DEALERs
with a bounded linger. Writes still in doubt then keep their memory registered
(the sender's shutdown says so).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from kvxferd.errors import Reason
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.journal import Ending
from kvxferd.transfer.session import SliceState
from kvxferd.transfer.views import WorkerView
from kvxferd.transfer.worker_lanes import Lanes
from kvxferd.transfer.worker_outbox import Outbox
from kvxferd.transfer.worker_tasks import (
    STOP,
    AckTask,
    ForgetTask,
    Peer,
    ReplyTask,
    WorkerHost,
    WriteTask,
)
from kvxferd.transfer.worker_writes import Change, Write, WritesInFlight

__all__ = [  # the tasks are re-exported: the sender package and views.py import them here
    "STOP",
    "TICK_S",
    "AckTask",
    "ForgetTask",
    "Peer",
    "ReplyTask",
    "Worker",
    "WorkerHost",
    "WriteTask",
]

log = logging.getLogger("kvxferd.sender")
jlog = logging.getLogger("kvxferd.journal")  # per-request lines: fields in extra (logs.py)

TICK_S = 0.05  # listener/worker housekeeping period
_POLL_MIN_S, _POLL_MAX_S = 20e-6, 1e-3  # back-off between polls of writes in flight


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
        self.lanes = Lanes()
        self.writes = WritesInFlight(host)
        self.outbox = Outbox(host)
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
            self.writes.lanes_held(),
            self.outbox.dealers(),
            self.last_progress,
        )

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
            self.outbox.close()

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
            self.outbox.close()

    def _finished(self) -> bool:
        """After STOP: nothing queued, no write holding a lane, every outbox empty."""
        return (
            self._stopping
            and not self.lanes.queued()
            and not self.writes.any_lane_held()
            and not self.outbox.pending()
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
        self.outbox.flush()
        self._poll_delay = _POLL_MIN_S if progressed else min(self._poll_delay * 2, _POLL_MAX_S)

    def _wait_s(self) -> float:
        if self._again:
            return 0.0
        if self.writes.lanes_held():  # writes in progress
            return self._poll_delay
        if self.outbox.pending():
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
            self.outbox.forget(task.endpoint, drop=task.drop)
            if task.shared:
                self.host.forget_shared(task.endpoint)
        elif isinstance(task, WriteTask | AckTask | ReplyTask):
            self.lanes.add(task)

    # -- starting work -----------------------------------------------------------------
    def _start_ready(self) -> bool:
        """Start each task its lane allows now (worker_lanes.py); True if any started."""
        started = False
        for task in self.lanes.ready(self.writes, self._max_writes, self._stopping):
            if isinstance(task, ReplyTask):
                self.outbox.enqueue(task.peer, task.msg)
            else:
                self._guarded(task)
            started = True
        return started

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

    def _post_many(self, tasks: list[WriteTask]) -> None:
        """Admit plain slices of one receiver and post them as one KV WRITE (worker_lanes.py's
        ``_coalesce``); a refused one, or all when the post fails, get their Result."""
        peer = tasks[0].peer
        admitted: list[WriteTask] = []
        for task in tasks:
            if self.writes.admit(task, peer):
                admitted.append(task)
            else:
                self._slice_over(task)
        if admitted and not self.writes.post_coalesced(admitted, peer):
            for task in admitted:  # nothing was posted: every admission was given back first
                self._slice_over(task)

    def _begin_slice(self, task: WriteTask) -> None:
        layers = None
        if task.session.streamed:
            layers = self._ready_range(task)
            if layers is None:
                return  # nothing new is ready: the next mark (or the ending) queues it again
            self.host.stats.add("stream_writes")
        if not self.writes.post(task, "kv", layers):
            self._slice_over(task)

    def _ready_range(self, task: WriteTask) -> tuple[int, int] | None:
        """The layers of a streamed slice that are ready and not written yet, in its own layer
        ids (absolute for a mapped peer: this stage's pool layer 0 is its ``layer_begin``).

        None when there are none; a stream that ended is then refused here (its one final
        result goes out now, after every write of it ended: its lane was free).
        """
        s, sl = task.session, task.slice
        topology = self.host.topology
        base = topology.layer_begin if task.peer.topology is not None and topology else 0
        lb, le = sl.next_layer, min(sl.layer_end, base + s.layers_ready)
        if le > lb:
            return lb, le
        if s.ended and s.admit_write(sl) is not None:
            self.host.stats.add("writes_refused")
            self._slice_over(task)
        return None

    # -- writes in flight ----------------------------------------------------------------
    def _poll_writes(self) -> bool:
        """Poll every write in flight once; settle those that changed. True if any changed."""
        now = time.monotonic()
        changed = False
        for w in self.writes.take():  # each write is kept in the table unless it ended
            try:
                change = self.writes.poll(w, now)
                if change is not None:
                    changed = True
                    self._settle(w, change, now)
            except Exception:
                self.host.guard.caught(f"{self.name}: write")
                changed = True
                self.writes.keep_after_error(w)
        return changed

    def _settle(self, w: Write, change: Change, now: float) -> None:
        """What a change of ``w`` means for its slices (worker_writes.py's state machine)."""
        if change is Change.DONE or change is Change.FAILED:
            self._ended(w, ok=change is Change.DONE)
        elif change is Change.DOUBTED:
            if w.lane_held:
                self._in_doubt(w, Reason.TRANSFER_ERROR, w.doubt)
        else:  # Change.STALLED
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

    def _in_doubt(self, w: Write, reason: Reason, detail: str) -> None:
        """The write may still land: report its slices in doubt and free its lane."""
        for task, _ in w.parts:
            task.session.write_in_doubt(task.slice, reason, detail)
        self.writes.free_lane(w)
        for task, _ in w.parts:
            self._report(task)
            if task.session.drained:  # pragma: no cover - in doubt means still in flight
                self.host.session_drained(task.session)

    def _ended(self, w: Write, ok: bool) -> None:
        """NIXL released the write: it is over, one way or the other, for each of its slices."""
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
                    self.outbox.enqueue(
                        task.peer,
                        wire.CancelAck(
                            request_id=s.request_id, fetch_id=sl.fetch_id, in_doubt=False
                        ),
                    )
                if s.drained:
                    host.session_drained(s)
            return
        self.writes.free_lane(w)
        for task, _ in w.parts:
            s, sl = task.session, task.slice
            if ok and w.kind == "kv" and s.streamed and sl.next_layer < sl.layer_end:
                # One range of a stream: the next is queued by the next mark, or by the
                # stream's ending (refused then); no result before the last layer landed.
                if s.drained:
                    host.session_drained(s)
                continue
            if ok and w.kind == "kv" and s.aux_len > 0 and sl.aux_slot >= 0:
                if not self.writes.post(task, "aux"):
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
            # Its last WRITE carried the done notification (worker_writes.py): no Result.
            stats.add("slices_done_notified")
            return
        self.outbox.enqueue(
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

    def _ack_cancel(self, task: AckTask) -> None:
        sl = task.session.slice((task.peer.receiver_id, task.fetch_id))
        in_doubt = sl is not None and sl.writes_in_flight > 0
        self.outbox.enqueue(
            task.peer,
            wire.CancelAck(
                request_id=task.session.request_id, fetch_id=task.fetch_id, in_doubt=in_doubt
            ),
        )
