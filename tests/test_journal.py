"""The journal: one record per request end, its log line, its bounded per-peer accounting."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from kvxferd import logs
from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.journal import BUCKETS_S, OTHER, Ending, Journal
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.sender import Sender
from tests.support.conditions import wait_until
from tests.test_races import BLOCKS, WAIT_S, Harness, h

__all__ = ["h"]  # the fixture, shared with tests/test_races.py

POOL = dict(num_layers=2, num_blocks=16, block_elems=64, aux_slots=4, aux_slot_bytes=64)


def ending(peer: str, outcome: str = "done", duration_s: float = 0.001) -> Ending:
    return Ending("receiver", "fetch", "r-1", outcome, peer=peer, duration_s=duration_s)


def test_peers_past_the_label_budget_share_one_label() -> None:
    """The first ``peer_labels`` peers keep their own label; every later peer is counted under ``other``."""
    j = Journal("receiver", peer_labels=2)
    for peer in ("tcp://a:1", "tcp://b:1", "tcp://c:1", "tcp://d:1", "tcp://a:1"):
        j.record(ending(peer))
    labels = {label for _, label in j.histograms()}
    assert labels == {"tcp://a:1", "tcp://b:1", OTHER}
    counts = {label: buckets[-1][1] for (_, label), (buckets, _) in j.histograms().items()}
    assert counts == {"tcp://a:1": 2, "tcp://b:1": 1, OTHER: 2}


def test_histogram_buckets_are_cumulative_and_inclusive() -> None:
    """A value equal to a bucket bound counts in that bucket (Prometheus ``le``), and counts accumulate."""
    j = Journal("receiver")
    for d in (BUCKETS_S[0], BUCKETS_S[3], 99.0):
        j.record(ending("tcp://a:1", duration_s=d))
    (buckets, total) = j.histograms()[("end_to_end", "tcp://a:1")]
    by_bound = dict(buckets)
    assert by_bound[BUCKETS_S[0]] == 1
    assert by_bound[BUCKETS_S[2]] == 1
    assert by_bound[BUCKETS_S[3]] == 2
    assert by_bound[float("inf")] == 3
    assert total == pytest.approx(BUCKETS_S[0] + BUCKETS_S[3] + 99.0)


def test_peer_rates_count_only_the_window() -> None:
    """A peer's failure rate counts its endings inside the window; older ones drop out."""
    j = Journal("receiver", window_s=10.0)
    for outcome in ("failed", "failed", "done"):
        j.record(ending("tcp://a:1", outcome))
    (rate,) = j.peer_rates()
    assert (rate.peer, rate.failed, rate.total) == ("tcp://a:1", 2, 3)
    assert rate.ratio == pytest.approx(2 / 3)
    assert j.peer_rates(now=j.last_ending + 11.0) == []


def test_progress_stamps_follow_endings() -> None:
    """``last_ending`` moves on every record, ``last_done`` only on a done one."""
    j = Journal("sender")
    j.record(ending("tcp://a:1", "failed"))
    assert j.last_ending > 0 and j.last_done == 0.0
    j.record(ending("tcp://a:1", "done"))
    assert j.last_done == j.last_ending
    assert j.idle_s(now=j.last_ending + 2.0) == pytest.approx(2.0)


# -- the log lines of real transfers ---------------------------------------------------------


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """Every log line of this process as JSON, at DEBUG, into a buffer; restored afterwards."""
    root = logging.getLogger()
    level = root.level
    buf = io.StringIO()
    logs.configure("debug", json=True, stream=buf)
    try:
        yield buf
    finally:
        for h in [h for h in root.handlers if h.get_name() == "kvxferd"]:
            root.removeHandler(h)
        root.setLevel(level)


def journal_lines(buf: io.StringIO) -> list[dict[str, Any]]:
    out = []
    for line in buf.getvalue().splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("logger") == "kvxferd.journal":
                out.append(rec)
    return out


@pytest.fixture
def pair() -> Iterator[tuple[Sender, Receiver]]:
    """A real sender and receiver in this process: real ZMQ, real NIXL over DRAM."""
    deadlines = dict(
        publish_ttl_ms=1500, drain_timeout_ms=500, shutdown_timeout_ms=3000, cancel_fence_ms=1000
    )
    tx = Sender(
        load_sender_settings(
            name="journal-tx",
            listen="tcp://127.0.0.1:0",
            num_threads=2,
            pool=POOL,
            deadlines=deadlines,
        )
    ).start()
    rx = Receiver(
        load_receiver_settings(
            name="journal-rx",
            result_endpoint="tcp://127.0.0.1:0",
            pool=POOL,
            deadlines=deadlines,
        )
    ).start()
    try:
        yield tx, rx
    finally:
        rx.shutdown(timeout=3)
        tx.shutdown(timeout=3)


