"""The receiver's links: one DEALER per sender endpoint, its monitor, its Register, its state.

A link (one sender endpoint) and its sender's incarnation; ``Link.state`` is the
:class:`LinkState` (what its connection was seen to do is in the link's other fields)::

    state        entered by                                  left by
    -----------  ------------------------------------------  ----------------------------------
    REGISTERING  open (Register sent, or waiting for a NIXL   RegisterReply ok -> READY;
                 agent); a Register again (reconnect,         register_timeout_ms / every connect
                 discovery saw a restart, unknown_peer)       refused for connect_refused_ms ->
                                                              closed (waiting fetches fail)
    READY        RegisterReply ok (from DOWN: ``links_back``)  a Register again -> REGISTERING;
                                                              lost for peer_down_ms -> DOWN
    DOWN         disconnected and no RegisterReply for        RegisterReply ok -> READY (its
                 peer_down_ms (``links_down``): its fetches   doubts re-asked now); a Register
                 end, its NIXL agent is torn down             on reconnect keeps it DOWN

    new link --Register--> REGISTERING --RegisterReply ok--> READY
       |  every connect refused for connect_refused_ms --> dropped (waiting fetches: peer_lost)
       |  no reply within register_timeout_ms ----------> dropped (waiting fetches: timeout)
    READY --disconnected, then connected (monitor)--> Register again --> REGISTERING
    disconnected, no RegisterReply for peer_down_ms --> DOWN: fetches not sent fail peer_lost,
       sent ones end failed/peer_lost with their fence in doubt (a write may have been
       posted); new fetches fail peer_lost at once; libzmq redials with a backoff
       (reconnect_max_ms) and the next CONNECTED registers again; the reply makes it READY
       (and re-asks about the doubt, or a new incarnation settles it: messages.py)
    discovery removed the sender (lease expired) --> if the link is not connected: as DOWN,
       and the link is closed; the endpoint is not dialled again (not even to re-ask about
       fetches in doubt) until discovery or a new fetch brings it back. A connected link
       stays (a lease expiry is no proof of death); its next disconnect closes it so.

The table (``links``, ``by_socket``, ``batched``, ``removed``) is the io thread's only: no
lock. It ends the fetches a dropped or down link strands through the receiver's fetch
table and groups (``rx.fetches``, ``rx.groups``), as the io thread it runs on.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvxferd.auth import HANDSHAKE_FAILED, handshake_kind
from kvxferd.errors import Reason, RejectedError, SendTimeout
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.control import connect_dealer, send_bounded, send_bounded_many
from kvxferd.transfer.link_agents import LinkAgent
from kvxferd.transfer.session import RxSession

if TYPE_CHECKING:
    from kvxferd.transfer.receiver.core import Receiver

log = logging.getLogger("kvxferd.receiver")

_monitor_ids = itertools.count(1)
_MONITORED = (
    zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | HANDSHAKE_FAILED
)


class LinkState(enum.Enum):
    """Where a link's registration stands (the table in this module's docstring)."""

    REGISTERING = "registering"  # a Register sent (or waiting for a NIXL agent), not answered
    READY = "ready"  # the last Register was answered ok
    DOWN = "down"  # lost for peer_down_ms: new fetches fail peer_lost until it is back


@dataclass(slots=True)
class Link:
    """Our connection to one sender endpoint, and what its monitor told us about it."""

    endpoint: str
    dealer: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]  # libzmq's events for ``dealer`` (connected, disconnected, retried)
    register_deadline: float
    server_key: str = ""  # the key the sender must present here (CURVE verifies it); "": off
    state: LinkState = LinkState.REGISTERING
    sender_id: str = ""  # the incarnation that answered it; another one means a restart
    ever_connected: bool = False
    disconnected: bool = False  # the connection dropped; the next CONNECTED registers again
    refused_since: float | None = None  # first refused connect while never connected
    lost_since: float | None = None  # the connection dropped and is not back since then
    removed: bool = False  # discovery removed the sender while this link was connected
    waiting: list[RxSession] = field(default_factory=list)  # fetches queued until registered
    # The NIXL agent its Register names (link_agents.py); None until one is taken (a link
    # waiting for a spare sends its Register when one is ready) and after a teardown.
    agent: LinkAgent | None = None
    # RequestData frames of this turn, sent together at its end (``Links.flush``): one
    # multipart message, one wake-up of ZMQ's I/O threads and of the sender's listener.
    batch: list[tuple[RxSession, bytes, bool]] = field(default_factory=list)
    # The wire version its Register offers and, once answered, the one its sender answered
    # in (protocol.negotiate); every frame on it is encoded in it. A Reject
    # (unsupported_version) of a Register at the newest version (a sender of the previous
    # release) makes it register again at the previous one, once per connection.
    version: int = wire.PROTOCOL_VERSION
    fell_back: bool = False

    @property
    def ready(self) -> bool:
        """The last Register was answered ok."""
        return self.state is LinkState.READY

    @property
    def down(self) -> bool:
        """Lost for peer_down_ms and not back: new fetches fail peer_lost."""
        return self.state is LinkState.DOWN


class Links:
    """The io thread's links by endpoint and by socket (no lock: the io thread's only)."""

    def __init__(self, rx: Receiver) -> None:
        self.rx = rx
        self.links: dict[str, Link] = {}
        self.batched: list[Link] = []  # links with RequestData to send
        self.by_socket: dict[zmq.Socket[bytes], Link] = {}  # dealers, monitors
        # Endpoints discovery removed; not dialled (not even to re-ask about a fetch in
        # doubt) until discovery adds them again or a new fetch names one.
        self.removed: set[str] = set()

    def get(self, endpoint: str) -> Link | None:
        return self.links.get(endpoint)

    def open(self, endpoint: str) -> Link | str:
        """The link to ``endpoint``, opened and registering if new; why not, if it cannot be."""
        rx = self.rx
        link = self.links.get(endpoint)
        if link is not None:
            return link
        try:
            server_key = rx.transport.server_key_for(endpoint)  # "" when security is off
        except RejectedError as e:
            rx.stats.add("connect_errors")
            return f"not_authorized: {e.detail}"
        try:
            # No routing identity: the sender's ROUTER names each connection, so no other
            # key can take our route; after a reconnect we register again (on_monitor).
            dealer = connect_dealer(
                endpoint,
                rx.socket_limits,
                rx.settings.deadlines.send_timeout_ms,
                server_key=server_key,
            )
        except zmq.ZMQError as e:  # connect_problem let it through, libzmq did not
            rx.stats.add("connect_errors")
            return f"cannot connect to {endpoint!r}: {e}"
        try:
            # A name of our own: pyzmq's default (the socket's fd) can repeat after a close.
            monitor = dealer.get_monitor_socket(
                _MONITORED, f"inproc://kvxferd-rx-monitor-{next(_monitor_ids)}"
            )
        except zmq.ZMQError as e:
            dealer.close(linger=0)
            rx.stats.add("connect_errors")
            return f"cannot watch the connection to {endpoint!r}: {e}"
        link = Link(endpoint, dealer, monitor, 0.0, server_key)
        self.links[endpoint] = link
        self.by_socket[dealer] = link
        self.by_socket[monitor] = link
        self.register(link)
        return link

    def register(self, link: Link, waited: bool = False) -> None:
        """Send Register on ``link``; fetches wait for the reply (``register_timeout_ms``).

        ``waited``: the link waited for a NIXL agent; its deadline runs from the first try.
        """
        rx = self.rx
        if link.state is LinkState.READY:  # a DOWN link stays DOWN until the reply
            link.state = LinkState.REGISTERING
        if not waited:
            link.register_deadline = (
                time.monotonic() + rx.settings.deadlines.register_timeout_ms / 1000
            )
        if link.agent is None:
            link.agent = rx.agents.take()
            if link.agent is None:  # sent when a spare is ready ("agent_ready")
                rx.stats.add("registers_waiting_agent")
                return
        pool = rx.pool
        # The link probe's scratch region (version 4 only; none: the sender does not probe).
        scratch = rx.agents.scratch_bytes if link.version >= 4 else 0
        reg = wire.Register(
            receiver_id=rx.receiver_id,
            result_endpoint=rx.result_endpoint,
            agent_metadata=link.agent.metadata,
            layout=wire.WireLayout.of(pool.layout),
            kv_base=pool.kv_base,
            aux_base=pool.aux_base,
            device="VRAM" if pool.mem_type == "VRAM" else "DRAM",
            device_id=pool.device_id,
            topology=rx.topology,
            scratch_base=rx.agents.scratch_base if scratch else 0,
            scratch_bytes=scratch,
        )
        self.flush(link)
        try:
            send_bounded(link.dealer, wire.encode(reg, link.version))
        except SendTimeout:
            self.drop(link, Reason.PEER_LOST, "REGISTER could not be sent")
            return
        rx.stats.add("registers_sent")

    def fall_back(self, link: Link) -> bool:
        """The sender refused ``link``'s Register as unsupported_version: register again at
        the previous version (once per connection; counted). False when it may not."""
        if link.ready or link.fell_back or link.version <= wire.MIN_PROTOCOL_VERSION:
            return False
        link.version, link.fell_back = wire.MIN_PROTOCOL_VERSION, True
        self.rx.stats.add("register_version_fallbacks")
        log.info(
            "sender at %s speaks an older protocol: registering at version %d",
            link.endpoint,
            link.version,
        )
        self.register(link, waited=True)
        return True

    def agent_ready(self) -> None:
        """A spare NIXL agent: links waiting for one register."""
        for link in list(self.links.values()):
            if link.agent is None and not link.ready and not link.disconnected:
                self.register(link, waited=True)

    def close(self, link: Link) -> None:
        if link.batch:
            self.flush(link)
        self.tear_down(link)
        if self.links.get(link.endpoint) is link:
            del self.links[link.endpoint]
        self.by_socket.pop(link.dealer, None)
        self.by_socket.pop(link.monitor, None)
        try:
            link.dealer.disable_monitor()
        except zmq.ZMQError:
            pass
        link.monitor.close(linger=0)
        link.dealer.close(linger=0)

    def close_all(self) -> None:
        for link in list(self.links.values()):
            self.close(link)

    def drop(self, link: Link, reason: Reason, detail: str) -> None:
        """Close ``link``; the fetches waiting for its registration fail with ``reason``."""
        rx = self.rx
        waiting, link.waiting = link.waiting, []
        self.close(link)
        rx.stats.add("links_dropped")
        for f in waiting:
            rx.fetches.fail(f, reason, detail)
        rx.groups.fail_waiting_on(link.endpoint, reason, f"{link.endpoint}: {detail}")

    def link_down(self, link: Link, detail: str) -> None:
        """``link`` is down: every fetch toward it ends now, not at its deadline.

        A fetch whose RequestData never left fails ``peer_lost`` (nothing can be written).
        One sent ends ``failed``/``peer_lost`` with its fence in doubt at once: a write of
        it may have been posted, and only proof (an answer, a new incarnation) releases
        its blocks; the engine hears both now and decides. New fetches fail ``peer_lost``
        at once until the link is back.
        """
        rx = self.rx
        self.flush(link)  # a RequestData of this turn is sent: it may be accepted
        link.state = LinkState.DOWN
        rx.stats.add("links_down")
        log.warning("link to %s down: %s", link.endpoint, detail)
        waiting, link.waiting = link.waiting, []
        for f in waiting:
            rx.fetches.fail(f, Reason.PEER_LOST, detail)
        rx.groups.fail_waiting_on(link.endpoint, Reason.PEER_LOST, f"{link.endpoint}: {detail}")
        for f in rx.fetches.open_toward(link.endpoint):
            if not f.sent:
                rx.fetches.fail(f, Reason.PEER_LOST, detail)
            elif f.abandon(Reason.PEER_LOST, detail):
                rx.stats.add("fetches_failed")
                rx.stats.add(f"failed_{Reason.PEER_LOST}")
                rx.stats.add("fetches_ended_peer_down")
                rx.doubts.maybe_forget(f)
        # Our side of the data plane toward it goes: once it is destroyed, no write
        # addressed to it can land (with revocable transports), and that proof
        # (InDoubt.agent_torn) ends its doubts.
        self.tear_down(link)

    def tear_down(self, link: Link) -> None:
        """Have ``link``'s NIXL agent destroyed (its next Register takes a fresh one)."""
        agent, link.agent = link.agent, None
        if agent is not None:
            self.rx.agents.tear_down(agent)

    def peer_gone(self, link: Link, detail: str) -> None:
        """Discovery removed the sender and ``link`` is not connected: down, and closed."""
        self.removed.add(link.endpoint)
        self.link_down(link, detail)
        self.close(link)
        self.rx.stats.add("links_dropped")

    def on_peer_event(self, event: Any) -> None:
        """Discovery (io thread): dial a sender before its first fetch; re-register on a restart.

        Added: open the link (it registers at once, so the first fetch finds it ready).
        Changed: a new incarnation at a known link registers again now (the reply
        settles what was sent to the old one, see messages.py's ``on_register_reply``); a
        new endpoint is dialled. Removed: a link that is not connected is down now and
        closed (``peer_gone``); a connected idle one is closed; a connected one in use
        stays (a lease expiry is no proof of death: it may be an etcd problem while the
        data path is fine) until its connection drops, which closes it as down.
        """
        from kvxferd.discovery import PeerAdded, PeerChanged, PeerRemoved

        rx = self.rx
        rx.stats.add("discovery_events")
        if isinstance(event, PeerAdded | PeerChanged):
            peer = event.peer if isinstance(event, PeerAdded) else event.new
            self.removed.discard(peer.endpoint)
            if peer.public_key:  # the key to expect there, if our allow-list holds it
                learned = rx.transport.learn_key(peer.endpoint, peer.public_key)
                rx.stats.add("discovery_keys_learned" if learned else "discovery_keys_refused")
            known = self.links.get(peer.endpoint)
            if known is None:
                if len(self.links) < rx.settings.limits.max_peers:
                    self.open(peer.endpoint)
            elif known.ready and known.sender_id and known.sender_id != peer.incarnation:
                self.register(known)  # a restart seen by discovery before the sender said so
        elif isinstance(event, PeerRemoved):
            self.removed.add(event.peer.endpoint)
            link = self.links.get(event.peer.endpoint)
            if link is not None and (link.disconnected or not link.ever_connected):
                self.peer_gone(link, "discovery removed the sender and its link is down")
                return
            if link is None or link.waiting:
                if link is not None:
                    link.removed = True
                return
            if not rx.fetches.open_toward(link.endpoint):
                self.close(link)
            else:
                link.removed = True  # its connection dropping closes it (on_monitor)

    def on_monitor(self, link: Link) -> None:
        """libzmq's connection events of one link: reconnects register again."""
        stats = self.rx.stats
        for _ in range(64):
            if link.monitor.closed:
                return
            try:
                event = recv_monitor_message(link.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_CONNECTED:
                # A TCP connect is no sign of life (a frozen process's kernel accepts it):
                # a lost link is back only once its sender answers the Register.
                link.refused_since = None
                if link.disconnected:
                    # The sender may be a new process that never heard of us: tell it who we
                    # are; its reply says whether it is the same incarnation.
                    link.disconnected = False
                    stats.add("reconnects")
                    # Maybe another release there now: offer the newest version again.
                    link.version, link.fell_back = wire.PROTOCOL_VERSION, False
                    self.register(link)
                    if self.links.get(link.endpoint) is not link:
                        return
                link.ever_connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                link.disconnected = True
                if link.lost_since is None:
                    link.lost_since = time.monotonic()
                stats.add("disconnects")
                if link.removed:  # discovery removed it and now its connection dropped
                    self.peer_gone(link, "discovery removed the sender and its link dropped")
                    return
            elif event & HANDSHAKE_FAILED:  # a sender presenting another key, or plaintext
                stats.add(f"handshakes_failed_{handshake_kind(event)}")
            elif event == zmq.EVENT_CONNECT_RETRIED:
                stats.add("connect_retries")  # a redial, refused or lost (backs off)
                if not link.ever_connected and link.refused_since is None:
                    link.refused_since = time.monotonic()

    def check_deadlines(self, now: float) -> None:
        """Links lost for peer_down_ms go down; links not registered in time are dropped."""
        d = self.rx.settings.deadlines
        refused_s = d.connect_refused_ms / 1000
        down_s = d.peer_down_ms / 1000
        for link in list(self.links.values()):
            if not link.down and link.lost_since is not None and now - link.lost_since >= down_s:
                self.link_down(link, f"connection to {link.endpoint} lost, not back in {down_s:g}s")
                continue
            if link.ready or link.down:
                continue
            if link.refused_since is not None and now - link.refused_since >= refused_s:
                self.drop(
                    link,
                    Reason.PEER_LOST,
                    f"connection to {link.endpoint} refused for {refused_s:g}s",
                )
            elif now >= link.register_deadline:
                self.drop(link, Reason.TIMEOUT, f"no REGISTER reply from {link.endpoint}")

    # -- what goes out on a link ---------------------------------------------------------
    def batch(self, link: Link, f: RxSession, frame: bytes, was_sent: bool) -> None:
        """Queue ``f``'s RequestData on ``link``: sent with this turn's batch (or when full)."""
        if not link.batch:
            self.batched.append(link)
        link.batch.append((f, frame, was_sent))
        if len(link.batch) >= wire.MAX_BATCH:
            self.flush(link)

    def flush_all(self) -> None:
        """Send every link's RequestData batch of this turn."""
        batched, self.batched = self.batched, []
        for link in batched:
            self.flush(link)

    def flush(self, link: Link) -> None:
        rx = self.rx
        batch, link.batch = link.batch, []
        if not batch or link.dealer.closed:
            return
        try:
            send_bounded_many(link.dealer, [frame for _, frame, _ in batch])
        except SendTimeout:
            rx.stats.add("send_timeouts", len(batch))
            for f, _, was_sent in batch:
                if not was_sent:  # nothing left: no write can come for it
                    rx.fetches.fail(
                        f, Reason.PEER_LOST, "REQUEST_DATA could not be sent (sender not reading)"
                    )
                # A resend that could not leave: the fetch's own deadline still ends it.
            return
        rx.stats.add("requests_sent", len(batch))
        rx.pacing.sent_at = time.monotonic()

    def send_cancel(self, f: RxSession) -> None:
        """Cancel ``f`` at its sender: on a registered link, else (re)open one for next time
        (not to a sender discovery removed: nothing dials it until it is back)."""
        if f.sender_endpoint in self.removed:
            return
        link = self.open(f.sender_endpoint)
        if isinstance(link, str) or not link.ready:
            return  # the fence deadline, or the next in-doubt retry, covers it
        self.flush(link)  # a RequestData of this turn goes first
        try:
            send_bounded(
                link.dealer,
                wire.encode(
                    wire.Cancel(request_id=f.request_id, fetch_id=f.fetch_id), link.version
                ),
            )
            self.rx.stats.add("cancels_sent")
        except SendTimeout:
            self.rx.stats.add("send_timeouts")  # the fence deadline still bounds the wait
