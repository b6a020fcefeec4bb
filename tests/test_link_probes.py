"""Link probes: each link's figure from timed WRITEs into the receiver's scratch region, never its KV blocks, never in anyone's way.

The bookkeeping (kvxferd/transfer/link_probes.py) deterministically, with the
controllable data plane (each probe WRITE ends when the test says); then with real
NIXL in one process (a Sender and a Receiver): the probe lands in the receiver's
scratch region and nowhere else, a receiver without scratch is not probed, readiness
follows ``min_link_gbps``; and a probe toward a receiver process that was SIGKILLed
fails, counted, while another receiver's fetch goes through.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.service.probes import SenderProbe
from kvxferd.stats import LINK_PROBE_RESULTS, Stats
from kvxferd.testing import ControlledDataPlane, ControlledXfer
from kvxferd.transfer.guard import Guard
from kvxferd.transfer.layout import Layout
from kvxferd.transfer.link_probes import LinkFigure, LinkProbes
from kvxferd.transfer.peer_agents import PeerAgents
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.sender import Sender
from kvxferd.transfer.worker_tasks import Peer
from tests.support.conditions import wait_until
from tests.support.peers import PeerProcess, check_request, fill_request

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0
SCRATCH = 1 << 20
LAYOUT = Layout(num_layers=1, num_blocks=4, block_bytes=64, dtype="uint8", aux_slots=1, aux_slot_bytes=64)  # fmt: skip


def counts(stats: Stats) -> dict[str, int]:
    return {r: stats.get(f"link_probes_{r}") for r in LINK_PROBE_RESULTS}


def peer(n: int = 1, endpoint: str = "tcp://127.0.0.1:7001") -> Peer:
    return Peer(f"rx-{n}", b"r%d" % n, endpoint, f"rx-{n}.l1", LAYOUT, 4096, 8192, "DRAM", 0)


class Probing:
    """LinkProbes over the controllable data plane: the test ends each probe WRITE."""

    def __init__(self, *, writes: int = 3, timeout_s: float = 5.0) -> None:
        self.dp = ControlledDataPlane("probe-tx")
        self.stats = Stats()
        self.agents = PeerAgents(self.dp, self.stats)
        self.guard = Guard(self.stats, logging.getLogger("test"))
        self.probes = LinkProbes(
            self.dp,
            self.agents,
            self.stats,
            self.guard,
            scratch_bytes=SCRATCH,
            writes=writes,
            timeout_s=timeout_s,
        )

    def posted(self, n: int) -> ControlledXfer:
        """The ``n``-th probe WRITE (0-based), once posted."""
        wait_until(lambda: len(self.dp.probes) > n, WAIT_S, f"probe WRITE {n} posted")
        return self.dp.probes[n]

    def figure(self) -> LinkFigure:
        [fig] = self.probes.figures()
        return fig

    def ended(self) -> LinkFigure:
        wait_until(lambda: self.figure().state != "probing", WAIT_S, "the probe ended")
        return self.figure()


@pytest.fixture
def probing() -> Iterator[Probing]:
    p = Probing()
    yield p
    for x in p.dp.probes:
        x.finish(True)
    p.probes.close(WAIT_S)
    assert p.guard.broken() is None


# -- the bookkeeping ---------------------------------------------------------------------------


def test_a_probe_times_its_writes_into_the_advertised_scratch_only(probing: Probing) -> None:
    """One untimed and ``writes`` timed WRITEs, each of min(both scratch sizes) into the advertised region; the figure is ok with a rate, the agent's write count back to zero."""
    p = probing
    assert p.probes.request(peer(), scratch_base=1 << 40, scratch_bytes=4 * SCRATCH)
    assert p.figure().state == "probing" and p.figure().gbps is None
    for i in range(4):
        x = p.posted(i)
        assert p.agents.writes() == {"rx-1.l1": 1}  # its agent is not removed under it
        assert x.kind == "probe" and x.peer == "rx-1.l1"
        assert x.dst.tolist() == [[1 << 40, SCRATCH, 0]]
        x.finish(True)
    fig = p.ended()
    assert (fig.state, fig.nbytes, fig.writes, fig.peer) == (
        "ok",
        SCRATCH,
        3,
        "tcp://127.0.0.1:7001",
    )
    assert fig.gbps is not None and fig.gbps > 0 and fig.transport.startswith("UCX")
    assert len(p.dp.probes) == 4 and p.dp.xfers == []  # no KV write was posted
    assert counts(p.stats) == {"ok": 1, "failed": 0, "timeout": 0, "dropped": 0}
    assert p.agents.writes() == {}


