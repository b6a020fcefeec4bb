"""A prefill engine or its sender daemon killed while the prefill's layers stream: the load fails at once, never garbage.

The deep model of test_stream.py and a 3000-token prompt, decode first: the decode
request's fetch parks at the sender, the prefill request streams its layers (about
2.5 s of forward here). Once the sender wrote a first layer range to the fetch, the test
SIGKILLs the prefill engine (or the sender daemon). The daemons move KV over UCX's tcp
transport, as across hosts: the transport the in-doubt bound holds for (docs/protocol.md
section 15; UCX's same-host cma writes need no help from the receiver, so a doubt there
ends only when the sender restarts). The decode request must then end
with a failed load as soon as the stream aborts, not at ``transfer_timeout_s`` (60 s
here): recomputed to the monolithic tokens under ``kv_load_failure_policy =
"recompute"``, an error under ``"fail"``; never a partly filled cache reported loaded.
No receiver block may stay fenced past the in-doubt bound.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.conditions import wait_until
from tests.test_daemon import TCP_DATA_PLANE, metrics
from tests_vllm.conftest import Rig, _rig
from tests_vllm.rig import DEEP, sessions
from tests_vllm.test_pd import DECODE_TOKENS, prompts
from tests_vllm.test_stream import (
    DEEP_POOL_BLOCKS,
    LONG_PROMPT,
    Streamed,
    idle,
    model_of,
    monolithic,
    send_both,
    start,
    stats,
    stream_writes,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ABORT_BOUND_S = 15.0  # kill -> decode output (a recompute of 3000 tokens included), loaded host
# A fetch in doubt ends on the sender's word (cancel_fence_ms, 5 s) or, with a revocable
# transport (UCX over TCP, as across hosts: TCP_DATA_PLANE), once the link to a dead sender
# is torn down (heartbeat_timeout_ms 3 s + peer_down_ms 1 s + the teardown); a loaded host.
IN_DOUBT_BOUND_S = 20.0


def fetches_not_done(s: Streamed) -> float:
    """The receiver's fetches that ended other than done (failed, cancelled, timed out)."""
    fam = metrics(s.receiver.probe_port).get("kvxferd_outcomes")
    if fam is None:
        return 0.0
    return float(
        sum(
            x.value
            for x in fam.samples
            if x.name.endswith("_total") and x.labels.get("outcome") != "done"
        )
    )


ONE_FORWARD = ("--max-batched", str(DEEP.max_len))  # the long prompt in one streamed forward


@pytest.fixture
def deep_rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    yield from _rig(model_of(DEEP, tmp_path_factory))


def kill_mid_stream(s: Streamed, tag: str, victim: Any) -> tuple[list[list[int]], float]:
    """Send a long prompt decode first, kill ``victim`` once the sender wrote a first layer
    range (the forward still computes the rest); the prompts and the kill's time."""
    ps = prompts([LONG_PROMPT - DECODE_TOKENS], seed=44)
    writes = stream_writes(s)
    send_both(s, tag, ps)
    # The kill must land inside the forward: right after the first layer range was written.
    wait_until(lambda: stream_writes(s) > writes, 120, "a first layer range written")
    victim.send_signal(signal.SIGKILL)
    return ps, time.monotonic()


def test_prefill_engine_killed_mid_stream_recomputes_at_once(deep_rig: Rig) -> None:
    """The prefill engine SIGKILLed while its forward streams: the decode request's load fails as soon as the stream aborts, is recomputed to the monolithic tokens, and no receiver block stays fenced."""
    s = start(deep_rig, DEEP, "recompute", DEEP_POOL_BLOCKS, TCP_DATA_PLANE, ONE_FORWARD)
    before, not_done = stats(s.decode), fetches_not_done(s)
    ps, killed = kill_mid_stream(s, "k", s.prefill.proc)
    failed = wait_until(lambda: fetches_not_done(s) > not_done, ABORT_BOUND_S, "the fetch failed")
    dec = s.decode.reply(330)["outputs"]
    took = time.monotonic() - killed
    print(
        f"\nprefill killed mid-stream: the fetch failed {failed - killed:.2f}s after the kill, "
        f"the decode request (recomputed) ended {took:.2f}s after it"
    )
    assert took < ABORT_BOUND_S
    after = stats(s.decode)
    assert after["load_failures"] - before["load_failures"] == 1, after
    assert after["loads"] == before["loads"], after
    receipt = (dec["kd0"]["kv_transfer_params"] or {}).get("kvxferd_receipt")
    assert receipt is None or (not receipt["loaded"] and receipt["recomputed"]), receipt
    back = idle(s, s.receiver, IN_DOUBT_BOUND_S)
    print(f"every decode pool block back {back - killed:.2f}s after the kill")
    # The sender ended the dead engine's stream: it holds no session for it.
    wait_until(lambda: sessions(s.sender.probe_port) == 0, IN_DOUBT_BOUND_S, "sender idle")
    assert dec["kd0"]["tokens"] == monolithic(s.decode, "km", ps)[0]


def test_sender_daemon_killed_mid_stream_fails_the_load(deep_rig: Rig) -> None:
    """The sender daemon SIGKILLed while the prefill's layers stream: the decode request ends with an error (policy "fail"), no token, well before transfer_timeout_s; the prefill engine keeps serving and no receiver block stays fenced."""
    s = start(deep_rig, DEEP, "fail", DEEP_POOL_BLOCKS, TCP_DATA_PLANE, ONE_FORWARD)
    before, not_done = stats(s.decode), fetches_not_done(s)
    _, killed = kill_mid_stream(s, "t", s.sender.proc)
    failed = wait_until(lambda: fetches_not_done(s) > not_done, ABORT_BOUND_S, "the fetch failed")
    dec = s.decode.reply(330)["outputs"]
    took = time.monotonic() - killed
    print(
        f"\nsender killed mid-stream: the fetch failed {failed - killed:.2f}s after the kill, "
        f"the decode request ended {took:.2f}s after it"
    )
    assert took < ABORT_BOUND_S
    assert dec["td0"]["finish_reason"] == "error" and dec["td0"]["tokens"] == [], dec
    after = stats(s.decode)
    assert after["load_failures"] - before["load_failures"] == 1, after
    assert after["loads"] == before["loads"], after
    back = idle(s, s.receiver, IN_DOUBT_BOUND_S)
    print(f"every decode pool block back {back - killed:.2f}s after the kill")
    s.prefill.reply(330)  # its forward ended; its publish failed with the daemon
    assert s.prefill.alive()
