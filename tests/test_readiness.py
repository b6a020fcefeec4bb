"""Readiness that reflects stuck work, failing peers and spent aux slots; liveness that sees a dead thread.

The rules are checked deterministically with the controllable data plane (a
write stays in progress until the test finishes it; ``readiness(now=...)``
judges the same state at a later instant), and end to end with real processes
over UCX's TCP transport (a frozen peer holds a write): a receiver child
SIGSTOPped while the sender's write into it is in progress, or a sender child
SIGSTOPped before it reads a fetch, turns ``/readyz`` red with the stuck
reason, and green again once the peer resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.service.health import Probe, ProbeServer
from kvxferd.service.probes import ReceiverProbe, SenderProbe
from kvxferd.testing import ControlledDataPlane
from kvxferd.transfer.journal import Ending
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.sender import Sender
from tests.support.conditions import wait_until
from tests.support.peers import PeerProcess, check_request, fill_request

WAIT_S = 5.0
POOL = dict(num_layers=2, num_blocks=16, block_elems=16, aux_slots=4, aux_slot_bytes=64)
HEALTH = dict(stuck_after_ms=1000, peer_failure_min=3, peer_failure_ratio=0.5)
STUCK_S = HEALTH["stuck_after_ms"] / 1000


@pytest.fixture
def pair() -> Iterator[tuple[Sender, ControlledDataPlane, Receiver]]:
    """A started Sender (two workers, writes the test finishes) and a Receiver fetching from it."""
    tx_settings = load_sender_settings(
        name="ready-tx",
        listen="tcp://127.0.0.1:0",
        num_threads=2,
        inline_write_max_bytes=0,  # the worker threads write (one dies in a test below)
        pool=POOL,
        health=HEALTH,
        deadlines=dict(drain_timeout_ms=500, shutdown_timeout_ms=3000),
    )
    dp = ControlledDataPlane("ready-tx")
    sx = Sender(tx_settings, dataplane=dp).start()
    dp.notify_as = sx.sender_id  # a real sender's NIXL agent is named after its id
    rx_settings = load_receiver_settings(
        name="ready-rx",
        result_endpoint="tcp://127.0.0.1:0",
        pool=POOL,
        health=HEALTH,
        deadlines=dict(drain_timeout_ms=500, shutdown_timeout_ms=3000, cancel_fence_ms=500),
    )
    rx = Receiver(rx_settings, dataplane=ControlledDataPlane("ready-rx")).start()
    try:
        yield sx, dp, rx
    finally:
        for x in dp.xfers:
            x.finish(True)
        rx.shutdown(timeout=3)
        sx.shutdown(timeout=3)


def stuck(failing: list[str]) -> list[str]:
    return [f for f in failing if f.startswith("stuck: ")]


# -- stuck work ----------------------------------------------------------------------------------


def test_a_write_that_never_ends_makes_both_sides_stuck_after_stuck_after_ms_only(
    pair: tuple[Sender, ControlledDataPlane, Receiver],
) -> None:
    """A write in progress with nothing ending fails readiness once stuck_after_ms passed since it started, on both sides, and not before."""
    sx, dp, rx = pair
    tx_probe, rx_probe = SenderProbe(sx, sx.settings), ReceiverProbe(rx, rx.settings)
    # A daemon idle for an hour: pending work counts from when it started, not from the
    # last ending, so one new request is not "stuck" at once.
    for journal in (sx.journal, rx.journal):
        journal.started -= 3600
    sx.publish("req-stuck", [1, 2])
    h = rx.fetch("req-stuck", sx.endpoint, [3, 4], want_aux=False)
    xfer = dp.wait_posted(1)
    t = time.monotonic()
    for probe in (tx_probe, rx_probe):
        ok, failing = probe.readiness(now=t)
        assert ok and failing == [], failing
    ok, failing = tx_probe.readiness(now=t + STUCK_S + 0.5)
    assert not ok
    assert stuck(failing) and stuck(failing)[0].startswith(
        "stuck: 1 slice queued or writing and nothing ended for "
    ), failing
    assert "(stuck_after_ms=1000)" in stuck(failing)[0]
    ok, failing = rx_probe.readiness(now=t + STUCK_S + 0.5)
    assert not ok
    assert stuck(failing) and stuck(failing)[0].startswith(
        "stuck: 1 fetch open and nothing ended for "
    ), failing
    xfer.finish(True)
    out = h.wait(WAIT_S)
    assert out is not None and out.ok, out
    wait_until(lambda: tx_probe.readiness()[0], WAIT_S, "the sender is ready again")
    # The receiver learns of the write from its notification, which NIXL sends as the write
    # completes: the sender's worker may see it DONE a moment later.
    wait_until(lambda: sx.writes_in_flight() == 0, WAIT_S, "the sender saw the write end")
    later = time.monotonic() + 10 * STUCK_S  # nothing pending: idle is not stuck
    assert tx_probe.readiness(now=later) == (True, [])
    assert rx_probe.readiness(now=later) == (True, [])


def test_pending_work_is_not_stuck_while_other_work_keeps_ending(
    pair: tuple[Sender, ControlledDataPlane, Receiver],
) -> None:
    """Stuck counts from the later of the last ending and the oldest pending start: an ending resets it."""
    sx, dp, rx = pair
    probe = SenderProbe(sx, sx.settings)
    # Two requests on different workers: one receiver's writes on one worker go one at a time.
    ids = [f"req-{k}" for k in range(64)]
    a = ids[0]
    b = next(
        i for i in ids if sx._worker_for(i, rx.receiver_id) is not sx._worker_for(a, rx.receiver_id)
    )
    sx.publish(a, [1])
    sx.publish(b, [2])
    ha = rx.fetch(a, sx.endpoint, [3], want_aux=False)
    hb = rx.fetch(b, sx.endpoint, [4], want_aux=False)
    first = dp.wait_posted(1)
    dp.wait_posted(2)
    t_end = time.monotonic()
    first.finish(True)
    wait_until(lambda: sx.journal.last_ending >= t_end, WAIT_S, "the first slice ended")
    ended_at = sx.journal.last_ending
    assert probe.readiness(now=ended_at + 0.9 * STUCK_S)[0]
    ok, failing = probe.readiness(now=ended_at + STUCK_S + 0.1)
    assert not ok and stuck(failing), failing
    for x in dp.xfers:
        x.finish(True)
    for h in (ha, hb):
        out = h.wait(WAIT_S)
        assert out is not None and out.ok, out


# -- failing peers ---------------------------------------------------------------------------------


def test_a_peer_whose_failures_reach_the_ratio_fails_readiness_naming_it(
    pair: tuple[Sender, ControlledDataPlane, Receiver],
) -> None:
    """peer_failure_min endings of which at least peer_failure_ratio failed name the peer on both sides; the window passing clears it."""
    sx, dp, rx = pair
    tx_probe, rx_probe = SenderProbe(sx, sx.settings), ReceiverProbe(rx, rx.settings)
    for i in range(2):  # two failures: below peer_failure_min, so not yet judged
        sx.publish(f"req-f{i}", [1])
        h = rx.fetch(f"req-f{i}", sx.endpoint, [2], want_aux=False)
        dp.wait_posted(i + 1).finish(False)
        out = h.wait(WAIT_S)
        assert out is not None and not out.ok, out
    wait_until(lambda: sx.journal.endings >= 4, WAIT_S, "the sender recorded both failures")
    assert tx_probe.readiness() == (True, [])
    assert rx_probe.readiness() == (True, [])
    sx.publish("req-f2", [1])
    h = rx.fetch("req-f2", sx.endpoint, [2], want_aux=False)
    dp.wait_posted(3).finish(False)
    assert h.wait(WAIT_S) is not None
    wait_until(lambda: not tx_probe.readiness()[0], WAIT_S, "the sender names the failing peer")
    ok, failing = tx_probe.readiness()
    peer_lines = [f for f in failing if f.startswith("peer failing: ")]
    assert peer_lines == [
        f"peer failing: {rx.result_endpoint} 3/3 ended failed in the last 60s"
        " (peer_failure_ratio=0.5, peer_failure_min=3)"
    ], failing
    ok, failing = rx_probe.readiness()
    assert not ok and any(f.startswith(f"peer failing: {sx.endpoint} 3/3 ") for f in failing), (
        failing
    )
    after_window = time.monotonic() + 61
    assert tx_probe.readiness(now=after_window) == (True, [])
    assert rx_probe.readiness(now=after_window) == (True, [])


def test_cancels_and_our_own_shutdown_never_count_as_a_peers_failures(
    pair: tuple[Sender, ControlledDataPlane, Receiver],
) -> None:
    """Fetches the engine cancelled, and slices ended by a cancel or our shutdown, count in a peer's window but not as failures."""
    sx, _, rx = pair
    handles = [rx.fetch(f"req-c{i}", sx.endpoint, [i], want_aux=False) for i in range(3)]
    for h in handles:
        h.cancel()
    for h in handles:
        out = h.wait(WAIT_S)
        assert out is not None and out.reason == "cancelled", out
    for reason in ("cancelled", "shutting_down", "draining"):
        sx.journal.record(
            Ending("sender", "slice", "req-x", "failed", reason=reason, peer=rx.result_endpoint)
        )
    assert [(r.failed, r.total) for r in rx.journal.peer_rates()] == [(0, 3)]
    assert [(r.failed, r.total) for r in sx.journal.peer_rates()] == [(0, 3)]
    assert ReceiverProbe(rx, rx.settings).readiness() == (True, [])
    assert SenderProbe(sx, sx.settings).readiness() == (True, [])