def test_a_receiver_without_scratch_is_not_probed(probing: Probing) -> None:
    """A Register with no scratch (an older receiver, or link_probe_bytes 0): no WRITE, no figure, nothing counted."""
    p = probing
    assert not p.probes.request(peer(), scratch_base=0, scratch_bytes=0)
    assert not p.probes.request(peer(2), scratch_base=1 << 40, scratch_bytes=0)
    assert p.probes.figures() == [] and p.dp.probes == []
    assert counts(p.stats) == dict.fromkeys(LINK_PROBE_RESULTS, 0)


def test_a_write_that_fails_leaves_the_figure_unknown_and_is_counted(probing: Probing) -> None:
    """A probe WRITE ending ERR ends the probe failed: no figure, counted once, the write released."""
    p = probing
    p.probes.request(peer(), 1 << 40, SCRATCH)
    p.posted(0).finish(True)
    p.posted(1).finish(False)
    fig = p.ended()
    assert fig.state == "failed" and fig.gbps is None and "ERR" in fig.detail
    assert len(p.dp.probes) == 2 and p.dp.probes[1].released
    assert counts(p.stats)["failed"] == 1 and p.agents.writes() == {}


def test_a_post_toward_a_gone_peer_fails_counted(probing: Probing) -> None:
    """The data plane refuses the post (the peer is gone): failed, counted, nothing held."""
    p = probing
    p.dp.fail_next_post = RuntimeError("no such remote agent")
    p.probes.request(peer(), 1 << 40, SCRATCH)
    fig = p.ended()
    assert fig.state == "failed" and "no such remote agent" in fig.detail
    assert counts(p.stats) == {"ok": 0, "failed": 1, "timeout": 0, "dropped": 0}
    assert p.agents.writes() == {}


def test_a_stalled_probe_times_out_and_holds_the_agent_until_nixl_ends_its_write() -> None:
    """Past link_probe_timeout_ms the probe counts timeout (figure unknown); its WRITE stays counted toward the agent (no removal under it) until it ends."""
    p = Probing(timeout_s=0.2)
    try:
        p.probes.request(peer(), 1 << 40, SCRATCH)
        x = p.posted(0)
        fig = p.ended()
        assert fig.state == "timeout" and fig.gbps is None
        assert counts(p.stats)["timeout"] == 1
        assert p.agents.writes() == {"rx-1.l1": 1} and p.probes.in_flight() == 1
        p.agents.retire("rx-1.l1")
        assert "rx-1.l1" in p.agents.retiring()  # its removal waits for the WRITE
        x.finish(True)
        wait_until(lambda: p.probes.in_flight() == 0, WAIT_S, "the stalled WRITE released")
        assert p.agents.writes() == {} and p.agents.retiring() == set()
    finally:
        p.probes.close(WAIT_S)


def test_a_new_probe_replaces_the_figure_and_a_leaving_peer_takes_it_away(probing: Probing) -> None:
    """A reconnect probes again (the newest figure counts); ``again`` by agent name; the peer's departure removes its figure."""
    p = probing
    p.probes.request(peer(), 1 << 40, SCRATCH)
    for i in range(4):
        p.posted(i).finish(True)
    assert p.ended().state == "ok"
    assert p.probes.again("rx-1.l1") and not p.probes.again("unknown")
    assert p.figure().state == "probing"
    p.posted(4).finish(False)
    assert p.ended().state == "failed"
    assert counts(p.stats) == {"ok": 1, "failed": 1, "timeout": 0, "dropped": 0}
    p.probes.forget(peer(2))  # another incarnation: not this figure's
    assert len(p.probes.figures()) == 1
    p.probes.forget(peer())
    assert p.probes.figures() == []


# -- real NIXL ---------------------------------------------------------------------------------

BLOCK = 64 << 10
BLOCKS = 64  # x 1 layer x 64 KiB = 4 MiB: the probe's size, were it aimed at the KV pool
POOL = dict(num_layers=1, num_blocks=BLOCKS, block_elems=BLOCK, dtype="uint8")


