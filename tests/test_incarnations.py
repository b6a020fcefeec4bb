"""Incarnations: a sender keys a receiver by its process (receiver_id = name-uuid), never by its address.

Deterministic tests drive the real Sender with the controllable data plane and
raw ZMQ peers (tests/test_races.py's harness); the loop at the end kills and
restarts a real receiver daemon on the same result endpoint while the sender
keeps serving another receiver.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvxferd.errors import Reason
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.session import TxState
from tests.support.conditions import wait_until
from tests.test_daemon import DaemonProcess, Engines, http_get, metrics
from tests.test_races import BLOCKS, QUIET_S, WAIT_S, Harness, h

__all__ = ["h"]  # the fixture, shared with tests/test_races.py

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def _on_other_workers(sx: Any, peer_id: str) -> tuple[str, str]:
    """Two request ids whose writes toward ``peer_id`` go to different workers."""
    first = "req-0"
    for i in range(1, 200):
        rid = f"req-{i}"
        if sx._worker_for(rid, peer_id) is not sx._worker_for(first, peer_id):
            return first, rid
    raise AssertionError("every request id maps to one worker")


# -- a new incarnation at the same endpoint ------------------------------------------------------


def test_a_replaced_receivers_queued_fetch_is_never_written_and_ends_peer_restarted(
    h: Harness,
) -> None:
    """When a new receiver id registers at a receiver's endpoint, that receiver's queued and writing fetches end peer_restarted, no new write starts toward it and no Result for them reaches the endpoint."""
    sx, dp = h.sender(num_threads=1)
    old = h.peer(sx, "peer-old")
    h1 = sx.publish("req-1", BLOCKS)
    h2 = sx.publish("req-2", [6, 7, 8])
    old.fetch("req-1", 1)
    x = dp.wait_posted(1)
    old.fetch("req-2", 2)  # queued in the old peer's lane behind the write
    h.until(lambda: len(h2.session.slices()) == 1, "fetch 2 attached")
    h.peer(sx, "peer-new", result_endpoint=old.result_endpoint)  # the old process is gone
    o2 = h2.wait(WAIT_S)
    assert o2 is not None and (o2.state, o2.reason) == (TxState.FAILED, Reason.PEER_RESTARTED)
    o1 = h1.wait(WAIT_S)
    assert o1 is not None and o1.reason is Reason.PEER_RESTARTED, o1
    assert "peer-old" in dp.peers, "removed under a write in flight"
    x.finish(True)
    wait_until(lambda: "peer-old" not in dp.peers, WAIT_S, "old NIXL peer removed")
    assert h1.close(WAIT_S) and h2.close(WAIT_S)
    # Only the endpoint's new owner reads it now: nothing of the old fetches may come.
    late = [m for m in old.more(QUIET_S) if isinstance(m, wire.Result | wire.CancelAck)]
    assert late == [], late
    assert len(dp.xfers) == 1, [x.peer for x in dp.xfers]
    assert sx.stats.get("fetches_ended_peer_restarted") == 2


def test_a_replaced_receivers_parked_fetch_is_dropped(h: Harness) -> None:
    """A fetch parked by a receiver that is then replaced at its endpoint is never attached when the request is published."""
    sx, dp = h.sender(num_threads=1)
    old = h.peer(sx, "peer-old")
    old.fetch("req-late", 1)
    h.until(lambda: sx.view().parked_count == 1, "fetch parked")
    h.peer(sx, "peer-new", result_endpoint=old.result_endpoint)
    assert sx.view().parked_count == 0 and not sx.view().parked
    hd = sx.publish("req-late", BLOCKS)
    assert hd.session.slices() == []
    assert old.more(QUIET_S) == [] and dp.xfers == []


# -- transport errors --------------------------------------------------------------------------


def test_a_nixl_write_error_forces_a_fresh_registration(h: Harness) -> None:
    """After a write toward a peer ends in a NIXL error, the peer's NIXL agent is removed and its next fetch gets unknown_peer until it registers again, which loads the agent afresh."""
    sx, dp = h.sender(num_threads=1)
    p = h.peer(sx, "peer-a")
    loads: list[str] = []
    add_peer = dp.add_peer

    def counted(metadata: bytes) -> str:
        loads.append(metadata.decode())
        return add_peer(metadata)

    dp.add_peer = counted  # type: ignore[method-assign]
    sx.publish("req-1", BLOCKS)
    p.fetch("req-1", 1)
    dp.wait_posted(1).finish(False)
    assert p.next_result().reason is Reason.TRANSFER_ERROR
    wait_until(lambda: "peer-a" not in dp.peers, WAIT_S, "the failed peer's agent removed")
    sx.publish("req-2", BLOCKS)
    p.fetch("req-2", 2)
    assert p.next_result().reason is Reason.UNKNOWN_PEER
    p.register()
    assert loads == ["peer-a"] and "peer-a" in dp.peers
    p.fetch("req-2", 3)
    dp.wait_posted(2).finish(True)
    assert p.next_result().status == "done"
    assert sx.stats.get("peers_invalidated") == 1


