"""The sender's listener thread (``kvxferd-listener``): the ROUTER socket, one poll loop.

It owns the ROUTER socket and what the io hooks hand it (the engine gateway's socket
and calls, iohooks.py), and drives the inline worker each turn. Each turn::

    poll (ROUTER, hooks; at most TICK_S) -> a bounded batch of messages (256), each
    decoded and validated frame by frame (a receiver batches one turn's messages) ->
    the inline worker's step -> housekeeping -> the hooks' timers

Message dispatch: REGISTER -> :class:`~kvxferd.transfer.sender.admission.Admission`;
HANDOVER -> the adopter's reply (adopt.py); REQUEST_DATA of a request this drain moved
-> ``Result{failed, moved, moved_to}`` (handover.py); REQUEST_DATA -> its deadline (``timeout_ms``, ``deadline_unix_ms``), then attached to
its published request (published.py) or parked until publish (parked.py), queued on
the pair's lane (``Sender._lane_for``); CANCEL -> admission ended, acked through the
lane (after the slice's own Result). A key removed from the allow-list is answered
message by message on its open connection (``_refuse_revoked``). Housekeeping expires
parked fetches and unfetched requests (a heap of TTL deadlines: cost ~ what expires),
ends streamed publishes with no progress mark for ``stream_stall_timeout_ms``
(streams.py), tells peers whose key was revoked, and reclaims orphans (admission.py).

It never blocks on a peer: replies go out on the ROUTER without waiting
(``router_reply``); results and acks go through the workers. The tables are read and
changed under the sender's registry lock (``Sender._lock``); ``PeerTable.seen`` is this
thread's own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import zmq

from kvxferd.auth import ANONYMOUS, peer_identity
from kvxferd.config import Limits
from kvxferd.errors import ProtocolError, Reason, RejectedError
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.control import bind_router, router_reply
from kvxferd.transfer.layout import Layout, check_blocks, check_layers
from kvxferd.transfer.poller import Poller, tight_timers
from kvxferd.transfer.sender.adopt import adopt_reply
from kvxferd.transfer.sender.parked import Parked
from kvxferd.transfer.worker import STOP, TICK_S, AckTask, Peer, WriteTask

if TYPE_CHECKING:
    from kvxferd.transfer.sender.api import Sender

log = logging.getLogger("kvxferd.sender")


class Listener:
    """The ``kvxferd-listener`` thread and the ROUTER socket it owns."""

    def __init__(self, sender: Sender) -> None:
        self._s = sender
        self.stats = sender.stats
        self._router, self.bound_endpoint = bind_router(
            sender.settings.listen, sender.socket_limits
        )
        # A ROUTER with a security mechanism has its peers authenticated (ZAP names each);
        # on a plaintext one every peer is ANONYMOUS, without asking each frame.
        self._authenticated = self._router.getsockopt(zmq.MECHANISM) != zmq.NULL
        self.progress = time.monotonic()
        self._reap_at = 0.0  # next orphan reclaim
        self._streams_at = 0.0  # next look for stalled streams (streams.py)
        self._allowed_keys: frozenset[str] = frozenset()  # the allow-list last seen
        # The version of the frame being handled (this thread's): its answers go in it.
        self._answering: int | None = None
        self.thread = threading.Thread(target=self._listen, name="kvxferd-listener", daemon=True)

    def close_unstarted(self) -> None:
        """Close the ROUTER of a sender never started (no thread owns it)."""
        self._router.close(linger=0)

    def _listen(self) -> None:
        """Owner of the ROUTER socket (and of what the io hooks add: the engine socket); never
        blocks on a peer."""
        s = self._s
        io = s.io
        io.bind_thread()
        tight_timers()
        max_bytes = s.settings.limits.max_frame_bytes
        poller: Poller | None = None
        version = -1
        delay: float | None = None
        try:
            while not s._stopping.is_set():
                try:
                    if poller is None or io.version != version:
                        poller, version = Poller(), io.version
                        poller.register(self._router, zmq.POLLIN)
                        for item, flags in io.items():
                            poller.register(item, flags)
                    delay = self._listen_turn(poller, max_bytes, delay)
                except Exception:
                    s.guard.caught("listener")
                    poller, delay = None, None
        finally:
            io.stop()  # the engine gateway answers what is outstanding and closes
            if s._inline is not None:  # as a worker thread does after STOP
                s._inline.put(STOP)
                s._inline.finish()
            self._router.close(linger=0)

    def _listen_turn(self, poller: Poller, max_bytes: int, delay: float | None) -> float | None:
        s = self._s
        self.progress = time.monotonic()
        wait_s = TICK_S if delay is None else min(TICK_S, delay)
        if s.io.pending():
            wait_s = 0.0
        ready = poller.poll(wait_s)
        now = time.monotonic()
        for item, ev in ready:
            if item is self._router:
                router = self._router
                # Bounded batch, then housekeeping. EVENTS says whether a message waits: the
                # zmq.Again that ended each batch cost more than the check (issue 22).
                for _ in range(256):
                    if not router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        break
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames, max_bytes)
            else:
                s.io.dispatch(item, ev, now)
        inline = s._inline
        wait = inline.step() if inline is not None else TICK_S
        now = time.monotonic()
        self._housekeeping(now)
        delay = s.io.turn(now)
        if inline is not None and inline.queue.qsize():
            wait = 0.0
        return wait if delay is None else min(wait, delay)

    def _handle(self, frames: Sequence[zmq.Frame | bytes], max_bytes: int) -> None:
        # The identity is the key ZAP authenticated for the connection, never a field.
        last = frames[-1]
        # With security off no handler authenticates the ROUTER's peers: every identity is
        # ANONYMOUS, and asking each frame for one raised (and caught) an error per message.
        identity = (
            peer_identity(last)
            if self._authenticated and isinstance(last, zmq.Frame)
            else ANONYMOUS
        )
        routing_id, *body = [f.bytes if isinstance(f, zmq.Frame) else f for f in frames]
        if identity and not self._s.transport.admits(identity):
            # ZAP checks a key once, at the handshake: a key removed from the allow-list
            # since then is refused here, message by message, on its open connection.
            self._refuse_revoked(routing_id, body, identity, max_bytes)
            return
        if len(body) > wire.MAX_BATCH:
            self.stats.add(f"rejected_{Reason.MALFORMED}")
            detail = f"{len(body)} frames in one message, at most {wire.MAX_BATCH}"
            self.reply(routing_id, wire.Reject(reason=Reason.MALFORMED, detail=detail))
            return
        # A receiver batches the messages of one turn (protocol.py): each frame is one.
        frames_: list[bytes | None] = list(body) if body else [None]
        for frame in frames_:
            self._handle_one(routing_id, frame, identity, max_bytes)

    def _refuse_revoked(
        self, routing_id: bytes, body: list[bytes], identity: str, max_bytes: int
    ) -> None:
        """Answer each message of a key removed from the allow-list, naming what it answers.

        A RequestData gets ``Result{failed, not_authorized}`` with its fetch id (nothing
        was written), a Register ``RegisterReply{ok=false, not_authorized}``, a frame that
        does not decode ``Reject{not_authorized}``. A Cancel is still honoured: it only
        gives up the key's own fetch, and its CancelAck is the receiver's proof that no
        write toward those blocks is in flight (docs/protocol.md, Reject).
        """
        detail = "this key is no longer in the allow-list"
        frames: list[bytes | None] = list(body) if 0 < len(body) <= wire.MAX_BATCH else [None]
        for frame in frames:
            try:
                msg = wire.decode_to_sender([] if frame is None else [frame], max_bytes)
            except ProtocolError:
                msg = None
            if isinstance(msg, wire.Cancel):
                self._handle_one(routing_id, frame, identity, max_bytes)
                continue
            # Answered in its frame's version (one that did not decode: the route's peer's).
            seen = wire.frame_version(frame) if frame is not None and msg is not None else 0
            self._answering = wire.answer_version(seen) if seen else None
            if isinstance(msg, wire.RequestData):
                self._refuse_fetch(routing_id, None, msg, Reason.NOT_AUTHORIZED, detail)
                continue
            self.stats.add(f"rejected_{Reason.NOT_AUTHORIZED}")
            if isinstance(msg, wire.Register):
                self.stats.add("registers_refused")
                reply: wire._Msg = wire.RegisterReply(
                    ok=False,
                    sender_id=self._s.sender_id,
                    reason=Reason.NOT_AUTHORIZED,
                    detail=detail,
                )
            else:
                reply = wire.Reject(reason=Reason.NOT_AUTHORIZED, detail=detail)
            self.reply(routing_id, reply)
        self._answering = None

    def _tell_revoked(self) -> None:
        """After the allow-list changed: tell each registered peer whose key left it.

        Its receiver hears ``Reject{not_authorized}`` on its route and ends the fetches it
        has open here at once instead of at their deadlines; its Cancels are still
        honoured (``_refuse_revoked``), and no fetch of it attaches any more
        (``Published._check_grant``).
        """
        s = self._s
        with s._lock:
            routes = [
                p.routing_id
                for p in s.peers.peers()
                if p.identity != ANONYMOUS and not s.transport.admits(p.identity)
            ]
        for rid in routes:
            self.stats.add("peers_told_revoked")
            self.reply(
                rid,
                wire.Reject(
                    reason=Reason.NOT_AUTHORIZED,
                    detail="this key was removed from the allow-list",
                ),
            )

    def _handle_one(
        self, routing_id: bytes, frame: bytes | None, identity: str, max_bytes: int
    ) -> None:
        """One message, answered in its frame's version (no header of ours: the route's peer's)."""
        ours = frame is not None and len(frame) > 2 and frame[:2] == wire.MAGIC
        offered = wire.frame_version(frame) if frame is not None and ours else 0
        self._answering = wire.answer_version(offered) if ours else None
        try:
            self._handle_message(routing_id, frame, identity, max_bytes, offered)
        finally:
            self._answering = None

    def _handle_message(
        self, routing_id: bytes, frame: bytes | None, identity: str, max_bytes: int, offered: int
    ) -> None:
        try:
            msg = wire.decode_to_sender([] if frame is None else [frame], max_bytes)
        except ProtocolError as e:
            self.stats.add(f"rejected_{e.reason}")
            self.reply(routing_id, wire.Reject(reason=e.reason, detail=e.detail[:1024]))
            return
        self._note_heard(routing_id, identity)
        try:
            if isinstance(msg, wire.Register):
                self._s.admission.on_register(routing_id, msg, identity, offered)
            elif isinstance(msg, wire.RequestData):
                self._on_request(routing_id, msg, identity)
            elif isinstance(msg, wire.Handover):  # another sender drains (sender/adopt.py)
                self.reply(routing_id, adopt_reply(self._s, msg))
            else:
                self._on_cancel(routing_id, msg, identity)
        except Exception:  # a bug on one message must not kill the listener
            self._s.guard.caught("listener: message")

    def _note_heard(self, routing_id: bytes, identity: str = "") -> None:
        """A receiver that sends us a message is reachable: the data plane may reconnect it.

        Only its own identity counts: another key on a route id it reuses proves nothing.
        """
        peer = self._s.peers.get(routing_id)  # one atomic read; its writers hold the lock
        if peer is not None and peer.identity == identity:
            self._s.agents.heard(peer.nixl_name)

    def reply(self, routing_id: bytes, msg: wire._Msg) -> None:
        """Send ``msg`` on the ROUTER to ``routing_id`` (listener thread), never waiting.

        In the version of the frame it answers (``_handle_one``); outside one (housekeeping),
        in the version negotiated with the peer on that route.
        """
        version = self._answering
        if version is None:
            peer = self._s.peers.get(routing_id)
            version = wire.PROTOCOL_VERSION if peer is None else peer.version
        if not router_reply(self._router, routing_id, wire.encode(msg, version)):
            self.stats.add("reply_dropped")

    # -- RequestData and Cancel ------------------------------------------------------------
    def _on_request(self, routing_id: bytes, msg: wire.RequestData, identity: str = "") -> None:
        s = self._s
        with s._lock:
            peer = s.peers.get(routing_id)
        if peer is None:
            return self._refuse_fetch(routing_id, None, msg, Reason.UNKNOWN_PEER, "REGISTER first")
        if peer.identity != identity:  # another key's connection under a route id of this peer
            self.stats.add("messages_refused_identity")
            return self._refuse_fetch(
                routing_id,
                None,
                msg,
                Reason.NOT_AUTHORIZED,
                "this route belongs to another identity",
            )
        s.peers.seen(routing_id)
        dst = np.asarray(msg.dst_blocks, dtype=np.int64)
        try:
            layers = checked_layers(peer, msg, dst, s.pool.layout, s.settings.limits)
        except RejectedError as e:
            return self._refuse_fetch(routing_id, peer, msg, e.reason, e.detail)
        now = time.monotonic()
        fetch_deadline = fetch_deadline_of(msg, now, s.settings.deadlines.clock_skew_ms)
        if fetch_deadline <= now:  # the receiver gave up already: nothing may start for it
            return self._refuse_fetch(
                routing_id,
                peer,
                msg,
                Reason.TIMEOUT,
                "the fetch's deadline passed before it was read",
            )
        moved = s.handover.redirect(msg) if peer.version >= 4 else None
        if moved is not None:  # handed over by this drain (handover.py): nothing written
            self.reply(routing_id, moved)
            return None
        if s.handover.hold(routing_id, msg, identity, peer.receiver_id):  # its request moves
            return None
        outcome: WriteTask | wire.Result | None = None
        with s._lock:
            key = (peer.receiver_id, msg.fetch_id)
            if key in s.published.fetches or s.parked.holds(key):
                refusal: tuple[Reason, str] | None = (Reason.DUPLICATE, "fetch id in use")
            elif (session := s.published.live.get(msg.request_id)) is not None:
                refusal = None  # while draining too: the drain waits for published requests
                outcome = s.published.attach(session, peer, msg, dst, fetch_deadline, layers)
            elif s._draining.is_set():  # nothing can be published here any more
                refusal = (Reason.DRAINING, "sender is draining: request not published here")
            elif len(s.parked) >= s.settings.limits.max_pending_fetches:
                refusal = (Reason.BUSY, "max_pending_fetches reached")
            elif (why := s.ownership.may_add(peer.receiver_id, "parked")) is not None:
                refusal = (Reason.BUSY, why)
            else:
                refusal = None
                ttl = s.settings.deadlines.pending_fetch_ttl_ms / 1000
                s.parked.park(
                    msg.request_id,
                    Parked(peer, msg, dst, min(now + ttl, fetch_deadline), fetch_deadline, layers),
                )
        if refusal is not None:
            return self._refuse_fetch(routing_id, peer, msg, *refusal)
        if outcome is None:
            self.stats.add("fetches_parked")
            return None
        s._dispatch(outcome, lambda m: self.reply(routing_id, m))
        return None

    def _refuse_fetch(
        self,
        routing_id: bytes,
        peer: Peer | None,
        msg: wire.RequestData,
        reason: Reason,
        detail: str,
    ) -> None:
        self.stats.add(f"rejected_{reason}")
        result = wire.Result(
            request_id=msg.request_id,
            fetch_id=msg.fetch_id,
            status="failed",
            reason=reason,
            detail=detail[:1024],
        )
        self.reply(routing_id, result)

    def _on_cancel(self, routing_id: bytes, msg: wire.Cancel, identity: str = "") -> None:
        s = self._s
        with s._lock:
            peer = s.peers.get(routing_id)
            if peer is not None and peer.identity != identity:
                stolen: Peer | None = peer  # another key under a route id of this peer
                peer = None
            else:
                stolen = None
            if peer is not None:
                s.peers.seen(routing_id)
            if peer is None:
                session = None
            else:
                session = s.published.fetches.get((peer.receiver_id, msg.fetch_id))
                p = s.parked.cancel(msg.request_id, peer, msg.fetch_id)
        if stolen is not None:
            self.stats.add("messages_refused_identity")
            self.stats.add(f"rejected_{Reason.NOT_AUTHORIZED}")
            self.reply(
                routing_id,
                wire.Reject(
                    reason=Reason.NOT_AUTHORIZED, detail="this route belongs to another identity"
                ),
            )
            return
        if peer is None:
            self.stats.add(f"rejected_{Reason.UNKNOWN_PEER}")
            self.reply(
                routing_id, wire.Reject(reason=Reason.UNKNOWN_PEER, detail="CANCEL before REGISTER")
            )
            return
        self.stats.add("cancels")
        if session is None:
            if p is not None or s.handover.unhold(peer.receiver_id, msg.fetch_id):
                self.reply(
                    routing_id,
                    wire.Result(
                        request_id=msg.request_id,
                        fetch_id=msg.fetch_id,
                        status="failed",
                        reason=Reason.CANCELLED,
                        detail="cancelled by the receiver",
                    ),
                )
            # Nothing of ours is in flight toward that fetch.
            self.reply(routing_id, wire.CancelAck(request_id=msg.request_id, fetch_id=msg.fetch_id))
            return
        session.cancel(Reason.CANCELLED, "cancelled by the receiver")
        # The ack goes after the slice's own result, from the worker that owns the pair.
        s._lane_for(session, peer.receiver_id).put(AckTask(session, peer, msg.fetch_id))

    # -- housekeeping ----------------------------------------------------------------------
    def _housekeeping(self, now: float) -> None:
        s = self._s
        allow = s.transport.allow
        if allow is not None and allow.keys is not self._allowed_keys:
            self._allowed_keys = allow.keys  # replaced whole by each reload
            self._tell_revoked()
        with s._lock:
            expired = s.parked.expire(now)
            # A receiver that reconnected since its fetch parked answers on its new route
            # (a receiver id is bound to one key: ownership.py).
            routes = s.peers.routes() if expired else {}
            due = s.published.due(now)
        for p in expired:
            self.stats.add(f"rejected_{Reason.EXPIRED}")
            self.stats.add("parked_fetches_expired")
            self.reply(
                routes.get(p.peer.receiver_id, p.peer.routing_id),
                wire.Result(
                    request_id=p.msg.request_id,
                    fetch_id=p.msg.fetch_id,
                    status="failed",
                    reason=Reason.EXPIRED,
                    detail="request was not published in time",
                ),
            )
        for session in due:  # one fetched before its TTL refuses to expire; its entry is gone
            if session.expire(now):
                self.stats.add("sessions_expired")
                came = len(session.slices())
                if came and came < session.expected_fetches:  # the TTL: late readers' lease
                    self.stats.add("reader_lease_expired")
                    log.warning(
                        "request %s expired with %d of %d expected readers",
                        session.request_id,
                        came,
                        session.expected_fetches,
                    )
            elif session.lease_pending():  # a reader still writing at the lease: look again soon
                with s._lock:
                    s.published.look_again(session, now + 1.0)
        for held in s.handover.released():  # their request's move settled (handover.py)
            self._on_request(*held[:3])
        if len(s.streams) and now >= self._streams_at:  # streamed publishes with no mark
            self._streams_at = now + TICK_S
            s.streams.stalled(now)
        if now >= self._reap_at:
            self._reap_at = now + min(1.0, s.ownership.limits.orphan_ttl_s / 4)
            s.admission.reclaim_orphans(now)


