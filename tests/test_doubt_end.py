"""Doubt ends on proof, and soon after the proof can come: a link back after a freeze settles it at once.

The sender is a ``tests/support/peers.py`` child; the receiver runs in the test
process so the test can watch each fetch's handle, its fence and the aux slots.
"""

from __future__ import annotations

import signal
import time

import pytest

from kvxferd.config import load_receiver_settings
from kvxferd.errors import Reason
from kvxferd.transfer.pool import IdAllocator
from kvxferd.transfer.receiver import Receiver
from tests.support.conditions import wait_until
from tests.test_dead_peer import FROZEN_DEADLINES
from tests.test_receiver_restart import BLOCKS, STARTUP_S, Spawn, pool, receivers, spawn

__all__ = ["receivers", "spawn"]  # fixtures shared with test_receiver_restart.py

pytestmark = pytest.mark.integration

# Re-asks back off: 5 s after the doubt, 10 s after, then 20 s. Those due while the sender
# is frozen find the link down and send nothing; after a freeze of FROZEN_S the next one is
# due 9 s after the link's return, far past HEAL_S: only asking again when the link comes
# back is in time.
DEADLINES = {**FROZEN_DEADLINES, "in_doubt_retry_ms": 5000, "in_doubt_retry_max_ms": 30_000}
FROZEN_S = 11.0
HEAL_S = 3.0


def test_a_link_back_after_a_freeze_ends_the_doubt_within_3s_and_returns_the_memory(
    spawn: Spawn, receivers: list[Receiver]
) -> None:
    """A fetch parked at a sender that is then SIGSTOPped ends peer_lost in doubt, blocks kept; once the thawed sender answers the Register again, the doubt is asked about at once and ends within 3 s and its aux slot comes back."""
    tx = spawn("sender", "tx", settings=dict(pool=pool(2)), prefix="d", count=0, blocks=BLOCKS)
    ep = tx.wait_event("ready", STARTUP_S)["endpoint"]
    r = Receiver(load_receiver_settings(pool=pool(2), deadlines=DEADLINES)).start()
    receivers.append(r)
    alloc = IdAllocator(2 * BLOCKS, shuffle_seed=7)
    h = r.fetch("d-0", ep, alloc.take(BLOCKS))  # never published: parked at the sender
    wait_until(lambda: h.session.sent, 10, "the RequestData sent")
    wait_until(lambda: r.stats.get("registers_sent") >= 1 and r.links.links[ep].ready, 10, "ready")
    tx.signal(signal.SIGSTOP)
    out = h.wait(5)
    assert out is not None and out.reason is Reason.PEER_LOST, out
    assert not h.close(0), "sent: its blocks stay fenced until proof"
    assert r.in_doubt() == 1
    time.sleep(FROZEN_S)  # the outage itself, during which the re-asks back off
    tx.signal(signal.SIGCONT)
    t_thaw = time.monotonic()
    wait_until(lambda: r.stats.get("links_back") >= 1, 15, "the thawed sender's link back")
    t_back = time.monotonic()
    print(f"\nlink back {t_back - t_thaw:.2f}s after the thaw")
    wait_until(lambda: h.close(0), HEAL_S, "the doubt ended after the link came back")
    print(f"\ndoubt ended {time.monotonic() - t_back:.2f}s after the link came back")
    assert r.in_doubt() == 0
    assert r.aux_slot_counts() == (r.pool.layout.aux_slots, 0)
    assert r.shutdown() is True
