"""Who owns what on a sender: receiver ids and NIXL agent names bound to the identity that registered them.

An identity is what :func:`kvxferd.auth.peer_identity` read from a message: the
CURVE key ZAP authenticated, or ``""`` for every peer when security is off (one
anonymous owner: then nothing here refuses anything that was accepted before).

The table, per ``receiver_id`` (a receiver incarnation; also what its fetches are
keyed by)::

    state      meaning                                   -> next
    ---------  ----------------------------------------  -----------------------------------
    (none)     nobody holds this id or its NIXL name     Register accepted -> live
    live       a registered peer uses it                 peer left the table (evicted,
                                                         replaced, invalidated) -> released
    released   no peer uses it; its fetches and parked   Register by the same identity -> live;
               fetches may still be open; still bound    no fetch open, none parked and
               (nobody else may take the id or name)     orphan_ttl passed -> (none) (reap)

Invariants (the sender's tests hold them):

* a ``receiver_id`` and a NIXL agent name are bound to at most one identity; a
  Register of either by another identity is refused ``not_authorized`` and
  changes nothing (no binding, no count, nothing removed);
* a binding is made only when a Register is accepted: a refused Register leaves
  no placeholder (the CVE-2026-94625 class: refused requests that left ownerless
  entries behind and starved valid ones while health stayed green);
* an identity's counts (live peers, open fetches, parked fetches) are the sums
  over its bindings, never negative, and bounded by :class:`IdentityLimits`
  (except the anonymous identity of security off: only the global limits hold);
* a binding nothing uses any more is reclaimed ``orphan_ttl`` after its peer left,
  so an identity that went away stops holding names; an identity with no binding
  left is forgotten at once. (The sender also removes a key's registered peer idle
  for ``orphan_ttl`` with nothing open; not the anonymous identity's.)

Not thread-safe on its own: the sender calls it with its registry lock held.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvxferd.auth import ANONYMOUS
from kvxferd.config import Limits

_SERDES_AGENT = b"nixlSerDes|Agent"  # how NIXL's serialised agent metadata starts
_NAME_MAX = 256


def nixl_agent_name(metadata: bytes) -> str | None:
    """The agent name in NIXL's serialised metadata, read without loading it; None if not that form.

    NIXL's ``nixlSerDes`` writes ``"nixlSerDes|Agent"``, the name's length (8 bytes,
    little-endian), the name and ``"|"``. Reading the name first lets the sender
    refuse another identity's agent *before* NIXL replaces that agent's connection
    details with the impostor's.
    """
    head = len(_SERDES_AGENT)
    if not metadata.startswith(_SERDES_AGENT) or len(metadata) < head + 8:
        return None
    n = int.from_bytes(metadata[head : head + 8], "little")
    end = head + 8 + n
    if not 0 < n <= _NAME_MAX or metadata[end : end + 1] != b"|":
        return None
    return metadata[head + 8 : end].decode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class IdentityLimits:
    """What one identity may hold at once on a sender, and how long unused state is kept."""

    max_peers: int  # registered receiver incarnations
    max_fetches: int  # fetches attached to a published request and not yet removed
    max_parked: int  # fetches parked until their request is published
    orphan_ttl_s: float  # a binding no peer uses is reclaimed this long after it left

    @classmethod
    def of(cls, limits: Limits) -> IdentityLimits:
        return cls(
            limits.max_peers_per_identity,
            limits.max_fetches_per_identity,
            limits.max_parked_per_identity,
            limits.orphan_ttl_ms / 1000,
        )


@dataclass(slots=True)
class _Binding:
    identity: str
    nixl_name: str
    live: bool = True
    released_at: float = 0.0
    fetches: int = 0
    parked: int = 0


@dataclass(slots=True)
class Usage:
    """One identity's counts: live peers, open fetches, parked fetches, ids it holds."""

    peers: int = 0
    fetches: int = 0
    parked: int = 0
    receiver_ids: set[str] = field(default_factory=set)