def test_registering_again_during_a_deferred_removal_keeps_the_new_agent(h: Harness) -> None:
    """A peer invalidated while another of its writes is in flight, and registered again before that write ends, keeps its NIXL agent when the write ends."""
    sx, dp = h.sender(num_threads=2)
    p = h.peer(sx, "peer-a")
    r1, r2 = _on_other_workers(sx, "peer-a")
    sx.publish(r1, BLOCKS)
    sx.publish(r2, [6, 7, 8])
    p.fetch(r1, 1)
    p.fetch(r2, 2)
    dp.wait_posted(2)
    x1, x2 = dp.xfers
    x1.finish(False)
    assert p.next_result().reason is Reason.TRANSFER_ERROR
    wait_until(lambda: sx.stats.get("peer_removals_deferred") == 1, WAIT_S, "removal deferred")
    p.register()
    x2.finish(True)
    assert p.next_result().status == "done"
    assert "peer-a" in dp.peers, "the deferred removal took the new registration's agent"
    assert sx.stats.get("peer_removals_cancelled") == 1


def test_a_restarted_receiver_starts_its_fetch_ids_elsewhere() -> None:
    """Two receiver processes start their fetch ids at different points, so a Result for the old one never matches a new fetch."""
    code = "from kvxferd.transfer.receiver import _fetch_ids; print(next(_fetch_ids))"
    env = {"PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
        for _ in range(2)
    ]
    firsts = [int(p.communicate(timeout=60)[0]) for p in procs]
    assert firsts[0] != firsts[1] and all(0 < f < 2**62 for f in firsts), firsts


# -- the restart loop, real daemons ---------------------------------------------------------------

LAYERS, BLOCK_BYTES = 2, 64 << 10
REQ_BLOCKS = 8
RESTARTS = 5  # each restart starts a daemon (~5 s on a loaded 2-core host)
SENTINEL = 0xA5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parked_fetches(d: DaemonProcess) -> float:
    family = metrics(d.probe_port)["kvxferd_transfers_in_flight"]
    return sum(x.value for x in family.samples if x.labels.get("state") == "parked")


