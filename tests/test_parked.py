"""The sender's table of parked fetches (kvxferd/transfer/sender/parked.py): every transition keeps its counts in step.

A pure table (the sender's registry lock is the caller's): a random walk of park,
take, cancel, drop_receiver, expire and clear, checked after every step against a
plain model: the total, the keys in use (duplicates), each identity's parked count in
Ownership, and which fetches each operation hands back.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.config import Limits
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.layout import Layout
from kvxferd.transfer.ownership import IdentityLimits, Ownership
from kvxferd.transfer.sender.parked import Parked, ParkedFetches
from kvxferd.transfer.worker import Peer

pytestmark = pytest.mark.timeout(60)

RECEIVERS = {"rx-a": "key-1", "rx-b": "key-1", "rx-c": "key-2"}  # receiver id -> identity
REQUESTS = ("req-0", "req-1", "req-2")
LAYOUT = Layout(1, 8, 64, "uint8", 1, 64)


def _peer(rid: str) -> Peer:
    return Peer(rid, rid.encode(), f"ipc://{rid}", f"{rid}-agent", LAYOUT, 0, 0, "DRAM", 0)


PEERS = {rid: _peer(rid) for rid in RECEIVERS}


def _parked(rid: str, request_id: str, fetch_id: int, deadline: float) -> Parked:
    msg = wire.RequestData(request_id=request_id, fetch_id=fetch_id, dst_blocks=[0])
    return Parked(PEERS[rid], msg, np.zeros(1, dtype=np.int64), deadline, deadline, (0, 1))


def _table() -> tuple[ParkedFetches, Ownership]:
    own = Ownership(IdentityLimits.of(Limits()))
    for rid, identity in RECEIVERS.items():
        own.bind(identity, rid, f"{rid}-agent")
    return ParkedFetches(own), own


def _check(table: ParkedFetches, own: Ownership, model: dict[tuple[str, int], Parked]) -> None:
    assert len(table) == len(model)
    assert {p.key for p in table} == set(model)
    for key in model:
        assert table.holds(key)
    assert table.receivers() == {rid for rid, _ in model}
    for identity in set(RECEIVERS.values()):
        held = sum(1 for rid, _ in model if RECEIVERS[rid] == identity)
        assert own.usage(identity).parked == held, identity


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("park"),
            st.sampled_from(sorted(RECEIVERS)),
            st.sampled_from(REQUESTS),
            st.integers(0, 5),
            st.integers(1, 9),
        ),
        st.tuples(st.just("take"), st.sampled_from(REQUESTS)),
        st.tuples(
            st.just("cancel"),
            st.sampled_from(sorted(RECEIVERS)),
            st.sampled_from(REQUESTS),
            st.integers(0, 5),
        ),
        st.tuples(st.just("drop"), st.sampled_from(sorted(RECEIVERS))),
        st.tuples(st.just("expire"), st.integers(0, 10)),
        st.tuples(st.just("clear")),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_every_transition_keeps_the_counts_in_step(ops: list[tuple[object, ...]]) -> None:
    table, own = _table()
    model: dict[tuple[str, int], Parked] = {}
    for op in ops:
        kind = op[0]
        if kind == "park":
            _, rid, req, fid, deadline = op
            key = (str(rid), int(fid))  # type: ignore[call-overload]
            if key in model:  # the sender refuses a duplicate before parking
                assert table.holds(key)
                continue
            p = _parked(str(rid), str(req), int(fid), float(deadline))  # type: ignore[arg-type]
            table.park(str(req), p)
            model[key] = p
        elif kind == "take":
            got = table.take(str(op[1]))
            want = [p for p in model.values() if p.msg.request_id == op[1]]
            assert sorted(p.key for p in got) == sorted(p.key for p in want)
            for p in got:
                del model[p.key]
        elif kind == "cancel":
            _, rid, req, fid = op
            got1 = table.cancel(str(req), PEERS[str(rid)], int(fid))  # type: ignore[call-overload]
            key = (str(rid), int(fid))  # type: ignore[call-overload]
            hit = model.get(key)
            if hit is not None and hit.msg.request_id == req:
                assert got1 is hit
                del model[key]
            else:
                assert got1 is None
        elif kind == "drop":
            n = table.drop_receiver(str(op[1]))
            gone = [k for k in model if k[0] == op[1]]
            assert n == len(gone)
            for k in gone:
                del model[k]
        elif kind == "expire":
            now = float(op[1])  # type: ignore[arg-type]
            got = table.expire(now)
            want_keys = {k for k, p in model.items() if p.deadline <= now}
            assert {p.key for p in got} == want_keys
            for k in want_keys:
                del model[k]
        else:
            got = table.clear()
            assert {p.key for p in got} == set(model)
            model.clear()
        _check(table, own, model)


def test_a_cancel_names_its_request_and_its_peer() -> None:
    """A Cancel takes out only the fetch of that request, parked by that very peer."""
    table, own = _table()
    p = _parked("rx-a", "req-0", 1, 5.0)
    table.park("req-0", p)
    assert table.cancel("req-1", PEERS["rx-a"], 1) is None  # another request
    assert table.cancel("req-0", _peer("rx-a"), 1) is None  # an equal peer, not the same one
    assert table.cancel("req-0", PEERS["rx-a"], 1) is p
    assert len(table) == 0 and not table.holds(p.key) and own.usage("key-1").parked == 0
