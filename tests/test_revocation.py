"""Revocation ends the fetch: a receiver whose key the sender removes learns it at once.

A real Sender and Receiver (real ZMQ with CURVE, real NIXL) in this process, each
allowing the other (tests/test_auth.py's ``pair``). The receiver's key is removed from
the sender's allow-list directory and the lists are re-read as SIGHUP does
(``reload_allow_lists``). The sender tells each registered peer whose key left
(``Reject{not_authorized}``) and answers a revoked key's RequestData with a Result
naming the fetch; the receiver ends every fetch open toward that sender within a
second, ``not_authorized``, its blocks released only on the sender's CancelAck (the
sender still honours a revoked key's Cancel), never by guess. The last test drives the
sender alone (tests/support/authz_world.py: real CURVE sockets, the controllable data plane) to
show that a parked fetch of a revoked key is never written; the last one runs a real
sender daemon and sends it SIGHUP.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest

from kvxferd.auth import AllowList, Curve, reload_allow_lists
from kvxferd.config import load_receiver_settings
from kvxferd.errors import Reason
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.session import RxState
from tests.support.authz_world import CurvePeer, CurveWorld, Keys, world
from tests.support.conditions import wait_until
from tests.support.peers import fill_request
from tests.test_auth import (
    DEADLINES,
    POOL,
    Keyring,
    Pair,
    answered,
    keys,
    pair,
    raw_dealer,
    transfer_ok,
)
from tests.test_daemon import DaemonProcess, daemon_env
from tests.test_races import BLOCKS, Harness, h

__all__ = ["h", "keys", "pair", "world"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

DEADLINE_MS = 8000  # the fetch deadline: the revoked fetch must end far sooner
ENDS_WITHIN_S = 1.0
WAIT_S = 10.0
MAX = 1 << 20


def revoke(keys: Keyring, who: str) -> None:
    """Remove ``who``'s certificate from the sender's allow-list and re-read it (SIGHUP's work)."""
    (keys.allowed("tx") / f"{who}.key").unlink()
    reload_allow_lists()


def test_revoking_the_receivers_key_ends_its_open_fetch_within_a_second(
    pair: Pair, keys: Keyring
) -> None:
    """A fetch parked at the sender when the receiver's key is removed ends not_authorized within a second, not at its deadline; its blocks are released by the sender's CancelAck, nothing stays in doubt."""
    transfer_ok(pair, "warm-up")
    dst = np.arange(8, 12, dtype=np.int64)
    f = pair.rx.fetch("later", pair.tx.endpoint, dst, want_aux=False, timeout_ms=DEADLINE_MS)
    wait_until(lambda: pair.tx.view().parked_count == 1, WAIT_S, "the fetch parked at the sender")
    t0 = time.monotonic()
    revoke(keys, keys.rx.name)
    out = f.wait(WAIT_S)
    took = time.monotonic() - t0
    assert out is not None and out.state is RxState.FAILED, out
    assert out.reason is Reason.NOT_AUTHORIZED, out
    assert took < ENDS_WITHIN_S, f"ended {took:.2f}s after the revocation"
    assert f.close(WAIT_S), "the blocks were not released (no CancelAck)"
    assert pair.rx.in_doubt() == 0
    assert pair.tx.stats.get("peers_told_revoked") == 1
    assert pair.tx.view().parked_count == 0, "the parked fetch is still waiting at the sender"


def test_a_fetch_sent_after_revocation_ends_at_once(pair: Pair, keys: Keyring) -> None:
    """On a connection opened before the key was removed, a fetch of a published request ends not_authorized at once, nothing written and its blocks reusable."""
    transfer_ok(pair, "warm-up")
    revoke(keys, keys.rx.name)
    src, dst = np.arange(4, dtype=np.int64), np.arange(20, 24, dtype=np.int64)
    fill_request(pair.tx.pool, "after", src)
    handle = pair.tx.publish("after", src)
    t0 = time.monotonic()
    f = pair.rx.fetch("after", pair.tx.endpoint, dst, want_aux=False, timeout_ms=DEADLINE_MS)
    out = f.wait(WAIT_S)
    took = time.monotonic() - t0
    assert out is not None and out.reason is Reason.NOT_AUTHORIZED, out
    assert took < ENDS_WITHIN_S, f"ended {took:.2f}s after it was sent"
    assert f.close(WAIT_S) and pair.rx.in_doubt() == 0
    assert pair.rx.stats.get("fetches_done") == 1, "only the warm-up"
    handle.close()


def test_a_revoked_keys_messages_are_answered_naming_what_they_answer(
    pair: Pair, keys: Keyring
) -> None:
    """On its open connection a revoked key's RequestData gets Result{failed, not_authorized} with its fetch id, its Register RegisterReply{ok=false, not_authorized}, its Cancel is still handled, and a frame that does not decode gets Reject{not_authorized}."""
    keys.allowed("tx", keys.stranger)  # a second key, allowed at its handshake
    reload_allow_lists()
    sock = raw_dealer(pair.tx.endpoint, Curve(keys.stranger.pair).client(keys.tx.pair.public))
    try:
        assert answered(sock, timeout_ms=int(WAIT_S * 1000))  # admitted at its handshake
        sock.recv()
        revoke(keys, keys.stranger.name)

        def reply_to(msg: wire._Msg) -> wire.ToReceiver:
            sock.send(wire.encode(msg))
            assert sock.poll(int(WAIT_S * 1000)), f"no reply to {msg!r}"
            return wire.decode_to_receiver([sock.recv()], MAX)

        req = wire.RequestData(request_id="gone", fetch_id=4242, dst_blocks=[1, 2])
        result = reply_to(req)
        assert isinstance(result, wire.Result), result
        assert (result.fetch_id, result.request_id) == (4242, "gone"), result
        assert result.status == "failed" and result.reason is Reason.NOT_AUTHORIZED, result
        reg = wire.Register(
            receiver_id="eve-1",
            result_endpoint="tcp://127.0.0.1:9",
            agent_metadata=b"x",
            layout=wire.WireLayout.of(pair.tx.pool.layout),
            kv_base=0,
            aux_base=0,
        )
        reply = reply_to(reg)
        assert isinstance(reply, wire.RegisterReply) and not reply.ok, reply
        assert reply.reason is Reason.NOT_AUTHORIZED, reply
        cancel = reply_to(wire.Cancel(request_id="gone", fetch_id=4242))
        assert isinstance(cancel, wire.Reject) and cancel.reason is Reason.UNKNOWN_PEER, cancel
        sock.send(b"not a kvxferd frame")
        assert sock.poll(int(WAIT_S * 1000))
        refused = wire.decode_to_receiver([sock.recv()], MAX)
        assert isinstance(refused, wire.Reject) and refused.reason is Reason.NOT_AUTHORIZED
    finally:
        sock.close(linger=0)
    transfer_ok(pair, "others-unaffected")


def test_a_parked_fetch_of_a_revoked_key_is_told_and_never_attaches(
    world: CurveWorld, h: Harness
) -> None:
    """A peer whose key is removed while its fetch is parked gets Reject{not_authorized} at once; if it does not cancel, the publish refuses that fetch not_authorized and writes nothing."""
    world.serving(Keys.new())
    sx, dp = h.sender()
    eve = Keys.new()
    sx.transport.allow = AllowList(None, extra=[eve.identity])
    peer = CurvePeer(world, sx, eve, "eve-1").register()
    try:
        peer.fetch("later", 5)
        wait_until(lambda: sx.view().parked_count == 1, WAIT_S, "the fetch parked")
        sx.transport.allow = AllowList(None)  # the key removed: a new list, as a reload makes
        told = peer.next_message()
        assert isinstance(told, wire.Reject) and told.reason is Reason.NOT_AUTHORIZED, told
        sx.publish("later", BLOCKS)
        refused = peer.next_result()
        assert (refused.fetch_id, refused.reason) == (5, Reason.NOT_AUTHORIZED), refused
        assert dp.xfers == [], "a write toward the revoked key was posted"
    finally:
        peer.close()


@pytest.mark.timeout(120)
def test_a_sender_daemon_told_by_sighup_ends_the_receivers_open_fetch(
    keys: Keyring, tmp_path: Path
) -> None:
    """A real sender daemon: the receiver's key removed from its allow-list and SIGHUP sent, the receiver's open fetch ends not_authorized within a second of the signal, its blocks released."""
    allowed = keys.allowed("daemon", keys.rx)
    env = daemon_env(
        KVXFERD_SECURITY__MODE="curve",
        KVXFERD_SECURITY__KEY_FILE=str(keys.tx.secret_file),
        KVXFERD_SECURITY__ALLOWED_KEYS_DIR=str(allowed),
        KVXFERD_SECURITY__ALLOWED_KEYS_POLL_MS=0,  # SIGHUP only
        KVXFERD_LISTEN="tcp://127.0.0.1:0",
        KVXFERD_POOL__NUM_LAYERS=POOL["num_layers"],
        KVXFERD_POOL__NUM_BLOCKS=POOL["num_blocks"],
        KVXFERD_POOL__BLOCK_ELEMS=POOL["block_elems"],
    )
    d = DaemonProcess("sender", "tx", str(tmp_path), env, [])
    rx: Receiver | None = None
    try:
        endpoint = d.endpoint
        rx = Receiver(
            load_receiver_settings(
                pool=POOL,
                deadlines=DEADLINES,
                security=keys.security(
                    keys.rx,
                    keys.allowed("rx", keys.tx),
                    sender_keys={endpoint: keys.tx.pair.public},
                ),
            )
        ).start()
        dst = np.arange(8, 12, dtype=np.int64)
        f = rx.fetch("never-published", endpoint, dst, want_aux=False, timeout_ms=DEADLINE_MS)
        wait_until(lambda: rx is not None and rx.stats.get("requests_sent") >= 1, WAIT_S, "sent")
        (allowed / f"{keys.rx.name}.key").unlink()
        t0 = d.signal(signal.SIGHUP)
        out = f.wait(WAIT_S)
        took = time.monotonic() - t0
        assert out is not None and out.reason is Reason.NOT_AUTHORIZED, out
        assert took < ENDS_WITHIN_S, f"ended {took:.2f}s after SIGHUP"
        assert f.close(WAIT_S) and rx.in_doubt() == 0
        assert d.alive()
    finally:
        if rx is not None:
            rx.shutdown(3.0)
        d.kill()
