"""Streamed publishes on a sender: their readers, the progress marks, the stall bound.

A streamed publish (``Sender.publish(..., streamed=True)``) is offered before its KV is
computed; its engine marks layers ready as prefill computes them (``Sender.progress``).
This table keeps, per stream still open, the fetches attached to it, so that each mark
and the stream's ending can queue a write on each fetch's lane::

    (none)  --publish(streamed=True)----------------------> open: in the table, no reader
    open    --a fetch attaches (parked before, or later)--> open, one more reader; its
                                                            first WriteTask writes what is
                                                            ready (maybe nothing)
    open    --mark (layers_ready < num_layers)------------> open: a WriteTask per reader
    open    --mark (layers_ready == num_layers)-----------> out: a WriteTask per reader;
                                                            from now on a normal publish
    open    --the session ends (cancel, failure, drain,---> out: a WriteTask per reader,
              no mark for stream_stall_timeout_ms)          refused at admission: each
                                                            fetch's failed Result at once,
                                                            after its writes in flight ended

A WriteTask queued by a mark writes, when its lane starts it, the range of its slice
that is ready and not yet written (worker.py ``_ready_range``), or nothing: a stream
waiting for its next layer never holds a lane. Marks and endings read the readers after
the session's state changed, and a fetch attaches (``TxSession.add_slice``) before it is
added here: a mark or an ending is never lost between the two (at worst one task more,
which writes nothing).

``_lock`` guards the table; it is a leaf (nothing else is taken while it is held), so
it may be taken from any thread: the engine's (publish, mark), the listener (attach,
housekeeping) and a worker (a session's ending committed there).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvxferd.errors import Reason, RejectedError
from kvxferd.stats import Stats
from kvxferd.transfer.session import TxSession, TxState
from kvxferd.transfer.worker import WriteTask


@dataclass(slots=True)
class _Stream:
    session: TxSession
    readers: list[WriteTask] = field(default_factory=list)


class Streams:
    """Open streamed publishes by session id and the fetches attached to each."""

    def __init__(self, stats: Stats, queue: Callable[[WriteTask], None], stall_s: float) -> None:
        self.stats = stats
        self._queue = queue  # puts a task on its (request, receiver) lane
        self._stall_s = stall_s
        self._lock = threading.Lock()
        self._open: dict[int, _Stream] = {}

    def __len__(self) -> int:
        return len(self._open)

    def opened(self, session: TxSession) -> None:
        """A streamed publish is being published (before its parked fetches attach)."""
        with self._lock:
            self._open[session.session_id] = _Stream(session)

    def discard(self, session: TxSession) -> None:
        """The publish was refused: forget it."""
        with self._lock:
            self._open.pop(session.session_id, None)

    def attached(self, task: WriteTask) -> None:
        """A fetch attached to a stream (its own first task is queued by the caller)."""
        with self._lock:
            stream = self._open.get(task.session.session_id)
            if stream is not None:
                stream.readers.append(WriteTask(task.session, task.slice, task.peer))

    def mark(self, session: TxSession | None, layers_ready: int) -> None:
        """Mark layers ``[0, layers_ready)`` of ``session`` ready (None: no open publish).

        A bad mark is counted (``stream_marks_refused_{why}``), ends the publish failed
        (``bad_progress``) when there is one, and raises RejectedError(bad_progress).
        """
        why = "unknown" if session is None else session.mark_ready(layers_ready)
        if why is None:
            assert session is not None
            return self._marked(session)
        self.stats.add(f"stream_marks_refused_{why}")
        detail = f"progress mark {layers_ready} refused: {why.replace('_', ' ')}"
        if session is not None:
            detail += f" (layers ready {session.layers_ready} of {session.num_layers})"
            session.fail(Reason.BAD_PROGRESS, detail)
        raise RejectedError(Reason.BAD_PROGRESS, detail)

    def _marked(self, session: TxSession) -> None:
        """A mark was accepted: each reader writes what is ready now."""
        with self._lock:
            stream = self._open.get(session.session_id)
            readers = [] if stream is None else list(stream.readers)
            if stream is not None and not session.streaming:
                del self._open[session.session_id]  # every layer ready, or it ended
        self.stats.add("stream_marks")
        self._kick(readers)

    def ended(self, session: TxSession) -> None:
        """``session`` ended (any way): a stream still open is aborted, each reader told."""
        with self._lock:
            stream = self._open.pop(session.session_id, None)
        if stream is None:
            return
        if session.layers_ready < session.num_layers and session.state is not TxState.COMPLETE:
            self.stats.add("streams_aborted")
        self._kick(stream.readers)

    def stalled(self, now: float) -> list[TxSession]:
        """End the streams with no mark for ``stream_stall_timeout_ms`` (listener thread)."""
        with self._lock:
            late = [
                st.session
                for st in self._open.values()
                if now - st.session.progressed_at >= self._stall_s
            ]
        for session in late:
            detail = (
                f"no progress mark for {self._stall_s * 1000:.0f} ms"
                f" ({session.layers_ready} of {session.num_layers} layers ready)"
            )
            if session.fail(Reason.STREAM_STALLED, detail):
                self.stats.add("streams_stalled")
        return late

    def _kick(self, readers: list[WriteTask]) -> None:
        for r in readers:
            if not r.slice.reported:
                self._queue(WriteTask(r.session, r.slice, r.peer))