@pytest.mark.timeout(60)
def test_each_failed_request_logs_one_warning_line_with_its_fields(
    captured: io.StringIO, pair: tuple[Sender, Receiver]
) -> None:
    """A done request logs only at DEBUG; an expired publish and a fetch of a request never published each log one WARNING line with request id, peer, role, reason, duration, bytes and blocks as fields."""
    tx, rx = pair
    ok = tx.publish("r-ok", [1, 2], aux=b"meta")
    expiring = tx.publish("r-expires", [3])
    got = rx.fetch("r-ok", tx.endpoint, [4, 5]).wait(WAIT_S)
    assert got is not None and got.ok, got
    assert ok.wait(WAIT_S) is not None
    missing = rx.fetch("r-never-published", tx.endpoint, [6], timeout_ms=1000).wait(WAIT_S)
    # Either the receiver's deadline passes first (timed_out) or the sender refuses the fetch
    # it parked when that deadline comes (failed/expired): a race both sides may win.
    assert missing is not None and missing.reason is not None, missing
    assert (missing.state.value, missing.reason.value) in {
        ("timed_out", "timeout"),
        ("failed", "expired"),
    }, missing
    out = expiring.wait(WAIT_S)
    assert out is not None and out.state.value == "expired", out

    def lines_for(rid: str) -> list[dict[str, Any]]:
        return [r for r in journal_lines(captured) if r["request_id"] == rid]

    wait_until(lambda: len(lines_for("r-ok")) == 3, WAIT_S, "three records of r-ok")
    done = {(r["role"], r["kind"]): r for r in lines_for("r-ok")}
    assert set(done) == {("sender", "request"), ("sender", "slice"), ("receiver", "fetch")}
    assert all(r["level"] == "debug" and r["outcome"] == "done" for r in done.values())
    sl = done[("sender", "slice")]
    assert sl["peer"] == rx.result_endpoint and sl["blocks"] == 2 and sl["bytes"] > 0
    assert sl["post_ms"] >= 0 and sl["transfer_ms"] >= 0 and sl["duration_ms"] > 0
    assert done[("receiver", "fetch")]["peer"] == tx.endpoint

    (refused,) = lines_for("r-never-published")
    assert refused["level"] == "warning"
    assert (refused["role"], refused["outcome"], refused["reason"]) == (
        "receiver",
        missing.state.value,
        missing.reason.value,
    )
    assert refused["peer"] == tx.endpoint and refused["blocks"] == 1
    assert refused["duration_ms"] > 0 and refused["bytes"] == 0

    (expired,) = lines_for("r-expires")
    assert expired["level"] == "warning"
    assert (expired["role"], expired["kind"], expired["outcome"], expired["reason"]) == (
        "sender",
        "request",
        "expired",
        "expired",
    )
    assert expired["blocks"] == 1 and expired["duration_ms"] >= 1500
    warnings = [r for r in journal_lines(captured) if r["level"] == "warning"]
    assert len(warnings) == 2, warnings


@pytest.mark.timeout(60)
def test_a_stalled_write_logs_when_it_stalls_not_only_when_it_ends(
    captured: io.StringIO, h: Harness
) -> None:
    """A write past its stall deadline logs a ``write stalled`` WARNING with its request, peer and fetch while NIXL still holds it, before the write ends."""
    sx, dp = h.sender(num_threads=1, deadlines=dict(xfer_stall_timeout_ms=200))
    p = h.peer(sx, "peer-a")
    sx.publish("req-stall", BLOCKS)
    p.fetch("req-stall", 7)
    x = dp.wait_posted(1)
    assert p.next_result().status == "in_doubt"

    def stalled() -> list[dict[str, Any]]:
        return [r for r in journal_lines(captured) if r["event"] == "write stalled"]

    wait_until(lambda: len(stalled()) == 1, WAIT_S, "a write-stalled line")
    (line,) = stalled()
    assert line["level"] == "warning" and line["request_id"] == "req-stall"
    assert line["fetch_id"] == 7 and line["write"] == "kv" and line["stalled_ms"] >= 200
    assert line["peer"] == p.result_endpoint
    x.finish(True)  # only now does the write end
    assert p.next_message() == wire.CancelAck(request_id="req-stall", fetch_id=7, in_doubt=False)
