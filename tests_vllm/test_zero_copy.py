"""Zero copy: vLLM's KV cache seated on the daemons' pools, the same tokens, and nothing freed under a transfer.

The engines run with ``zero_copy`` and ``num_gpu_blocks_override``: vLLM's KV
tensors live in the daemon's pool, the prefill engine's blocks are freed late
(after its publish ended) and a decode engine's load lands in its own blocks.
The same checks as test_pd (tokens equal monolithic decode, every prompt loaded
through the daemons, a corrupted block changes the tokens) plus what zero copy
adds: vLLM's blocks really are pool memory, the prefill side frees its blocks
only once the decode side fetched them, and a failed load is reported only once
no write can land.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.support.conditions import wait_until
from tests.test_daemon import DaemonProcess
from tests_vllm.conftest import Rig, _rig
from tests_vllm.rig import MODEL_LAYERS, EngineProcess, counter, sessions
from tests_vllm.test_failures import unknown
from tests_vllm.test_pd import BLOCK, BLOCK_BYTES, DECODE_TOKENS, LENGTHS, prompts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

VLLM_BLOCKS = 384  # num_gpu_blocks_override: 16 prompts of up to 16 blocks, with room to spare
TRANSFER_TIMEOUT_S = 5.0


@dataclass
class ZC:
    rig: Rig
    sender: DaemonProcess
    receiver: DaemonProcess
    prefill: EngineProcess
    decode: EngineProcess


@pytest.fixture(scope="module")
def zc(model_dir: Path) -> Iterator[ZC]:
    for rig in _rig(model_dir):
        sender = rig.daemon("sender", "ztx", VLLM_BLOCKS, zero_copy=True)
        receiver = rig.daemon("receiver", "zrx", VLLM_BLOCKS, zero_copy=True)
        sender.wait_ready()
        receiver.wait_ready()
        zero = ["--zero-copy", "--num-blocks", str(VLLM_BLOCKS)]
        timeout = ["--transfer-timeout-s", str(TRANSFER_TIMEOUT_S), "--policy", "recompute"]
        prefill = rig.engine("zprefill", "producer", sender, *zero)
        decode = rig.engine("zdecode", "consumer", receiver, *zero, *timeout)
        prefill.wait_ready()
        decode.wait_ready()
        yield ZC(rig, sender, receiver, prefill, decode)


def _prefill(z: ZC, tag: str, ps: list[list[int]]) -> list[dict]:
    reqs = [
        {"id": f"{tag}{i}", "prompt": p, "max_tokens": 1, "params": {"do_remote_decode": True}}
        for i, p in enumerate(ps)
    ]
    out = z.prefill.run(reqs)["outputs"]
    params = [out[f"{tag}{i}"]["kv_transfer_params"] for i in range(len(ps))]
    assert all(p and p.get("do_remote_prefill") for p in params), params
    return params


def _decode(z: ZC, tag: str, ps: list[list[int]], params: list) -> list[list[int]]:
    reqs = [
        {"id": f"{tag}{i}", "prompt": p, "max_tokens": DECODE_TOKENS, "params": kv}
        for i, (p, kv) in enumerate(zip(ps, params, strict=True))
    ]
    out = z.decode.run(reqs)["outputs"]
    return [out[f"{tag}{i}"]["tokens"] for i in range(len(ps))]


def test_zero_copy_equals_monolithic(zc: ZC) -> None:
    """16 prompts decode to the monolithic tokens, each loaded through the daemons into vLLM's own blocks."""
    ps = prompts(LENGTHS, seed=11)
    rx_bytes = counter(zc.receiver.probe_port, "kvxferd_bytes")
    before = zc.decode.call({"op": "stats"}, 30)["stats"]
    disagg = _decode(zc, "zd", ps, _prefill(zc, "zp", ps))
    mono = _decode(zc, "zm", ps, [None] * len(ps))
    assert disagg == mono
    stats = zc.decode.call({"op": "stats"}, 30)["stats"]
    assert stats["loads"] - before["loads"] == len(ps), stats
    assert stats["load_failures"] == before["load_failures"], stats
    want = sum(-(-n // BLOCK) for n in LENGTHS) * MODEL_LAYERS * BLOCK_BYTES
    assert counter(zc.receiver.probe_port, "kvxferd_bytes") - rx_bytes == want
    # The prefill engine held its published blocks until fetched, then freed them all.
    zc.prefill.drain()
    zc.decode.drain()
    wait_until(lambda: sessions(zc.sender.probe_port) == 0, 30, "sender sessions at zero")
    wait_until(lambda: sessions(zc.receiver.probe_port) == 0, 30, "receiver sessions at zero")


def test_vllm_computes_into_the_pool(zc: ZC) -> None:
    """vLLM's KV really is the pool: a prefill fills pool blocks, and one corrupted there changes the decode."""
    from kvxferd.engine.client import Client, attach_pool

    ps = prompts([100], seed=12)
    mono = _decode(zc, "zcm", ps, [None])
    with Client(zc.sender.engine_socket, timeout_s=10) as c:
        pool = attach_pool(c.describe())
        wait_until(lambda: sessions(zc.sender.probe_port) == 0, 30, "sender idle")
        pool.fill_(0)
        params = _prefill(zc, "zc", ps)
        used = [b for b in range(pool.shape[1]) if bool(pool[:, b].any())]
        assert len(used) == 4, used  # 100 tokens: 4 blocks, computed by vLLM into the pool
        assert max(used) < VLLM_BLOCKS  # vLLM's own blocks, not the connector's scratch
        # Finite garbage: a byte-reversed float can be NaN, and a NaN left in a freed block
        # poisons whichever request vLLM gives that block next (attention reads whole blocks).
        first = pool[0, used[0]].view(torch.float32)
        first.copy_(torch.randn(first.shape, generator=torch.Generator().manual_seed(0)) * 4)
    disagg = _decode(zc, "zcd", ps, params)
    assert disagg != mono


def test_failed_load_recomputes_and_frees(zc: ZC) -> None:
    """A load of a transfer never published fails, vLLM recomputes (same tokens), and every session ends."""
    ps = prompts([70], seed=13)
    params = _prefill(zc, "zf", ps)
    before = zc.decode.call({"op": "stats"}, 30)["stats"]
    got = _decode(zc, "zfd", ps, [unknown(params[0])])
    stats = zc.decode.call({"op": "stats"}, 30)["stats"]
    assert stats["load_failures"] - before["load_failures"] == 1, stats
    assert got == _decode(zc, "zfm", ps, [None])
    # The real publish is still there: decode it for real so the sender's session ends.
    assert _decode(zc, "zfr", ps, params) == got
    zc.prefill.drain()
    zc.decode.drain()
    wait_until(lambda: sessions(zc.sender.probe_port) == 0, 30, "sender sessions at zero")
    wait_until(lambda: sessions(zc.receiver.probe_port) == 0, 30, "receiver sessions at zero")


def test_abort_while_loading_holds_blocks_until_safe(zc: ZC) -> None:
    """A decode request aborted while loading into vLLM's own blocks ends, its blocks are freed, and no session stays."""
    ps = prompts([64, 90], seed=14)
    params = _prefill(zc, "za", ps)
    params[1] = unknown(params[1])  # parked on the sender: still loading when the abort comes
    reqs = [
        {"id": f"zaa{i}", "prompt": p, "max_tokens": DECODE_TOKENS, "params": kv}
        for i, (p, kv) in enumerate(zip(ps, params, strict=True))
    ]
    out = zc.decode.run(reqs, abort=["zaa1"], abort_after_steps=3)
    assert set(out["outputs"]) == {"zaa0"}
    assert out["outputs"]["zaa0"]["tokens"] == _decode(zc, "zam", ps[:1], [None])[0]
    zc.decode.drain()  # returns only once vLLM got the aborted request's blocks back
    # zaa1's publish is never fetched: vLLM gets its held blocks back at publish_ttl_ms (30 s
    # from the prefill), so a drain bounded by the same 30 s from later lost that race at times.
    zc.prefill.drain(timeout=60)
    wait_until(lambda: sessions(zc.sender.probe_port) == 0, 30, "sender sessions at zero")
    wait_until(lambda: sessions(zc.receiver.probe_port) == 0, 30, "receiver sessions at zero")


def test_published_blocks_are_not_reused_before_they_are_fetched(zc: ZC) -> None:
    """A second batch prefilled while the first waits to be fetched does not overwrite it: vLLM frees published blocks late."""
    first, second = prompts(LENGTHS, seed=15), prompts(LENGTHS, seed=16)
    params_first = _prefill(zc, "zra", first)
    params_second = _prefill(zc, "zrb", second)  # would take the first batch's blocks if freed
    assert _decode(zc, "zrad", first, params_first) == _decode(zc, "zram", first, [None] * 16)
    _decode(zc, "zrbd", second, params_second)  # fetch the second batch too: sessions end
    zc.prefill.drain()
    wait_until(lambda: sessions(zc.sender.probe_port) == 0, 30, "sender sessions at zero")
