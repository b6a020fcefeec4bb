"""What other threads hand the receiver's io thread: one typed command each, run in order.

Engine threads (fetch, cancel), the drain, discovery's watcher, the link agents'
thread and the digest thread never touch the io thread's sockets or tables: they append one of these to the
receiver's command queue (under its lock) and wake the io thread, which runs them in
order at the start of its next turn (``Receiver._run_commands``, a ``match``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvxferd.transfer.session import RxGroup, RxSession


@dataclass(frozen=True, slots=True)
class StartFetch:
    """An engine's fetch, admitted: send its RequestData (or queue it on its link)."""

    rx: RxSession


@dataclass(frozen=True, slots=True)
class StartGroup:
    """An engine's fetch from a prefill instance: plan its pieces once the record is known."""

    group: RxGroup


@dataclass(frozen=True, slots=True)
class Cancel:
    """The engine cancels (or closes) a fetch or a group."""

    target: RxSession | RxGroup


@dataclass(frozen=True, slots=True)
class CancelPiece:
    """A piece of a group ended without its bytes: the other pieces are cancelled."""

    rx: RxSession


@dataclass(frozen=True, slots=True)
class DrainEnd:
    """Shutdown: the drain deadline passed with this fetch (or group) still open."""

    target: RxSession | RxGroup


@dataclass(frozen=True, slots=True)
class RetryInDoubt:
    """Shutdown: ask about every fetch in doubt now, not when its backoff says."""


@dataclass(frozen=True, slots=True)
class PeerEvent:
    """Discovery saw a sender come, change or go."""

    event: Any  # kvxferd.discovery's PeerAdded | PeerChanged | PeerRemoved


@dataclass(frozen=True, slots=True)
class AgentReady:
    """A spare NIXL agent is ready (link_agents.py): links waiting for one register."""


@dataclass(frozen=True, slots=True)
class AgentTorn:
    """The NIXL agent ``gen`` of a link is destroyed: what was sent through it ends."""

    gen: int


@dataclass(frozen=True, slots=True)
class DigestChecked:
    """The kvxferd-rx-digest thread computed a fetch's digest: apply its Result now."""

    check: Any  # receiver/digests.py's Check (it imports this module)
    ours: bytes | None  # None: it could not be computed


Command = (
    StartFetch
    | StartGroup
    | Cancel
    | CancelPiece
    | DrainEnd
    | RetryInDoubt
    | PeerEvent
    | AgentReady
    | AgentTorn
    | DigestChecked
)
