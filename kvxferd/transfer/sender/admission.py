"""Peers coming and going on a sender: a Register admitted in steps, and what a leaving peer held.

A Register is admitted on the listener thread, in four steps::

    1. validate      the result endpoint, the layout and topology, the NIXL agent's name
                     (read before NIXL loads anything): a refusal ends it here
    2. incarnations  under the registry lock: who owns what (owner refusal), the same
                     peer again (accepted as is), the incarnations it replaces, room in the
                     table (evict an idle peer of its identity, or refuse busy); then the
                     replaced ones end (``end_incarnation``) outside the lock
    3. load          the data plane loads the peer's NIXL metadata and prepares its
                     descriptor lists (``load_peer``; NIXL may block here)
    4. bind          under the lock the peer enters the table (peers.py); then the reply,
                     and its link probe is queued (link_probes.py) when it advertised scratch

Receivers are keyed by incarnation (``receiver_id`` = name-uuid, also their NIXL agent's
name), never by address. Which peer state changes how::

    event                                   what the sender does
    --------------------------------------  ------------------------------------------------
    Register, new receiver_id at the        the old incarnation is gone: its parked fetches
    result endpoint of a registered (or     dropped, its open fetches end peer_restarted, no
    invalidated) incarnation                write starts and no message is sent for it, its
                                            DEALERs closed, NIXL agent removed when no write
                                            is in flight (``end_incarnation``)
    a NIXL write ends ERR / is not posted   invalidated: out of the table (next RequestData
    by NIXL                                 gets unknown_peer, the receiver registers again
                                            and its agent is loaded afresh), NIXL agent
                                            removed when no write is in flight
    peer table full                         the longest-idle peer of that identity with no
                                            write possible toward it is evicted
    a key's peer idle past orphan_ttl_ms    reclaimed (``reclaim_orphans``)

What a leaving peer held is released here: ``end_incarnation`` (replaced), ``forget_peer``
(evicted, reclaimed); a NIXL agent is removed only once no write toward it is in flight
(peer_agents.py). An invalidated peer is ``Sender.peer_failed`` (a worker calls it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvxferd.endpoints import connect_problem
from kvxferd.errors import Reason
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.ownership import nixl_agent_name
from kvxferd.transfer.reshard import Piece, piece_for
from kvxferd.transfer.session import SliceState
from kvxferd.transfer.worker import ForgetTask, Peer

if TYPE_CHECKING:
    from kvxferd.transfer.sender.api import Sender

log = logging.getLogger("kvxferd.sender")


class Refused(Exception):
    """A Register is refused: the reason and detail its RegisterReply carries."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@dataclass(slots=True)
class _Incarnations:
    """What step 2 decided under the lock."""

    owner_problem: str | None = None  # another identity owns what it names
    again: bool = False  # the same peer registers again, unchanged
    replaced: list[Peer] = field(default_factory=list)  # taken out of the table
    unregistered: list[Peer] = field(default_factory=list)  # an earlier one, invalidated since
    full: bool = False
    evicted: Peer | None = None


