"""Failures are vLLM load errors, never garbage: kv_load_failure_policy, aborts, a killed daemon.

One rig per test module: a sender with a prefill engine, and two receivers each with
a decode engine, one under ``kv_load_failure_policy="fail"`` and one under
``"recompute"``. Every test ends with the daemons' session gauges at zero.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.conditions import wait_until
from tests.test_daemon import DaemonProcess
from tests_vllm.conftest import POOL_BLOCKS, Rig, _rig
from tests_vllm.engine import MAX_MODEL_LEN
from tests_vllm.rig import EngineProcess, sessions
from tests_vllm.test_pd import DECODE_TOKENS, prompts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

TRANSFER_TIMEOUT_S = (
    5.0  # the decode engines' transfer_timeout_s: a load that cannot finish ends by then
)
FAIL_BOUND_S = TRANSFER_TIMEOUT_S + 5.0  # plus a step, a close and a loaded 2-core host


@dataclass
class Pair:
    rig: Rig
    sender: DaemonProcess
    rx_fail: DaemonProcess
    rx_recompute: DaemonProcess
    prefill: EngineProcess
    decode_fail: EngineProcess
    decode_recompute: EngineProcess


@pytest.fixture(scope="module")
def pair(model_dir: Path) -> Iterator[Pair]:
    for rig in _rig(model_dir):
        sender = rig.daemon("sender", "tx")
        rx_f = rig.daemon("receiver", "rxf")
        rx_r = rig.daemon("receiver", "rxr")
        for d in (sender, rx_f, rx_r):
            d.wait_ready()
        prefill = rig.engine("prefill", "producer", sender)
        timeout = ["--transfer-timeout-s", str(TRANSFER_TIMEOUT_S)]
        dec_f = rig.engine("decode-fail", "consumer", rx_f, "--policy", "fail", *timeout)
        dec_r = rig.engine("decode-recompute", "consumer", rx_r, "--policy", "recompute", *timeout)
        for e in (prefill, dec_f, dec_r):
            e.wait_ready()
        yield Pair(rig, sender, rx_f, rx_r, prefill, dec_f, dec_r)


def prefill(p: Pair, tag: str, ps: list[list[int]]) -> list[dict[str, Any]]:
    reqs = [
        {"id": f"{tag}{i}", "prompt": x, "max_tokens": 1, "params": {"do_remote_decode": True}}
        for i, x in enumerate(ps)
    ]
    out = p.prefill.run(reqs)["outputs"]
    return [out[f"{tag}{i}"]["kv_transfer_params"] for i in range(len(ps))]


def decode(
    e: EngineProcess, tag: str, ps: list[list[int]], params: list[Any], **kw: Any
) -> dict[str, Any]:
    reqs = [
        {"id": f"{tag}{i}", "prompt": x, "max_tokens": DECODE_TOKENS, "params": kv}
        for i, (x, kv) in enumerate(zip(ps, params, strict=True))
    ]
    return e.run(reqs, **kw)


ZC_BLOCKS = 256  # zero copy: vLLM's blocks (num_gpu_blocks_override), the pool has scratch after
ZC_SCRATCH = MAX_MODEL_LEN // 32  # pool-config --zero-copy: one longest request of scratch
# Zero copy gives up on a daemon that answers no close after transfer_timeout_s + close_timeout_s.
ZC_FAIL_BOUND_S = FAIL_BOUND_S + TRANSFER_TIMEOUT_S + 5.0


def modes(zero_copy: bool, vllm_blocks: int = ZC_BLOCKS) -> tuple[dict[str, Any], list[str]]:
    """Daemon keyword arguments and engine arguments for copy mode or zero copy."""
    if not zero_copy:
        return {}, []
    return {"pool_blocks": vllm_blocks, "zero_copy": True}, [
        "--zero-copy",
        "--num-blocks",
        str(vllm_blocks),
    ]


def idle(*daemons: DaemonProcess, within: float = 30.0) -> None:
    for d in daemons:
        wait_until(lambda d=d: sessions(d.probe_port) == 0, within, f"{d.name} sessions at zero")


def unknown(params: dict[str, Any]) -> dict[str, Any]:
    """The same params naming a transfer the sender never published."""
    return {**params, "kvxferd_transfer_id": "never-published-" + params["kvxferd_transfer_id"]}


def test_fail_policy_fails_the_request(pair: Pair) -> None:
    """Under "fail", a load the sender cannot serve ends the request with an error, not tokens."""
    ps = prompts([40, 70], seed=11)
    params = [unknown(kv) for kv in prefill(pair, "f", ps)]
    t0 = time.monotonic()
    out = decode(pair.decode_fail, "ff", ps, params)["outputs"]
    took = time.monotonic() - t0
    print(f"\nfailed loads ended after {took:.1f}s")
    assert took < FAIL_BOUND_S
    assert {o["finish_reason"] for o in out.values()} == {"error"}, out
    stats = pair.decode_fail.call({"op": "stats"}, 30)["stats"]
    assert stats["load_failures"] >= 2 and stats["loads"] == 0, stats
    pair.prefill.drain()
    pair.decode_fail.drain()
    idle(pair.sender, pair.rx_fail)


def test_recompute_policy_recomputes(pair: Pair) -> None:
    """Under "recompute", a failed load is computed locally: the tokens equal monolithic ones."""
    ps = prompts([40, 70], seed=12)
    params = [unknown(kv) for kv in prefill(pair, "r", ps)]
    out = decode(pair.decode_recompute, "rr", ps, params)["outputs"]
    mono = decode(pair.decode_recompute, "rm", ps, [None, None])["outputs"]
    assert [out[f"rr{i}"]["tokens"] for i in range(2)] == [
        mono[f"rm{i}"]["tokens"] for i in range(2)
    ]
    stats = pair.decode_recompute.call({"op": "stats"}, 30)["stats"]
    assert stats["load_failures"] >= 2 and stats["loads"] == 0, stats
    pair.prefill.drain()
    pair.decode_recompute.drain()
    idle(pair.sender, pair.rx_recompute)


def test_abort_while_loading_releases_both_sides(pair: Pair) -> None:
    """A decode request aborted while its KV is loading ends, and neither daemon keeps a session for it."""
    ps = prompts([64, 90], seed=13)
    params = prefill(pair, "a", ps)
    params[1] = unknown(params[1])  # parked on the sender: still loading when the abort comes
    out = decode(pair.decode_fail, "aa", ps, params, abort=["aa1"], abort_after_steps=3)
    assert set(out["outputs"]) == {"aa0"}
    pair.decode_fail.drain()
    pair.prefill.drain()
    # The prefill's own publish of a1 is never fetched (the decode asked for another id): it
    # ends at publish_ttl_ms (30 s after it was published), which a 30 s bound from here
    # only just covered.
    idle(pair.sender, pair.rx_fail, within=45.0)
    stats = pair.decode_fail.call({"op": "stats"}, 30)["stats"]
    assert stats["pool_free"] == POOL_BLOCKS, stats


def test_abort_before_loading_frees_the_prefill_side(pair: Pair) -> None:
    """A decode request aborted before it was scheduled releases the prefill side's published blocks at once."""
    ps = prompts([50], seed=14)
    params = prefill(pair, "b", ps)
    wait_until(
        lambda: sessions(pair.sender.probe_port) >= 1, 30, "published, waiting for its fetch"
    )
    out = decode(pair.decode_fail, "bb", ps, params, abort=["bb0"], abort_after_steps=0)
    assert out["outputs"] == {}
    pair.decode_fail.drain()
    idle(pair.sender, pair.rx_fail)  # long before publish_ttl_ms (30 s)
    stats = pair.prefill.call({"op": "stats"}, 30)["stats"]
    wait_until(
        lambda: pair.prefill.call({"op": "stats"}, 30)["stats"]["pool_free"] == POOL_BLOCKS,
        30,
        f"prefill pool blocks all free ({stats})",
    )


