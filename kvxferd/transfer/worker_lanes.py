"""A sender worker's lanes: its tasks, one FIFO lane per receiver, and which one starts next.

Owned by one worker's thread (``kvxferd-worker-i``, or the listener for the inline
worker); no lock. A worker never waits on one peer: a lane starts its next task
only when it has no write holding it on this worker, so one receiver's results
keep their order (a CancelAck goes out after the same fetch's Result) while the
other lanes go on. The head of a lane, in order::

    AckTask, ReplyTask  start at once (a CancelAck or a Result for the outbox)
    WriteTask           waits while its lane holds a write (the in-flight table's
                        ``lane_busy``), while another write of the same request
                        holds a lane (a failure of the first refuses it instead of
                        writing bytes for a failed request), and while
                        ``max_writes_in_flight_per_worker`` writes hold a lane
                        (not once the worker is stopping: what is queued is refused)

A WriteTask that starts takes with it the plain WriteTasks right behind it that
one WRITE can serve (:meth:`Lanes._coalesce`). A lane left empty is removed.

A streamed publish never parks a task in a lane: each progress mark queues one
WriteTask per open fetch, which writes the range ready when it starts (or nothing,
if an earlier task took it) and frees the lane when that write ends; a stream
waiting for its next layer holds no lane, so other requests to that receiver go on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from kvxferd.transfer.worker_tasks import AckTask, ReplyTask, WriteTask
from kvxferd.transfer.worker_writes import WritesInFlight

MAX_COALESCED = 32  # slices one coalesced WRITE serves at most (see Lanes._coalesce)


class Lanes:
    """Queued tasks by receiver id, each lane in arrival order."""

    def __init__(self) -> None:
        self._lanes: dict[str, deque[object]] = {}  # receiver id -> tasks in arrival order

    def add(self, task: WriteTask | AckTask | ReplyTask) -> None:
        """Queue ``task`` at the end of its receiver's lane."""
        self._lanes.setdefault(task.peer.receiver_id, deque()).append(task)

    def queued(self) -> bool:
        """True while some lane holds a task."""
        return any(self._lanes.values())

    def ready(
        self, writes: WritesInFlight, limit: int, stopping: bool
    ) -> Iterator[WriteTask | list[WriteTask] | AckTask | ReplyTask]:
        """Take each task a lane may start now: a WriteTask (or a coalesced list of them),
        an AckTask or a ReplyTask. The caller starts each before the next is chosen (a
        write it posts makes its lane busy)."""
        for rid in list(self._lanes):
            lane = self._lanes[rid]
            while lane and not writes.lane_busy(rid):
                task = lane[0]
                if isinstance(task, WriteTask):
                    if writes.session_busy(task.session.session_id):
                        break
                    if writes.lanes_held() >= limit and not stopping:
                        break
                    lane.popleft()
                    batch = self._coalesce(task, lane, writes)
                    yield [task, *batch] if batch else task
                else:
                    assert isinstance(task, AckTask | ReplyTask)
                    lane.popleft()
                    yield task
            if not lane:
                del self._lanes[rid]

    def _coalesce(
        self, first: WriteTask, lane: deque[object], writes: WritesInFlight
    ) -> list[WriteTask]:
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
                and not writes.session_busy(nxt.session.session_id)
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
            and not s.streamed  # written range by range (worker.py's _begin_slice)
        )
