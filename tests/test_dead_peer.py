"""A dead or removed sender ends its fetches fast and is not dialled in a loop (issue 23, item 2).

Real processes: a sender daemon (``python -m kvxferd sender``), SIGKILLed while a fetch of
ours is parked there, and a receiver in this process; real ZMQ and NIXL.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvxferd.config import load_receiver_settings
from kvxferd.discovery.record import PeerRecord
from kvxferd.discovery.watcher import PeerRemoved
from kvxferd.errors import Reason
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.session import Fence, RxState
from tests.conditions import wait_until
from tests.test_daemon import (
    BLOCK_BYTES,
    LAYERS,
    N_REQ,
    REQ_BLOCKS,
    DaemonProcess,
    daemon_env,
    sock_dir,  # noqa: F401 - the fixture
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

FETCH_MS = 30_000  # far beyond every bound below: an outcome by the deadline would fail
REFUSED_MS = 1000


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rx = Receiver(
        load_receiver_settings(
            pool=dict(
                num_layers=LAYERS,
                num_blocks=N_REQ * REQ_BLOCKS,
                block_elems=BLOCK_BYTES,
                dtype="uint8",
            ),
            deadlines=dict(
                kv_transfer_timeout_ms=FETCH_MS,
                connect_refused_ms=REFUSED_MS,
                cancel_fence_ms=500,
                drain_timeout_ms=500,
                shutdown_timeout_ms=3000,
            ),
        )
    ).start()
    try:
        yield rx
    finally:
        rx.shutdown(3.0)


def _parked(rx: Receiver, endpoint: str, request_id: str) -> object:
    """A fetch of a request nobody published: sent, and parked at the sender."""
    sent = rx.stats.get("requests_sent")
    handle = rx.fetch(request_id, endpoint, np.arange(2), want_aux=False, timeout_ms=FETCH_MS)
    wait_until(lambda: rx.stats.get("requests_sent") > sent, 10, "RequestData sent")
    return handle


def test_a_killed_sender_ends_its_fetches_in_seconds_and_is_not_redialled(
    receiver: Receiver,
    sock_dir: str,  # noqa: F811
) -> None:
    tx = DaemonProcess("sender", "tx", sock_dir, daemon_env(), ["--listen", "tcp://127.0.0.1:0"])
    try:
        endpoint = tx.endpoint
        handle = _parked(receiver, endpoint, "dead-1")
        retries = receiver.stats.get("connect_retries")
        killed = time.monotonic()
        tx.kill()  # SIGKILL: its port refuses every connection from now on
        out = handle.wait(10.0)  # type: ignore[attr-defined]
        took = time.monotonic() - killed
        assert out is not None, f"no outcome: {receiver.stats.snapshot()}"
        assert took < REFUSED_MS / 1000 + 2.0, f"the outcome came {took:.1f}s after the kill"
        assert out.state is RxState.FAILED and out.reason is Reason.PEER_LOST, out
        # a fetch toward the sender known down fails at once: nothing is sent
        sent = receiver.stats.get("requests_sent")
        start = time.monotonic()
        again = receiver.fetch(
            "dead-2", endpoint, np.arange(2, 4), want_aux=False, timeout_ms=FETCH_MS
        ).wait(5.0)
        assert again is not None and again.reason is Reason.PEER_LOST, again
        assert time.monotonic() - start < 1.0
        assert receiver.stats.get("requests_sent") == sent
        assert receiver.stats.get("fetches_refused_peer_down") >= 1
        # the 10 s after the kill: fewer than 5 connection attempts to the dead port
        wait_until(lambda: time.monotonic() - killed >= 10.0, 12, "10 s after the kill")
        tried = receiver.stats.get("connect_retries") - retries
        assert tried < 5, f"{tried} connection attempts to a dead sender in 10 s"
    finally:
        tx.kill()


def test_a_sender_discovery_removes_ends_its_fetches_and_a_live_one_releases_the_blocks(
    receiver: Receiver,
    sock_dir: str,  # noqa: F811
) -> None:
    """Lease expiry is not proof of death: the fetch ends peer_lost at once, with its
    blocks fenced; a sender that is alive (cut from etcd only) acknowledges the Cancel,
    and the blocks come back safe."""
    tx = DaemonProcess("sender", "tx", sock_dir, daemon_env(), ["--listen", "tcp://127.0.0.1:0"])
    try:
        endpoint = tx.endpoint
        handle = _parked(receiver, endpoint, "removed-1")
        removed = time.monotonic()
        record = PeerRecord(role="sender", name="tx", endpoints={"listen": endpoint})
        receiver.on_peer_event(PeerRemoved(record, "lease expired"))
        out = handle.wait(5.0)  # type: ignore[attr-defined]
        assert out is not None and time.monotonic() - removed < 1.0
        assert out.reason is Reason.PEER_LOST, out
        assert receiver.stats.get("fetches_ended_peer_removed") == 1
        session = handle.session  # type: ignore[attr-defined]
        wait_until(lambda: session.fence is Fence.RELEASED, 5, "the live sender's CancelAck")
        assert receiver.stats.get("fences_in_doubt") == 0
        # a fetch brings the sender back: it is dialled and served
        later = receiver.fetch(
            "removed-2", endpoint, np.arange(2, 4), want_aux=False, timeout_ms=FETCH_MS
        )
        wait_until(lambda: receiver.stats.get("requests_sent") >= 2, 10, "sent again")
        later.cancel()
    finally:
        tx.kill()
