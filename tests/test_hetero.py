"""Heterogeneous prefill/decode sharding on real daemons: byte-exact against the torch reference.

Each prefill rank is a real Sender and each decode rank a real Receiver (in this
process, real ZMQ on loopback, real NIXL moving the bytes), each pool holding its
rank's packed KV as ``tests/test_topology_reshard.py``'s reference builds it. The
senders declare their records, publish with ``expected_fetches = readers_for(...)``;
each receiver declares its record and fetches naming the prefill instance
(``sender_endpoints``); every byte of every decode pool is then compared with the
reference's reshard. Refusals at REGISTER reach the fetch as a typed outcome.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.errors import Reason, RejectedError
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.reshard import readers_for
from kvxferd.transfer.sender import Sender
from kvxferd.transfer.session import RxState, TxState
from kvxferd.transfer.topology import LayoutKind, Topology
from tests.support.conditions import wait_until
from tests.test_topology_reshard import ELEM, SWEEP, Case, _World

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

DEADLINES: dict[str, int] = dict(
    kv_transfer_timeout_ms=10_000,
    cancel_fence_ms=1000,
    drain_timeout_ms=1000,
    shutdown_timeout_ms=3000,
    register_timeout_ms=5000,
)
WAIT_S = 15.0


def _pool(t: Topology, num_blocks: int) -> dict[str, Any]:
    return dict(
        num_layers=t.num_stage_layers,
        num_blocks=num_blocks,
        block_elems=t.block_bytes // ELEM,
        dtype="float16",
        aux_slots=2,
        aux_slot_bytes=64,
    )


class Daemons:
    """Senders and receivers of one test; all shut down in teardown."""

    def __init__(self) -> None:
        self.senders: list[Sender] = []
        self.receivers: list[Receiver] = []

    def sender(self, t: Topology | None, pool: dict[str, Any], **deadlines: int) -> Sender:
        settings = load_sender_settings(
            listen="tcp://127.0.0.1:0",
            deadlines={**DEADLINES, **deadlines},
            pool=pool,
            num_threads=1,
        )
        s = Sender(settings, topology=t).start()
        self.senders.append(s)
        return s

    def receiver(self, t: Topology | None, pool: dict[str, Any]) -> Receiver:
        r = Receiver(load_receiver_settings(deadlines=DEADLINES, pool=pool), topology=t).start()
        self.receivers.append(r)
        return r

    def close(self) -> None:
        for r in self.receivers:
            r.shutdown()
        for s in self.senders:
            s.shutdown()


@pytest.fixture
def daemons() -> Iterator[Daemons]:
    d = Daemons()
    try:
        yield d
    finally:
        d.close()


def _run_case(daemons: Daemons, case: Case, seed: int) -> None:
    """Publish the reference on every prefill rank, fetch it on every decode rank, compare."""
    w = _World(case, seed)
    senders = {}
    for t in w.prefill:
        s = daemons.sender(t, _pool(t, w.num_blocks[("p", t.rank)]))
        w.fill("p", t, s.pool.kv_bytes_view())
        senders[t.rank] = s
    endpoints = [senders[r].endpoint for r in range(len(w.prefill))]
    receivers = {}
    for d in w.decode:
        r = daemons.receiver(d, _pool(d, w.num_blocks[("d", d.rank)]))
        w.fill("d", d, r.pool.kv_bytes_view())
        receivers[d.rank] = r
    published = {}
    for t in w.prefill:
        readers = readers_for(w.decode[0], t)
        published[t.rank] = (
            readers,
            senders[t.rank].publish(
                "req-1", w.ids[("p", t.rank)].tolist(), expected_fetches=readers
            ),
        )
    handles = {
        d.rank: receivers[d.rank].fetch(
            "req-1",
            endpoints[0],
            w.ids[("d", d.rank)].tolist(),
            sender_endpoints=endpoints,
            want_aux=False,
        )
        for d in w.decode
    }
    for rank, h in handles.items():
        out = h.wait(WAIT_S)
        assert out is not None and out.state is RxState.DONE, (rank, out)
        assert h.close(WAIT_S), f"decode rank {rank}: blocks not reusable after done"
        got = receivers[rank].pool.kv_bytes_view()
        assert torch.equal(got, w.want[rank]), f"decode rank {rank} differs from the reference"
    for rank, (readers, tx) in published.items():
        out = tx.wait(WAIT_S)
        assert out is not None and out.state is TxState.COMPLETE, (rank, readers, out)
        assert len(tx.session.slices()) == readers
        assert senders[rank].stats.get("released_unread") == (readers == 0)


DAEMON_CASES: list[tuple[str, LayoutKind]] = [
    ("1P2D (TP1->TP2)", "heads_major"),
    ("1P2D (TP1->TP2)", "tokens_major"),
    ("2P1D (TP2->TP1)", "heads_major"),
    ("2P1D (TP2->TP1)", "heads_planes_tokens"),  # vLLM's CPU backend
    ("1P2D (TP1->TP2)", "heads_tokens_planes"),  # vLLM's [H, N, 2 * D] blocks
    ("2P4D", "tokens_major"),
    ("4P2D", "heads_major"),
    ("PP2->PP1", "heads_major"),
    ("PP3 TP2 -> PP2 TP1, uneven layers", "tokens_major"),
    ("GQA: prefill TP4 over 2 heads -> TP1", "heads_major"),
    ("GQA: TP1 -> decode TP4 over 2 heads", "tokens_major"),
    ("MLA 2->1", "heads_major"),
]


@pytest.mark.parametrize("name, layout", DAEMON_CASES)
def test_sweep_on_daemons(daemons: Daemons, name: str, layout: LayoutKind) -> None:
    """Every decode rank's pool equals the reference's reshard, byte for byte, and each prefill
    rank's request completes once its expected readers (0: at publish) have read it."""
    c = SWEEP[name]
    _run_case(daemons, Case(**{**c.__dict__, "p_layout": layout, "d_layout": layout}), seed=11)


