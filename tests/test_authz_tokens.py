"""Who may fetch a request: the publisher's fetch token and allowed_receivers, end to end.

The token tests run the engine protocol end to end (tests/test_gateway.py's real
Sender and Receiver with real NIXL behind Gateways, driven by Clients); the
allowed_receivers tests run the real Sender behind real CURVE with raw peers of
two keys (tests/support/authz_world.py).
"""

from __future__ import annotations

import pytest
import torch

from kvxferd.engine.client import Client, EngineRejected
from kvxferd.engine.engine_protocol import EngineReason
from kvxferd.errors import Reason
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.sender import Sender
from tests.support.authz_world import CurvePeer, CurveWorld, Keys, world
from tests.test_gateway import (
    CALL_S,
    _attach,
    _fill,
    clients,
    gateways,
    receiver,
    sender,
    sock_dir,
    start_gateway,
)
from tests.test_races import BLOCKS, Harness, h

__all__ = ["clients", "gateways", "h", "receiver", "sender", "sock_dir", "start_gateway", "world"]

pytestmark = pytest.mark.timeout(60)


def test_a_fetch_without_the_token_is_refused_and_the_one_with_it_is_served(
    clients: tuple[Client, Client], sender: Sender, receiver: Receiver
) -> None:
    """A request published with a token refuses fetches without it or with a wrong one (not_authorized, counted) and serves the one carrying it byte-exact."""
    tx, rx = clients
    src_kv, dst_kv = _attach(tx.describe()), _attach(rx.describe())
    src, dst = [3, 4, 5], [20, 21, 22]
    data = _fill(src_kv, src, seed=7)
    dst_kv[:, dst, :] = 0
    before = sender.stats.get("fetches_refused_token")
    pub = tx.publish_for("tok-1", src)
    assert pub.sender_endpoint == sender.endpoint and pub.sender_key == ""
    assert len(pub.token) >= 22, pub
    for token in ("", "A" * 22):
        h = rx.fetch("tok-1", pub.sender_endpoint, dst, token=token)
        out = rx.wait(h, CALL_S)
        assert out is not None and out.state == "failed", out
        assert out.reason is EngineReason.NOT_AUTHORIZED, out
        assert rx.close(h, CALL_S)
    assert sender.stats.get("fetches_refused_token") == before + 2
    assert not torch.any(dst_kv[:, dst, :]), "a refused fetch wrote"
    h = rx.fetch("tok-1", pub.sender_endpoint, dst, token=pub.token, sender_key=pub.sender_key)
    out = rx.wait(h, CALL_S)
    assert out is not None and out.ok, out
    assert torch.equal(dst_kv[:, dst, :], data)
    out_tx = tx.wait(pub.handle_id, CALL_S)
    assert out_tx is not None and out_tx.ok
    assert tx.close(pub.handle_id, CALL_S) and rx.close(h, CALL_S)
    assert not sender.published.grants, "the token outlived its request"


def test_a_retried_publish_gets_the_same_token(clients: tuple[Client, Client]) -> None:
    """Publish is idempotent by key: a retry with the same arguments gets the same handle and token."""
    tx, _ = clients
    first = tx.publish_for("tok-2", [1, 2])
    again = tx.publish_for("tok-2", [1, 2])
    assert again == first
    own = tx.publish_for("tok-3", [6], token="engine-chosen-token-0001")
    assert own.token == "engine-chosen-token-0001"
    with pytest.raises(EngineRejected) as ei:
        tx.publish_for("tok-4", [7], token="short")
    assert ei.value.reason is EngineReason.MALFORMED
    for hid in (first.handle_id, own.handle_id):
        tx.cancel(hid)
        assert tx.close(hid, CALL_S)


def test_only_allowed_receivers_may_fetch(world: CurveWorld, h: Harness) -> None:
    """A request published for one key (or receiver id) refuses another key's fetch not_authorized, counted, and serves the allowed ones."""
    world.serving(Keys.new())
    sx, dp = h.sender()
    a, b = Keys.new(), Keys.new()
    pa = CurvePeer(world, sx, a, "rx-a")
    pb = CurvePeer(world, sx, b, "rx-b")
    pc = CurvePeer(world, sx, b, "rx-c")
    for p in (pa, pb, pc):
        h._closers.append(p.close)
        p.register()
    handle = sx.publish(
        "only-a", BLOCKS, expected_fetches=2, allowed_receivers=[a.identity, "rx-c"]
    )
    pb.fetch("only-a", 1)
    refused = pb.next_result()
    assert refused.reason is Reason.NOT_AUTHORIZED and "allowed_receivers" in refused.detail
    assert sx.stats.get("fetches_refused_receiver") == 1
    pa.fetch("only-a", 2)
    dp.wait_posted(1).finish(True)
    assert pa.next_result().status == "done"
    pc.fetch("only-a", 3)  # b's key, but this receiver id is listed
    dp.wait_posted(2).finish(True)
    assert pc.next_result().status == "done"
    out = handle.wait(CALL_S)
    assert out is not None and out.state.value == "complete", out
    assert [x.peer for x in dp.xfers] == ["rx-a", "rx-c"]


def test_a_token_is_checked_at_attach_for_a_parked_fetch(h: Harness) -> None:
    """A fetch parked before its request was published is refused not_authorized at publish when it lacks the token."""
    sx, dp = h.sender()
    p = h.peer(sx, "rx-early")
    p.fetch("later", 1)  # parked: no token
    h.until(lambda: sx.stats.get("fetches_parked") == 1, "parked")
    sx.publish("later", BLOCKS, token="secret-token-0123456789")
    refused = p.next_result()
    assert refused.reason is Reason.NOT_AUTHORIZED, refused
    p._send(
        wire.RequestData(
            request_id="later", fetch_id=2, dst_blocks=BLOCKS, token="secret-token-0123456789"
        )
    )
    dp.wait_posted(1).finish(True)
    assert p.next_result().status == "done"