# -- aux slots ----------------------------------------------------------------------------------


def test_sender_readiness_fails_when_its_aux_slots_run_out(
    pair: tuple[Sender, ControlledDataPlane, Receiver],
) -> None:
    """With every sender aux slot held by a published request, readiness says no free aux slot."""
    sx, _, _ = pair
    probe = SenderProbe(sx, sx.settings)
    handles = [sx.publish(f"req-aux-{i}", [i], aux=b"x") for i in range(POOL["aux_slots"])]
    ok, failing = probe.readiness()
    assert not ok and failing == [
        "no free aux slot (0 free, aux_slots=4: a publish with aux is refused busy)"
    ], failing
    assert handles[0].close(1.0)
    assert probe.readiness() == (True, [])


# -- liveness and the metric over HTTP --------------------------------------------------------------


async def _get(client: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with client.get(url) as r:
        return r.status, await r.text()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_worker_thread_fails_healthz_and_readyz_and_the_metric_names_the_reasons(
    pair: tuple[Sender, ControlledDataPlane, Receiver],
) -> None:
    """A worker thread that ended makes /healthz 503 naming it, /readyz 503, and kvxferd_not_ready{reason="thread_dead"} 1."""
    sx, _, _ = pair
    worker = sx._workers[1]

    def die(*_: object) -> None:
        raise SystemExit  # not an Exception: the worker's guard lets it end the thread

    worker._turn = die  # type: ignore[method-assign]
    worker.thread.join(WAIT_S)
    assert not worker.thread.is_alive()
    probe = SenderProbe(sx, sx.settings)

    async def main() -> tuple[tuple[int, str], tuple[int, str], str]:
        server = ProbeServer(probe, "127.0.0.1", 0)
        port = await server.start()
        try:
            timeout = aiohttp.ClientTimeout(total=WAIT_S)
            async with aiohttp.ClientSession(timeout=timeout) as client:
                base = f"http://127.0.0.1:{port}"
                health = await _get(client, base + "/healthz")
                ready = await _get(client, base + "/readyz")
                metrics = (await _get(client, base + "/metrics"))[1]
                return health, ready, metrics
        finally:
            await server.stop()

    (h_status, h_body), (r_status, r_body), metrics = asyncio.run(main())
    assert h_status == 503 and "kvxferd-worker-1: thread ended" in h_body, h_body
    assert r_status == 503 and "worker 1 thread not alive\n" in r_body, r_body
    fams = {f.name: f for f in text_string_to_metric_families(metrics)}
    assert [s.value for s in fams["kvxferd_ready"].samples] == [0]
    not_ready = {s.labels["reason"]: s.value for s in fams["kvxferd_not_ready"].samples}
    assert not_ready["thread_dead"] == 1 and not_ready["stuck"] == 0, not_ready
    assert set(not_ready) >= {"draining", "stuck", "peer_failing", "no_aux_slot", "table_full"}


def test_ready_metric_is_1_with_every_reason_0_when_ready(
    pair: tuple[Sender, ControlledDataPlane, Receiver],
) -> None:
    """A ready receiver exports kvxferd_ready 1 and kvxferd_not_ready 0 for every reason."""
    _, _, rx = pair
    server = ProbeServer(ReceiverProbe(rx, rx.settings), "127.0.0.1", 0)
    text = generate_latest(server.registry).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert [s.value for s in fams["kvxferd_ready"].samples] == [1]
    assert {s.value for s in fams["kvxferd_not_ready"].samples} == {0}


# -- with real processes -------------------------------------------------------------------------

BLOCK = 256 << 10
BLOCKS = 64  # x 2 layers x 256 KiB = 32 MiB: more than TCP buffers take while the receiver sleeps
STARTUP_S = 60.0


@pytest.fixture
def tcp_sender(monkeypatch: pytest.MonkeyPatch) -> Iterator[Sender]:
    """A one-worker sender over UCX/TCP (a frozen receiver holds its write), stuck after 1 s."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # the receiver child inherits it
    settings = load_sender_settings(
        listen="tcp://127.0.0.1:0",
        num_threads=1,
        pool=dict(num_layers=2, num_blocks=2 * BLOCKS, block_elems=BLOCK, dtype="uint8"),
        dataplane=dict(ucx_tls="tcp"),
        health=dict(stuck_after_ms=1000),
        deadlines=dict(
            xfer_stall_timeout_ms=60_000, drain_timeout_ms=500, shutdown_timeout_ms=5000
        ),
    )
    s = Sender(settings).start()
    try:
        yield s
    finally:
        s.shutdown()


@contextlib.contextmanager
def probe_port(probe: Probe) -> Iterator[str]:
    """A ProbeServer for ``probe`` on its own event loop thread; yields the /readyz URL."""
    server = ProbeServer(probe, "127.0.0.1", 0)
    loop = asyncio.new_event_loop()
    served = threading.Thread(target=loop.run_forever, name="test-probe-loop", daemon=True)
    served.start()
    try:
        port = asyncio.run_coroutine_threadsafe(server.start(), loop).result(WAIT_S)
        try:
            yield f"http://127.0.0.1:{port}/readyz"
        finally:
            asyncio.run_coroutine_threadsafe(server.stop(), loop).result(WAIT_S)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        served.join(WAIT_S)
        loop.close()


def stuck_lines(body: str, prefix: str) -> list[str]:
    return [line for line in body.splitlines() if line.startswith(prefix)]


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_readyz_is_503_stuck_while_the_receiver_is_frozen_and_200_after_it_resumes(
    tcp_sender: Sender, tmp_path: Path
) -> None:
    """A receiver process SIGSTOPped with a fetch parked on the sender: once published, the write into it hangs and /readyz says stuck; SIGCONT lets it finish and /readyz is 200 again."""
    sx = tcp_sender
    settings = dict(
        pool=dict(num_layers=2, num_blocks=2 * BLOCKS, block_elems=BLOCK, dtype="uint8"),
        dataplane=dict(ucx_tls="tcp"),
        deadlines=dict(kv_transfer_timeout_ms=60_000, register_timeout_ms=int(STARTUP_S * 1000)),
    )
    args = ["--settings", json.dumps(settings), "--endpoint", sx.endpoint, "--prefix", "st"]
    args += ["--ids", "0:2", "--blocks", str(BLOCKS), "--window", "1"]
    rx = PeerProcess("receiver", args, tmp_path, "rx-frozen")
    try:
        with probe_port(SenderProbe(sx, sx.settings)) as readyz:
            blocks = [list(range(i * BLOCKS, (i + 1) * BLOCKS)) for i in range(2)]
            rx.wait_event("ready", STARTUP_S)
            _publish(sx, "st-0", blocks[0])  # one transfer first: the UCX connection is up
            rx.wait_event("fetched", 30, where=lambda e: e["id"] == "st-0" and e["verified"])
            wait_until(lambda: sx.view().parked_count == 1, 30, "st-1 parked on the sender")
            rx.signal(signal.SIGSTOP)
            t_frozen = time.monotonic()
            _publish(sx, "st-1", blocks[1])
            t_red = wait_until(lambda: _http_get(readyz)[0] == 503, 15, "/readyz 503")
            status, body = _http_get(readyz)
            print(f"\n[frozen receiver] /readyz {status} {t_red - t_frozen:.2f}s after: {body!r}")
            assert stuck_lines(body, "stuck: 1 slice queued or writing"), body
            assert sx.writes_in_flight() >= 1, "the write into the frozen receiver ended"
            rx.signal(signal.SIGCONT)
            t_green = wait_until(lambda: _http_get(readyz)[0] == 200, 30, "/readyz 200")
            print(f"[resumed] /readyz 200 {t_green - t_red:.2f}s after it went red")
        rx.wait_event("fetched", 30, where=lambda e: e["id"] == "st-1" and e["verified"])
        assert rx.wait_exit(30) == 0, rx.describe()
    finally:
        rx.kill()


@pytest.fixture
def tcp_receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    """A receiver over UCX/TCP, stuck after 1 s, fetches given a minute."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # the sender child inherits it
    settings = load_receiver_settings(
        pool=dict(num_layers=2, num_blocks=2 * BLOCKS, block_elems=BLOCK, dtype="uint8"),
        dataplane=dict(ucx_tls="tcp"),
        health=dict(stuck_after_ms=1000),
        deadlines=dict(
            kv_transfer_timeout_ms=60_000,
            register_timeout_ms=int(STARTUP_S * 1000),
            drain_timeout_ms=500,
            shutdown_timeout_ms=5000,
        ),
    )
    r = Receiver(settings).start()
    try:
        yield r
    finally:
        r.shutdown()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_receiver_readyz_is_503_stuck_while_its_sender_is_frozen_and_200_after_it_resumes(
    tcp_receiver: Receiver, tmp_path: Path
) -> None:
    """A fetch sent to a SIGSTOPped sender process makes the receiver's /readyz say stuck; SIGCONT lets it complete and /readyz is 200 again."""
    r = tcp_receiver
    settings = dict(
        pool=dict(num_layers=2, num_blocks=2 * BLOCKS, block_elems=BLOCK, dtype="uint8"),
        dataplane=dict(ucx_tls="tcp"),
        num_threads=1,
    )
    args = ["--settings", json.dumps(settings), "--prefix", "sf", "--count", "2"]
    args += ["--blocks", str(BLOCKS)]
    tx = PeerProcess("sender", args, tmp_path, "tx-frozen")
    try:
        endpoint = tx.wait_event("ready", STARTUP_S)["endpoint"]
        tx.wait_events("published", 2, 30)
        with probe_port(ReceiverProbe(r, r.settings)) as readyz:
            blocks = [np.arange(i * BLOCKS, (i + 1) * BLOCKS) for i in range(2)]
            first = r.fetch("sf-0", endpoint, blocks[0], want_aux=False).wait(30)
            assert first is not None and first.ok, first  # registered, UCX connection up
            tx.signal(signal.SIGSTOP)
            t_frozen = time.monotonic()
            h = r.fetch("sf-1", endpoint, blocks[1], want_aux=False)
            t_red = wait_until(lambda: _http_get(readyz)[0] == 503, 15, "/readyz 503")
            status, body = _http_get(readyz)
            print(f"\n[frozen sender] /readyz {status} {t_red - t_frozen:.2f}s after: {body!r}")
            assert stuck_lines(body, "stuck: 1 fetch open"), body
            assert h.wait(0) is None, "the fetch from the frozen sender ended"
            tx.signal(signal.SIGCONT)
            t_green = wait_until(lambda: _http_get(readyz)[0] == 200, 30, "/readyz 200")
            print(f"[resumed] /readyz 200 {t_green - t_red:.2f}s after it went red")
            out = h.wait(30)
            assert out is not None and out.ok, out
            assert check_request(r.pool, "sf-1", blocks[1]) == ""
    finally:
        tx.kill()


def _publish(sx: Sender, request_id: str, blocks: list[int]) -> None:
    fill_request(sx.pool, request_id, np.asarray(blocks, dtype=np.int64))
    sx.publish(request_id, blocks)


def _http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
