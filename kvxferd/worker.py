"""A sender worker thread, the tasks it takes, and the peers it writes to.

Each ``kvxferd-worker-i`` owns its queue and one DEALER per receiver result
endpoint. For each :class:`WriteTask` it admits the write through the session
(or is refused), posts the NIXL WRITE, waits for it with a stall deadline and
sends exactly one Result per slice; an :class:`AckTask` sends a CancelAck after
the results of the same (request, receiver), which the sender routes to the
same worker; a :class:`ForgetTask` closes the DEALER to an evicted peer. The
listener and API callers (kvxferd/sender.py) only enqueue. A write still in
progress past ``xfer_stall_timeout_ms`` is kept and polled each tick: its
memory stays registered until NIXL lets go of it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import zmq

from kvxferd import protocol as wire
from kvxferd.control import connect_dealer, send_bounded
from kvxferd.dataplane import Xfer, wait_xfer
from kvxferd.errors import Reason, SendTimeout
from kvxferd.layout import Layout, aux_descriptors, write_descriptors
from kvxferd.session import Slice, TxSession

if TYPE_CHECKING:
    from kvxferd.sender import Sender

log = logging.getLogger("kvxferd.sender")

TICK_S = 0.05  # listener/worker housekeeping period
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
    prepped: bool = False  # the data plane holds a prepared list of its KV pool (post_blocks)


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


@dataclass(slots=True)
class ForgetTask:
    """A peer was evicted: close this worker's DEALER to its result endpoint (and, for one
    worker, the shared pool's: that close may wait for a bounded send, which a worker may)."""

    endpoint: str
    shared: bool = False


@dataclass(slots=True)
class Stalled:
    session: TxSession
    slice: Slice
    xfer: Xfer