def _pair(
    daemons: Daemons, prefill: Topology, decode: Topology, *, sender_record: bool = True
) -> tuple[Sender, Receiver]:
    s = daemons.sender(prefill if sender_record else None, _pool(prefill, 8))
    r = daemons.receiver(decode, _pool(decode, 8))
    return s, r


def _refused_fetch(s: Sender, r: Receiver) -> tuple[Reason | None, str]:
    s.publish("req-r", [0, 1])
    h = r.fetch("req-r", s.endpoint, [2, 3], sender_endpoints=[s.endpoint], want_aux=False)
    out = h.wait(WAIT_S)
    assert out is not None, "a refused pair must end the fetch, never hang"
    assert out.state is RxState.FAILED
    assert h.close(WAIT_S), "nothing was sent: the blocks are reusable"
    return out.reason, out.detail


BASE = Case(4, 4, 2, 1, 1, 1, 1)


class TestRefusals:
    @pytest.mark.parametrize(
        "decode, text",
        [
            (
                BASE.instance(1, 1, "heads_major", tokens_per_block=8)[0],
                "tokens_per_block: prefill 4 != decode 8",
            ),
            (
                Case(4, 4, 2, 1, 1, 1, 1, d_layout="tokens_major").decode[0],
                "layout: prefill heads_major -> decode tokens_major is not served",
            ),
            (Case(4, 4, 2, 1, 1, 1, 1, model="other").decode[0], "compat hash: prefill"),
        ],
        ids=["block size", "layout", "compat hash"],
    )
    def test_register_refuses_what_the_mapping_cannot_serve(
        self, daemons: Daemons, decode: Topology, text: str
    ) -> None:
        """A pair the mapping cannot serve is refused at REGISTER with incompatible and the
        mapping's text, counted, and the fetch ends failed with both: no hang, no bytes."""
        s, r = _pair(daemons, BASE.prefill[0], decode)
        reason, detail = _refused_fetch(s, r)
        assert reason is Reason.INCOMPATIBLE and text in detail
        assert s.stats.get("topology_refused") == 1
        assert s.stats.get("rejected_incompatible") >= 1

    def test_a_sender_without_a_record_is_refused_typed(self, daemons: Daemons) -> None:
        """Naming a prefill instance whose sender declared no topology fails incompatible."""
        s, r = _pair(daemons, BASE.prefill[0], BASE.decode[0], sender_record=False)
        reason, detail = _refused_fetch(s, r)
        assert reason is Reason.INCOMPATIBLE and "declared no topology" in detail

    def test_wrong_instance_size_is_refused(self, daemons: Daemons) -> None:
        """A list of endpoints that is not the instance (here one rank of TP2) fails incompatible."""
        c = SWEEP["2P1D (TP2->TP1)"]
        s, r = _pair(daemons, c.prefill[0], c.decode[0])
        reason, detail = _refused_fetch(s, r)
        assert reason is Reason.INCOMPATIBLE and "the instance has 2 ranks" in detail

    def test_endpoints_out_of_rank_order_are_refused(self, daemons: Daemons) -> None:
        """4P2D with ranks 1 and 2 swapped in the list: the piece planned for rank 1 is not
        sent to rank 2's sender; the fetch fails incompatible naming the rank."""
        w = _World(SWEEP["4P2D"], 3)
        ss = [daemons.sender(t, _pool(t, w.num_blocks[("p", t.rank)])) for t in w.prefill]
        for t, s in zip(w.prefill, ss, strict=True):
            s.publish("req-o", w.ids[("p", t.rank)].tolist())
        d = w.decode[0]
        r = daemons.receiver(d, _pool(d, w.num_blocks[("d", 0)]))
        eps = [ss[0].endpoint, ss[2].endpoint, ss[1].endpoint, ss[3].endpoint]
        h = r.fetch("req-o", eps[0], w.ids[("d", 0)].tolist(), sender_endpoints=eps, want_aux=False)
        out = h.wait(WAIT_S)
        assert out is not None and out.state is RxState.FAILED, out
        assert out.reason is Reason.INCOMPATIBLE and "is prefill rank 2" in out.detail, out
        assert h.close(WAIT_S)

    def test_a_record_must_describe_the_pool(self, daemons: Daemons) -> None:
        """Declaring a record whose block size is not the pool's is refused incompatible."""
        c = SWEEP["1P2D (TP1->TP2)"]
        r = daemons.receiver(None, _pool(c.decode[0], 8))
        with pytest.raises(RejectedError) as e:
            r.declare_topology(c.prefill[0])
        assert (
            e.value.reason is Reason.INCOMPATIBLE
            and "does not describe this pool" in e.value.detail
        )

    def test_without_records_the_exact_rule_holds(self, daemons: Daemons) -> None:
        """A receiver with a record registering at a sender without one gets today's rule:
        unequal pools refused with the exact-layout text."""
        c = SWEEP["1P2D (TP1->TP2)"]
        s = daemons.sender(None, _pool(c.prefill[0], 8))
        r = daemons.receiver(c.decode[0], _pool(c.decode[0], 8))
        s.publish("req-x", [0])
        h = r.fetch("req-x", s.endpoint, [1], want_aux=False)
        out = h.wait(WAIT_S)
        assert out is not None and out.state is RxState.FAILED
        assert out.reason is Reason.INCOMPATIBLE and out.detail.startswith("block_bytes")