def test_killed_sender_fails_loads_in_bounded_time(pair: Pair) -> None:
    """With the sender daemon killed, loads fail (or recompute) within a bound and the decode instances keep serving."""
    ps = prompts([33, 65], seed=15)
    params = prefill(pair, "k", ps)
    pair.sender.proc.send_signal(signal.SIGKILL)
    pair.sender.proc.wait(10)
    t0 = time.monotonic()
    failed = decode(pair.decode_fail, "kf", ps, params)["outputs"]
    recomputed = decode(pair.decode_recompute, "kr", ps, params)["outputs"]
    took = time.monotonic() - t0
    print(f"\nloads from a dead sender ended after {took:.1f}s (both policies)")
    assert took < 2 * FAIL_BOUND_S
    assert {o["finish_reason"] for o in failed.values()} == {"error"}
    mono = decode(pair.decode_recompute, "km", ps, [None, None])["outputs"]
    assert [recomputed[f"kr{i}"]["tokens"] for i in range(2)] == [
        mono[f"km{i}"]["tokens"] for i in range(2)
    ]
    for e in (pair.decode_fail, pair.decode_recompute):
        e.drain()
    idle(pair.rx_fail, pair.rx_recompute)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero_copy"])
def test_killed_receiver_recomputes_then_a_restarted_one_serves(rig: Rig, zero_copy: bool) -> None:
    """With the receiver killed, loads recompute within a bound; once it restarts, the connector maps its new pool (zero copy: moves vLLM's KV cache onto it) and loads again."""
    dk, ek = modes(zero_copy)
    sender, rx = rig.daemon("sender", "tx", **dk), rig.daemon("receiver", "rx", **dk)
    sender.wait_ready()
    rx.wait_ready()
    pre = rig.engine("prefill", "producer", sender, *ek)
    timeout = ["--transfer-timeout-s", str(TRANSFER_TIMEOUT_S)]
    dec = rig.engine("decode", "consumer", rx, "--policy", "recompute", *timeout, *ek)
    pre.wait_ready()
    dec.wait_ready()
    p = Pair(rig, sender, rx, rx, pre, dec, dec)
    ps = prompts([45, 96], seed=16)
    mono = [decode(dec, "m", ps, [None, None])["outputs"][f"m{i}"]["tokens"] for i in range(2)]

    rx.proc.send_signal(signal.SIGKILL)
    rx.proc.wait(10)
    t0 = time.monotonic()
    out = decode(dec, "x", ps, prefill(p, "x", ps))["outputs"]
    took = time.monotonic() - t0
    print(f"\nloads through a dead receiver ended after {took:.1f}s")
    assert took < (ZC_FAIL_BOUND_S if zero_copy else FAIL_BOUND_S)
    assert [out[f"x{i}"]["tokens"] for i in range(2)] == mono
    before = dec.call({"op": "stats"}, 30)["stats"]
    assert before["load_failures"] == 2, before

    rx2 = rig.daemon("receiver", "rx", **dk)  # the same engine socket, a new pool
    rx2.wait_ready()
    wait_until(
        lambda: (
            decode(dec, f"w{time.monotonic_ns()}", ps[:1], prefill(p, "w", ps[:1]))["outputs"]
            and dec.call({"op": "stats"}, 30)["stats"]["loads"] > before["loads"]
        ),
        60,
        "a load through the restarted receiver",
    )
    out = decode(dec, "y", ps, prefill(p, "y", ps))["outputs"]
    assert [out[f"y{i}"]["tokens"] for i in range(2)] == mono
    after = dec.call({"op": "stats"}, 30)["stats"]
    assert after["loads"] >= before["loads"] + 3, after
    pre.drain()
    dec.drain()
    idle(sender, rx2)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero_copy"])
