"""A sender worker's writes in flight: posting them to NIXL, polling them, their stall deadline, doubt.

Owned by one worker's thread (``kvxferd-worker-i``, or the listener for the inline
worker); no lock. Probes read only ``lanes_held()`` (a len).

A :class:`~kvxferd.transfer.worker_tasks.WriteTask` is admitted through its session
and counted toward its peer, or refused (``admit``), then posted (``post`` admits and
posts one slice; ``post_coalesced`` posts slices admitted for one WRITE); a write that
could not be posted gives its admission back before the worker queues its Result.
A streamed slice's KV is posted one ready layer range per WRITE (``post(..., layers)``,
moving the slice's ``next_layer``); only the WRITE of its last layer (or its AUX write)
carries the done notification. Every turn the worker polls each write once (``take``,
then ``poll`` each); ``poll`` keeps the write unless NIXL released it and returns
what changed (a :class:`Change`), which the worker settles. KV first, then AUX,
one after the other (the worker posts the AUX write when the KV one ends). One
write's states::

    POSTED (holds its lane)
       |--released after DONE/ERR (DONE | FAILED)--> ENDED: the worker posts its AUX
       |                                              write, or queues its Result
       |--past xfer_stall_timeout_ms (STALLED)-----+
       |--NIXL answered or raised, release         +--> IN DOUBT: the worker reports its
       |  refused (DOUBTED)------------------------+    slices in_doubt, then ``free_lane``
    IN DOUBT --released after DONE/ERR (DONE | FAILED)--> ENDED: the worker sends the
                                                          receiver CancelAck(in_doubt=false)

A stalled write whose release is refused later is DOUBTED too (counted; its
slices were reported already). If settling a write raises, ``keep_after_error``
keeps it while NIXL may hold it. The table counts the post's refusals and
failures and ``writes_in_doubt``; the worker counts what it reports
(``writes_stalled``, the slices' outcomes).

* **Lanes held.** A posted write holds its receiver's lane and counts toward its
  sessions' busy count until it ends or falls in doubt; at most
  ``limits.max_writes_in_flight_per_worker`` writes hold a lane at once (writes in
  doubt aside: they stay in the table, polled every turn, every ``TICK_S`` once
  only they are left).
* **Not finished until released.** A write counts as finished only when NIXL gave
  a terminal state (DONE/ERR) *and* released its handle. A status check that
  raises, or a ``release()`` that says False, leaves the write in the table and
  its slices in doubt (``writes_in_doubt``, counted once); it is released again
  every turn (its session stays undrained, its source blocks fenced). A write is
  never dropped from the table while NIXL may hold it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum

import numpy as np

from kvxferd.errors import Reason
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.dataplane import PathStalled, Xfer
from kvxferd.transfer.layout import aux_descriptors, write_descriptors
from kvxferd.transfer.reshard import piece_descriptors
from kvxferd.transfer.worker_tasks import Peer, WorkerHost, WriteTask


class Change(Enum):
    """What one poll of a write found (``None``: nothing changed)."""

    STALLED = "stalled"  # it holds its lane past its stall deadline: its slices are in doubt
    DOUBTED = "doubted"  # NIXL answered (or raised) but kept the handle: in doubt from now
    DONE = "done"  # NIXL released it after DONE
    FAILED = "failed"  # NIXL released it after ERR, or after a status check that raised


@dataclass(slots=True)
class Write:
    """One posted WRITE and where it stands; it serves one slice, or several coalesced."""

    parts: list[tuple[WriteTask, int]]  # (the slice's task, its bytes in this WRITE)
    kind: str  # "kv" | "aux"
    xfer: Xfer
    state: str  # last polled: "PROC" | "DONE" | "ERR"
    stall_at: float  # monotonic; past it the slices are in doubt
    lane_held: bool = True  # still holds its lane (not stalled, not in doubt)
    doubt: str = ""  # why it is in doubt (a raise, a refused release), "" when not
    error: str = ""
    over: bool = False  # NIXL released it: settled (or being settled) by its worker

    @property
    def task(self) -> WriteTask:
        return self.parts[0][0]


class WritesInFlight:
    """Every write this worker posted and NIXL has not released, stalled ones included."""

    def __init__(self, host: WorkerHost) -> None:
        self.host = host
        self._writes: list[Write] = []  # every write in flight, stalled ones included
        self._busy_lanes: set[str] = set()  # receiver ids with a write holding their lane
        self._busy_sessions: dict[int, int] = {}  # session id -> writes holding a lane

    def lane_busy(self, receiver_id: str) -> bool:
        """True while a write toward ``receiver_id`` holds its lane."""
        return receiver_id in self._busy_lanes

    def session_busy(self, session_id: int) -> bool:
        """True while a write of session ``session_id`` holds a lane."""
        return session_id in self._busy_sessions

    def lanes_held(self) -> int:
        """Writes in progress that hold a lane (the ones the per-worker bound counts)."""
        return len(self._busy_lanes)

    def any_lane_held(self) -> bool:
        """True while some write holds its lane (one in doubt does not)."""
        return any(w.lane_held for w in self._writes)

    # -- posting -------------------------------------------------------------------------
    def admit(self, task: WriteTask, peer: Peer) -> bool:
        """Admit ``task``'s write through its session and count it toward ``peer``; False
        when refused (its session or slice ended, or a newer incarnation replaced ``peer``)."""
        host, s, sl = self.host, task.session, task.slice
        if s.admit_write(sl) is not None:
            host.stats.add("writes_refused")
            return False
        # Counted before the post: a peer retired meanwhile waits for this write to end
        # instead of losing its NIXL remote agent under it; a replaced one gets no write.
        if not host.peer_write_started(peer):
            s.release_admission(sl, f"receiver {peer.receiver_id} restarted", Reason.PEER_RESTARTED)
            host.stats.add("writes_refused_peer_gone")
            return False
        return True

    def post(self, task: WriteTask, kind: str, layers: tuple[int, int] | None = None) -> bool:
        """Admit and post one WRITE; True when it is in flight (the slice goes on later).

        ``layers``: a KV write of only these layers of the slice (a streamed publish's ready
        range; the slice's ``next_layer`` moves to its end once posted), else all of them.
        """
        host, s, sl, peer = self.host, task.session, task.slice, task.peer
        lb, le = (sl.layer_begin, sl.layer_end) if layers is None else layers
        if not self.admit(task, peer):
            return False
        nixl = False  # the exception (if any) came from NIXL, not from our descriptors
        try:
            # Prepared lists (the whole pool, or a mapped peer's piece): indices, no descriptors
            # The slice's last write (KV of its last layer with no aux after it, else the aux
            # one) carries its done notification.
            last = kind == "aux" or (
                le >= sl.layer_end and not (s.aux_len > 0 and sl.aux_slot >= 0)
            )
            if kind == "kv" and peer.prepped:
                per_block = (
                    host.pool.layout.block_bytes
                    if peer.piece is None or peer.topology is None
                    else int(peer.piece.ranges.length.sum())  # a slice of each block
                )
                nbytes = s.block_ids.size * per_block * (le - lb)
                nixl = True
                xfer, state = host.dataplane.post_blocks(
                    peer.nixl_name,
                    s.block_ids,
                    sl.dst_blocks,
                    lb,
                    le,
                    self._notification([(task, nbytes)]) if last else b"",
                )
            else:
                src, dst, src_mem, dst_mem, nbytes = self._build(task, kind, lb, le)
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
        if kind == "kv":
            sl.next_layer = le
        stall_at = now + host.settings.deadlines.xfer_stall_timeout_ms / 1000
        self._writes.append(Write([(task, nbytes)], kind, xfer, state, stall_at))
        self._busy_lanes.add(peer.receiver_id)
        self._busy_sessions[s.session_id] = self._busy_sessions.get(s.session_id, 0) + 1
        return True

    def post_coalesced(self, admitted: list[WriteTask], peer: Peer) -> bool:
        """Post admitted plain slices of ``peer`` as one KV WRITE (worker_lanes.py's
        ``_coalesce``); True when it is in flight, False when not (admissions given back)."""
        host = self.host
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
            return False
        host.stats.add("writes_coalesced", len(admitted) - 1)
        now = time.monotonic()
        for task in admitted:
            if not task.slice.posted_at:
                task.slice.posted_at = now
            task.slice.next_layer = le
            sid = task.session.session_id
            self._busy_sessions[sid] = self._busy_sessions.get(sid, 0) + 1
        stall_at = now + host.settings.deadlines.xfer_stall_timeout_ms / 1000
        self._writes.append(Write(parts, "kv", xfer, state, stall_at))
        self._busy_lanes.add(peer.receiver_id)
        return True

    def _build(
        self, task: WriteTask, kind: str, lb: int, le: int
    ) -> tuple[np.ndarray, np.ndarray, str, str, int]:
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
                lb,
                le,
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
                lb,
                le,
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

    @staticmethod
    def _notification(parts: list[tuple[WriteTask, int]]) -> bytes:
        """The done notification a slice's last WRITE carries (protocol.py), b"" when none.

        NIXL sends it once the WRITE is complete (and reports the WRITE DONE only then),
        so its arrival means the bytes are in place; the receiver's nonce authenticates
        it. One notification covers every slice of a coalesced WRITE.
        """
        records = []
        version = parts[0][0].peer.version if parts else wire.PROTOCOL_VERSION  # one peer
        for task, nbytes in parts:
            sl, s = task.slice, task.session
            if sl.notify:
                aux = s.aux_len if sl.aux_slot >= 0 else 0
                records.append((sl.fetch_id, sl.notify, sl.nbytes + nbytes, aux))
        return wire.encode_notification(records, version) if records else b""

    # -- polling -------------------------------------------------------------------------
    def take(self) -> list[Write]:
        """Every write in flight, to ``poll`` each once: each is kept again unless it ended."""
        writes, self._writes = self._writes, []
        return writes

    def poll(self, w: Write, now: float) -> Change | None:
        """Poll ``w`` once and keep it unless NIXL released it; what changed, None if nothing."""
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
            return Change.STALLED
        return None

    def _try_release(self, w: Write, doubt: str) -> Change | None:
        """Release a write NIXL answered for; in doubt (and kept) while it will not let go."""
        try:
            released = w.xfer.release()
        except Exception:
            released = False
        if released:
            w.over = True
            return Change.DONE if w.state == "DONE" and not doubt else Change.FAILED
        w.state = "PROC"  # ask again next turn
        self._writes.append(w)
        if w.doubt:
            return None
        w.doubt = doubt or f"NIXL did not release the {w.kind} write handle"
        self.host.stats.add("writes_in_doubt")
        return Change.DOUBTED

    def keep_after_error(self, w: Write) -> None:
        """Settling ``w`` raised: keep it if NIXL may hold it, else free its lane."""
        if not w.over and w not in self._writes:  # never lose a write NIXL may hold
            self._writes.append(w)
        elif w.over:
            self.free_lane(w)

    def free_lane(self, w: Write) -> None:
        """``w`` no longer holds its lane (its slices were reported in doubt, or it ended)."""
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
