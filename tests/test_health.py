"""The probe port: HTTP answers from a fake probe, and the real probes of a Sender and a Receiver."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.errors import Reason
from kvxferd.service.health import Probe, ProbeServer
from kvxferd.service.metrics import DURATION_BUCKETS_S, Snapshot
from kvxferd.service.probes import ReceiverProbe, SenderProbe
from kvxferd.testing import ControlledDataPlane
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.sender import Sender

pytestmark = pytest.mark.timeout(20)

WAIT_S = 5.0
POOL = dict(num_layers=2, num_blocks=16, block_elems=16, aux_slots=4, aux_slot_bytes=64)


@dataclass
class FakeProbe:
    """A probe whose answers the test sets."""

    live: tuple[bool, str] = (True, "workers fine")
    ready: tuple[bool, list[str]] = (True, [])
    durations: list[float] = field(default_factory=list)
    snapshots: int = 0

    def liveness(self) -> tuple[bool, str]:
        return self.live

    def readiness(self) -> tuple[bool, list[str]]:
        return self.ready

    def snapshot(self) -> Snapshot:
        self.snapshots += 1
        durations, self.durations = self.durations, []
        return Snapshot(
            role="sender",
            stats={
                "slices_done": 5,
                "slices_failed": 2,
                "slices_in_doubt": 1,
                "bytes_written": 4096,
                "rejected_busy": 3,
                "rejected_duplicate": 1,
                "worker_0_slices": 6,
                "worker_2_slices": 2,
            },
            sessions_by_state={"transferring": 2, "complete": 7},
            queue_depths=[0, 4, 1],
            writes_in_flight=2,
            peers=3,
            durations_s=durations,
        )


@asynccontextmanager
async def serving(
    probe: Probe, **kw: float
) -> AsyncIterator[tuple[ProbeServer, aiohttp.ClientSession, str]]:
    """A started ProbeServer on a free port, a client, and its base URL."""
    server = ProbeServer(probe, "127.0.0.1", 0, build_info={"version": "9.9.9"}, **kw)
    port = await server.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as client:
            yield server, client, f"http://127.0.0.1:{port}"
    finally:
        await server.stop()


async def get(client: aiohttp.ClientSession, url: str) -> tuple[int, str, str]:
    async with client.get(url) as r:
        return r.status, await r.text(), r.headers["Content-Type"]


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


# -- HTTP layer -------------------------------------------------------------------------------


def test_healthz_is_200_when_live_and_503_with_the_reason_when_not() -> None:
    """/healthz answers 200 "ok ..." while live and 503 with the liveness text otherwise."""

    async def main() -> None:
        probe = FakeProbe()
        async with serving(probe) as (_, client, base):
            status, body, _ = await get(client, base + "/healthz")
            assert status == 200 and body.startswith("ok workers fine")
            probe.live = (False, "worker 2: no progress for 12.0s")
            status, body, _ = await get(client, base + "/healthz")
            assert status == 503 and "worker 2: no progress" in body

    asyncio.run(main())


def test_readyz_lists_every_failing_condition_one_per_line() -> None:
    """/readyz answers 200 "ready", or 503 with each failing condition on its own line."""

    async def main() -> None:
        probe = FakeProbe()
        async with serving(probe) as (server, client, base):
            assert (await get(client, base + "/readyz"))[:2] == (200, "ready\n")
            probe.ready = (False, ["draining", "pool not registered"])
            status, body, _ = await get(client, base + "/readyz")
            assert status == 503 and body.splitlines() == ["draining", "pool not registered"]
            probe.ready = (True, [])
            server.draining = True  # the daemon's first signal, before the service drains
            status, body, _ = await get(client, base + "/readyz")
            assert status == 503 and body.splitlines() == ["draining"]

    asyncio.run(main())


def test_metrics_are_parseable_prometheus_text_with_every_family() -> None:
    """/metrics parses with prometheus_client and carries each family with its bounded labels."""

    async def main() -> None:
        probe = FakeProbe(durations=[0.00005, 0.0002, 0.003, 20.0])
        async with serving(probe) as (_, client, base):
            status, text, ctype = await get(client, base + "/metrics")
        assert status == 200 and ctype == CONTENT_TYPE_LATEST
        fams = families(text)

        def samples(name: str) -> dict[tuple[tuple[str, str], ...], float]:
            return {
                tuple(sorted(s.labels.items())): s.value
                for s in fams[name].samples  # type: ignore[attr-defined]
            }

        assert samples("kvxferd_sessions") == {
            (("state", "complete"),): 7,
            (("state", "transferring"),): 2,
        }
        outcomes = samples("kvxferd_outcomes")
        assert outcomes[(("outcome", "done"),)] == 5
        assert outcomes[(("outcome", "in_doubt"),)] == 1
        assert samples("kvxferd_bytes") == {(): 4096}
        assert samples("kvxferd_queue_depth") == {
            (("worker", "0"),): 0,
            (("worker", "1"),): 4,
            (("worker", "2"),): 1,
        }
        assert samples("kvxferd_worker_slices") == {
            (("worker", "0"),): 6,
            (("worker", "1"),): 0,
            (("worker", "2"),): 2,
        }
        rejections = samples("kvxferd_rejections")
        assert rejections[(("reason", "busy"),)] == 3
        assert {dict(k)["reason"] for k in rejections} == {r.value for r in Reason}
        assert samples("kvxferd_peers") == {(): 3}
        assert samples("kvxferd_writes_in_flight") == {(): 2}
        assert samples("kvxferd_build_info") == {(("role", "sender"), ("version", "9.9.9")): 1}

    asyncio.run(main())


def test_duration_histogram_has_sub_millisecond_buckets_and_accumulates() -> None:
    """The histogram has the sub-ms buckets and keeps counting across scrapes that drain samples."""

    async def main() -> None:
        probe = FakeProbe(durations=[0.00005, 0.0002, 0.003])
        async with serving(probe) as (_, client, base):
            await get(client, base + "/metrics")
            probe.durations = [0.0004, 20.0]
            _, text, _ = await get(client, base + "/metrics")
        hist = families(text)["kvxferd_transfer_duration_seconds"]
        buckets = {
            float(s.labels["le"]): s.value
            for s in hist.samples  # type: ignore[attr-defined]
            if s.name.endswith("_bucket")
        }
        assert sorted(buckets) == [*DURATION_BUCKETS_S, float("inf")]
        assert {0.0001, 0.00025, 0.0005} <= set(buckets)
        assert buckets[0.0001] == 1
        assert buckets[0.00025] == 2
        assert buckets[0.0005] == 3
        assert buckets[0.005] == 4
        assert buckets[10.0] == 4
        assert buckets[float("inf")] == 5
        total = {s.name: s.value for s in hist.samples}  # type: ignore[attr-defined]
        assert total["kvxferd_transfer_duration_seconds_count"] == 5
        assert total["kvxferd_transfer_duration_seconds_sum"] == pytest.approx(20.0036500)

    asyncio.run(main())


def test_stale_loop_heartbeat_fails_healthz_even_when_the_probe_is_live() -> None:
    """/healthz is 503 "event loop stalled" once the heartbeat is older than loop_stall_s."""

    async def main() -> None:
        # A long heartbeat interval: the stamp stays where the test put it.
        async with serving(FakeProbe(), loop_stall_s=1.0, heartbeat_interval_s=60.0) as (
            server,
            client,
            base,
        ):
            server.loop_heartbeat = time.monotonic() - 5.0
            status, body, _ = await get(client, base + "/healthz")
            assert status == 503 and "event loop stalled" in body

    asyncio.run(main())


def test_a_blocked_loop_stops_its_heartbeat() -> None:
    """While the loop is blocked its heartbeat does not move, so liveness fails after loop_stall_s."""
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, name="test-loop", daemon=True)
    runner.start()
    server = ProbeServer(FakeProbe(), "127.0.0.1", 0, loop_stall_s=0.2, heartbeat_interval_s=0.01)
    entered, release = threading.Event(), threading.Event()
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(WAIT_S)

        def block() -> None:
            entered.set()
            release.wait(WAIT_S)

        loop.call_soon_threadsafe(block)
        assert entered.wait(WAIT_S)
        stamp = server.loop_heartbeat
        assert server.liveness(now=stamp + 0.1)[0]
        ok, text = server.liveness(now=stamp + 0.3)  # as if 0.3 s passed with the loop stuck
        assert not ok and "event loop stalled" in text
        assert server.loop_heartbeat == stamp  # nothing stamps while the loop is blocked
        release.set()

        async def next_beat() -> None:
            while server.loop_heartbeat == stamp:
                await asyncio.sleep(0.005)

        asyncio.run_coroutine_threadsafe(next_beat(), loop).result(WAIT_S)
        assert server.liveness()[0]
    finally:
        release.set()
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(WAIT_S)
        loop.call_soon_threadsafe(loop.stop)
        runner.join(WAIT_S)
        loop.close()


# -- the real probes -----------------------------------------------------------------------------


@pytest.fixture
def sender() -> Iterator[tuple[Sender, ControlledDataPlane]]:
    """A started Sender with two workers and a data plane the test drives."""
    settings = load_sender_settings(
        name="probe-tx",
        listen="tcp://127.0.0.1:0",
        num_threads=2,
        pool=POOL,
        deadlines=dict(drain_timeout_ms=3000, shutdown_timeout_ms=5000),
    )
    dp = ControlledDataPlane("probe-tx")
    sx = Sender(settings, dataplane=dp).start()
    dp.notify_as = sx.sender_id  # a real sender's NIXL agent is named after its id
    try:
        yield sx, dp
    finally:
        for x in dp.xfers:
            x.finish(True)
        if not sx.draining:  # a test may have shut it down already
            sx.shutdown(timeout=5)


def receiver() -> Receiver:
    settings = load_receiver_settings(
        name="probe-rx",
        result_endpoint="tcp://127.0.0.1:0",
        pool=POOL,
        deadlines=dict(drain_timeout_ms=500, shutdown_timeout_ms=2000, cancel_fence_ms=500),
    )
    return Receiver(settings, dataplane=ControlledDataPlane("probe-rx")).start()


def scrape(probe: Probe) -> str:
    async def main() -> str:
        async with serving(probe) as (_, client, base):
            return (await get(client, base + "/metrics"))[1]

    return asyncio.run(main())


def test_sender_probe_is_live_and_ready_while_workers_idle(
    sender: tuple[Sender, ControlledDataPlane],
) -> None:
    """An idle started sender is live and ready: idle workers still stamp progress."""
    sx, _ = sender
    probe = SenderProbe(sx, sx.settings)
    ok, text = probe.liveness()
    assert ok, text
    assert probe.readiness() == (True, [])


def test_sender_probe_reports_draining_during_shutdown_and_metrics_hide_request_ids(
    sender: tuple[Sender, ControlledDataPlane],
) -> None:
    """Once shutdown starts readiness fails with "draining" while liveness holds; ids never label."""
    sx, dp = sender
    probe = SenderProbe(sx, sx.settings)
    rx = receiver()
    try:
        sx.publish("req-secret-4242", [3, 4, 5])
        rx.fetch("req-secret-4242", sx.endpoint, [6, 7, 8])
        xfer = dp.wait_posted(1)  # a write in flight keeps the drain busy
        text = scrape(probe)
        fams = families(text)
        assert "req-secret-4242" not in text
        sessions = {s.labels["state"]: s.value for s in fams["kvxferd_sessions"].samples}  # type: ignore[attr-defined]
        assert sessions["transferring"] == 1
        assert fams["kvxferd_writes_in_flight"].samples[0].value == 1  # type: ignore[attr-defined]
        assert fams["kvxferd_peers"].samples[0].value == 1  # type: ignore[attr-defined]

        shutdown = threading.Thread(target=sx.shutdown, name="test-shutdown")
        shutdown.start()
        assert sx._draining.wait(WAIT_S)
        ok, failing = probe.readiness()
        assert not ok and "draining" in failing
        ok, text = probe.liveness()
        assert ok, text
        xfer.finish(True)
        shutdown.join(WAIT_S)
        assert not shutdown.is_alive()
        ok, text = probe.liveness()  # threads told to stop are not stalled
        assert ok, text
    finally:
        rx.shutdown(timeout=3)


def test_sender_probe_names_stalled_and_dead_workers_and_a_full_table() -> None:
    """An unstarted sender: dead threads and a full session table fail readiness by name."""
    settings = load_sender_settings(
        name="probe-tx",
        listen="tcp://127.0.0.1:0",
        num_threads=2,
        pool=POOL,
        limits=dict(max_live_sessions=1),
    )
    sx = Sender(settings, dataplane=ControlledDataPlane("probe-tx"))
    try:
        probe = SenderProbe(sx, settings)
        sx.publish("req-1", [1])
        ok, failing = probe.readiness()
        assert not ok
        assert "listener thread not alive" in failing
        assert "worker 1 thread not alive" in failing
        assert "session table full (max_live_sessions=1)" in failing
        sx._workers[1].last_progress = time.monotonic() - 10 * probe.worker_stall_s
        ok, text = probe.liveness()
        assert not ok and text.startswith("worker 1: no progress")
    finally:
        sx.shutdown(timeout=3)


def test_receiver_probe_is_ready_until_shutdown() -> None:
    """A started receiver is live and ready; after shutdown readiness says draining."""
    rx = receiver()
    probe = ReceiverProbe(rx, rx.settings)
    try:
        ok, text = probe.liveness()
        assert ok, text
        assert probe.readiness() == (True, [])
        fams = families(scrape(probe))
        assert fams["kvxferd_build_info"].samples[0].labels["role"] == "receiver"  # type: ignore[attr-defined]
    finally:
        rx.shutdown(timeout=3)
    ok, failing = probe.readiness()
    assert not ok and "draining" in failing
    assert probe.liveness()[0]


def test_receiver_io_error_is_caught_fetches_go_on_and_healthz_is_503(
    sender: tuple[Sender, ControlledDataPlane], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception on the io thread is survived (fetches complete) but /healthz says 503 and why."""
    sx, dp = sender
    rx = receiver()
    try:
        real_notifications = rx.agents.notifications
        raised = threading.Event()

        def notifications_once(agent: object = None) -> list[tuple[int, str, bytes]]:
            if not raised.is_set():
                raised.set()
                raise RuntimeError("injected io fault")
            return real_notifications()

        monkeypatch.setattr(rx.agents, "notifications", notifications_once)
        assert raised.wait(WAIT_S)
        sx.publish("req-after-fault", [3])
        h = rx.fetch("req-after-fault", sx.endpoint, [6])
        dp.wait_posted(1).finish(True)
        out = h.wait(WAIT_S)
        assert out is not None and out.ok, out
        probe = ReceiverProbe(rx, rx.settings)

        async def main() -> tuple[int, str]:
            async with serving(probe) as (_, client, base):
                status, text, _ = await get(client, base + "/healthz")
                return status, text

        status, text = asyncio.run(main())
        assert status == 503 and "injected io fault" in text and "rx-io" in text, text
        assert rx.stats.get("thread_errors") == 1
    finally:
        rx.shutdown(timeout=3)


