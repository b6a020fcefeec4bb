"""Authorisation on the sender: receiver ids, NIXL agents and routes belong to the key that registered them.

Unit tests drive kvxferd/transfer/ownership.py directly; the others run the real Sender
(the controllable data plane of tests/test_races.py) behind a real CURVE
ROUTER, with raw peers that each authenticate with a key of their own
(tests/support/authz_world.py), so every identity is the one ZAP authenticated.
"""

from __future__ import annotations

import pytest

from kvxferd.errors import Reason
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.ownership import IdentityLimits, Ownership, nixl_agent_name
from kvxferd.transfer.session import TxState
from tests.support.authz_world import CurvePeer, CurveWorld, Keys, world
from tests.support.conditions import wait_until
from tests.test_races import BLOCKS, WAIT_S, Harness, h

__all__ = ["h", "world"]

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _table(**kw: float) -> tuple[Ownership, Clock]:
    clock = Clock()
    limits = dict(max_peers=4, max_fetches=4, max_parked=4, orphan_ttl_s=10.0) | kw
    return Ownership(IdentityLimits(**limits), clock), clock  # type: ignore[arg-type]


# -- the table ------------------------------------------------------------------------------


def test_a_receiver_id_and_its_agent_belong_to_the_first_identity_that_bound_them() -> None:
    """Once A bound a receiver id and agent, B may register neither; A may register again."""
    t, _ = _table()
    assert t.register_problem("A", "rx-1", "agent-1") is None
    t.bind("A", "rx-1", "agent-1")
    assert "another identity" in (t.register_problem("B", "rx-1", "agent-9") or "")
    assert "another identity" in (t.register_problem("B", "rx-2", "agent-1") or "")
    assert t.register_problem("A", "rx-1", "agent-1") is None
    assert t.register_problem("B", "rx-2", "agent-2") is None


def test_a_released_binding_is_kept_until_the_orphan_ttl_and_only_while_unused() -> None:
    """A binding whose peer left stays A's for orphan_ttl, longer while a fetch is open, then is free."""
    t, clock = _table()
    t.bind("A", "rx-1", "agent-1")
    t.count("rx-1", "fetches", +1)
    t.release("rx-1")
    clock.now += 11
    assert t.reap() == [] and t.owner_of("rx-1") == "A", "reclaimed with a fetch open"
    t.count("rx-1", "fetches", -1)
    assert t.reap() == ["rx-1"]
    assert t.owner_of("rx-1") is None and t.agent_owner("agent-1") is None
    assert t.identities() == {}, "an identity holding nothing is forgotten"
    assert t.register_problem("B", "rx-1", "agent-1") is None


def test_a_live_binding_is_never_reclaimed() -> None:
    """A binding whose peer is still registered survives any number of reaps."""
    t, clock = _table()
    t.bind("A", "rx-1", "agent-1")
    clock.now += 1000
    assert t.reap() == [] and t.owner_of("rx-1") == "A"


def test_per_identity_limits_hold_for_keys_and_not_for_the_anonymous_identity() -> None:
    """An identity at max_peers / max_fetches / max_parked is refused more; the anonymous one only meets global limits."""
    t, _ = _table(max_peers=1, max_fetches=1, max_parked=1)
    t.bind("A", "rx-1", "agent-1")
    assert t.peers_full("A") and not t.peers_full("B")
    t.count("rx-1", "fetches", +1)
    t.count("rx-1", "parked", +1)
    assert "max_fetches_per_identity" in (t.may_add("rx-1", "fetches") or "")
    assert "max_parked_per_identity" in (t.may_add("rx-1", "parked") or "")
    t.bind("", "rx-anon", "agent-anon")
    t.bind("", "rx-anon-2", "agent-anon-2")
    t.count("rx-anon", "fetches", +5)
    assert not t.peers_full("") and t.may_add("rx-anon", "fetches") is None
    assert t.usage("").peers == 2 and t.usage("").fetches == 5


def test_nixl_agent_name_reads_real_nixl_metadata_and_nothing_else() -> None:
    """The agent name is read from NIXL's serialised metadata; other bytes give None."""
    nixl = pytest.importorskip("nixl._api")
    agent = nixl.nixl_agent("authz-probe-agent", nixl.nixl_agent_config(backends=["UCX"]))
    assert nixl_agent_name(agent.get_agent_metadata()) == "authz-probe-agent"
    for junk in (
        b"",
        b"victim",
        b"nixlSerDes|Agent",
        b"nixlSerDes|Agent" + (2**40).to_bytes(8, "little"),
    ):
        assert nixl_agent_name(junk) is None


# -- the sender behind CURVE ----------------------------------------------------------------


def _peer(
    world: CurveWorld, h: Harness, sx: object, keys: Keys, rid: str, **kw: object
) -> CurvePeer:
    p = CurvePeer(world, sx, keys, rid, **kw)  # type: ignore[arg-type]
    h._closers.append(p.close)
    return p