def test_preempted_requests_decode_right_and_release(rig: Rig, zero_copy: bool) -> None:
    """With too little KV memory for the batch to grow, vLLM preempts loaded decode requests; tokens still equal monolithic ones and nothing leaks."""
    dk, ek = modes(zero_copy, vllm_blocks=48)
    sender, rx = rig.daemon("sender", "tx", **dk), rig.daemon("receiver", "rx", **dk)
    sender.wait_ready()
    rx.wait_ready()
    small = ["--kv-cache-bytes", str(48 * 2 * 16384), *ek]  # 48 blocks of 32 tokens in all
    pre = rig.engine("prefill", "producer", sender, *small)
    dec = rig.engine("decode", "consumer", rx, *small)
    pre.wait_ready()
    dec.wait_ready()
    p = Pair(rig, sender, rx, rx, pre, dec, dec)
    # 45 blocks of prompt, each a few tokens short of a block boundary: decoding needs 6 more.
    ps = prompts([318, 286, 254, 222, 190, 158], seed=17)
    params = prefill(p, "p", ps)
    out = decode(dec, "d", ps, params)
    mono = decode(dec, "m", ps, [None] * len(ps))
    print(f"\npreemptions: disaggregated {out['preemptions']}, monolithic {mono['preemptions']}")
    assert out["preemptions"] > 0
    n = len(ps)
    assert [out["outputs"][f"d{i}"]["tokens"] for i in range(n)] == [
        mono["outputs"][f"m{i}"]["tokens"] for i in range(n)
    ]
    pre.drain()
    dec.drain()
    idle(sender, rx)
    for e in (pre, dec):
        free = e.call({"op": "stats"}, 30)["stats"]["pool_free"]
        assert free == (ZC_SCRATCH if zero_copy else POOL_BLOCKS)


