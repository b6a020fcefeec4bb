"""Decode-first: the decode and the prefill request run at once, the fetch parked at the sender until the publish.

The test plays the proxy: it chooses each transfer's id and fetch token, gives the
prefill engine ``{"do_remote_decode": true, "kvxferd_transfer_id": X, "kvxferd_token": T}``
and the decode engine the params ``proxy.decode_first_params`` builds from the sender
daemon's endpoint, and starts both engines' runs before reading either answer. The
decode engine runs with ``kv_load_failure_policy = "recompute"``; its receipts (the
output's ``kvxferd_receipt``) and counters are checked against the receiver daemon's.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvxferd.engine.client import Client
from kvxferd.integrations.vllm.proxy import Instance, decode_first_params
from tests_vllm.conftest import PD, POOL_BLOCKS, _rig
from tests_vllm.rig import MODEL_LAYERS, counter, sessions
from tests_vllm.test_pd import BLOCK, BLOCK_BYTES, DECODE_TOKENS, LENGTHS, prompts
from tests_vllm.test_zero_copy import VLLM_BLOCKS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

TRANSFER_TIMEOUT_S = 10.0  # the decode's fetch bound: the prefill's queueing and compute included


@pytest.fixture(scope="module", params=["copy", "zero_copy"])
def df(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[PD]:
    """A prefill instance and a decode instance (policy recompute), with their daemons;
    copying through the daemons' pools, or with vLLM's KV cache in them (zero copy)."""
    zero = request.param == "zero_copy"
    blocks = VLLM_BLOCKS if zero else POOL_BLOCKS
    extra = ["--zero-copy", "--num-blocks", str(VLLM_BLOCKS)] if zero else []
    for rig in _rig(model_dir):
        sender = rig.daemon("sender", "tx", blocks, zero_copy=zero)
        receiver = rig.daemon("receiver", "rx", blocks, zero_copy=zero)
        sender.wait_ready()
        receiver.wait_ready()
        prefill = rig.engine("prefill", "producer", sender, *extra)
        decode = rig.engine(
            "decode",
            "consumer",
            receiver,
            *extra,
            "--policy",
            "recompute",
            "--transfer-timeout-s",
            str(TRANSFER_TIMEOUT_S),
        )
        prefill.wait_ready()
        decode.wait_ready()
        yield PD(rig, sender, receiver, prefill, decode)


def instance(df: PD) -> Instance:
    """What a proxy knows of the prefill instance: its sender's endpoint and key."""
    with Client(df.sender.engine_socket, timeout_s=10) as c:
        info = c.describe()
    return Instance((info.endpoint,), (info.public_key,))


