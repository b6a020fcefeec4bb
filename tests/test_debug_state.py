"""``/debug/state`` over real HTTP: off by default to strangers, the hang dump a person reads, never blocked by a held lock."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import aiohttp
import pytest

from kvxferd.config import HealthSettings, load_receiver_settings, load_sender_settings
from kvxferd.service.health import Probe, ProbeServer
from kvxferd.service.probes import ReceiverProbe, SenderProbe
from kvxferd.testing import ControlledDataPlane
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.sender import Sender

pytestmark = pytest.mark.timeout(30)

WAIT_S = 5.0
POOL = dict(num_layers=2, num_blocks=16, block_elems=16, aux_slots=4, aux_slot_bytes=64)


@pytest.fixture
def pair() -> Iterator[tuple[Sender, ControlledDataPlane, Receiver]]:
    """A started Sender (two workers, writes the test finishes) and a Receiver fetching from it."""
    sx = Sender(
        load_sender_settings(
            name="dbg-tx",
            listen="tcp://127.0.0.1:0",
            num_threads=2,
            pool=POOL,
            deadlines=dict(drain_timeout_ms=500, shutdown_timeout_ms=3000),
        ),
        dataplane=(dp := ControlledDataPlane("dbg-tx")),
    ).start()
    dp.notify_as = sx.sender_id  # a real sender's NIXL agent is named after its id
    rx = Receiver(
        load_receiver_settings(
            name="dbg-rx",
            result_endpoint="tcp://127.0.0.1:0",
            pool=POOL,
            deadlines=dict(drain_timeout_ms=500, shutdown_timeout_ms=3000, cancel_fence_ms=500),
        ),
        dataplane=ControlledDataPlane("dbg-rx"),
    ).start()
    try:
        yield sx, dp, rx
    finally:
        for x in dp.xfers:
            x.finish(True)
        rx.shutdown(timeout=3)
        sx.shutdown(timeout=3)


@asynccontextmanager
async def serving(
    probe: Probe, debug_state: str | None, host: str = "127.0.0.1"
) -> AsyncIterator[tuple[aiohttp.ClientSession, int]]:
    server = ProbeServer(probe, host, 0, debug_state=debug_state)  # type: ignore[arg-type]
    port = await server.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as client:
            yield client, port
    finally:
        await server.stop()


async def get(client: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with client.get(url) as r:
        return r.status, await r.text()


def fetch_state(probe: Probe, debug_state: str | None = "loopback") -> tuple[int, str]:
    async def main() -> tuple[int, str]:
        async with serving(probe, debug_state) as (client, port):
            return await get(client, f"http://127.0.0.1:{port}/debug/state")

    return asyncio.run(main())


def test_debug_state_is_404_when_off(pair: tuple[Sender, ControlledDataPlane, Receiver]) -> None:
    """With health.debug_state "off" the route answers 404 and says which setting turns it on."""
    sx, _, _ = pair
    status, body = fetch_state(SenderProbe(sx, sx.settings), "off")
    assert status == 404 and "health.debug_state" in body, body


def test_the_probe_port_follows_health_debug_state_and_defaults_to_loopback(
    pair: tuple[Sender, ControlledDataPlane, Receiver],
) -> None:
    """Without an explicit setting the probe port takes health.debug_state from the probe's settings; the shipped default is "loopback"."""
    sx, _, _ = pair
    assert sx.settings.health.debug_state == "loopback"
    status, body = fetch_state(SenderProbe(sx, sx.settings), None)
    assert status == 200 and json.loads(body)["role"] == "sender", body
    off = sx.settings.model_copy(update={"health": HealthSettings(debug_state="off")})
    status, body = fetch_state(SenderProbe(sx, off), None)
    assert status == 404, body