@pytest.fixture
def sender() -> Iterator[Sender]:
    s = Sender(load_sender_settings(listen="tcp://127.0.0.1:0", pool=POOL, num_threads=1))
    s.start()
    yield s
    s.shutdown()


def fetch_one(sx: Sender, rx: Receiver, rid: str, blocks: np.ndarray) -> None:
    fill_request(sx.pool, rid, blocks)
    sx.publish(rid, blocks)
    out = rx.fetch(rid, sx.endpoint, blocks).wait(WAIT_S)
    assert out is not None and out.ok, out
    assert check_request(rx.pool, rid, blocks) == ""


def probed(sx: Sender) -> list[LinkFigure]:
    wait_until(
        lambda: sx.probes.figures() and sx.probes.figures()[0].state != "probing",
        WAIT_S,
        "the link probed",
    )
    return sx.probes.figures()


@pytest.mark.integration
def test_the_probe_lands_in_the_scratch_region_and_in_no_kv_block(sender: Sender) -> None:
    """Real NIXL: after a fetch of blocks 60-63 and the link's probe, every other KV block and the aux slots hold what they held; the receiver's scratch holds the sender's pattern."""
    sx = sender
    rx = Receiver(load_receiver_settings(pool=POOL)).start()
    try:
        kv = rx.pool.kv_bytes_view()
        kv.fill_(0xAB)
        rx.pool.aux.fill_(0xCD)
        scratch = rx.dataplane.scratch if rx.dataplane is not None else rx.agents.scratch  # type: ignore[union-attr]
        scratch.zero_()
        blocks = np.arange(BLOCKS - 4, BLOCKS)
        fetch_one(sx, rx, "probe-kv", blocks)
        [fig] = probed(sx)
        assert fig.state == "ok" and fig.gbps, fig
        print(f"\n[in-process link] {fig.gbps:.3f} GB/s over {fig.transport}")
        assert bool((kv[:, : BLOCKS - 4] == 0xAB).all()), "a KV block not fetched was written"
        assert bool((rx.pool.aux == 0xCD).all()), "an aux slot was written"
        want = torch.arange(fig.nbytes, dtype=torch.int32).remainder_(251).to(torch.uint8)
        assert torch.equal(scratch[: fig.nbytes], want), "the probe did not land in the scratch"
    finally:
        rx.shutdown()


@pytest.mark.integration
def test_a_receiver_without_scratch_gets_no_probe(sender: Sender) -> None:
    """A receiver with link_probe_bytes 0 advertises no scratch: its fetch is served, no probe is made or counted, the link has no figure."""
    sx = sender
    rx = Receiver(load_receiver_settings(pool=POOL, dataplane=dict(link_probe_bytes=0))).start()
    try:
        fetch_one(sx, rx, "no-scratch", np.arange(4))
        # A second fetch after the Register: a probe queued then would have run by now.
        fetch_one(sx, rx, "no-scratch-2", np.arange(4, 8))
        assert sx.probes.figures() == [] and sx.view().links == ()
        assert counts(sx.stats) == dict.fromkeys(LINK_PROBE_RESULTS, 0)
    finally:
        rx.shutdown()