class Worker:
    """One sender worker thread: its queue, its DEALERs, its stalled writes."""

    def __init__(self, sender: Sender, index: int) -> None:
        self.sender = sender
        self.index = index
        self.queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._dealers: dict[str, zmq.Socket[bytes]] = {}  # owned by this thread only
        self._stalled: list[Stalled] = []
        self.last_progress = time.monotonic()
        self.thread = threading.Thread(
            target=self._run, name=f"kvxferd-worker-{index}", daemon=True
        )

    def _run(self) -> None:
        try:
            while True:
                try:
                    task = self.queue.get(timeout=TICK_S)
                except queue.Empty:
                    task = None
                self.last_progress = time.monotonic()
                if self._stalled:
                    self._recheck_stalled()
                if task is STOP:
                    break
                if task is None:
                    continue
                try:
                    if isinstance(task, WriteTask):
                        self._write_slice(task)
                    elif isinstance(task, AckTask):
                        self._ack_cancel(task)
                    elif isinstance(task, ForgetTask):
                        self._forget(task.endpoint)
                        if task.shared:
                            self.sender._shared.forget(task.endpoint)
                except Exception:  # a bug must not kill the worker; the slice still reports
                    log.exception("worker %d: task failed", self.index)
                    if isinstance(task, WriteTask):
                        task.session.fail_slice(task.slice, Reason.TRANSFER_ERROR, "internal error")
                        task.session.fail(Reason.TRANSFER_ERROR, "internal error")
                        self._report(task)
        finally:
            # A bounded linger lets the last Results still queued reach their receivers.
            linger_ms = self.sender.settings.deadlines.worker_send_timeout_ms
            for sock in self._dealers.values():
                sock.close(linger=linger_ms)
            self._dealers.clear()

    # -- one slice ---------------------------------------------------------------
    def _write_slice(self, task: WriteTask) -> None:
        s, sl, peer = task.session, task.slice, task.peer
        ok = self._one_write(task, "kv")
        if ok and s.aux_len > 0 and sl.aux_slot >= 0:
            ok = self._one_write(task, "aux")
        if ok:
            s.slice_written(sl)
        self._report(task)
        if s.drained:
            self.sender._session_drained(s)
        del peer

    def _build(self, task: WriteTask, kind: str) -> tuple[np.ndarray, np.ndarray, str, str, int]:
        snd, s, sl, peer = self.sender, task.session, task.slice, task.peer
        if kind == "kv":
            src, dst = write_descriptors(
                snd.pool.layout,
                snd.pool.kv_base,
                s.block_ids,
                peer.kv_base,
                sl.dst_blocks,
                sl.layer_begin,
                sl.layer_end,
                src_dev=snd.pool.device_id,
                dst_dev=peer.device_id,
                dst_layer_stride=peer.layout.layer_stride,
            )
            return src, dst, snd.pool.mem_type, peer.mem_type, int(src[:, 1].sum())
        src, dst = aux_descriptors(
            snd.pool.layout,
            snd.pool.aux_base,
            s.aux_slot,
            peer.layout,
            peer.aux_base,
            sl.aux_slot,
            s.aux_len,
        )
        return src, dst, "DRAM", "DRAM", s.aux_len

    def _one_write(self, task: WriteTask, kind: str) -> bool:
        """Admit, post and wait for one WRITE; True when its bytes are in place."""
        snd, s, sl = self.sender, task.session, task.slice
        if s.admit_write(sl) is not None:
            snd.stats.add("writes_refused")
            return False
        peer = task.peer
        try:
            if kind == "kv" and peer.prepped:  # prepared lists: block indices, no descriptors
                xfer, state = snd.dataplane.post_blocks(
                    peer.nixl_name, s.block_ids, sl.dst_blocks, sl.layer_begin, sl.layer_end
                )
                nbytes = (
                    s.block_ids.size * snd.pool.layout.block_bytes * (sl.layer_end - sl.layer_begin)
                )
            else:
                src, dst, src_mem, dst_mem, nbytes = self._build(task, kind)
                xfer, state = snd.dataplane.post_write(peer.nixl_name, src, dst, src_mem, dst_mem)
        except Exception as e:  # nothing was posted: give the admission back first
            s.release_admission(sl, f"{kind} write not built: {e}")
            snd.stats.add("writes_build_failed")
            return False
        deadline = time.monotonic() + snd.settings.deadlines.xfer_stall_timeout_ms / 1000
        try:
            final = wait_xfer(xfer, state, deadline)
        except Exception as e:  # nixl raises a typed error where its docs say "ERR"
            final, error = "ERR", f": {e}"
        else:
            error = ""
        if final == "STALLED":
            s.write_stalled(sl, f"{kind} write in progress past xfer_stall_timeout")
            self._stalled.append(Stalled(s, sl, xfer))
            snd.stats.add("writes_stalled")
            return False
        xfer.release()
        ok = final == "DONE"
        s.finish_write(
            sl, ok, nbytes if ok else 0, "" if ok else f"NIXL reported an error ({kind}){error}"
        )
        snd.stats.add("bytes_written" if ok else "writes_failed", nbytes if ok else 1)
        return ok

    def _recheck_stalled(self) -> None:
        still: list[Stalled] = []
        for st in self._stalled:
            try:
                state = st.xfer.poll()
            except Exception:  # a raised NIXL error ends the write; it must not end this thread
                state = "ERR"
            if state == "PROC":
                still.append(st)
                continue
            st.xfer.release()
            st.session.finish_write(st.slice, state == "DONE")
            if st.session.drained:
                self.sender._session_drained(st.session)
        self._stalled = still

    # -- results -----------------------------------------------------------------
    def _dealer(self, endpoint: str) -> zmq.Socket[bytes]:
        sock = self._dealers.get(endpoint)
        if sock is None:
            snd = self.sender
            sock = connect_dealer(
                endpoint, snd.socket_limits, snd.settings.deadlines.worker_send_timeout_ms
            )
            self._dealers[endpoint] = sock
        return sock

    def _forget(self, endpoint: str) -> None:
        sock = self._dealers.pop(endpoint, None)
        if sock is not None:  # a Result still queued gets the usual bounded linger
            sock.close(linger=self.sender.settings.deadlines.worker_send_timeout_ms)

    def _send(self, endpoint: str, msg: wire.Result | wire.CancelAck) -> None:
        try:
            send_bounded(self._dealer(endpoint), wire.encode(msg))
            self.sender.stats.add(f"sent_{msg.__struct_config__.tag}")
        except SendTimeout:
            self.sender.stats.add("send_timeouts")
            log.warning("result for fetch %d dropped: receiver not reading", msg.fetch_id)
        except zmq.ZMQError as e:
            self.sender.stats.add("send_errors")
            log.warning("result for fetch %d dropped: %s", msg.fetch_id, e)

    def _report(self, task: WriteTask) -> None:
        rep = task.session.take_report(task.slice)
        if rep is None:
            return
        self.sender.stats.add(f"slices_{rep.status}")
        self.sender.stats.observe("slice_seconds", time.monotonic() - task.queued_at)
        self.sender.stats.add(f"worker_{self.index}_slices")
        self._send(
            rep.result_endpoint,
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
        self._send(
            task.peer.result_endpoint,
            wire.CancelAck(
                request_id=task.session.request_id, fetch_id=task.fetch_id, in_doubt=in_doubt
            ),
        )