class Admission:
    """Registers admitted and peers released, on the listener thread of ``sender``."""

    def __init__(self, sender: Sender) -> None:
        self._s = sender
        self.stats = sender.stats

    def on_register(
        self,
        routing_id: bytes,
        msg: wire.Register,
        identity: str = "",
        offered: int = wire.PROTOCOL_VERSION,
    ) -> None:
        """Admit ``msg`` (steps 1-4) and reply; a refusal is counted and replied.

        ``offered``: the version byte of its frame; the peer speaks ``wire.negotiate`` of
        it (recorded on it, counted), the RegisterReply already in that version.
        """
        version = wire.negotiate(offered)
        try:
            piece = self._validate(msg)  # 1
            # Read the NIXL agent's name before NIXL loads anything: loading an impostor's
            # metadata under the owner's name would replace the owner's connection details.
            agent = nixl_agent_name(msg.agent_metadata)
            if not self._incarnations(routing_id, msg, identity, agent, version):  # 2
                return
            peer = self.load_peer(routing_id, msg, identity, agent, piece, version)  # 3
        except Refused as r:
            return self._refuse(routing_id, r.reason, r.detail)
        self._bind(peer)  # 4
        self._s.listener.reply(routing_id, self._accepted())
        # The link's speed: measured off this thread (link_probes.py); no scratch, no probe.
        self._s.probes.request(peer, msg.scratch_base, msg.scratch_bytes)

    def _accepted(self) -> wire.RegisterReply:
        """The reply to an accepted Register: it carries this rank's record, if any."""
        return wire.RegisterReply(ok=True, sender_id=self._s.sender_id, topology=self._s.topology)

    def _refuse(self, routing_id: bytes, reason: Reason, detail: str) -> None:
        self.stats.add(f"rejected_{reason}")
        self.stats.add("registers_refused")
        self._s.listener.reply(
            routing_id,
            wire.RegisterReply(ok=False, sender_id=self._s.sender_id, reason=reason, detail=detail),
        )

    def _validate(self, msg: wire.Register) -> Piece | None:
        """Step 1: Refused unless ``msg`` can be served; the piece of this rank it reads."""
        s = self._s
        # Registers are taken while draining: a receiver may still come for a request
        # published before the drain (its fetch is served); any other fetch gets draining.
        why = connect_problem(msg.result_endpoint)
        if why:
            raise Refused(Reason.BAD_ENDPOINT, f"result_endpoint {why}")
        why = wire.check_compatible(s.pool.layout, msg.layout, s.topology, msg.topology)
        if why:
            if s.topology is not None and msg.topology is not None:
                self.stats.add("topology_refused")
            raise Refused(Reason.INCOMPATIBLE, why)
        if s.topology is not None and msg.topology is not None:
            return piece_for(msg.topology, s.topology)  # None: it reads nothing here
        return None

    def _incarnations(
        self,
        routing_id: bytes,
        msg: wire.Register,
        identity: str,
        agent: str | None,
        version: int = wire.PROTOCOL_VERSION,
    ) -> bool:
        """Step 2: settle the incarnations ``msg`` replaces; False when it was answered here
        (registered again, unchanged); Refused when it may not register."""
        s = self._s
        plan = _Incarnations()
        with s._lock:
            known = s.peers.get(routing_id)
            plan.owner_problem = s.peers.register_problem(routing_id, msg, identity, agent)
            plan.again = s.peers.is_again(routing_id, msg, agent, version)
            if plan.owner_problem is None and not plan.again:
                # Only one process can bind a result endpoint: a new receiver id there (or
                # on this route) means the old process is gone; what it held is released.
                plan.replaced = s.peers.take_replaced(routing_id, msg.result_endpoint)
                last = s.peers.last_at(msg.result_endpoint)
                if last is not None and last.receiver_id != msg.receiver_id:
                    if all(p is not last for p in plan.replaced):  # invalidated, not registered
                        plan.unregistered.append(last)
                plan.full = known is None and not plan.replaced and s.peers.full(identity)
                plan.evicted = self._evict_idle_locked(identity) if plan.full else None
        if plan.owner_problem is not None:
            self.stats.add("registers_refused_owner")
            log.warning("Register of %s refused: %s", msg.receiver_id, plan.owner_problem)
            raise Refused(Reason.NOT_AUTHORIZED, plan.owner_problem)
        if plan.again:
            s.peers.seen(routing_id)
            self.stats.add("registers_accepted")
            s.listener.reply(routing_id, self._accepted())
            return False
        for old in plan.replaced:
            if old.receiver_id == msg.receiver_id:
                # The same process on a new route: its NIXL agent is the one it sends. A new
                # agent means it destroyed the old one (a receiver's agent per link, torn
                # down when the link went down): nothing more is written or sent toward it.
                if agent is not None and old.nixl_name != agent:
                    s.agents.retire(old.nixl_name, True)
                continue
            self.end_incarnation(old, msg.receiver_id)
        for old in plan.unregistered:
            self.end_incarnation(old, msg.receiver_id, registered=False)
        if plan.evicted is not None:
            self.forget_peer(plan.evicted)
        elif plan.full:
            raise Refused(
                Reason.BUSY,
                "max_peers (or this identity's max_peers_per_identity) reached and every"
                " peer of this identity has work in flight",
            )
        return True

    def _evict_idle_locked(self, identity: str) -> Peer | None:
        """Evict ``identity``'s least recently heard-from peer no write can still target.

        A peer is idle when none of its fetches is queued, writing or in doubt and none is
        parked. Nothing can start a write toward it afterwards: fetches attach only under
        the registry lock (held here), and its next RequestData meets ``unknown_peer``
        (kvxferd's receiver then registers again).
        """
        s = self._s
        busy = s.published.busy_receivers()
        busy.update(s.parked.receivers())
        return s.peers.evict_idle(identity, busy)

    def load_peer(
        self,
        routing_id: bytes,
        msg: wire.Register,
        identity: str,
        agent: str | None,
        piece: Piece | None,
        version: int = wire.PROTOCOL_VERSION,
    ) -> Peer:
        """Step 3: the data plane loads the peer's NIXL metadata and prepares its lists.

        The one step that calls NIXL (``add_peer`` may block for seconds toward an
        unreachable address); it reads no table but the agent's owner. Refused when NIXL
        does not accept the metadata or the agent it names is another identity's.
        """
        s = self._s
        try:
            nixl_name = s.dataplane.add_peer(msg.agent_metadata)
        except Exception as e:
            raise Refused(Reason.INCOMPATIBLE, f"NIXL metadata not accepted: {e}"[:1024]) from e
        if agent is None:
            with s._lock:
                owner = s.ownership.agent_owner(nixl_name)
            if owner is not None and owner != identity:
                # Only metadata NIXL could not name in advance (a test double's) gets here.
                self.stats.add("registers_refused_owner")
                raise Refused(
                    Reason.NOT_AUTHORIZED,
                    f"NIXL agent {nixl_name} is registered by another identity",
                )
        # Registered again (after an invalidation) while writes of its last registration
        # are in flight: the agent just loaded stays; its deferred removal must not run.
        s.agents.registered(nixl_name)
        layout = msg.layout.to_layout()
        prepped = False
        try:
            # A peer read through the reshard mapping gets lists of its piece (False: it
            # gets piece descriptors per request); one that reads nothing here, none.
            if msg.topology is None or s.topology is None:
                prepped = s.dataplane.prepare_peer(
                    nixl_name, layout, msg.kv_base, msg.device, msg.device_id
                )
            elif piece is not None:
                prepped = s.dataplane.prepare_piece(
                    nixl_name,
                    piece,
                    msg.topology,
                    msg.kv_base,
                    layout.num_blocks,
                    msg.device,
                    msg.device_id,
                )
        except Exception:  # the protocol says False, never raises; a bug costs only speed
            log.exception("preparing descriptors for %s failed", msg.receiver_id)
        return Peer(
            msg.receiver_id,
            routing_id,
            msg.result_endpoint,
            nixl_name,
            layout,
            msg.kv_base,
            msg.aux_base,
            msg.device,
            msg.device_id,
            prepped,
            identity,  # also the key its result ROUTER presents (CURVE)
            msg.topology if s.topology is not None else None,
            piece,
            version,
        )

    def _bind(self, peer: Peer) -> None:
        """Step 4: the peer enters the table."""
        s = self._s
        with s._lock:
            s.peers.add(peer)
        s.peers.seen(peer.routing_id)
        self.stats.add("peers_registered")
        if peer.version < wire.PROTOCOL_VERSION:
            self.stats.add("peers_registered_previous_version")
        self.stats.add("registers_accepted")
        log.info("receiver %s registered (results at %s)", peer.receiver_id, peer.result_endpoint)

    # -- what a leaving peer held ------------------------------------------------------------
    def end_incarnation(self, old: Peer, new_id: str, registered: bool = True) -> None:
        """A new receiver process replaced ``old``: drop what the old one held, end its fetches.

        Its parked fetches are dropped; its open fetches end ``peer_restarted`` (a write in
        flight toward it still holds the session undrained until NIXL returns); no write
        starts toward it and no Result is sent for it (``peer_gone``); its NIXL agent and
        prepared list go once no write toward it is in flight; the workers' DEALERs to its
        endpoint are closed without linger (what they queued was for the dead process).
        ``registered``: False for an incarnation invalidated earlier (already retired).
        """
        s = self._s
        with s._lock:
            s.parked.drop_receiver(old.receiver_id)
            open_fetches = s.published.fetches_of(old.receiver_id)
        if registered:
            s.agents.retire(old.nixl_name, gone=True)
        else:
            s.agents.mark_gone(old.nixl_name)
        detail = f"receiver {old.receiver_id} restarted (now {new_id})"
        ended = 0
        for key, session in open_fetches:
            sl = session.slice(key)
            if sl is not None and sl.state in (SliceState.QUEUED, SliceState.WRITING):
                session.fail_slice(sl, Reason.PEER_RESTARTED, detail)
                session.fail(Reason.PEER_RESTARTED, detail)
                ended += 1
        for i, w in enumerate(s._all_workers()):
            w.put(ForgetTask(old.result_endpoint, shared=i == 0, drop=True))
        s.probes.forget(old)
        self.stats.add("peers_replaced")
        if ended:
            self.stats.add("fetches_ended_peer_restarted", ended)
        log.info(
            "receiver %s replaced by %s: %d open fetch%s ended peer_restarted",
            old.receiver_id,
            new_id,
            ended,
            "" if ended == 1 else "es",
        )

    def forget_peer(self, peer: Peer, reclaimed: bool = False) -> None:
        """Release what an evicted (or reclaimed) peer held: its NIXL agent and DEALERs to it."""
        s = self._s
        s.agents.retire(peer.nixl_name, False)
        s.probes.forget(peer)
        with s._lock:
            still_used = s.peers.forget(peer)
        if not still_used:  # the listener never waits on a socket: the workers close them
            for i, w in enumerate(s._all_workers()):
                w.put(ForgetTask(peer.result_endpoint, shared=i == 0))
        if reclaimed:
            self.stats.add("peers_reclaimed")
            log.info("receiver %s reclaimed: idle past orphan_ttl_ms", peer.receiver_id)
            return
        self.stats.add("peers_evicted")
        log.info("receiver %s evicted: peer table full, it was the longest idle", peer.receiver_id)

    def reclaim_orphans(self, now: float) -> None:
        """Reclaim what identities no longer use (listener thread; see ownership.py).

        A key's registered peer not heard from for ``orphan_ttl_ms`` with nothing open or
        parked leaves the table (its next message meets ``unknown_peer`` and kvxferd's
        receiver registers again); bindings no peer used for that long are released. The
        anonymous identity of security off keeps its idle peers, as before (only a full
        table evicts them).
        """
        s = self._s
        ttl = s.ownership.limits.orphan_ttl_s
        with s._lock:
            peers = s.peers.reclaim_idle(now, ttl)
            gone = s.ownership.reap()
        for p in peers:
            self.forget_peer(p, reclaimed=True)
        if gone:
            self.stats.add("bindings_reclaimed", len(gone))
