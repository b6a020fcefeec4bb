"""Adoption: requests a draining sender of the group hands over, fetched into reserved blocks.

``[handover] adopt_blocks`` = N reserves the top N blocks of the pool (an engine publish
naming one is refused ``bad_blocks``) and a share of the aux slots. The adopter fetches
each accepted request from the draining sender with kvxferd's own receiver core
(kvxferd/transfer/receiver) over this sender's pool, with its own NIXL agent and result
endpoint: Register, RequestData with the request's fetch token, fences, in-doubt rules
and digests as for any fetch. Then it publishes the request from those blocks under the
same id and token, with the TTL it had left and the same expected fetches.

One request's reserved blocks (``AdoptBlocks``; the ``kvxferd-adopt`` thread moves them)::

    free --accepted (Handover, listener thread)----------------------> receiving
    receiving --the fetch done--> published (the same id and token, remaining TTL)
    receiving --failed, blocks reusable (no write can come)----------> free
    receiving --failed in doubt--> held until the receiver's fence resolves, then free
    published --the publish ended (fetched, expired, cancelled) and drained--> free

When this sender drains, it first takes no new Handover and waits (within its drain
deadline) for the fetches under way to publish (``finish_moves``): a request its source
already counts as moved is published here before publishing is refused.

A request refused (not enough free blocks, a layer count or aux size this pool cannot
take, no aux slot free for its publish, already published here, this sender draining)
stays with the draining sender. A request with aux holds one of the sender's aux slots
from its acceptance; it goes back to the sender's free list just before the publish takes
one (the list is last-in first-out: the same slot, unless an engine publish takes it in
between while no other slot is free).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvxferd.config import ReceiverSettings
from kvxferd.errors import ConfigError, Reason, RejectedError
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.pool import IdAllocator
from kvxferd.transfer.receiver import Receiver, RxHandle
from kvxferd.transfer.session import RxState

if TYPE_CHECKING:
    from kvxferd.transfer.sender.api import Sender, TxHandle

log = logging.getLogger("kvxferd.sender")

_TICK_S = 0.01


@dataclass(slots=True)
class Adopted:
    """One accepted request: its reserved blocks and where it is."""

    item: wire.HandoverItem
    blocks: np.ndarray
    fetch: RxHandle | None = None
    publish: TxHandle | None = None
    accepted_at: float = 0.0
    aux_slot: int = -1  # a sender aux slot held for its publish (the request has aux), or -1


class AdoptBlocks:
    """The reserved blocks' free list (its own lock): ``take`` / ``give_back``."""

    def __init__(self, first: int, count: int) -> None:
        self.first, self.count = first, count
        self._free = list(range(first + count - 1, first - 1, -1))
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)

    def take(self, n: int) -> np.ndarray | None:
        with self._lock:
            if n > len(self._free):
                return None
            out = self._free[-n:]
            del self._free[-n:]
        return np.array(out[::-1], dtype=np.int64)

    def give_back(self, blocks: np.ndarray) -> None:
        with self._lock:
            self._free.extend(int(b) for b in blocks)


def _adopt_endpoint(listen: str) -> str:
    """The embedded receiver's result endpoint, beside the listener's."""
    if listen.startswith("ipc://"):
        return listen + ".adopt"
    m = re.match(r"^tcp://(.+):[0-9*]+$", listen)
    return f"tcp://{m.group(1) if m else '127.0.0.1'}:0"