def test_an_impostor_cannot_take_a_victims_receiver_id_agent_or_endpoint(
    world: CurveWorld, h: Harness
) -> None:
    """A second key registering the victim's receiver id, NIXL agent or result endpoint is refused not_authorized, counted, and the victim's fetch is served."""
    world.serving(Keys.new())
    sx, dp = h.sender()
    victim_keys, evil = Keys.new(), Keys.new()
    victim = _peer(world, h, sx, victim_keys, "victim-1").register()
    tries = [
        _peer(world, h, sx, evil, "victim-1", metadata=b"evil-agent"),  # its receiver id
        _peer(world, h, sx, evil, "evil-1", metadata=b"victim-1"),  # its NIXL agent
        _peer(world, h, sx, evil, "evil-2", result_endpoint=victim.result_endpoint),  # its endpoint
    ]
    for imp in tries:
        reply = imp.try_register()
        assert not reply.ok and reply.reason is Reason.NOT_AUTHORIZED, reply
    assert sx.stats.get("registers_refused_owner") == 3
    assert sx.stats.get(f"rejected_{Reason.NOT_AUTHORIZED}") == 3
    assert dp.peers == {"victim-1"}, "an impostor's agent was loaded or the victim's removed"
    handle = sx.publish("req-v", BLOCKS)
    victim.fetch("req-v", 1)
    dp.wait_posted(1).finish(True)
    result = victim.next_result()
    assert result.status == "done", result
    out = handle.wait(WAIT_S)
    assert out is not None and out.state is TxState.COMPLETE
    assert [x.peer for x in dp.xfers] == ["victim-1"]


def test_another_key_cannot_cancel_a_victims_fetch(world: CurveWorld, h: Harness) -> None:
    """A key that tries to register the victim's receiver id (to cancel its fetch by id) is refused, its Cancel meets unknown_peer, and the victim's fetch completes."""
    world.serving(Keys.new())
    sx, dp = h.sender()
    victim = _peer(world, h, sx, Keys.new(), "victim-1").register()
    handle = sx.publish("req-v", BLOCKS)
    victim.fetch("req-v", 7)
    x = dp.wait_posted(1)
    evil = _peer(world, h, sx, Keys.new(), "victim-1", metadata=b"evil-agent")
    reply = evil.try_register()
    assert not reply.ok and reply.reason is Reason.NOT_AUTHORIZED, reply
    evil.cancel("req-v", 7)
    reject = evil.next_message()
    assert isinstance(reject, wire.Reject) and reject.reason is Reason.UNKNOWN_PEER, reject
    x.finish(True)
    assert victim.next_result().status == "done"
    out = handle.wait(WAIT_S)
    assert out is not None and out.state is TxState.COMPLETE, out
    assert sx.stats.get("cancels") == 0


def test_a_route_taken_over_by_another_key_cannot_cancel_or_fetch(
    world: CurveWorld, h: Harness
) -> None:
    """Another key presenting the victim's routing id gets no part of its route while the victim is connected, and is refused not_authorized (Cancel, RequestData) once it holds that id after the victim left; the victim's fetch completes."""
    world.serving(Keys.new())
    sx, dp = h.sender()
    victim = _peer(world, h, sx, Keys.new(), "victim-1", route=b"victim-1").register()
    handle = sx.publish("req-v", BLOCKS)
    victim.fetch("req-v", 7)
    x = dp.wait_posted(1)
    thief_keys = Keys.new()
    early = _peer(world, h, sx, thief_keys, "thief", route=b"victim-1")
    early.cancel("req-v", 7)
    assert early.more() == [], "the listener answered a connection presenting a taken route"
    victim.cancel("req-v", 99)  # the route still answers the victim
    ack = victim.next_message()
    assert isinstance(ack, wire.CancelAck) and ack.fetch_id == 99, ack
    assert sx.stats.get("cancels") == 1 and sx.stats.get("messages_refused_identity") == 0
    victim.dealer.close(linger=0)  # the route id is free once the listener sees it gone

    def thief_refused() -> bool:
        thief = _peer(world, h, sx, thief_keys, "thief", route=b"victim-1")
        thief.cancel("req-v", 7)  # on a connection that did not get the id: eaten, unanswered
        reply = thief._poll(0.3)
        if reply is None:
            thief.close()
            return False
        assert isinstance(reply, wire.Reject) and reply.reason is Reason.NOT_AUTHORIZED, reply
        thief.fetch("req-v", 8)
        refused = thief.next_result()
        assert refused.reason is Reason.NOT_AUTHORIZED, refused
        return True

    wait_until(thief_refused, WAIT_S, "a thief holding the victim's route id", poll=0.05)
    assert sx.stats.get("messages_refused_identity") == 2
    x.finish(True)
    assert victim.results is not None and victim.results.poll(int(WAIT_S * 1000))
    done = wire.decode_to_receiver(victim.results.recv_multipart()[1:], 1 << 30)
    assert isinstance(done, wire.Result) and done.status == "done", done
    out = handle.wait(WAIT_S)
    assert out is not None and out.state is TxState.COMPLETE, out
    assert len(dp.xfers) == 1