@dataclass
class FakeGateway:
    why: str | None = None

    def broken(self) -> str | None:
        return self.why


def test_liveness_fails_naming_a_broken_gateway() -> None:
    """A gateway whose serve task ended makes the receiver's liveness fail with that reason."""
    rx = receiver()
    gw = FakeGateway()
    probe = ReceiverProbe(rx, rx.settings, gateway=gw)
    try:
        assert probe.liveness()[0]
        gw.why = "gateway serve task ended"
        ok, text = probe.liveness()
        assert not ok and "gateway serve task ended" in text, text
    finally:
        rx.shutdown(timeout=3)


def test_receiver_readiness_fails_when_no_aux_slot_is_free(
    sender: tuple[Sender, ControlledDataPlane],
) -> None:
    """With every aux slot held, /readyz fails and names the free and quarantined counts."""
    sx, _ = sender
    rx = receiver()
    probe = ReceiverProbe(rx, rx.settings)
    try:
        handles = [rx.fetch(f"req-aux-{i}", sx.endpoint, [i]) for i in range(POOL["aux_slots"])]
        ok, failing = probe.readiness()
        assert not ok
        assert any(f.startswith("no free aux slot (0 free, 0 quarantined") for f in failing), (
            failing
        )
        for h in handles:
            h.cancel()
    finally:
        rx.shutdown(timeout=3)


def test_sender_liveness_fails_naming_an_error_its_threads_caught(
    sender: tuple[Sender, ControlledDataPlane],
) -> None:
    """Once the sender's guard caught an unexpected exception, its liveness fails and names it."""
    sx, _ = sender
    probe = SenderProbe(sx, sx.settings)
    assert probe.liveness()[0]
    try:
        raise RuntimeError("injected listener fault")
    except RuntimeError:
        sx.guard.caught("listener")
    ok, text = probe.liveness()
    assert not ok and "injected listener fault" in text, text
