"""Fetches from a prefill instance: one group of pieces, planned once rank 0's record is known.

A group (session.py's RxGroup) and where it sits here::

    admitted (engine thread) -> ``unplanned`` (counts toward max_fetches_in_flight)
    start (io thread): rank 0's record known (``records``) -> planned now
                       else its link registers; the group waits in ``resolving``
    RegisterReply ok with a record -> planned: one piece (an RxSession in the fetch table)
                       per prefill rank it needs; too many for the table -> busy
    RegisterReply without one, link dropped / down / key refused -> the group fails
    cancel / deadline before planning -> ended; its aux slot goes back (``forget``)

``unplanned`` is guarded by the receiver's ``_lock`` (engine threads admit into it);
``records`` and ``resolving`` are the io thread's only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvxferd.errors import Reason, RejectedError
from kvxferd.transfer import commands as cmd
from kvxferd.transfer.layout import check_blocks, check_layers
from kvxferd.transfer.receiver.fetches import _REQUEST_ID, _fetch_ids
from kvxferd.transfer.receiver.handle import RxHandle
from kvxferd.transfer.reshard import plan_rank
from kvxferd.transfer.session import RxGroup, RxSession, RxState
from kvxferd.transfer.topology import Topology, instance_ranks

if TYPE_CHECKING:
    from kvxferd.transfer.receiver.core import Receiver

NO_RECORD = "sender at {} declared no topology: a fetch from a prefill instance needs one"


class Groups:
    """Instance fetches: those not planned yet, and what planning needs."""

    def __init__(self, rx: Receiver) -> None:
        self.rx = rx
        # Each sender's record from its RegisterReply, the groups waiting for one (io
        # thread only), and the groups not planned yet (the receiver's ``_lock``).
        self.records: dict[str, Topology] = {}
        self.resolving: dict[str, list[RxGroup]] = {}
        self.unplanned: dict[int, RxGroup] = {}

    def admit(
        self,
        request_id: str,
        endpoints: list[str],
        block_ids: Sequence[int] | np.ndarray,
        layers: tuple[int, int] | None,
        want_aux: bool,
        timeout_ms: int | None,
        tokens: list[str],
        keys: list[str],
        digest: bool = False,
    ) -> RxHandle:
        """A fetch from a prefill instance: planned on the io thread once a record is known."""
        rx = self.rx
        if rx.topology is None:
            raise RejectedError(
                Reason.INCOMPATIBLE,
                "a fetch from a prefill instance needs this receiver's topology (declare it)",
            )
        if rx._draining.is_set():
            raise RejectedError(Reason.DRAINING, "receiver is draining")
        if not _REQUEST_ID.match(request_id):
            raise RejectedError(Reason.MALFORMED, "request id must be 1-256 printable ASCII chars")
        for what, extra in (("tokens", tokens), ("sender_keys", keys)):
            if extra and len(extra) != len(endpoints):
                raise RejectedError(
                    Reason.MALFORMED, f"{len(extra)} {what} for {len(endpoints)} sender endpoints"
                )
        for ep_ in endpoints:
            rx.fetches.check_dialable(ep_)
        keys = [
            rx.transport.server_key_for(e, keys[i] if keys else "") for i, e in enumerate(endpoints)
        ]
        blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if blocks.size > rx.settings.limits.max_blocks_per_request:
            raise RejectedError(Reason.TOO_LARGE, f"{blocks.size} blocks > max_blocks_per_request")
        check_blocks(rx.pool.layout, blocks, "destination blocks")
        lb, le = layers or (0, rx.pool.layout.num_layers)
        check_layers(rx.pool.layout, lb, le)
        aux_slot = int(rx.aux_slots.take(1)[0]) if want_aux else -1
        timeout_ms = timeout_ms or rx.settings.deadlines.kv_transfer_timeout_ms
        group = RxGroup(
            next(_fetch_ids),
            request_id,
            endpoints,
            blocks,
            lb,
            le,
            aux_slot,
            time.monotonic() + timeout_ms / 1000,
            tokens,
            keys,
            self.cancel_pieces,
        )
        group.digest = digest
        with rx._lock:
            if rx._draining.is_set():  # atomic with the drain's start, as in Fetches.admit
                refusal = RejectedError(Reason.DRAINING, "receiver is draining")
            elif len(rx.fetches.by_id) + len(self.unplanned) >= (
                rx.settings.limits.max_fetches_in_flight
            ):
                refusal = RejectedError(Reason.BUSY, "max_fetches_in_flight reached")
            else:
                self.unplanned[group.fetch_id] = group
                rx.enqueue_locked(cmd.StartGroup(group))
                rx.stats.add("instance_fetches")
                return RxHandle(rx, group)
        if aux_slot >= 0:
            rx.aux_slots.give_back([aux_slot])
        raise refusal

    def cancel_pieces(self, pieces: list[RxSession]) -> None:
        """A piece of a group ended without its bytes: the others are cancelled (io thread)."""
        for p in pieces:
            self.rx._command(cmd.CancelPiece(p))

    def start(self, g: RxGroup) -> None:
        """Plan ``g`` now if its instance's record is known, else register to learn it."""
        if g.ended:
            return self.forget(g)
        ep0 = g.sender_endpoints[0]
        if ep0 in self.records:
            return self.plan(g)
        link = self.rx.links.open(ep0)
        if isinstance(link, str):
            denied = link.startswith(Reason.NOT_AUTHORIZED)
            return self.fail(g, Reason.NOT_AUTHORIZED if denied else Reason.BAD_ENDPOINT, link)
        if link.ready:  # registered, and its reply carried no record
            return self.fail(g, Reason.INCOMPATIBLE, NO_RECORD.format(ep0))
        self.resolving.setdefault(ep0, []).append(g)
        return None

    def plan(self, g: RxGroup) -> None:
        """Plan ``g`` against the instance (derived from rank 0's record) and start its pieces."""
        rx = self.rx
        own, rec = rx.topology, self.records[g.sender_endpoints[0]]
        assert own is not None
        n = rec.tp_size * rec.pp_size
        if rec.rank != 0 or len(g.sender_endpoints) != n:
            return self.fail(
                g,
                Reason.INCOMPATIBLE,
                f"sender_endpoints lists {len(g.sender_endpoints)} endpoints, the first one "
                f"being prefill rank {rec.rank}: the instance has {n} ranks, rank 0 first",
            )
        try:
            plan = plan_rank(own, instance_ranks(rec))
        except RejectedError as e:
            rx.stats.add("topology_refused")
            return self.fail(g, e.reason, e.detail)
        lb, le = own.layer_begin + g.layer_begin, own.layer_begin + g.layer_end  # absolute
        pieces: list[RxSession] = []
        for piece in plan.pieces:
            p_lb, p_le = max(lb, piece.layer_begin), min(le, piece.layer_end)
            if p_lb >= p_le:
                continue
            r = piece.prefill_rank
            pieces.append(
                RxSession(
                    fetch_id=next(_fetch_ids),
                    request_id=g.request_id,
                    sender_endpoint=g.sender_endpoints[r],
                    dst_blocks=g.dst_blocks,
                    layer_begin=p_lb - own.layer_begin,  # layers of our pool, as always
                    layer_end=p_le - own.layer_begin,
                    aux_slot=g.aux_slot if not pieces else -1,
                    deadline=g.deadline,
                    token=g.tokens[r] if g.tokens else "",
                    sender_key=g.sender_keys[r],
                    on_end=rx.fetches.journal,
                    on_change=g.piece_changed,
                    prefill_rank=r,
                    prefill_compat=rec.compat,
                    digest=g.digest,
                )
            )
        limit = rx.settings.limits.max_fetches_in_flight
        with rx._lock:
            # Each piece is a fetch in flight: the group's one slot becomes len(pieces).
            room = limit - len(rx.fetches.by_id) - (len(self.unplanned) - 1)
            if len(pieces) <= room:
                self.unplanned.pop(g.fetch_id, None)
                if not g.plan(pieces):
                    return None
                for p in pieces:
                    rx.fetches.by_id[p.fetch_id] = p
        if len(pieces) > room:
            rx.stats.add("instance_fetches_busy")
            return self.fail(
                g,
                Reason.BUSY,
                f"max_fetches_in_flight {limit}: this fetch reads {len(pieces)} pieces, "
                f"room for {max(0, room)}",
            )
        rx.stats.add("instance_pieces", len(pieces))
        for p in pieces:
            rx.fetches.start(p)
        return None

    def fail(self, g: RxGroup, reason: Reason, detail: str) -> None:
        if g.fail(reason, detail):
            self.rx.stats.add("instance_fetches_failed")
        self.forget(g)

    def fail_waiting_on(self, endpoint: str, reason: Reason, detail: str) -> None:
        """The link to ``endpoint`` dropped, went down or was refused: the groups waiting
        for its record fail."""
        for g in self.resolving.pop(endpoint, []):
            self.fail(g, reason, detail)

    def end(self, g: RxGroup, state: RxState, reason: Reason, detail: str) -> None:
        """Cancel (or time out) a group: its open pieces are cancelled, each with its fence."""
        for p in g.end_locally(state, reason, detail):
            self.rx.fetches.cancel(p, state, reason, detail)
        self.forget(g)

    def forget(self, g: RxGroup) -> None:
        """An ended group not planned gives its aux slot back (a planned one's piece holds it)."""
        with self.rx._lock:
            gone = self.unplanned.pop(g.fetch_id, None) is not None
        if gone and not g.planned and g.aux_slot >= 0:
            self.rx.aux_slots.give_back([g.aux_slot])
            g.aux_slot = -1

    def on_record(self, endpoint: str, record: Topology | None) -> None:
        """A RegisterReply ok at ``endpoint``: the groups waiting for its record are planned."""
        if record is not None:
            self.records[endpoint] = record
        for g in self.resolving.pop(endpoint, []):
            if g.ended:
                self.forget(g)
            elif record is None:
                self.fail(g, Reason.INCOMPATIBLE, NO_RECORD.format(endpoint))
            else:
                self.plan(g)