class Adopter:
    """This sender's side of a handover: reserved blocks, the fetches, the re-publishes."""

    @classmethod
    def of(cls, sender: Sender) -> Adopter | None:
        n = sender.settings.handover.adopt_blocks
        return cls(sender, n) if n > 0 else None

    def __init__(self, sender: Sender, n: int) -> None:
        s = sender.settings
        layout = sender.pool.layout
        if n >= layout.num_blocks:
            raise ConfigError(
                f"handover.adopt_blocks = {n} leaves no block of the {layout.num_blocks} for "
                "the engine"
            )
        self._s = sender
        self.stats = sender.stats
        self.blocks = AdoptBlocks(layout.num_blocks - n, n)
        settings = ReceiverSettings(
            name=f"{s.name}-adopt"[:64],
            result_endpoint=_adopt_endpoint(s.listen),
            pool=s.pool,
            dataplane=s.dataplane,
            deadlines=s.deadlines,
            limits=s.limits,
            service=s.service,
            security=s.security,
        )
        self.rx = Receiver(settings, pool=sender.pool)
        # Its aux slots: a share of the sender's, taken out of the sender's allocator.
        k = max(1, min(n, layout.aux_slots // 4))
        mine = sender.aux_slots.take(k)
        self.rx.aux_slots = IdAllocator(layout.aux_slots)
        self.rx.aux_slots.take(layout.aux_slots)
        self.rx.aux_slots.give_back(mine.tolist())
        self._lock = threading.Lock()
        self._adopted: dict[str, Adopted] = {}  # request id -> its state
        self._stop = threading.Event()
        self._closing = threading.Event()  # this sender drains: no new Handover is taken
        self.rx.start()
        self._thread = threading.Thread(target=self._run, name="kvxferd-adopt", daemon=True)
        self._thread.start()

    @property
    def receiver_id(self) -> str:
        return self.rx.receiver_id

    def refuse_reserved(self, blocks: np.ndarray) -> None:
        """RejectedError(bad_blocks) for an engine publish naming a reserved block."""
        if blocks.size and int(blocks.max()) >= self.blocks.first:
            raise RejectedError(
                Reason.BAD_BLOCKS,
                f"blocks {self.blocks.first} and up are reserved for adopted requests "
                "(handover.adopt_blocks)",
            )

    # -- the Handover (listener thread) ---------------------------------------------------------
    def accept(self, msg: wire.Handover) -> wire.HandoverReply:
        """Take what fits into the reserved blocks; start fetching it from its sender."""
        s = self._s
        layout = s.pool.layout
        accepted: list[str] = []
        refused: list[wire.HandoverRefusal] = []
        started: list[Adopted] = []
        for item in msg.items:
            why = self._refusal(item, layout.num_layers, layout.aux_slot_bytes)
            blocks = None if why else self.blocks.take(item.blocks)
            aux_slot = -1
            if blocks is not None and item.aux_bytes > 0:
                try:  # held for its publish: a move never ends for want of an aux slot
                    aux_slot = int(s.aux_slots.take(1)[0])
                except RejectedError:
                    self.blocks.give_back(blocks)
                    blocks, why = None, (Reason.BUSY, "no free aux slot for its publish")
            if blocks is None:
                why = why or (
                    Reason.BUSY,
                    f"{item.blocks} blocks asked, {self.blocks.free} reserved blocks free",
                )
                refused.append(
                    wire.HandoverRefusal(request_id=item.request_id, reason=why[0], detail=why[1])
                )
                self.stats.add("handover_adopt_refused")
                continue
            self.stats.add("adopt_blocks_taken", int(blocks.size))
            a = Adopted(item, blocks, accepted_at=time.monotonic(), aux_slot=aux_slot)
            with self._lock:
                self._adopted[item.request_id] = a
            accepted.append(item.request_id)
            started.append(a)
        for a in started:
            self._fetch(a, msg.sender_endpoint)
        if accepted:
            log.info(
                "adopting %d request%s from %s (%d refused)",
                len(accepted),
                "" if len(accepted) == 1 else "s",
                msg.sender_endpoint,
                len(refused),
            )
        return wire.HandoverReply(receiver_id=self.receiver_id, accepted=accepted, refused=refused)

    def _refusal(
        self, item: wire.HandoverItem, layers: int, aux_bytes: int
    ) -> tuple[Reason, str] | None:
        s = self._s
        if s.draining or self._closing.is_set():
            return Reason.DRAINING, "this sender is draining too"
        if item.num_layers != layers:
            return Reason.INCOMPATIBLE, f"{item.num_layers} layers, this pool has {layers}"
        if item.aux_bytes > aux_bytes:
            return Reason.TOO_LARGE, f"aux of {item.aux_bytes} bytes > aux_slot_bytes"
        with s._lock:
            live = item.request_id in s.published.live
        with self._lock:
            live = live or item.request_id in self._adopted
        if live:
            return Reason.DUPLICATE, "already published or adopted here"
        return None

    def _fetch(self, a: Adopted, endpoint: str) -> None:
        item = a.item
        timeout_ms = min(item.ttl_ms, self._s.settings.deadlines.kv_transfer_timeout_ms)
        try:
            a.fetch = self.rx.fetch(
                item.request_id,
                endpoint,
                a.blocks,
                want_aux=item.aux_bytes > 0,
                timeout_ms=max(1, timeout_ms),
                token=item.token,
            )
        except RejectedError as e:
            log.warning("adopt %s: fetch refused: %s", item.request_id, e)
            self._end(a, "adopt_failed", reusable=True)

    # -- the kvxferd-adopt thread ---------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(_TICK_S):
            try:
                self._turn()
            except Exception:
                self._s.guard.caught("adopt")

    def _turn(self) -> None:
        with self._lock:
            adopted = list(self._adopted.values())
        for a in adopted:
            if a.publish is not None:
                session = a.publish.session
                if session.ended and session.drained:
                    a.publish.close(0)
                    self._end(a, "", reusable=True)
            elif a.fetch is not None:
                f = a.fetch.session
                if not f.ended:
                    continue
                if f.state is RxState.DONE:
                    self._publish(a)
                elif f.blocks_reusable:  # failed, and no write can still land in them
                    log.warning("adopt %s failed: %s", a.item.request_id, f.outcome)
                    self._end(a, "adopt_failed", reusable=True)
                # else: fenced or in doubt: kept out of the free list until it resolves

    def _publish(self, a: Adopted) -> None:
        assert a.fetch is not None
        item, outcome = a.item, a.fetch.session.outcome
        aux = outcome.aux if outcome is not None else None
        a.fetch.close(0)  # its aux slot back: the publish copies the aux into one of its own
        a.fetch = None
        ttl_s = item.ttl_ms / 1000 - (time.monotonic() - a.accepted_at)
        if a.aux_slot >= 0:  # back just before the publish takes one: the slot it held
            self._s.aux_slots.give_back([a.aux_slot])
            a.aux_slot = -1
        try:
            if ttl_s <= 0:
                raise RejectedError(Reason.EXPIRED, "its TTL passed while it moved")
            a.publish = self._s.publish(
                item.request_id,
                a.blocks,
                aux=aux or None,
                expected_fetches=item.expected_fetches,
                token=item.token or None,
                adopted_ttl_s=ttl_s,
            )
        except RejectedError as e:
            log.warning("adopt %s: publish refused: %s", item.request_id, e)
            self._end(a, "adopt_failed", reusable=True)
            return
        self.stats.add("handover_adopted")

    def _end(self, a: Adopted, result: str, *, reusable: bool) -> None:
        with self._lock:
            self._adopted.pop(a.item.request_id, None)
        if a.aux_slot >= 0:
            self._s.aux_slots.give_back([a.aux_slot])
            a.aux_slot = -1
        if result == "adopt_failed":
            self.stats.add("handover_adopt_failed")
        if reusable:
            self.blocks.give_back(a.blocks)
            self.stats.add("adopt_blocks_returned", int(a.blocks.size))

    def finish_moves(self, deadline: float) -> None:
        """This sender starts draining: take no new Handover, and let each fetch under way
        end and publish (within ``deadline``) before the drain refuses publishes."""
        self._closing.set()
        while time.monotonic() < deadline:
            with self._lock:
                moving = [
                    a
                    for a in self._adopted.values()
                    if a.publish is None
                    and a.fetch is not None
                    and (not a.fetch.session.ended or a.fetch.session.state is RxState.DONE)
                ]
            if not moving:
                return
            time.sleep(_TICK_S)  # poll: the kvxferd-adopt thread publishes them

    def close(self, timeout: float) -> None:
        """Stop the thread and shut the embedded receiver down, within ``timeout``."""
        t0 = time.monotonic()
        self._stop.set()
        self._thread.join(timeout / 4)
        self.rx.shutdown(max(0.05, timeout - (time.monotonic() - t0)))


def adopt_reply(sender: Sender, msg: wire.Handover) -> wire.HandoverReply:
    """The listener's answer to a Handover: the adopter's, or every request refused."""
    if sender.adopt is not None:
        return sender.adopt.accept(msg)
    refused = [
        wire.HandoverRefusal(
            request_id=i.request_id,
            reason=Reason.BUSY,
            detail="this sender adopts nothing (handover.adopt_blocks = 0)",
        )
        for i in msg.items
    ]
    sender.stats.add("handover_adopt_refused", len(refused))
    return wire.HandoverReply(receiver_id=sender.sender_id, refused=refused)