def test_sender_and_receiver_dump_a_transfer_in_progress(
    pair: tuple[Sender, ControlledDataPlane, Receiver],
) -> None:
    """With a write in progress and a fetch parked, both sides' dumps show the session, slice, fetch, peer, link and parked fetch with their ids and ages."""
    sx, dp, rx = pair
    sx.publish("req-live", [1, 2], aux=b"aux")
    h = rx.fetch("req-live", sx.endpoint, [5, 6])
    xfer = dp.wait_posted(1)
    parked = rx.fetch("req-not-yet", sx.endpoint, [7], want_aux=False)
    deadline = time.monotonic() + WAIT_S
    while sx.view().parked_count < 1 and time.monotonic() < deadline:
        time.sleep(0.005)  # the listener parks it: no event announces that
    assert sx.view().parked_count == 1

    status, body = fetch_state(SenderProbe(sx, sx.settings))
    assert status == 200, body
    tx = json.loads(body)
    assert {
        "role",
        "id",
        "endpoint",
        "uptime_s",
        "draining",
        "ready",
        "not_ready",
        "live",
        "liveness",
        "sessions",
        "peers",
        "retiring_peers",
        "parked",
        "workers",
        "aux_slots",
        "journal",
        "stats",
    } <= set(tx), sorted(tx)
    assert (tx["role"], tx["id"], tx["draining"], tx["ready"]) == (
        "sender",
        sx.sender_id,
        False,
        True,
    )
    sessions = tx["sessions"]
    assert sessions["by_state"]["transferring"] == 1 and sessions["total"] == 1
    [session] = sessions["open"]
    assert session["request_id"] == "req-live" and session["state"] == "transferring"
    assert session["writes_in_flight"] == 1 and session["age_s"] >= 0
    [sl] = session["slices"]
    assert sl["receiver_id"] == rx.receiver_id and sl["endpoint"] == rx.result_endpoint
    assert sl["fetch_id"] == h.fetch_id and sl["state"] == "writing" and sl["age_s"] >= 0
    [peer] = tx["peers"]
    assert peer["receiver_id"] == rx.receiver_id and peer["writes_in_flight"] == 1
    assert (peer["identity"], peer["decode_rank"], tx["topology"]) == ("", None, None)
    # The ownership table: security is off here, so one anonymous identity holds it all.
    assert tx["identities"] == [
        {"identity": "", "peers": 1, "fetches": 1, "parked": 1, "receiver_ids": 1}
    ], tx["identities"]
    assert tx["parked"]["count"] == 1
    [p] = tx["parked"]["oldest"]
    assert p["request_id"] == "req-not-yet" and p["fetch_id"] == parked.fetch_id
    assert p["age_s"] >= 0 and p["expires_in_s"] > 0
    assert [w["index"] for w in tx["workers"]] == [0, 1]
    # A small request: written by the listener itself (inline_write_max_bytes).
    assert sum(w["writes_in_flight"] for w in tx["workers"]) == 0
    assert tx["inline"]["writes_in_flight"] == 1 and tx["inline"]["lanes_busy"] == 1
    assert all(w["alive"] and w["last_progress_age_s"] < WAIT_S for w in tx["workers"])
    assert tx["aux_slots"] == {"free": 3, "total": 4}
    assert tx["journal"]["endings"] == 0 and tx["journal"]["peer_rates"] == []

    status, body = fetch_state(ReceiverProbe(rx, rx.settings))
    assert status == 200, body
    rs = json.loads(body)
    assert (rs["role"], rs["id"]) == ("receiver", rx.receiver_id)
    fetches = rs["fetches"]
    assert fetches["total"] == 2 and fetches["by_state"]["requested"] == 2
    first = fetches["oldest"][0]
    assert first["fetch_id"] == h.fetch_id and first["request_id"] == "req-live"
    assert first["state"] == "requested" and first["fence"] == "none" and first["sent"]
    assert first["sent_to"] == sx.sender_id and first["sender_endpoint"] == sx.endpoint
    [link] = rs["links"]
    assert link["endpoint"] == sx.endpoint and link["ready"] and link["sender_id"] == sx.sender_id
    assert link["waiting"] == 0
    assert rs["aux_slots"] == {"free": 3, "quarantined": 0, "total": 4}
    assert rs["in_doubt"]["count"] == 0
    assert rs["io_thread"]["alive"]

    xfer.finish(True)
    dp.wait_posted(2).finish(True)  # the aux write follows the KV write
    out = h.wait(WAIT_S)
    assert out is not None and out.ok, out
    parked.cancel()


def test_the_dumps_answer_while_the_registry_locks_are_held(
    pair: tuple[Sender, ControlledDataPlane, Receiver],
) -> None:
    """With the sender's and the receiver's registry locks held (a deadlock), both still dump their state: a dump never waits on those locks."""
    sx, _, rx = pair
    sx.publish("req-held", [1])
    with sx._lock, rx._lock:
        tx_status, tx_body = fetch_state(SenderProbe(sx, sx.settings))
        rx_status, rx_body = fetch_state(ReceiverProbe(rx, rx.settings))
    assert tx_status == 200, tx_body
    assert json.loads(tx_body)["sessions"]["by_state"]["published"] == 1
    assert rx_status == 200, rx_body
    assert json.loads(rx_body)["fetches"]["total"] == 0


def _local_non_loopback_address() -> str | None:
    """An IPv4 address of this host other than 127/8 (traffic to it stays on lo), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # UDP: no packet is sent; only picks the source address
            addr = str(s.getsockname()[0])
        except OSError:
            return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


@pytest.mark.parametrize(("mode", "want"), [("loopback", 403), ("any", 200)])
def test_a_non_loopback_client_is_refused_unless_any(
    pair: tuple[Sender, ControlledDataPlane, Receiver], mode: str, want: int
) -> None:
    """A client whose address is not loopback gets 403 under "loopback" and the dump under "any"."""
    addr = _local_non_loopback_address()
    if addr is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    sx, _, _ = pair

    async def main() -> tuple[int, str, int]:
        async with serving(SenderProbe(sx, sx.settings), mode, host="0.0.0.0") as (client, port):
            status, body = await get(client, f"http://{addr}:{port}/debug/state")
            local, _ = await get(client, f"http://127.0.0.1:{port}/debug/state")
            return status, body, local

    status, body, local = asyncio.run(main())
    assert (status, local) == (want, 200), body
    if want == 403:
        assert "loopback" in body, body
    else:
        assert json.loads(body)["role"] == "sender"