@pytest.mark.integration
def test_readiness_follows_the_link_floor() -> None:
    """min_link_gbps above the measured figure: /readyz's reasons name link_slow with the peer and its figure; below it, or off: no such reason."""
    figures: dict[float | None, list[str]] = {}
    for floor in (None, 1e6, 1e-6):
        tx_settings = load_sender_settings(
            listen="tcp://127.0.0.1:0", pool=POOL, dataplane=dict(min_link_gbps=floor)
        )
        sx = Sender(tx_settings).start()
        rx = Receiver(load_receiver_settings(pool=POOL)).start()
        try:
            fetch_one(sx, rx, "floor", np.arange(4))
            [fig] = probed(sx)
            assert fig.gbps, fig
            ready, failing = SenderProbe(sx, sx.settings).readiness()
            figures[floor] = [f for f in failing if f.startswith("link_slow: ")]
            if floor == 1e6:
                assert not ready
                [line] = figures[floor]
                assert line.startswith(
                    f"link_slow: {rx.result_endpoint} measured {fig.gbps:.3g} GB/s"
                )
                assert "min_link_gbps=1e+06" in line, line
        finally:
            rx.shutdown()
            sx.shutdown()
    assert figures[None] == [] and figures[1e-6] == [], figures


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_probe_toward_a_killed_receiver_fails_counted_and_harmless(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over TCP, the link of a receiver process SIGKILLed is probed again: the probe fails or times out (counted, figure unknown), the sender stays live, and another receiver's fetch is served."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # the child inherits it
    tcp = dict(ucx_tls="tcp")
    settings = load_sender_settings(
        listen="tcp://127.0.0.1:0",
        pool=POOL,
        num_threads=1,
        dataplane=tcp,
        deadlines=dict(link_probe_timeout_ms=2000),
    )
    sx = Sender(settings).start()
    child = dict(pool=POOL, dataplane=tcp)
    args = ["--settings", json.dumps(child), "--endpoint", sx.endpoint, "--prefix", "kp"]
    # kp-1 is never published: the child waits for it, alive, until it is killed.
    args += ["--ids", "0:2", "--blocks", "4", "--window", "1"]
    rx = PeerProcess("receiver", args, tmp_path, "rx-killed")
    try:
        rx.wait_event("ready", 60)
        fill_request(sx.pool, "kp-0", np.arange(4))
        sx.publish("kp-0", np.arange(4))
        rx.wait_event("fetched", 30, where=lambda e: e["id"] == "kp-0" and e["verified"])
        [fig] = probed(sx)
        assert fig.state == "ok", fig
        rx.signal(signal.SIGKILL)
        rx.wait_exit(10)
        [p] = sx.peers.peers()
        assert sx.probes.again(p.nixl_name)
        [fig] = probed(sx)
        print(f"\n[probe toward a killed receiver] {fig.state}: {fig.detail}")
        assert fig.state in ("failed", "timeout") and fig.gbps is None, fig
        c = counts(sx.stats)
        assert c["ok"] == 1 and c["failed"] + c["timeout"] == 1, c
        assert sx.broken() is None
        other = Receiver(load_receiver_settings(pool=POOL, dataplane=tcp)).start()
        try:
            fetch_one(sx, other, "after-kill", np.arange(8, 12))
        finally:
            other.shutdown()
    finally:
        rx.kill()
        sx.shutdown()


@pytest.mark.integration
def test_a_peer_moved_to_a_fresh_path_is_probed_again() -> None:
    """Real NIXL: a data plane whose post toward a peer failed moves it to a fresh path (a new local agent); the sender's probes measure that link again, over the new path, into the peer's scratch."""
    from tests.test_dataplane import _Pair, _wait
    from tests.test_dataplane_reconnect import _fail_a_post

    pair = _Pair(16, 16)
    stats = Stats()
    guard = Guard(stats, logging.getLogger("test"))
    probes = LinkProbes.of(
        pair.tx, PeerAgents(pair.tx, stats), stats, guard, load_sender_settings()
    )
    done = threading.Event()

    def drive() -> None:  # the receiver's io thread would: its agent must progress
        while not done.wait(0.0005):
            pair.rx.progress()

    driver = threading.Thread(target=drive, name="test-rx-progress", daemon=True)
    driver.start()
    try:
        rx = Peer("rx", b"r", "tcp://127.0.0.1:7001", pair.peer, LAYOUT, 0, 0, "DRAM", 0)
        pair.rx.scratch.zero_()
        assert probes.request(rx, pair.rx.scratch_base, pair.rx.scratch_bytes)
        wait_until(lambda: counts(stats)["ok"] == 1, WAIT_S, "the first probe")
        pair.rx.scratch.zero_()
        _fail_a_post(pair)
        src, dst = np.array([1, 5], dtype=np.int64), np.array([2, 9], dtype=np.int64)
        _wait(pair, pair.tx.post_blocks(pair.peer, src, dst, 0, 1))  # starts the move
        wait_until(lambda: pair.tx.fresh_paths == 1, WAIT_S, "the peer moved to a fresh path")
        wait_until(lambda: counts(stats)["ok"] == 2, WAIT_S, "the link probed again")
        [fig] = probes.figures()
        assert fig.state == "ok" and fig.gbps and pair.tx.paths() == 2, fig
        want = torch.arange(fig.nbytes, dtype=torch.int32).remainder_(251).to(torch.uint8)
        assert torch.equal(pair.rx.scratch[: fig.nbytes], want)
        assert guard.broken() is None
    finally:
        probes.close(WAIT_S)
        done.set()
        driver.join(WAIT_S)
        pair.close()
