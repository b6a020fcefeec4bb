"""A draining sender's handover: its unfetched requests offered to another sender, then redirects.

Run by the drain (drain.py), between refusing the parked fetches and waiting for the
published requests. One offered request::

    candidate (published, live, no fetch attached, every layer ready, no allowed_receivers)
      --Handover (to each ``[handover] targets`` endpoint in turn, then each sender
        discovery lists with ``[handover] discover``, until one takes it)-->
    offered   the target answered HandoverReply with it accepted: the target fetches it
              from here as any receiver would (Register, RequestData with its token); the
              session stays published and is served as usual
      --the target's fetch of it DONE--> moved: ``moved[request_id] = target endpoint``
              until its publish TTL; a session expecting more fetches ends ``cancelled``
              (reason ``moved``): the target serves the rest
      --the target's fetch failed / in doubt, or not come within reply_timeout_ms of the
        reply--> kept: the drain handles it
              as before (fetched here by its receiver, or dropped at drain_timeout_ms)
    refused by every target, or none reachable -> kept (``no_target`` when none answered)

A receiver's RequestData for an offered request is held (``hold``) until its move
settles, then handled again. While the drain runs, a RequestData for a moved request is answered
``Result{failed, moved, moved_to}`` (the listener asks ``moved_to``), toward a peer that
speaks version 4. Once the drain's wait is over, every registered version-4 receiver is
told ``Moved`` (ids -> endpoint) on its result endpoint, and the drain waits up to
``redirect_window_ms`` (less once every moved request was redirected) before it stops the
listener. ``moved`` is bounded by the requests published here; its own lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from kvxferd.errors import ProtocolError, Reason, SendTimeout
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.control import connect_dealer, send_bounded
from kvxferd.transfer.session import SliceState, TxSession

if TYPE_CHECKING:
    from kvxferd.transfer.sender.api import Sender

log = logging.getLogger("kvxferd.sender")

MOVED_BATCH = 1024  # requests per Moved message
MAX_HELD = 4096  # fetches held while their request moves

Held = tuple[bytes, wire.RequestData, str, str]  # (routing id, RequestData, identity, receiver id)


class Handover:
    """The handover of one drain: offered requests, moved ones, redirects answered."""

    def __init__(self, sender: Sender) -> None:
        self._s = sender
        self.stats = sender.stats
        self._lock = threading.Lock()
        # request id -> (session, target endpoint, the target's receiver id, by when the
        # target's fetch must have come: its reply + reply_timeout_ms)
        self._offered: dict[str, tuple[TxSession, str, str, float]] = {}
        self._moved: dict[str, tuple[str, float]] = {}  # request id -> (endpoint, until)
        self._redirected: set[str] = set()
        self._held: list[Held] = []  # fetches of offered requests, until their move settles
        self.started_at = 0.0
        self.moved_at = 0.0  # when the last request moved
        # Set once a drain offers something: until then the listener's look-ups per
        # RequestData (``moved_to``, ``hold``) cost one attribute read, no lock.
        self.active = False
        self.moved_bytes = 0
        # Listen endpoints of the other senders discovery lists (``[handover] discover``:
        # the daemon sets it, service/daemon.py); tried after the configured targets.
        self.discovered: Callable[[], list[str]] = list

    @property
    def moved(self) -> int:
        with self._lock:
            return len(self._moved)

    def moved_to(self, request_id: str) -> str | None:
        """The endpoint a moved request went to (listener thread), or None."""
        if not self.active:
            return None
        with self._lock:
            entry = self._moved.get(request_id)
            if entry is None or entry[1] <= time.monotonic():
                return None
            self._redirected.add(request_id)
            return entry[0]

    def redirect(self, msg: wire.RequestData) -> wire.Result | None:
        """``Result{failed, moved, moved_to}`` for a fetch of a request this drain handed over
        (listener thread; nothing was written), counted; None when it was not moved."""
        moved_to = self.moved_to(msg.request_id)
        if moved_to is None:
            return None
        self.stats.add("moved_redirects")
        self.stats.add(f"rejected_{Reason.MOVED}")
        return wire.Result(
            request_id=msg.request_id,
            fetch_id=msg.fetch_id,
            status="failed",
            reason=Reason.MOVED,
            detail="the draining sender handed this request over",
            moved_to=moved_to,
        )

    # -- fetches that come while their request moves (listener thread) ----------------------
    def hold(
        self, routing_id: bytes, msg: wire.RequestData, identity: str, receiver_id: str
    ) -> bool:
        """Hold a receiver's fetch of a request the target is fetching now; False: go on.

        Attached here it would take the request's expected fetch from the target's (and
        one of them would be refused ``duplicate``). Handled again once the move settled:
        answered ``moved``, or served here if the request stayed.
        """
        if not self.active:
            return False
        with self._lock:
            offered = self._offered.get(msg.request_id)
            if offered is None or offered[2] == receiver_id or len(self._held) >= MAX_HELD:
                return False
            if any(h[3] == receiver_id and h[1].fetch_id == msg.fetch_id for h in self._held):
                return False  # the same fetch again: refused as a duplicate fetch id
            self._held.append((routing_id, msg, identity, receiver_id))
        self.stats.add("fetches_held_moving")
        return True

    def unhold(self, receiver_id: str, fetch_id: int) -> bool:
        """A Cancel of a held fetch: forgotten (nothing was written); True if it was held."""
        with self._lock:
            kept = [
                h for h in self._held if not (h[3] == receiver_id and h[1].fetch_id == fetch_id)
            ]
            found, self._held = len(kept) < len(self._held), kept
        return found

    def released(self) -> list[Held]:
        """The held fetches whose request's move settled (listener's housekeeping)."""
        if not self.active:
            return []
        with self._lock:
            if not self._held:
                return []
            out = [h for h in self._held if h[1].request_id not in self._offered]
            if out:
                self._held = [h for h in self._held if h[1].request_id in self._offered]
        return out

    # -- the offer ---------------------------------------------------------------------------
    def candidates(self) -> list[tuple[TxSession, str]]:
        """(session, its fetch token or "") of each request that may be offered."""
        s = self._s
        with s._lock:
            sessions = list(s.published.live.values())
            grants = dict(s.published.grants)
        out = []
        for x in sessions:
            grant = grants.get(x.session_id)
            if grant is not None and grant.allowed:
                continue  # only the receivers it names may fetch it: not the target
            if (
                x.ended
                or x.slices()
                or x.expected_fetches < 1
                or x.streaming
                or not x.block_ids.size
            ):
                continue
            out.append((x, grant.token.decode() if grant is not None and grant.token else ""))
        return out

    def offer(self, deadline: float) -> None:
        """Offer every candidate to the targets in turn, within ``deadline``; logs the result."""
        s = self._s
        self.started_at = time.monotonic()
        left = self.candidates()
        if not left:
            return
        targets = list(s.settings.handover.targets)
        targets += [t for t in self.discovered() if t not in targets]
        targets = [t for t in targets if t and t != s.endpoint]
        if not targets:
            self.stats.add("handover_no_target", len(left))
            log.info(
                "handover: no target (configured or discovered): %d unfetched request%s "
                "stay here; the drain drops what is not fetched by drain_timeout_ms",
                len(left),
                "" if len(left) == 1 else "s",
            )
            return
        self.active = True
        answered = False
        for target in targets:
            if not left or time.monotonic() >= deadline:
                break
            reply = self._ask(target, left, deadline)
            if reply is None:
                continue
            answered = True
            taken = set(reply.accepted)
            start_by = time.monotonic() + s.settings.handover.reply_timeout_ms / 1000
            with self._lock:
                for x, _ in left:
                    if x.request_id in taken:
                        self._offered[x.request_id] = (x, target, reply.receiver_id, start_by)
            for r in reply.refused[:3]:
                log.info("handover: %s refused %s: %s %s", target, r.request_id, r.reason, r.detail)
            left = [(x, t) for x, t in left if x.request_id not in taken]
        with self._lock:
            offered = len(self._offered)
        if left:
            self.stats.add("handover_kept" if answered else "handover_no_target", len(left))
        log.info(
            "handover: %d request%s offered and taken, %d kept here%s",
            offered,
            "" if offered == 1 else "s",
            len(left),
            "" if answered else " (no target reachable)",
        )

    def _ask(
        self, target: str, sessions: list[tuple[TxSession, str]], deadline: float
    ) -> wire.HandoverReply | None:
        """One Handover to ``target`` and its reply, or None (unreachable, refused, late)."""
        s = self._s
        now = time.monotonic()
        items = []
        for x, token in sessions[:4096]:
            items.append(
                wire.HandoverItem(
                    request_id=x.request_id,
                    token=token,
                    blocks=int(x.block_ids.size),
                    num_layers=x.num_layers,
                    aux_bytes=x.aux_len,
                    ttl_ms=max(1, int((x.ttl_deadline - now) * 1000)),
                    expected_fetches=x.expected_fetches,
                )
            )
        until = min(deadline, now + s.settings.handover.reply_timeout_ms / 1000)
        try:
            key = s.transport.server_key_for(target, "")
            sock = connect_dealer(
                target, s.socket_limits, s.settings.deadlines.send_timeout_ms, server_key=key
            )
        except Exception as e:  # a bad endpoint or no key for it: this target is skipped
            log.warning("handover: target %s skipped: %s", target, e)
            return None
        try:
            send_bounded(sock, wire.encode(wire.Handover(sender_endpoint=s.endpoint, items=items)))
            while (left := until - time.monotonic()) > 0:
                if not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                    continue
                frame = sock.recv(zmq.NOBLOCK)
                try:
                    msg = wire.decode_to_receiver([frame], s.settings.limits.max_frame_bytes)
                except ProtocolError as e:
                    self.stats.add(f"rejected_{e.reason}")
                    continue
                if isinstance(msg, wire.HandoverReply):
                    return msg
                if isinstance(msg, wire.Reject):
                    log.warning("handover: %s rejected it: %s %s", target, msg.reason, msg.detail)
                    return None
            log.warning("handover: no reply from %s in time", target)
            return None
        except (SendTimeout, zmq.ZMQError) as e:
            log.warning("handover: %s unreachable: %s", target, e)
            return None
        finally:
            sock.close(linger=0)

    # -- the moves ---------------------------------------------------------------------------
    def pending(self) -> bool:
        """True while an offered request is neither moved nor given up (drain's wait loop)."""
        self.settle()
        with self._lock:
            return bool(self._offered)

    def settle(self) -> None:
        """Offered requests whose move ended: moved (the target's fetch is done) or kept."""
        with self._lock:
            offered = list(self._offered.items())
        if not offered:
            return
        now = time.monotonic()
        for rid, (x, target, receiver_id, start_by) in offered:
            mine = [sl for sl in x.slices() if sl.peer_id == receiver_id]
            if any(sl.state is SliceState.DONE for sl in mine):
                if not x.ended:  # more fetches expected: the target serves them now
                    x.cancel(Reason.MOVED, f"moved to {target}")
                with self._lock:
                    del self._offered[rid]
                    self._moved[rid] = (target, x.ttl_deadline)
                    self.moved_bytes += sum(sl.nbytes for sl in mine)  # aux included
                self.moved_at = time.monotonic()
                self.stats.add("handover_moved")
            elif (
                x.ended
                or (not mine and now >= start_by)  # the target's fetch never came
                or any(sl.state in (SliceState.FAILED, SliceState.IN_DOUBT) for sl in mine)
            ):
                with self._lock:
                    del self._offered[rid]
                self.stats.add("handover_kept")
                log.warning("handover: %s not moved to %s; it stays here", rid, target)
        with self._lock:
            settled = not self._offered
            moved = len(self._moved)
        if settled:
            log.info(
                "handover: %d request%s moved (%d bytes) in %.3f s",
                moved,
                "" if moved == 1 else "s",
                self.moved_bytes,
                max(0.0, self.moved_at - self.started_at),
            )

    def give_up(self) -> None:
        """The drain deadline: offered requests not moved stay here (counted kept)."""
        with self._lock:
            left, self._offered = len(self._offered), {}
        if left:
            self.stats.add("handover_kept", left)

    # -- after the moves ---------------------------------------------------------------------
    def tell_and_wait(self, deadline: float) -> None:
        """Tell each version-4 receiver where its moved requests went, then wait for
        redirects up to ``redirect_window_ms`` (within ``deadline``)."""
        s = self._s
        with self._lock:
            moved = dict(self._moved)
        if not moved:
            return
        now = time.monotonic()
        by_target: dict[str, list[wire.MovedItem]] = {}
        for rid, (target, until) in moved.items():
            ttl_ms = max(1, int((until - now) * 1000))
            by_target.setdefault(target, []).append(wire.MovedItem(request_id=rid, ttl_ms=ttl_ms))
        with s._lock:
            peers = [p for p in s.peers.peers() if p.version >= 4]
        for p in peers:
            for target, items in by_target.items():
                for i in range(0, len(items), MOVED_BATCH):
                    if time.monotonic() >= deadline:
                        return
                    msg = wire.Moved(endpoint=target, items=items[i : i + MOVED_BATCH])
                    s.drain.reply_shared(p, msg)
                    self.stats.add("moved_told")
        log.info(
            "handover: receivers told; answering redirects for up to %d ms",
            s.settings.handover.redirect_window_ms,
        )
        window = min(deadline, time.monotonic() + s.settings.handover.redirect_window_ms / 1000)
        while time.monotonic() < window:
            with self._lock:
                if self._redirected >= moved.keys():
                    return
            time.sleep(0.01)  # poll: the listener answers the redirects