def decode_first(
    df: PD, tag: str, ps: list[list[int]], abort_prefill: bool = False
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Both runs at once, the decode's sent first; (decode outputs, prefill outputs, transfer ids)."""
    inst = instance(df)
    tids = [f"{tag}-{uuid.uuid4().hex}" for _ in ps]
    toks = [secrets.token_urlsafe(16) for _ in ps]
    dec = [
        {"id": f"{tag}d{i}", "prompt": p, "max_tokens": DECODE_TOKENS,
         "params": decode_first_params(inst, tid, tok)}
        for i, (p, tid, tok) in enumerate(zip(ps, tids, toks, strict=True))
    ]  # fmt: skip
    pre = [
        {"id": f"{tag}p{i}", "prompt": p, "max_tokens": 1,
         "params": {"do_remote_decode": True, "kvxferd_transfer_id": tid, "kvxferd_token": tok}}
        for i, (p, tid, tok) in enumerate(zip(ps, tids, toks, strict=True))
    ]  # fmt: skip
    dec_bound = df.decode.start_run(dec)
    abort = {"abort": [r["id"] for r in pre], "abort_after_steps": 0} if abort_prefill else {}
    pre_bound = df.prefill.start_run(pre, **abort)
    pre_out = df.prefill.reply(pre_bound)["outputs"]
    dec_out = df.decode.reply(dec_bound)["outputs"]
    return dec_out, pre_out, tids


def monolithic(df: PD, tag: str, ps: list[list[int]]) -> list[list[int]]:
    reqs = [
        {"id": f"{tag}{i}", "prompt": p, "max_tokens": DECODE_TOKENS, "params": None}
        for i, p in enumerate(ps)
    ]
    out = df.decode.run(reqs)["outputs"]
    return [out[f"{tag}{i}"]["tokens"] for i in range(len(ps))]


def stats(df: PD) -> dict[str, int]:
    return df.decode.call({"op": "stats"}, 30)["stats"]  # type: ignore[no-any-return]


def test_decode_first_equals_monolithic_and_every_receipt_says_loaded(df: PD) -> None:
    """16 prompts sent to decode and prefill at once decode to the monolithic tokens; each
    prefill published under the proxy's transfer id, each load counted, and each receipt
    says loaded with the bytes the receiver daemon wrote."""
    ps = prompts(LENGTHS, seed=31)
    mono = monolithic(df, "m", ps)
    rx = df.receiver.probe_port
    bytes_before, before = counter(rx, "kvxferd_bytes"), stats(df)

    t0 = time.monotonic()
    dec, pre, tids = decode_first(df, "a", ps)
    print(f"\n16 prompts decode-first: {time.monotonic() - t0:.2f}s")

    assert [dec[f"ad{i}"]["tokens"] for i in range(len(ps))] == mono
    # Each prefill published under exactly the transfer id the proxy chose.
    assert [
        pre[f"ap{i}"]["kv_transfer_params"]["kvxferd_transfer_id"] for i in range(len(ps))
    ] == tids
    after = stats(df)
    assert after["loads"] - before["loads"] == len(ps), after
    assert after["loaded"] - before["loaded"] == len(ps), after
    assert after["load_failures"] == before["load_failures"], after
    receipts = [dec[f"ad{i}"]["kv_transfer_params"]["kvxferd_receipt"] for i in range(len(ps))]
    sender = instance(df).senders[0]
    for n, r in zip(LENGTHS, receipts, strict=True):
        blocks = -(-n // BLOCK)
        assert r["loaded"] is True and r["recomputed"] is False and r["reason"] is None, r
        assert r["blocks"] == blocks and r["bytes"] == blocks * MODEL_LAYERS * BLOCK_BYTES, r
        assert r["from"] == sender and r["streamed"] is False and r["ms"] > 0, r
    assert sum(r["bytes"] for r in receipts) == counter(rx, "kvxferd_bytes") - bytes_before


def test_aborted_prefill_fails_the_load_and_decode_recomputes(df: PD) -> None:
    """A decode-first request whose prefill is aborted before it ran: its parked fetch
    fails within the decode's bound, vLLM recomputes, the tokens equal monolithic ones,
    and the receipt and the counters say recomputed, with the reason."""
    ps = prompts([40, 100], seed=32)
    mono = monolithic(df, "n", ps)
    before = stats(df)
    t0 = time.monotonic()
    dec, pre, _ = decode_first(df, "b", ps, abort_prefill=True)
    took = time.monotonic() - t0
    assert pre == {}  # both aborted before their first step: nothing published
    assert [dec[f"bd{i}"]["tokens"] for i in range(len(ps))] == mono
    assert took < TRANSFER_TIMEOUT_S + 3 + 20, took  # + call_timeout_s, + a busy host's slack
    after = stats(df)
    assert after["recomputed"] - before["recomputed"] == len(ps), after
    assert after["loaded"] == before["loaded"], after
    for i in range(len(ps)):
        r = dec[f"bd{i}"]["kv_transfer_params"]["kvxferd_receipt"]
        assert r["loaded"] is False and r["recomputed"] is True and r["reason"], r
        assert after[f"recomputed{{{r['reason']}}}"] >= 1, after
    print(f"\naborted prefill: decode recomputed after {took:.2f}s, reason {r['reason']}")


def test_malformed_token_is_refused_and_nothing_published(df: PD) -> None:
    """A prefill request whose router-chosen token the engine protocol would refuse is not
    published, and its output's kv_transfer_params say why."""
    bad = {"do_remote_decode": True, "kvxferd_transfer_id": "t-ok", "kvxferd_token": "short"}
    before = df.prefill.call({"op": "stats"}, 30)["stats"]
    out = df.prefill.run([{"id": "bad", "prompt": [5] * 40, "max_tokens": 1, "params": bad}])
    params = out["outputs"]["bad"]["kv_transfer_params"]
    assert set(params) == {"kvxferd_error"} and "kvxferd_token" in params["kvxferd_error"], params
    df.prefill.drain()
    after = df.prefill.call({"op": "stats"}, 30)["stats"]
    assert (after["saves"], after["save_failures"]) == (before["saves"], before["save_failures"])
    assert sessions(df.sender.probe_port) == 0
