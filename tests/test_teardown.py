"""A frozen sender's late write never lands in blocks that the receiver's teardown released.

Two daemons, UCX over TCP (a revocable transport: the receiver has a NIXL agent per
sender link, docs/protocol.md section 15). A fetch parks at the sender (its request
not published yet), then the sender is SIGSTOPped. The receiver's link goes down
(heartbeats stop), the fetch ends ``peer_lost`` and the link's agent is torn down,
which releases its blocks while the sender is still frozen. The engine reuses them
(writes a marker). Then the sender is thawed and its engine publishes the request:
the link comes back with a fresh agent, so the sender knows the parked fetch's agent
is gone and refuses its write (it is never readdressed to the fresh agent): not one
byte of it lands; the link carries the next fetch byte-exact. (A write addressed to a
destroyed agent lands nowhere either: tests/test_link_agents.py.)
"""

from __future__ import annotations

import signal
import time

import pytest
import torch

from tests.support.conditions import wait_until
from tests.test_daemon import (
    REQ_BLOCKS,
    TCP_DATA_PLANE,
    DaemonProcess,
    Engines,
    blocks_of,
    content,
    daemon_env,
)
from tests.test_daemon import engines as engines  # the fixtures, shared
from tests.test_daemon import sock_dir as sock_dir
from tests.test_discovery_daemons import counter
from tests.test_engine_deadlines import stopped

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HEARTBEAT_TIMEOUT_MS, PEER_DOWN_MS = 1000, 1000
# The link is down within heartbeat_timeout + peer_down of the freeze; its agent is gone
# well under a second later. Slack for a loaded 2-core host.
RELEASE_BOUND_S = (HEARTBEAT_TIMEOUT_MS + PEER_DOWN_MS) / 1000 + 4.0
MARKER = 0x5A


def in_flight(port: int) -> int:
    """The sender's transfers parked, queued, writing or in doubt (its /metrics gauge)."""
    return int(counter(port, "kvxferd_transfers_in_flight"))


def test_a_frozen_senders_late_write_never_lands_in_blocks_released_by_the_teardown(
    sock_dir: str, engines: Engines
) -> None:
    env = daemon_env(
        **TCP_DATA_PLANE,
        KVXFERD_DEADLINES__HEARTBEAT_IVL_MS=250,
        KVXFERD_DEADLINES__HEARTBEAT_TIMEOUT_MS=HEARTBEAT_TIMEOUT_MS,
        KVXFERD_DEADLINES__PEER_DOWN_MS=PEER_DOWN_MS,
        KVXFERD_DEADLINES__KV_TRANSFER_TIMEOUT_MS=60_000,
        KVXFERD_DEADLINES__PENDING_FETCH_TTL_MS=60_000,
    )
    tx = DaemonProcess("sender", "tdtx", sock_dir, env, ["--listen", "tcp://127.0.0.1:0"])
    rx = DaemonProcess("receiver", "tdrx", sock_dir, env, [])
    try:
        tx.wait_ready(), rx.wait_ready()
        ct, pt = engines.client(tx)
        cr, pr = engines.client(rx)
        # A first request end to end: the link is up, its agent is the first one.
        pt[:, blocks_of(0)] = content("td-0")
        ct.publish("td-0", blocks_of(0))
        out = cr.wait(cr.fetch("td-0", tx.endpoint, blocks_of(0)), 20)
        assert out is not None and out.ok, out
        assert torch.equal(pr[:, blocks_of(0)], content("td-0"))

        # Parked at the sender: its RequestData accepted, its request not published.
        sent = counter(rx.probe_port, "kvxferd_requests_sent")
        h = cr.fetch("td-1", tx.endpoint, blocks_of(1))
        wait_until(
            lambda: counter(rx.probe_port, "kvxferd_requests_sent") > sent, 10, "RequestData sent"
        )
        wait_until(lambda: in_flight(tx.probe_port) == 1, 10, "the fetch parked at the sender")
        t_stop = tx.signal(signal.SIGSTOP)
        wait_until(lambda: stopped(tx.pid), 5, "every thread of the sender stopped", 0.01)

        out = cr.wait(h, 20)
        assert out is not None and out.state == "failed" and out.reason == "peer_lost", out
        wait_until(
            lambda: counter(rx.probe_port, "kvxferd_fences_released_teardown") >= 1,
            max(0.1, t_stop + RELEASE_BOUND_S - time.monotonic()),
            "the fetch's fence released by the link's teardown, the sender still frozen",
        )
        released_s = time.monotonic() - t_stop
        assert stopped(tx.pid), "the sender was thawed before the release"
        assert counter(rx.probe_port, "kvxferd_link_agents_torn_down") >= 1

        # The engine reuses the released blocks.
        pr[:, blocks_of(1)] = MARKER
        marker = torch.full_like(pr[:, blocks_of(1)], MARKER)

        tx.signal(signal.SIGCONT)
        # The link comes back with a fresh agent: the sender now knows the one the parked
        # fetch arrived under is gone.
        wait_until(
            lambda: counter(rx.probe_port, "kvxferd_links_back") >= 1, 15, "the link is back"
        )
        pt[:, blocks_of(1)] = content("td-1")
        ct.publish("td-1", blocks_of(1))  # the parked fetch has its bytes now
        # Its write is refused (its agent is gone), never addressed to the fresh agent.
        wait_until(
            lambda: in_flight(tx.probe_port) == 0, 20, "the sender holds no transfer of td-1"
        )
        refused = counter(tx.probe_port, "kvxferd_writes_refused_peer_gone")
        assert refused >= 1, "the parked fetch's write was not refused as toward a gone agent"
        assert torch.equal(pr[:, blocks_of(1)], marker), "a late write landed in reused blocks"

        # The link carries the next fetch through its fresh agent, byte-exact.
        pt[:, blocks_of(2)] = content("td-2")
        ct.publish("td-2", blocks_of(2))
        out = cr.wait(cr.fetch("td-2", tx.endpoint, blocks_of(2)), 20)
        assert out is not None and out.ok, out
        assert torch.equal(pr[:, blocks_of(2)], content("td-2"))
        assert torch.equal(pr[:, blocks_of(1)], marker)
        assert counter(rx.probe_port, "kvxferd_link_agents_taken") >= 2
        print(
            f"\nblocks released {released_s:.2f}s after the freeze; {REQ_BLOCKS} blocks intact;"
            f" writes refused toward the gone agent: {refused:g}"
        )
    finally:
        engines.close()
        for d in (tx, rx):
            d.kill()
