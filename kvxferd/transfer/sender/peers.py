"""The sender's peer table: the registered receivers by route, when each was last heard from.

One peer's states (a peer is one receiver incarnation: ``receiver_id`` = name-uuid)::

    (none)      --add (its Register admitted: admission.py)-------------------> registered
    registered  --take_replaced (a new receiver id at its route or endpoint)--> gone
    registered  --invalidate (a NIXL write toward it ended ERR)---------------> gone
    registered  --evict_idle (the table is full; it is idle and longest
                  unheard of its identity)-----------------------------------> gone
    registered  --reclaim_idle (a key's peer idle past orphan_ttl_ms)---------> gone

Every transition keeps the table in step itself: the routes (``_peers``), when each
route was last heard from (``_seen``), the receiver id's binding in
:class:`~kvxferd.transfer.ownership.Ownership` (bound by ``add``, released whenever a
peer leaves), and the last incarnation registered at each result endpoint (``_last_at``,
kept when that peer leaves, so its restart is still recognised at the next Register;
at most ``4 * max_peers`` of them, the oldest go first).

It has no lock of its own: the caller holds the sender's registry lock, except for
``get`` (one atomic read, for ``_note_heard``) and ``seen``/``heard_at`` (the
listener's own, never locked). What a peer leaving the table held (its NIXL agent,
its DEALERs, its fetches) is released by the caller (admission.py, api.py).
"""

from __future__ import annotations

import time

from kvxferd.auth import ANONYMOUS
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.ownership import Ownership
from kvxferd.transfer.worker import Peer


