"""Disaggregated prefill/decode through the kvxferd daemons equals monolithic decode, token for token.

The prefill engine (kv_producer) runs each prompt with max_tokens=1 and
``{"do_remote_decode": true}``; its output's kv_transfer_params go unchanged into
the decode engine's request (kv_consumer), which loads the prompt's KV through
sender daemon -> receiver daemon and decodes greedily. The same prompts decoded
with no params on the decode engine are the monolithic reference: that path
prefills locally and never touches the connector.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import torch

from kvxferd.engine.client import Client
from tests.support.conditions import wait_until
from tests_vllm.conftest import PD, POOL_BLOCKS
from tests_vllm.rig import MODEL_LAYERS, VOCAB, counter, sessions

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

BLOCK = 32
BLOCK_BYTES = 2 * 2 * BLOCK * 32 * 4  # K and V x 2 kv heads x 32 tokens x head_dim 32 x float32
DECODE_TOKENS = 8
# 1 token, exact block multiples, partial last blocks, the longest prompt max_model_len allows.
LENGTHS = [1, 2, 31, 32, 33, 63, 64, 65, 96, 127, 128, 200, 255, 256, 300, 512 - DECODE_TOKENS]


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def prefill_all(pd: PD, tag: str, ps: list[list[int]]) -> list[dict[str, Any]]:
    """Prefill every prompt (all in flight at once); their kv_transfer_params."""
    reqs = [
        {"id": f"{tag}p{i}", "prompt": p, "max_tokens": 1, "params": {"do_remote_decode": True}}
        for i, p in enumerate(ps)
    ]
    out = pd.prefill.run(reqs)["outputs"]
    params = [out[f"{tag}p{i}"]["kv_transfer_params"] for i in range(len(ps))]
    assert all(p and p.get("do_remote_prefill") for p in params), params
    return params


def decode_all(
    pd: PD, tag: str, ps: list[list[int]], params: list[dict[str, Any] | None]
) -> dict[str, Any]:
    reqs = [
        {"id": f"{tag}{i}", "prompt": p, "max_tokens": DECODE_TOKENS, "params": kv}
        for i, (p, kv) in enumerate(zip(ps, params, strict=True))
    ]
    return pd.decode.run(reqs)["outputs"]  # type: ignore[no-any-return]


def tokens(out: dict[str, Any], tag: str, n: int) -> list[list[int]]:
    return [out[f"{tag}{i}"]["tokens"] for i in range(n)]


def test_disaggregated_equals_monolithic(pd: PD) -> None:
    """16 prompts (1 token, block multiples, partial blocks, the longest allowed) decode to the monolithic tokens, every one loaded through the daemons."""
    ps = prompts(LENGTHS, seed=1)
    rx_port = pd.receiver.probe_port
    bytes_before = counter(rx_port, "kvxferd_bytes")
    loads_before = pd.decode.call({"op": "stats"}, 30)["stats"]["loads"]

    t0 = time.monotonic()
    params = prefill_all(pd, "a", ps)
    t1 = time.monotonic()
    out = decode_all(pd, "d", ps, params)
    disagg = tokens(out, "d", len(ps))
    t2 = time.monotonic()
    mono = tokens(decode_all(pd, "m", ps, [None] * len(ps)), "m", len(ps))
    print(f"\n16 prompts: prefill {t1 - t0:.2f}s, decode with KV loads {t2 - t1:.2f}s")

    assert disagg == mono
    assert all(len(t) == DECODE_TOKENS for t in disagg)
    # The decode side really loaded every prompt's KV through the daemons.
    stats = pd.decode.call({"op": "stats"}, 30)["stats"]
    assert stats["loads"] - loads_before == len(ps), stats
    assert stats["load_failures"] == 0, stats
    want = sum(-(-n // BLOCK) for n in LENGTHS) * MODEL_LAYERS * BLOCK_BYTES
    assert counter(rx_port, "kvxferd_bytes") - bytes_before == want
    # Each output's receipt says loaded, with the bytes the receiver daemon wrote for it.
    receipts = [out[f"d{i}"]["kv_transfer_params"]["kvxferd_receipt"] for i in range(len(ps))]
    assert all(r["loaded"] and not r["streamed"] for r in receipts), receipts
    assert sum(r["bytes"] for r in receipts) == want


def test_each_worker_declared_its_topology(pd: PD) -> None:
    """Both engines' workers declared their rank's record to their daemons (the CPU
    backend's [heads, K/V, tokens, head_size] block), and the records pair."""
    records = []
    for daemon in (pd.sender, pd.receiver):
        c = Client(daemon.engine_socket, timeout_s=10)
        try:
            records.append(c.describe().topology)
        finally:
            c.close_client()
    tx, rx = records
    assert tx is not None and rx is not None, records
    assert (tx.tp_size, tx.num_layers, tx.tokens_per_block) == (1, MODEL_LAYERS, BLOCK)
    assert tx.layout == "heads_planes_tokens" and tx.block_bytes == BLOCK_BYTES
    assert tx.compat == rx.compat and tx.layout == rx.layout


def test_corrupted_block_changes_tokens(pd: PD) -> None:
    """The comparison can fail: one transferred block corrupted in the sender's pool changes the decoded tokens."""
    from kvxferd.engine.client import Client, attach_pool

    ps = prompts([100], seed=2)
    mono = tokens(decode_all(pd, "cm", ps, [None]), "cm", 1)
    with Client(pd.sender.engine_socket, timeout_s=10) as c:
        pool = attach_pool(c.describe())
        wait_until(lambda: sessions(pd.sender.probe_port) == 0, 30, "sender idle")
        pool.fill_(0)  # free pool blocks read as zero; the published ones will not
        params = prefill_all(pd, "c", ps)
        used = [b for b in range(pool.shape[1]) if bool(pool[:, b].any())]
        assert len(used) == 4, used  # 100 tokens: 4 blocks
        # Finite garbage: a byte-reversed float can be NaN, and a NaN left in a freed block
        # poisons whichever request vLLM gives that block next (attention reads whole blocks).
        first = pool[0, used[0]].view(torch.float32)
        first.copy_(torch.randn(first.shape, generator=torch.Generator().manual_seed(0)) * 4)
    disagg = tokens(decode_all(pd, "cd", ps, params), "cd", 1)
    assert disagg != mono


def test_many_requests_leak_nothing(pd: PD) -> None:
    """After 64 more requests, both daemons hold no session and both connectors got every pool block back."""
    before = pd.decode.call({"op": "stats"}, 30)["stats"]
    for r in range(4):
        ps = prompts(LENGTHS, seed=100 + r)
        decode_all(pd, f"n{r}.", ps, prefill_all(pd, f"n{r}.", ps))
    after = pd.decode.call({"op": "stats"}, 30)["stats"]
    assert after["loads"] - before["loads"] == 4 * len(LENGTHS), after
    assert after["load_failures"] == before["load_failures"], after
    pd.prefill.drain()
    pd.decode.drain()
    wait_until(lambda: sessions(pd.sender.probe_port) == 0, 30, "sender sessions at zero")
    wait_until(lambda: sessions(pd.receiver.probe_port) == 0, 30, "receiver sessions at zero")
    for e in (pd.prefill, pd.decode):
        wait_until(
            lambda e=e: e.call({"op": "stats"}, 30)["stats"]["pool_free"] == POOL_BLOCKS,
            30,
            f"{e.name} pool blocks all free",
        )