def test_a_full_peer_table_never_evicts_another_keys_receiver(
    world: CurveWorld, h: Harness
) -> None:
    """With the table full, a new key's Register is refused busy instead of evicting another key's idle peer."""
    world.serving(Keys.new())
    sx, dp = h.sender(limits={"max_peers": 1})
    _peer(world, h, sx, Keys.new(), "victim-1").register()
    reply = _peer(world, h, sx, Keys.new(), "other-1").try_register()
    assert not reply.ok and reply.reason is Reason.BUSY, reply
    assert dp.peers == {"victim-1"} and sx.stats.get("peers_evicted") == 0


def test_per_identity_peer_and_parked_limits(world: CurveWorld, h: Harness) -> None:
    """A key at max_peers_per_identity / max_parked_per_identity is refused busy while another key is served."""
    world.serving(Keys.new())
    sx, _ = h.sender(limits={"max_peers_per_identity": 1, "max_parked_per_identity": 1})
    a, b = Keys.new(), Keys.new()
    a1 = _peer(world, h, sx, a, "a-1").register()
    a1.fetch("later-1", 1)  # parked: a-1 is busy, so it cannot be evicted for a-2
    wait_until(lambda: sx.stats.get("fetches_parked") == 1, WAIT_S, "fetch parked")
    reply = _peer(world, h, sx, a, "a-2").try_register()
    assert not reply.ok and reply.reason is Reason.BUSY, reply
    a1.fetch("later-2", 2)
    refused = a1.next_result()
    assert refused.reason is Reason.BUSY and "max_parked_per_identity" in refused.detail
    b1 = _peer(world, h, sx, b, "b-1").register()
    b1.fetch("later-3", 3)
    wait_until(lambda: sx.stats.get("fetches_parked") == 2, WAIT_S, "b's fetch parked")
    usage = sx.ownership.identities()
    assert usage[a.identity].parked == 1 and usage[b.identity].parked == 1


def test_idle_peers_and_their_bindings_are_reclaimed_after_the_orphan_ttl(
    world: CurveWorld, h: Harness
) -> None:
    """A key's idle peer leaves the table after orphan_ttl_ms and its receiver id is free again after another."""
    world.serving(Keys.new())
    sx, dp = h.sender(limits={"orphan_ttl_ms": 200})
    a = _peer(world, h, sx, Keys.new(), "gone-1").register()
    wait_until(lambda: sx.stats.get("peers_reclaimed") == 1, WAIT_S, "idle peer reclaimed")
    wait_until(lambda: sx.stats.get("bindings_reclaimed") == 1, WAIT_S, "binding released")
    assert sx.ownership.owner_of("gone-1") is None and sx.ownership.identities() == {}
    wait_until(lambda: "gone-1" not in dp.peers, WAIT_S, "NIXL agent removed")
    a.close()
    newcomer = _peer(world, h, sx, Keys.new(), "gone-1").try_register()
    assert newcomer.ok, newcomer


def test_a_refused_register_leaves_no_binding(world: CurveWorld, h: Harness) -> None:
    """A Register refused for any reason (here incompatible) binds nothing: the id stays free for another key."""
    world.serving(Keys.new())
    sx, _ = h.sender()
    bad = _peer(world, h, sx, Keys.new(), "rx-1")
    bad.layout = wire.WireLayout(
        num_layers=sx.pool.layout.num_layers + 1,
        num_blocks=sx.pool.layout.num_blocks,
        block_bytes=sx.pool.layout.block_bytes,
        dtype=sx.pool.layout.dtype,  # type: ignore[arg-type]
        aux_slots=sx.pool.layout.aux_slots,
        aux_slot_bytes=sx.pool.layout.aux_slot_bytes,
    )
    reply = bad.try_register()
    assert not reply.ok and reply.reason is Reason.INCOMPATIBLE
    assert sx.ownership.owner_of("rx-1") is None and sx.ownership.identities() == {}
    assert _peer(world, h, sx, Keys.new(), "rx-1").try_register().ok


def test_security_off_is_one_anonymous_owner(h: Harness) -> None:
    """Without CURVE every peer is the anonymous identity: a new receiver id at a known endpoint still replaces it, and idle peers are never reclaimed."""
    sx, _ = h.sender(limits={"orphan_ttl_ms": 1, "max_peers_per_identity": 1})
    old = h.peer(sx, "peer-old")
    h.peer(sx, "peer-new", result_endpoint=old.result_endpoint)
    h.peer(sx, "peer-other")
    assert sx.stats.get("peers_replaced") == 1
    # Housekeeping reclaims it, not a handled message: h.until would see it only at its bound.
    wait_until(
        lambda: sx.stats.get("bindings_reclaimed") == 1, WAIT_S, "the replaced binding reclaimed"
    )
    assert sx.stats.get("peers_reclaimed") == 0 and len(sx.peers) == 2
    assert sx.stats.get("registers_refused_owner") == 0
    assert set(sx.ownership.identities()) == {""}