class PeerTable:
    """Registered receivers by routing id; the caller holds the sender's registry lock."""

    def __init__(self, ownership: Ownership, max_peers: int) -> None:
        self._ownership = ownership
        self._max_peers = max_peers
        self._peers: dict[bytes, Peer] = {}  # routing id -> peer
        self._seen: dict[bytes, float] = {}  # routing id -> last message (listener only)
        # result endpoint -> the last incarnation registered there, kept when that peer is
        # invalidated, so its restart is still recognised at the next Register.
        self._last_at: dict[str, Peer] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def get(self, routing_id: bytes) -> Peer | None:
        """The peer registered on this route (one atomic read: safe without the lock)."""
        return self._peers.get(routing_id)

    def peers(self) -> list[Peer]:
        return list(self._peers.values())

    def routes(self) -> dict[str, bytes]:
        """receiver id -> its route now (a receiver that reconnected answers on its new one)."""
        return {q.receiver_id: rid for rid, q in self._peers.items()}

    # -- the listener's own: when each route was last heard from (never locked) ------------
    def seen(self, routing_id: bytes, now: float | None = None) -> None:
        self._seen[routing_id] = time.monotonic() if now is None else now

    def heard_at(self) -> dict[bytes, float]:
        """routing id -> when its last message came (a copy)."""
        return dict(self._seen)

    # -- a Register ----------------------------------------------------------------------
    def register_problem(
        self, routing_id: bytes, msg: wire.Register, identity: str, agent: str | None
    ) -> str | None:
        """Why ``identity`` may not register ``msg`` on this route, or None.

        Another identity's receiver id, NIXL agent, route or result endpoint is never
        taken over: registering there would end, evict or redirect that identity's peer.
        """
        why = self._ownership.register_problem(identity, msg.receiver_id, agent)
        if why is not None:
            return why
        known = self._peers.get(routing_id)
        if known is not None and known.identity != identity:
            return "this connection's route is registered by another identity"
        for p in self._peers.values():
            if p.result_endpoint == msg.result_endpoint and p.identity != identity:
                return f"result_endpoint {msg.result_endpoint} is registered by another identity"
        last = self._last_at.get(msg.result_endpoint)
        if last is not None and self._ownership.owner_of(last.receiver_id) not in (None, identity):
            return f"result_endpoint {msg.result_endpoint} is registered by another identity"
        return None

    def is_again(
        self,
        routing_id: bytes,
        msg: wire.Register,
        agent: str | None,
        version: int = wire.PROTOCOL_VERSION,
    ) -> bool:
        """True when ``msg`` registers again the peer already on this route, unchanged
        (in the same negotiated version)."""
        known = self._peers.get(routing_id)
        return (
            known is not None
            and known.receiver_id == msg.receiver_id
            and known.version == version
            and known.topology == msg.topology
            and (agent is None or known.nixl_name == agent)
        )

    def take_replaced(self, routing_id: bytes, result_endpoint: str) -> list[Peer]:
        """Take out the peers a Register on this route and endpoint replaces.

        Only one process can bind a result endpoint: a new receiver id there (or on this
        route) means the old process is gone.
        """
        replaced = [
            p
            for rid, p in self._peers.items()
            if rid == routing_id or p.result_endpoint == result_endpoint
        ]
        for p in replaced:
            self._remove(p.routing_id)
        return replaced

    def last_at(self, result_endpoint: str) -> Peer | None:
        """The last incarnation registered at ``result_endpoint`` (maybe gone since)."""
        return self._last_at.get(result_endpoint)

    def full(self, identity: str) -> bool:
        """True when a new peer of ``identity`` finds no room (max_peers, or its own limit)."""
        return len(self._peers) >= self._max_peers or self._ownership.peers_full(identity)

    def evict_idle(self, identity: str, busy: set[str]) -> Peer | None:
        """Take out ``identity``'s least recently heard-from peer not in ``busy``, if any.

        Only a peer of the registering identity is evicted: a full table never lets one
        key push another key's receiver out. ``busy``: the receiver ids a write can still
        target (a fetch queued, writing or in doubt, or parked: admission.py).
        """
        idle = [
            rid
            for rid, peer in self._peers.items()
            if peer.receiver_id not in busy and peer.identity == identity
        ]
        if not idle:
            return None
        victim = min(idle, key=lambda rid: self._seen.get(rid, 0.0))
        peer = self._peers[victim]
        self._remove(victim)
        return peer

    def add(self, peer: Peer) -> None:
        """A Register was admitted: ``peer`` is registered on its route and bound to its key."""
        self._peers[peer.routing_id] = peer
        self._ownership.bind(peer.identity, peer.receiver_id, peer.nixl_name)
        self._last_at.pop(peer.result_endpoint, None)
        self._last_at[peer.result_endpoint] = peer  # newest last: the oldest go first
        while len(self._last_at) > 4 * self._max_peers:
            del self._last_at[next(iter(self._last_at))]

    # -- leaving ----------------------------------------------------------------------
    def invalidate(self, peer: Peer) -> bool:
        """Take out ``peer`` after a transport error; False when it had left already."""
        if self._peers.get(peer.routing_id) is not peer:
            return False  # already replaced, evicted or invalidated
        self._remove(peer.routing_id)
        return True

    def forget(self, peer: Peer) -> bool:
        """``peer`` (evicted or reclaimed) is forgotten at its endpoint; True when another
        peer still uses that endpoint (its DEALERs stay)."""
        if self._last_at.get(peer.result_endpoint) is peer:
            del self._last_at[peer.result_endpoint]
        return any(p.result_endpoint == peer.result_endpoint for p in self._peers.values())

    def reclaim_idle(self, now: float, ttl: float) -> list[Peer]:
        """Take out every key's peer not heard from for ``ttl`` seconds with nothing held.

        The anonymous identity of security off keeps its idle peers (only a full table
        evicts them).
        """
        idle = [
            rid
            for rid, p in self._peers.items()
            if p.identity != ANONYMOUS
            and now - self._seen.get(rid, now) >= ttl
            and self._ownership.unused(p.receiver_id)
        ]
        peers = [self._peers[rid] for rid in idle]
        for rid in idle:
            self._remove(rid)
        return peers

    def _remove(self, routing_id: bytes) -> None:
        peer = self._peers.pop(routing_id)
        self._seen.pop(routing_id, None)
        self._ownership.release(peer.receiver_id)