class Ownership:
    """The binding table and the per-identity counts (see the module docstring)."""

    def __init__(self, limits: IdentityLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._receivers: dict[str, _Binding] = {}  # receiver_id -> binding
        self._agents: dict[str, tuple[str, int]] = {}  # NIXL name -> (identity, bindings using it)
        self._usage: dict[str, Usage] = {}  # identity -> counts (only while it holds a binding)

    # -- who owns what -----------------------------------------------------------------
    def owner_of(self, receiver_id: str) -> str | None:
        """The identity ``receiver_id`` is bound to, or None when it is free."""
        b = self._receivers.get(receiver_id)
        return None if b is None else b.identity

    def agent_owner(self, nixl_name: str) -> str | None:
        """The identity the NIXL agent ``nixl_name`` is bound to, or None when it is free."""
        entry = self._agents.get(nixl_name)
        return None if entry is None else entry[0]

    def register_problem(
        self, identity: str, receiver_id: str, nixl_name: str | None
    ) -> str | None:
        """Why ``identity`` may not register ``receiver_id`` (with that agent), or None."""
        owner = self.owner_of(receiver_id)
        if owner is not None and owner != identity:
            return f"receiver_id {receiver_id} is registered by another identity"
        if nixl_name is not None:
            agent = self.agent_owner(nixl_name)
            if agent is not None and agent != identity:
                return f"NIXL agent {nixl_name} is registered by another identity"
        return None

    def peers_full(self, identity: str) -> bool:
        """True when ``identity`` holds ``max_peers`` live registrations (never for anonymous)."""
        return identity != ANONYMOUS and self.usage(identity).peers >= self.limits.max_peers

    def usage(self, identity: str) -> Usage:
        """The counts of ``identity`` (a fresh zero Usage when it holds nothing)."""
        return self._usage.get(identity) or Usage()

    def identities(self) -> dict[str, Usage]:
        """Every identity holding something (for /debug/state and tests)."""
        return dict(self._usage)

    # -- transitions ---------------------------------------------------------------------
    def bind(self, identity: str, receiver_id: str, nixl_name: str) -> None:
        """A Register of ``identity`` was accepted: (none|released) -> live. Call after
        :meth:`register_problem` said None (the caller holds the lock across both)."""
        b = self._receivers.get(receiver_id)
        usage = self._usage.setdefault(identity, Usage())
        if b is None:
            b = self._receivers[receiver_id] = _Binding(identity, nixl_name, live=False)
            usage.receiver_ids.add(receiver_id)
            self._ref_agent(identity, nixl_name, +1)
        elif b.nixl_name != nixl_name:  # the same incarnation with a new agent (re-registered)
            self._ref_agent(identity, b.nixl_name, -1)
            self._ref_agent(identity, nixl_name, +1)
            b.nixl_name = nixl_name
        if not b.live:
            b.live = True
            usage.peers += 1

    def release(self, receiver_id: str) -> None:
        """Its peer left the table (evicted, replaced, invalidated): live -> released."""
        b = self._receivers.get(receiver_id)
        if b is None or not b.live:
            return
        b.live, b.released_at = False, self._clock()
        self._usage[b.identity].peers -= 1

    def may_add(self, receiver_id: str, what: str) -> str | None:
        """Why one more fetch (``what`` = "fetches" or "parked") of ``receiver_id`` is refused, or None."""
        b = self._receivers.get(receiver_id)
        if b is None:
            return None  # not bound (cannot happen for a registered peer): nothing to count
        if b.identity == ANONYMOUS:
            return None
        usage = self._usage[b.identity]
        if what == "fetches" and usage.fetches >= self.limits.max_fetches:
            return f"max_fetches_per_identity ({self.limits.max_fetches}) reached"
        if what == "parked" and usage.parked >= self.limits.max_parked:
            return f"max_parked_per_identity ({self.limits.max_parked}) reached"
        return None

    def count(self, receiver_id: str, what: str, n: int) -> None:
        """Add ``n`` (may be negative) to ``receiver_id``'s open ``fetches`` or ``parked`` fetches."""
        b = self._receivers.get(receiver_id)
        if b is None:
            return
        usage = self._usage[b.identity]
        if what == "fetches":
            b.fetches = max(0, b.fetches + n)
            usage.fetches = max(0, usage.fetches + n)
        else:
            b.parked = max(0, b.parked + n)
            usage.parked = max(0, usage.parked + n)

    def unused(self, receiver_id: str) -> bool:
        """True when nothing of ``receiver_id`` is open or parked (its peer may be reclaimed)."""
        b = self._receivers.get(receiver_id)
        return b is None or (b.fetches == 0 and b.parked == 0)

    def reap(self) -> list[str]:
        """Reclaim released bindings unused for ``orphan_ttl``: released -> (none); their ids."""
        cutoff = self._clock() - self.limits.orphan_ttl_s
        gone = [
            rid
            for rid, b in self._receivers.items()
            if not b.live and b.fetches == 0 and b.parked == 0 and b.released_at <= cutoff
        ]
        for rid in gone:
            b = self._receivers.pop(rid)
            self._ref_agent(b.identity, b.nixl_name, -1)
            usage = self._usage[b.identity]
            usage.receiver_ids.discard(rid)
            if not usage.receiver_ids:
                del self._usage[b.identity]
        return gone

    def _ref_agent(self, identity: str, nixl_name: str, n: int) -> None:
        owner, refs = self._agents.get(nixl_name, (identity, 0))
        refs += n
        if refs > 0:
            self._agents[nixl_name] = (owner, refs)
        else:
            self._agents.pop(nixl_name, None)
