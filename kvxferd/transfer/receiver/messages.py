"""What senders tell the receiver: RegisterReplies, Results, CancelAcks, Rejects, notifications.

All on the io thread. Who is heard about a fetch::

    message                  taken from                          does
    -----------------------  ----------------------------------  ------------------------------
    RegisterReply            the link's DEALER only              the link ready (or dropped);
                                                                 a new sender_id: a restart
    Moved                    the result ROUTER, from a sender     its requests' new sender
                             this receiver registered with        (moved.py)
    Reject{not_authorized}   the link's DEALER                   every fetch toward it ends now
    Result / CancelAck       the result ROUTER: the ZAP identity  the fetch's outcome / fence
                             the fetch expects, still allowed;    (unknown_peer: Register again,
                             a link's DEALER: the link the fetch  once per fetch)
                             was sent on
    NIXL notification        the fetch's nonce, from its sender   done: the bytes are in our
                             incarnation's agent, its key still   blocks
                             allowed

A Result ``failed/moved`` sends the fetch again to the sender named in ``moved_to``
(``follow_moved``). A RegisterReply with another sender_id is a new sender process: open fetches sent to
the old one are sent again (same fetch id) while their deadline allows, else fail
peer_restarted; fences toward the old one are released (it is gone).
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import TYPE_CHECKING

import zmq

from kvxferd.auth import peer_identity
from kvxferd.errors import ProtocolError, Reason, RejectedError
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.receiver.links import Link, LinkState
from kvxferd.transfer.receiver.moved import MAX_HOPS
from kvxferd.transfer.session import RxSession, RxState

if TYPE_CHECKING:
    from kvxferd.transfer.receiver.core import Receiver

log = logging.getLogger("kvxferd.receiver")


class Messages:
    """The io thread's handling of every message and notification a sender sends it."""

    def __init__(self, rx: Receiver) -> None:
        self.rx = rx

    def drain_socket(self, sock: zmq.Socket[bytes]) -> None:
        rx = self.rx
        for _ in range(256):
            if sock.closed:
                return  # a message closed its link (a refused Register)
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError:
                rx.stats.add("recv_errors")
                return
            identity = peer_identity(parts[-1])  # the key ZAP authenticated, never a field
            if sock is rx._router and identity and not rx.transport.admits(identity):
                # ZAP checked the key once, at the handshake: a sender key removed from
                # the allow-list since is refused here, message by message, on the
                # connection it already opened. Its Result never makes a fetch done: the
                # fetch ends by its deadline, fenced as any fetch whose sender went quiet.
                rx.stats.add(f"rejected_{Reason.NOT_AUTHORIZED}")
                continue
            frames = [p.bytes for p in parts]
            body = frames[1:] if sock is rx._router else frames
            try:
                msg = wire.decode_to_receiver(body, rx.settings.limits.max_frame_bytes)
            except ProtocolError as e:
                rx.stats.add(f"rejected_{e.reason}")
                continue
            try:
                self.on_message(sock, msg, identity, wire.frame_version(body[0]))
            except Exception:
                rx.guard.caught("rx-io message")

    def on_message(
        self,
        sock: zmq.Socket[bytes],
        msg: wire.ToReceiver,
        identity: str = "",
        version: int = wire.PROTOCOL_VERSION,
    ) -> None:
        """One message; ``version``: its frame's (a RegisterReply's is the link's version)."""
        rx = self.rx
        links, fetches = rx.links, rx.fetches
        if isinstance(msg, wire.RegisterReply):
            link = links.by_socket.get(sock)
            if link is not None and sock is link.dealer:
                link.version = min(version, link.version)  # the sender answers in the lower
                self.on_register_reply(link, msg)
            else:  # on the result socket: no sender sends one there
                rx.stats.add(f"rejected_{Reason.UNKNOWN_MESSAGE}")
            return
        if isinstance(msg, wire.Moved | wire.HandoverReply):
            self.on_moved(sock, msg, identity)
            return
        if isinstance(msg, wire.Reject):
            rx.stats.add(f"peer_rejected_{msg.reason}")
            link = links.by_socket.get(sock)
            if (
                msg.reason is Reason.UNSUPPORTED_VERSION
                and link is not None
                and sock is link.dealer
                and links.fall_back(link)
            ):
                return  # a sender of the previous release: registering again in its version
            log.warning("sender rejected a message: %s %s", msg.reason, msg.detail)
            if msg.reason is Reason.NOT_AUTHORIZED and link is not None and sock is link.dealer:
                self.key_refused(link, msg.detail)
            return
        with rx._lock:
            found = fetches.by_id.get(msg.fetch_id) or rx.doubts.by_id.get(msg.fetch_id)
        if found is None or found.request_id != msg.request_id:
            rx.stats.add("late_messages")
            return
        f = found
        if not self.from_asked_sender(sock, f, identity):
            rx.stats.add("results_unsolicited")
            log.warning(
                "%s for fetch %d dropped: not from the sender it was sent to",
                type(msg).__name__,
                f.fetch_id,
            )
            return
        if isinstance(msg, wire.CancelAck):
            f.on_cancel_ack(msg.in_doubt)
            rx.doubts.settle(f)
            return
        if (
            msg.status == "failed"
            and msg.reason is Reason.UNKNOWN_PEER
            and f.fetch_id not in fetches.reregistered
            and not f.ended
        ):
            # The sender forgot us (it restarted, or evicted us): nothing was written.
            # Register again on the same link, once per fetch, and resend after the reply.
            fetches.reregistered.add(f.fetch_id)
            rx.stats.add("reregistrations")
            link = links.get(f.sender_endpoint)
            if link is None:
                fetches.start(f)
                return
            if link.ready:
                links.register(link)
            if links.get(f.sender_endpoint) is link:
                link.waiting.append(f)
            else:
                fetches.fail(f, Reason.PEER_LOST, "REGISTER could not be sent")
            return
        if msg.status == "failed" and msg.reason is Reason.MOVED and self.follow_moved(f, msg):
            return
        self.apply_result(
            f, msg.status, msg.reason, msg.detail, msg.nbytes, msg.aux_bytes, msg.digest
        )

    def on_moved(
        self, sock: zmq.Socket[bytes], msg: wire.Moved | wire.HandoverReply, identity: str
    ) -> None:
        """A draining sender says where its requests went: remember them (moved.py).

        Taken only on the result socket, from a sender this receiver registered with (a
        link at some endpoint whose server key is ``identity``; with security off, any
        link): the entries are keyed by that link's endpoint, so nobody can redirect
        another sender's requests. A HandoverReply is for a draining sender's own DEALER.
        """
        rx = self.rx
        if not isinstance(msg, wire.Moved) or sock is not rx._router:
            rx.stats.add(f"rejected_{Reason.UNKNOWN_MESSAGE}")
            return
        olds = [
            link.endpoint
            for link in rx.links.links.values()
            if link.sender_id and link.server_key == identity
        ]
        if not olds:
            rx.stats.add("results_unsolicited")
            return
        for item in msg.items:
            for old in olds:
                rx.moved.learn(old, item.request_id, msg.endpoint, item.ttl_ms / 1000)
        rx.stats.add("moved_learned", len(msg.items))
        log.info("%d request(s) moved from %s to %s", len(msg.items), olds[0], msg.endpoint)

    def follow_moved(self, f: RxSession, msg: wire.Result) -> bool:
        """A fetch answered ``moved``: send it to the request's new sender; False to end it.

        Nothing was written by the sender that answered it. The same fetch (id, blocks,
        token, deadline) goes to ``moved_to``, at most ``MAX_HOPS`` times.
        """
        rx = self.rx
        if f.ended or not msg.moved_to or f.hops >= MAX_HOPS or f.prefill_rank >= 0:
            return False
        try:
            rx.fetches.check_dialable(msg.moved_to)
            key = rx.transport.server_key_for(msg.moved_to, "")
        except RejectedError:
            return False
        old = f.sender_endpoint
        rx.moved.learn(old, f.request_id, msg.moved_to, max(1.0, f.deadline - time.monotonic()))
        f.redirect(msg.moved_to, key)
        rx.fetches.reregistered.discard(f.fetch_id)
        rx.stats.add("fetches_redirected")
        log.info(
            "fetch %d of %s moved from %s to %s", f.fetch_id, f.request_id, old, f.sender_endpoint
        )
        rx.fetches.start(f)
        return True

    def on_register_reply(self, link: Link, msg: wire.RegisterReply) -> None:
        rx = self.rx
        known, link.sender_id = link.sender_id, msg.sender_id
        rx.stats.add("register_replies_ok" if msg.ok else "register_replies_refused")
        # Fetches sent to another incarnation at this endpoint, whether this link or an
        # earlier one (dropped meanwhile) carried them: that process is gone.
        with rx._lock:
            stale = [
                f
                for f in (*rx.fetches.by_id.values(), *rx.doubts.by_id.values())
                if f.sender_endpoint == link.endpoint
                and f.sent
                and f.sent_to not in ("", msg.sender_id)
            ]
        if stale or (known and known != msg.sender_id):
            self.sender_restarted(link, stale, resend=msg.ok)
        if not msg.ok:
            rx.links.drop(link, msg.reason or Reason.INCOMPATIBLE, msg.detail)
            return
        if link.agent is None:
            # It answers a Register whose NIXL agent was torn down since (the link went down
            # meanwhile): register again with a fresh one; that reply makes the link ready.
            rx.stats.add("registers_stale_agent")
            rx.links.register(link)
            return
        was_down = link.down
        link.state = LinkState.READY
        link.lost_since = None
        if was_down:
            rx.stats.add("links_back")
            log.info("link to %s back", link.endpoint)
        rx.doubts.ask_again_now(link.endpoint)
        rx.groups.on_record(link.endpoint, msg.topology)
        waiting, link.waiting = link.waiting, []
        for f in waiting:
            if not f.ended:
                rx.fetches.send_request(link, f)

    def sender_restarted(self, link: Link, stale: list[RxSession], *, resend: bool) -> None:
        """A new sender process answers at ``link``: nothing of the old one can still land.

        Open fetches sent to an old incarnation are sent again (same fetch id: the new
        one never saw it) while their deadline allows, or fail with peer_restarted;
        fences toward an old incarnation are released.
        """
        rx = self.rx
        rx.stats.add("sender_restarts")
        log.warning("sender at %s is a new process (%s)", link.endpoint, link.sender_id)
        now = time.monotonic()
        for f in stale:
            if not f.ended:
                rx.fetches.reregistered.discard(f.fetch_id)
                if resend and now < f.deadline:
                    if f not in link.waiting:  # sent once the reply made the link ready
                        link.waiting.append(f)
                    rx.stats.add("fetches_resent")
                else:
                    rx.fetches.fail(f, Reason.PEER_RESTARTED, f"sender {f.sent_to} restarted")
            elif f.release():
                rx.stats.add("fences_released_restart")
                rx.doubts.settle(f)

    def key_refused(self, link: Link, detail: str) -> None:
        """The sender at ``link`` refuses our key (``Reject{not_authorized}``, e.g. revoked):
        end every fetch open toward it now, not at its deadline.

        One not yet sent fails (nothing can be written). One sent ends ``not_authorized``
        with its blocks fenced, since a write of it may be in flight, and its Cancel goes
        out: the sender still honours a revoked key's Cancel, so its CancelAck (or the
        fetch's failed Result) releases them; else the fence deadline puts them in doubt.
        """
        rx = self.rx
        why = f"sender at {link.endpoint} refused this receiver's key: {detail}"
        open_here = rx.fetches.open_toward(link.endpoint)
        for f in open_here:
            if f.sent:
                rx.fetches.cancel(f, RxState.FAILED, Reason.NOT_AUTHORIZED, why)
            else:
                if f in link.waiting:
                    link.waiting.remove(f)
                rx.fetches.fail(f, Reason.NOT_AUTHORIZED, why)
        rx.groups.fail_waiting_on(link.endpoint, Reason.NOT_AUTHORIZED, why)
        if open_here:
            rx.stats.add("fetches_ended_key_refused", len(open_here))

    def apply_result(
        self,
        f: RxSession,
        status: str,
        reason: Reason | None,
        detail: str,
        nbytes: int,
        aux_bytes: int,
        digest: bytes = b"",
        *,
        checked: bool = False,
    ) -> None:
        """The sender's final word on ``f`` (a Result, or the notification of its last WRITE).

        A done one for a fetch that asked for a digest goes to its check first (digests.py),
        which applies it again with ``checked``: done, or failed ``digest_mismatch``.
        """
        rx = self.rx
        if status == "done" and f.digest and not checked and not f.ended:
            rx.digests.check(f, nbytes, aux_bytes, digest)
            return
        aux = None
        if status == "done" and f.aux_slot >= 0 and aux_bytes and not f.ended:
            n = min(aux_bytes, rx.pool.layout.aux_slot_bytes)
            aux = bytes(rx.pool.aux[f.aux_slot, :n].numpy().tobytes())
        if f.on_result(status, reason, detail, nbytes, aux):
            rx.stats.add(f"fetches_{f.state}")
            rx.stats.observe("fetch_seconds", time.monotonic() - f.started)
            if status == "done":
                rx.stats.add("bytes_received", nbytes)
        rx.doubts.settle(f)

    def take_notifications(self) -> bool:
        """Progress NIXL and complete the fetches whose last WRITE's notification came.

        A notification counts only with the fetch's nonce (sent over the authenticated
        control plane, so no other process can forge it) and from the NIXL agent of the
        sender incarnation the fetch was sent to (its sender id, or a spare path of it).
        NIXL sends it once the WRITE is complete: the bytes are in our blocks.
        """
        rx = self.rx
        got = rx.agents.notifications()
        for gen, agent, payload in got:
            records = wire.decode_notification(payload)
            if records is None:
                rx.stats.add("notifications_unknown")
                continue
            for fetch_id, nonce, nbytes, aux_bytes in records:
                with rx._lock:
                    f = rx.fetches.by_id.get(fetch_id) or rx.doubts.by_id.get(fetch_id)
                if f is None:
                    rx.stats.add("late_messages")
                    continue
                if f.agent_gen != gen or not self.notified_by_its_sender(f, agent, nonce):
                    rx.stats.add("notifications_refused")
                    log.warning("notification for fetch %d refused: not from its sender", fetch_id)
                    continue
                rx.stats.add("notifications")
                self.apply_result(f, "done", None, "", nbytes, aux_bytes)
        return bool(got)

    def notified_by_its_sender(self, f: RxSession, agent: str, nonce: bytes) -> bool:
        """True when a notification for ``f`` is its sender's word, as a Result would be.

        The nonce went only to that sender, over the link whose server key (CURVE verifies
        it) is the key the fetch expects; the NIXL agent is that sender incarnation's; and
        the key is still in the allow-list (a revoked key completes nothing, counted as a
        refused Result would be).
        """
        sender = f.sent_to
        if not (
            f.nonce
            and hmac.compare_digest(nonce, f.nonce)
            and sender
            and (agent == sender or agent.startswith(sender + ".p"))
        ):
            return False
        link = self.rx.links.get(f.sender_endpoint)
        if link is None or link.server_key != f.sender_key:
            return False
        if f.sender_key and not self.rx.transport.admits(f.sender_key):
            self.rx.stats.add(f"rejected_{Reason.NOT_AUTHORIZED}")
            return False
        return True

    def from_asked_sender(self, sock: zmq.Socket[bytes], f: RxSession, identity: str) -> bool:
        """True when a Result/CancelAck for ``f`` came from the sender ``f`` was sent to.

        On the result ROUTER: the authenticated identity must be the fetch's expected
        sender key (both "" with security off). On a link's DEALER (the listener's own
        refusals): it must be the link to the fetch's sender endpoint.
        """
        if sock is self.rx._router:
            return identity == f.sender_key
        link = self.rx.links.by_socket.get(sock)
        return link is not None and link.dealer is sock and link.endpoint == f.sender_endpoint
