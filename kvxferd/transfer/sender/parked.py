"""Fetches parked on a sender: a RequestData that arrived before its request was published.

One parked fetch's states::

    (none)  --park (RequestData, its request not published yet)--> parked
    parked  --take (its request is published: it is attached)-----> gone
    parked  --cancel (its receiver's Cancel)-----------------------> gone
    parked  --drop_receiver (a new incarnation replaced it)--------> gone
    parked  --expire (pending_fetch_ttl_ms, or its fetch deadline)-> gone
    parked  --clear (the sender drains: nothing can publish it)----> gone

The table keeps its counts in step itself, on every transition: the total
(``max_pending_fetches``), the keys ``(receiver_id, fetch_id)`` in use (a second
RequestData with a parked key is a duplicate), and each identity's parked count in
:class:`~kvxferd.transfer.ownership.Ownership` (``max_parked``). It has no lock of
its own: the sender calls it with its registry lock held, as it does Ownership.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from kvxferd.transfer import protocol as wire
from kvxferd.transfer.ownership import Ownership
from kvxferd.transfer.worker import Peer

Key = tuple[str, int]  # (receiver_id, fetch_id)


@dataclass(slots=True)
class Parked:
    """A REQUEST_DATA that arrived before its request was published."""

    peer: Peer
    msg: wire.RequestData
    dst: np.ndarray  # msg.dst_blocks, already converted and checked
    deadline: float  # parked until then
    fetch_deadline: float  # no write starts after it (see listener.py fetch_deadline_of)
    layers: tuple[int, int]  # the layers to write, checked (absolute ids for a mapped peer)
    parked_at: float = field(default_factory=time.monotonic)  # for /debug/state

    @property
    def key(self) -> Key:
        return (self.peer.receiver_id, self.msg.fetch_id)


class ParkedFetches:
    """Parked fetches by request id; the caller holds the sender's registry lock."""

    def __init__(self, ownership: Ownership) -> None:
        self._ownership = ownership
        self._by_request: dict[str, list[Parked]] = {}
        self._keys: set[Key] = set()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Parked]:
        """Every parked fetch (a snapshot: the table may change while it is read)."""
        return iter([p for ps in list(self._by_request.values()) for p in list(ps)])

    def holds(self, key: Key) -> bool:
        """True when a fetch with this key is parked (a second one is a duplicate)."""
        return key in self._keys

    def receivers(self) -> set[str]:
        """The receiver ids with a fetch parked (busy: not evicted)."""
        return {p.peer.receiver_id for ps in self._by_request.values() for p in ps}

    def park(self, request_id: str, p: Parked) -> None:
        """Park ``p`` (the caller checked the limits and that its key is free)."""
        self._by_request.setdefault(request_id, []).append(p)
        self._keys.add(p.key)
        self._count += 1
        self._ownership.count(p.peer.receiver_id, "parked", +1)

    def take(self, request_id: str) -> list[Parked]:
        """The fetches parked for ``request_id``, out of the table (its request is published)."""
        taken = self._by_request.pop(request_id, [])
        self._gone(taken)
        return taken

    def cancel(self, request_id: str, peer: Peer, fetch_id: int) -> Parked | None:
        """Take out the fetch ``fetch_id`` that ``peer`` parked for ``request_id``, if any."""
        parked = self._by_request.get(request_id, [])
        for p in parked:
            if p.peer is peer and p.msg.fetch_id == fetch_id:
                parked.remove(p)
                if not parked:
                    del self._by_request[request_id]
                self._gone([p])
                return p
        return None

    def drop_receiver(self, receiver_id: str) -> int:
        """Take out every fetch ``receiver_id`` parked (a new incarnation replaced it)."""
        dropped: list[Parked] = []
        for rid in list(self._by_request):
            ps = self._by_request[rid]
            keep = [p for p in ps if p.peer.receiver_id != receiver_id]
            if len(keep) != len(ps):
                dropped.extend(p for p in ps if p.peer.receiver_id == receiver_id)
                if keep:
                    self._by_request[rid] = keep
                else:
                    del self._by_request[rid]
        self._gone(dropped)
        return len(dropped)

    def expire(self, now: float) -> list[Parked]:
        """Take out every fetch parked past its deadline."""
        expired: list[Parked] = []
        for rid in list(self._by_request):
            ps = self._by_request[rid]
            keep = [p for p in ps if p.deadline > now]
            if len(keep) != len(ps):
                expired.extend(p for p in ps if p.deadline <= now)
                if keep:
                    self._by_request[rid] = keep
                else:
                    del self._by_request[rid]
        self._gone(expired)
        return expired

    def clear(self) -> list[Parked]:
        """Take out every parked fetch (the sender drains: nothing can publish them)."""
        every = [p for ps in self._by_request.values() for p in ps]
        self._by_request.clear()
        self._gone(every)
        return every

    def _gone(self, ps: list[Parked]) -> None:
        for p in ps:
            self._keys.discard(p.key)
            self._ownership.count(p.peer.receiver_id, "parked", -1)
        self._count -= len(ps)