def _two_prefill_ranks(daemons: Daemons) -> tuple[_World, list[Sender], Receiver]:
    w = _World(SWEEP["2P1D (TP2->TP1)"], 5)
    ss = []
    for t in w.prefill:
        s = daemons.sender(t, _pool(t, w.num_blocks[("p", t.rank)]))
        w.fill("p", t, s.pool.kv_bytes_view())
        ss.append(s)
    d = w.decode[0]
    r = daemons.receiver(d, _pool(d, w.num_blocks[("d", d.rank)]))
    w.fill("d", d, r.pool.kv_bytes_view())
    return w, ss, r


def test_done_only_when_every_piece_is_done(daemons: Daemons) -> None:
    """2P1D with rank 1 publishing late: the fetch is not done while rank 1's piece is
    missing, and once it is done every byte is the reference's."""
    w, ss, r = _two_prefill_ranks(daemons)
    ss[0].publish("req-late", w.ids[("p", 0)].tolist())
    h = r.fetch(
        "req-late",
        ss[0].endpoint,
        w.ids[("d", 0)].tolist(),
        sender_endpoints=[s.endpoint for s in ss],
        want_aux=False,
    )
    assert h.wait(1.0) is None, "done before rank 1's piece arrived"
    ss[1].publish("req-late", w.ids[("p", 1)].tolist())
    out = h.wait(WAIT_S)
    assert out is not None and out.state is RxState.DONE, out
    assert torch.equal(r.pool.kv_bytes_view(), w.want[0])