@pytest.mark.parametrize("address", ["same", "new"])
def test_restarted_sender_serves_the_prefill_instance_again(rig: Rig, address: str) -> None:
    """A sender killed and restarted (on its address or another) is mapped again by the prefill instance, whose params then name it, and decodes load from it."""
    from tests_vllm.test_serve import free_port

    listen = f"tcp://127.0.0.1:{free_port()}"
    sender, rx = rig.daemon("sender", "tx", listen=listen), rig.daemon("receiver", "rx")
    sender.wait_ready()
    rx.wait_ready()
    pre = rig.engine("prefill", "producer", sender)
    dec = rig.engine("decode", "consumer", rx, "--transfer-timeout-s", "5")
    pre.wait_ready()
    dec.wait_ready()
    p = Pair(rig, sender, rx, rx, pre, dec, dec)
    ps = prompts([77], seed=18)
    mono = decode(dec, "m", ps, [None])["outputs"]["m0"]["tokens"]
    assert decode(dec, "a", ps, prefill(p, "a", ps))["outputs"]["a0"]["tokens"] == mono

    sender.proc.send_signal(signal.SIGKILL)
    sender.proc.wait(10)
    sender2 = rig.daemon("sender", "tx", listen=listen if address == "same" else "")
    sender2.wait_ready()
    loads = dec.call({"op": "stats"}, 30)["stats"]["loads"]

    def loaded_again() -> bool:
        tag = f"b{time.monotonic_ns()}"
        out = decode(dec, tag, ps, prefill(p, tag, ps))["outputs"][f"{tag}0"]
        return bool(
            dec.call({"op": "stats"}, 30)["stats"]["loads"] > loads and out["tokens"] == mono
        )

    wait_until(loaded_again, 60, "a load through the restarted sender")
    pre.drain()
    dec.drain()
    # A try that failed before the restarted sender was mapped left its publish unfetched:
    # it ends at publish_ttl_ms (30 s after it was published).
    idle(sender2, rx, within=45.0)
