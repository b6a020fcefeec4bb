"""The impostor scenario with real NIXL: another key presenting the victim's NIXL metadata is refused, the victim's bytes arrive exact.

A real Sender and a real Receiver (NIXL over UCX, DRAM pools) run behind real
CURVE sockets (tests/support/authz_world.py); the impostor is a raw peer with a key of
its own that sends a Register carrying the victim receiver's own NIXL agent
metadata and the victim's memory addresses.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.errors import Reason
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.ownership import nixl_agent_name
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.sender import Sender
from kvxferd.transfer.session import RxState
from tests.support.authz_world import CurvePeer, CurveWorld, Keys, world

__all__ = ["world"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

POOL = dict(num_layers=2, num_blocks=32, block_elems=512, dtype="uint8")
DEADLINES = dict(kv_transfer_timeout_ms=10_000, drain_timeout_ms=1000, shutdown_timeout_ms=3000)
WAIT_S = 15.0


@pytest.fixture
def pair(world: CurveWorld) -> Iterator[tuple[Sender, Receiver, Keys]]:
    tx_keys = Keys.new()
    world.serving(tx_keys)
    sx = Sender(load_sender_settings(listen="tcp://127.0.0.1:0", pool=POOL, deadlines=DEADLINES))
    world.serving(Keys.new())
    # Done Results, not notifications: CURVE here comes from the test's world, not from
    # the receiver's settings, so its links do not know the key a fetch expects (the
    # notification path's key check is tested in test_auth.py with real security).
    rx = Receiver(
        load_receiver_settings(pool=POOL, deadlines=DEADLINES, dataplane={"notifications": False})
    )
    world.dial_as(rx.bound_result_endpoint, tx_keys)
    sx.start()
    rx.start()
    try:
        yield sx, rx, tx_keys
    finally:
        rx.shutdown(timeout=3.0)
        sx.shutdown(timeout=3.0)


def _move(sx: Sender, rx: Receiver, key: Keys, rid: str, seed: int) -> None:
    src, dst = [1, 2, 3], [10, 20, 30]
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (2, 3, 512), dtype=torch.uint8, generator=g)
    sx.pool.kv_bytes_view()[:, src, :] = data
    rx.pool.kv_bytes_view()[:, dst, :] = 0
    tx = sx.publish(rid, src)
    out = rx.fetch(rid, sx.endpoint, dst, want_aux=False, sender_key=key.identity).wait(WAIT_S)
    assert out is not None and out.state is RxState.DONE, out
    assert torch.equal(rx.pool.kv_bytes_view()[:, dst, :], data), "bytes differ"
    assert tx.close(WAIT_S)


def test_an_impostor_with_the_victims_nixl_metadata_is_refused_and_the_victim_is_byte_exact(
    world: CurveWorld, pair: tuple[Sender, Receiver, Keys]
) -> None:
    """A second key registering the victim's real NIXL metadata (and memory addresses) is refused not_authorized before NIXL loads it; the victim's transfers before and after are byte-exact."""
    sx, rx, tx_keys = pair
    _move(sx, rx, tx_keys, "before", seed=1)
    victim_agent = nixl_agent_name(rx.agents.metadata())
    assert victim_agent == rx.receiver_id
    imp = CurvePeer(world, sx, Keys.new(), "impostor-1", metadata=rx.dataplane.metadata())
    try:
        imp._send(
            wire.Register(
                receiver_id="impostor-1",
                result_endpoint=imp.result_endpoint,
                agent_metadata=rx.dataplane.metadata(),
                layout=wire.WireLayout.of(rx.pool.layout),
                kv_base=rx.pool.kv_base,
                aux_base=rx.pool.aux_base,
            )
        )
        reply = imp.next_message()
        assert isinstance(reply, wire.RegisterReply) and not reply.ok, reply
        assert reply.reason is Reason.NOT_AUTHORIZED and victim_agent in reply.detail, reply
        # Nothing registered under the impostor's name: its fetch meets unknown_peer.
        sx.publish("stolen", [4, 5])
        imp.fetch("stolen", 1, [4, 5])
        refused = imp.next_result()
        assert refused.reason is Reason.UNKNOWN_PEER, refused
    finally:
        imp.close()
    assert sx.stats.get("registers_refused_owner") == 1
    _move(sx, rx, tx_keys, "after", seed=2)