def _content(rid: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(rid) & 0xFFFF_FFFF)
    return torch.randint(0, 255, (LAYERS, REQ_BLOCKS, BLOCK_BYTES), dtype=torch.uint8, generator=g)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_receiver_restarted_on_its_address_is_served_at_once_and_never_written_as_the_old_one(
    tmp_path: Path,
) -> None:
    """Killed and restarted RESTARTS (5) times on one result endpoint while another receiver keeps fetching: every new incarnation's fetches succeed byte-exact within seconds, the other's never fail, blocks no fetch targeted keep their sentinel, and the sender holds exactly two peers and no retiring agent afterwards."""
    env = {
        "KVXFERD_POOL__NUM_LAYERS": str(LAYERS),
        "KVXFERD_POOL__NUM_BLOCKS": str(8 * REQ_BLOCKS),
        "KVXFERD_POOL__BLOCK_ELEMS": str(BLOCK_BYTES),
        "KVXFERD_POOL__DTYPE": "uint8",
        "KVXFERD_NUM_THREADS": "2",
        "KVXFERD_DEADLINES__KV_TRANSFER_TIMEOUT_MS": "5000",
        "KVXFERD_DEADLINES__CANCEL_FENCE_MS": "500",
        "KVXFERD_DEADLINES__DRAIN_TIMEOUT_MS": "500",
        "KVXFERD_DEADLINES__SHUTDOWN_TIMEOUT_MS": "2000",
    }
    d = str(tmp_path)
    port = _free_port()
    tx = DaemonProcess("sender", "tx", d, env, ["--listen", "tcp://127.0.0.1:0"])
    steady = DaemonProcess("receiver", "rx-b", d, env, [])
    engines = Engines()
    spawned = [tx, steady]

    def restarting(n: int) -> DaemonProcess:
        rx = DaemonProcess(
            "receiver", f"rx-a{n}", d, env, ["--result-endpoint", f"tcp://127.0.0.1:{port}"]
        )
        spawned.append(rx)
        return rx

    try:
        tx.wait_ready(), steady.wait_ready()
        ct, pt = engines.client(tx)
        cb, pb = engines.client(steady)
        published: dict[str, int] = {}
        seq = [0]

        def publish() -> str:
            i = seq[0] = seq[0] + 1
            rid = f"r{i}"
            src = [(i % 8) * REQ_BLOCKS + b for b in range(REQ_BLOCKS)]
            pt[:, src] = _content(rid)
            published[rid] = ct.publish(rid, src)
            return rid

        def fetch_ok(c: Any, pool: torch.Tensor, slot: int, timeout: float) -> bool:
            rid = publish()
            dst = [slot * REQ_BLOCKS + b for b in range(REQ_BLOCKS)]
            out = c.wait(c.fetch(rid, tx.endpoint, dst), timeout)
            ct.close(published.pop(rid), timeout=5.0)
            return (
                out is not None
                and out.state == "done"
                and bool(torch.equal(pool[:, dst], _content(rid)))
            )

        rx = restarting(0)
        rx.wait_ready()
        for n in range(RESTARTS):
            ca, pa = engines.client(rx)
            # The old incarnation dies with work at the sender: two fetches of published
            # requests (into slots 0-1) and two parked for requests not published yet.
            for slot in range(2):
                rid = publish()
                ca.fetch(rid, tx.endpoint, [slot * REQ_BLOCKS + b for b in range(REQ_BLOCKS)])
            parked = [f"parked-{n}-{k}" for k in range(2)]
            for k, rid in enumerate(parked):
                ca.fetch(rid, tx.endpoint, [(2 + k) * REQ_BLOCKS + b for b in range(REQ_BLOCKS)])
            wait_until(lambda: parked_fetches(tx) >= 2, 10, "both fetches parked")
            rx.signal(signal.SIGKILL)
            rx.wait_exit(10)
            assert fetch_ok(cb, pb, 0, 10), f"restart {n}: the other receiver failed"
            rx = restarting(n + 1)
            rx.wait_ready()
            t_ready = time.monotonic()
            ca, pa = engines.client(rx)
            pa[:] = SENTINEL
            # 100 % of the new incarnation's fetches succeed, into slots 4-7 only. Its first
            # fetch registers it: the sender learns of the restart there.
            assert fetch_ok(ca, pa, 4, 10), f"restart {n}: new incarnation's first fetch failed"
            late = []
            for k, rid in enumerate(parked):  # published once the new process registered
                src = [(k + 4) * REQ_BLOCKS + b for b in range(REQ_BLOCKS)]
                pt[:, src] = _content(rid)
                late.append(ct.publish(rid, src))
            for slot in range(5, 8):
                assert fetch_ok(ca, pa, slot, 10), f"restart {n}: new incarnation's fetch failed"
            took = time.monotonic() - t_ready
            assert took < 10, f"restart {n}: {took:.1f}s to serve the new incarnation"
            # No fetch of the dead incarnation attached to the requests published after it.
            assert [ct.poll(h) for h in late] == [None, None], f"restart {n}: a dead fetch ran"
            # Nothing meant for the old incarnation landed in the new one's slots 0-3.
            assert bool((pa[:, : 4 * REQ_BLOCKS] == SENTINEL).all()), f"restart {n}: stray write"
            assert fetch_ok(cb, pb, 1, 10), f"restart {n}: the other receiver failed"
            for h in late:
                ct.close(h, timeout=5.0)
            print(f"restart {n}: new incarnation served 4/4 in {took:.2f}s")
        for rid in list(published):  # the killed incarnations' requests: all ended by now
            out = ct.wait(published[rid], 10)
            assert out is not None, rid
            ct.close(published.pop(rid), timeout=5.0)

        def settled() -> bool:
            s = json.loads(http_get(tx.probe_port, "/debug/state")[1])
            return not s["retiring_peers"] and len(s["peers"]) == 2

        wait_until(settled, 10, "the sender forgot every dead incarnation")
    finally:
        engines.close()
        for p in spawned:
            p.kill()