def checked_layers(
    peer: Peer, msg: wire.RequestData, dst: np.ndarray, layout: Layout, limits: Limits
) -> tuple[int, int]:
    """The layers ``msg`` writes, its blocks and aux slot checked; RejectedError if not."""
    if dst.size > limits.max_blocks_per_request:
        raise RejectedError(Reason.TOO_LARGE, "too many blocks")
    check_blocks(peer.layout, dst, "destination blocks")
    if peer.topology is not None:
        layers = piece_layers(peer, msg.layer_begin, msg.layer_end)
    else:
        check_layers(layout, msg.layer_begin, msg.layer_end or layout.num_layers)
        layers = (msg.layer_begin, msg.layer_end or layout.num_layers)
    if msg.aux_slot >= peer.layout.aux_slots:
        raise RejectedError(Reason.BAD_BLOCKS, "aux slot outside the receiver's pool")
    return layers


def fetch_deadline_of(msg: wire.RequestData, now: float, clock_skew_ms: int) -> float:
    """When the receiver gives up on ``msg`` (monotonic): no write of it starts later.

    ``timeout_ms`` counts from arrival; ``deadline_unix_ms`` (the receiver's clock, widened
    by ``clock_skew_ms``) also holds when a frozen or slow sender reads the fetch late.
    """
    deadline = now + msg.timeout_ms / 1000
    if msg.deadline_unix_ms > 0:
        left_ms = msg.deadline_unix_ms + clock_skew_ms - time.time() * 1000
        deadline = min(deadline, now + left_ms / 1000)
    return deadline


def piece_layers(peer: Peer, layer_begin: int, layer_end: int) -> tuple[int, int]:
    """The absolute layers a mapped peer's fetch writes: its piece's, inside the asked range.

    RequestData names layers of the receiver's pool (0 as the end: all of them), as
    always; its record says where they lie in the model. RejectedError when this rank
    holds nothing the peer reads in that range.
    """
    t = peer.topology
    assert t is not None
    num = t.num_stage_layers
    end = layer_end or num
    if not 0 <= layer_begin < end <= num:
        raise RejectedError(
            Reason.BAD_BLOCKS, f"layer range [{layer_begin}, {end}) outside [0, {num})"
        )
    piece = peer.piece
    if piece is None:
        raise RejectedError(
            Reason.INCOMPATIBLE, f"receiver {peer.receiver_id} reads nothing from this prefill rank"
        )
    lb = max(t.layer_begin + layer_begin, piece.layer_begin)
    le = min(t.layer_begin + end, piece.layer_end)
    if lb >= le:
        raise RejectedError(
            Reason.INCOMPATIBLE,
            f"the receiver's layers [{layer_begin}, {end}) hold nothing of this rank's "
            f"[{piece.layer_begin}, {piece.layer_end})",
        )
    return lb, le