def test_a_failed_piece_fails_the_fetch_and_cancels_the_rest(daemons: Daemons) -> None:
    """Rank 0 refuses its piece (a fetch token is missing) while rank 1's piece waits parked:
    the fetch fails at once with rank 0's reason, rank 1's piece is cancelled, and the
    blocks are reusable long before the fetch's own deadline."""
    w, ss, r = _two_prefill_ranks(daemons)
    ss[0].publish("req-tok", w.ids[("p", 0)].tolist(), token="a-token-of-sixteen-chars")
    h = r.fetch(
        "req-tok",
        ss[0].endpoint,
        w.ids[("d", 0)].tolist(),
        sender_endpoints=[s.endpoint for s in ss],
        want_aux=False,
        timeout_ms=30_000,
    )
    out = h.wait(WAIT_S)
    assert out is not None and out.state is RxState.FAILED, out
    assert out.reason is Reason.NOT_AUTHORIZED and out.detail.startswith("piece 0"), out
    assert h.close(5.0), "rank 1's piece was not cancelled: its fence waits for the deadline"


def test_a_reader_that_never_comes_is_reclaimed_by_the_lease(daemons: Daemons) -> None:
    """1P2D where only decode rank 0 reads: the request expires at the publish TTL (the
    readers' lease), counted in reader_lease_expired, and rank 0's bytes are exact."""
    w = _World(SWEEP["1P2D (TP1->TP2)"], 4)
    p, d = w.prefill[0], w.decode[0]
    s = daemons.sender(p, _pool(p, w.num_blocks[("p", 0)]), publish_ttl_ms=1500)
    w.fill("p", p, s.pool.kv_bytes_view())
    r = daemons.receiver(d, _pool(d, w.num_blocks[("d", 0)]))
    w.fill("d", d, r.pool.kv_bytes_view())
    tx = s.publish("req-l", w.ids[("p", 0)].tolist(), expected_fetches=readers_for(d, p))
    h = r.fetch(
        "req-l", s.endpoint, w.ids[("d", 0)].tolist(), sender_endpoints=[s.endpoint], want_aux=False
    )
    out = h.wait(WAIT_S)
    assert out is not None and out.state is RxState.DONE, out
    assert torch.equal(r.pool.kv_bytes_view(), w.want[0])
    ended = tx.wait(WAIT_S)
    assert ended is not None and ended.state is TxState.EXPIRED, ended
    # Counted by the listener right after the session turned expired (no event for it).
    wait_until(lambda: s.stats.get("reader_lease_expired") == 1, WAIT_S, "the lease counted")
