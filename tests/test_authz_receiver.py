"""Authorisation on the receiver: a Result is taken only from the sender the fetch was sent to.

The real Sender and Receiver (controllable data planes) run behind real CURVE
sockets (tests/support/authz_world.py): the receiver's result ROUTER authenticates every
peer, the sender's workers dial it with the sender's key, and a forger dials it
with a key of its own. The receivers here ask for done Results (``notifications``
off): the Result path is what these tests check; the notification path's checks are
in tests/test_notifications.py.
"""

from __future__ import annotations

import pytest
import zmq

from kvxferd.transfer import protocol as wire
from kvxferd.transfer.session import RxState
from tests.support.authz_world import CurveWorld, Keys, world
from tests.support.conditions import wait_until
from tests.test_races import BLOCKS, QUIET_S, WAIT_S, Harness, h

__all__ = ["h", "world"]

pytestmark = pytest.mark.timeout(60)


def _forger(world: CurveWorld, endpoint: str, keys: Keys) -> zmq.Socket[bytes]:
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.curve_serverkey = world.server_of(endpoint).public
    d.curve_publickey = keys.public
    d.curve_secretkey = keys.secret
    d.connect(endpoint)
    return d


def test_forged_results_from_another_key_are_dropped_and_counted(
    world: CurveWorld, h: Harness
) -> None:
    """A done Result and a CancelAck for an open fetch, sent by a key other than its sender's, are dropped and counted; the real Result completes it."""
    tx_keys, rx_keys = Keys.new(), Keys.new()
    world.serving(tx_keys)
    sx, dp = h.sender()
    world.serving(rx_keys)
    rx = h.receiver("rx-victim", notifications=False)
    world.dial_as(rx.bound_result_endpoint, tx_keys)  # the sender's workers use its key
    sx.publish("req-1", BLOCKS)
    f = rx.fetch("req-1", sx.endpoint, [9, 10, 11], sender_key=tx_keys.identity)
    x = dp.wait_posted(1)
    forger = _forger(world, rx.bound_result_endpoint, Keys.new())
    try:
        forger.send(
            wire.encode(wire.Result(request_id="req-1", fetch_id=f.fetch_id, status="done"))
        )
        forger.send(wire.encode(wire.CancelAck(request_id="req-1", fetch_id=f.fetch_id)))
        wait_until(lambda: rx.stats.get("results_unsolicited") == 2, WAIT_S, "forgeries counted")
    finally:
        forger.close(linger=0)
    assert f.wait(QUIET_S) is None, "a forged Result ended the fetch"
    x.finish(True)
    out = f.wait(WAIT_S)
    assert out is not None and out.state is RxState.DONE, out
    assert rx.stats.get("results_unsolicited") == 2


def test_a_fetch_expecting_another_key_takes_nothing_from_this_sender(
    world: CurveWorld, h: Harness
) -> None:
    """A fetch whose sender_key names another key never completes on this sender's Result (it times out)."""
    tx_keys, rx_keys = Keys.new(), Keys.new()
    world.serving(tx_keys)
    sx, dp = h.sender()
    world.serving(rx_keys)
    rx = h.receiver("rx-victim", notifications=False)
    world.dial_as(rx.bound_result_endpoint, tx_keys)
    sx.publish("req-1", BLOCKS)
    f = rx.fetch("req-1", sx.endpoint, [9, 10, 11], sender_key=Keys.new().identity, timeout_ms=1500)
    dp.wait_posted(1).finish(True)
    wait_until(lambda: rx.stats.get("results_unsolicited") >= 1, WAIT_S, "result dropped")
    out = f.wait(WAIT_S)
    assert out is not None and out.state is not RxState.DONE, out
