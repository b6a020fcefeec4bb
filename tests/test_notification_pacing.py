"""The receiver's io thread while a fetch waits: it looks for NIXL notifications often, and never spins.

Right after a RequestData leaves, the io thread looks for the fetch's notification without
a timed wait (a small write over UCX completes within microseconds); past that window its
waits double up to ``_NOTIF_WAIT_MAX_S``. A fetch that waits longer (parked at its sender
until the publish: decode-first, a streamed prefill) must leave the core to the engines.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.receiver import core as rx_core
from kvxferd.transfer.receiver.core import NotificationPacing
from kvxferd.transfer.sender import Sender
from kvxferd.transfer.session import RxState
from tests.support.conditions import wait_until

pytestmark = pytest.mark.timeout(60)

POOL = dict(num_layers=2, num_blocks=16, block_elems=1024, dtype="uint8")
OFF = dict(mode="off")  # loopback only
WAIT_S = 10.0


def test_waits_grow_again_after_the_spin_window() -> None:
    """Within the spin window the waits are 0; once the last send is old they start at the
    minimum again and double to the maximum (they stayed 0 for good: doubling 0)."""
    p = NotificationPacing()
    p.sent_at = time.monotonic() + 3600.0  # a RequestData just left (however slow this host): spin
    spun = [p.wait(1) for _ in range(4)]
    assert spun[-1] == 0.0, spun
    p.sent_at = time.monotonic() - 1.0  # long ago: the fetch waits for its sender
    waits = [p.wait(1) for _ in range(16)]
    assert waits[-1] == rx_core._NOTIF_WAIT_MAX_S, waits
    assert all(b >= a for a, b in zip(waits[1:], waits[2:], strict=False)), waits


@pytest.fixture
def pair() -> Iterator[tuple[Sender, Receiver]]:
    tx = Sender(load_sender_settings(listen="tcp://127.0.0.1:0", pool=POOL, security=OFF))
    tx.start()
    rx = Receiver(load_receiver_settings(pool=POOL, security=OFF)).start()
    try:
        yield tx, rx
    finally:
        rx.shutdown(timeout=3)
        tx.shutdown(timeout=3)


@pytest.mark.integration
def test_a_fetch_parked_at_its_sender_does_not_spin_the_receiver(
    pair: tuple[Sender, Receiver],
) -> None:
    """Real NIXL and ZMQ: while a fetch waits 1 s for its publish, this process (the
    receiver and the sender, both idle but for it) uses well under half a core; then the
    publish lands it as usual."""
    tx, rx = pair
    warm = rx.fetch("warm", tx.endpoint, [3, 4])  # the link is up before the measurement
    tx.publish("warm", [1, 2])
    out = warm.wait(WAIT_S)
    assert out is not None and out.state is RxState.DONE, out
    assert warm.close(WAIT_S)
    h = rx.fetch("parked", tx.endpoint, [5, 6])
    wait_until(lambda: tx.stats.get("fetches_parked") == 1, WAIT_S, "the fetch parked")
    cpu0, wall0 = time.process_time(), time.monotonic()
    assert h.wait(1.0) is None  # parked: nothing can end it for this second
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    assert cpu < 0.4 * wall, f"{cpu:.2f} s of CPU in {wall:.2f} s while a fetch was parked"
    tx.publish("parked", [1, 2])
    out = h.wait(WAIT_S)
    assert out is not None and out.state is RxState.DONE, out
    assert h.close(WAIT_S)
