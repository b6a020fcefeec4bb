"""Streamed KV, decode first: decode equals monolithic token for token, on two model shapes.

The test plays the router of the decode-first flow: it chooses each request's transfer
id and fetch token, sends the decode request first (its fetch parks at the sender) and
the prefill request at once with ``{"do_remote_decode": true, "kvxferd_transfer_id",
"kvxferd_token", "kvxferd_stream": true}``. The prefill worker publishes before the
forward that completes the prompt and marks each layer ready in it (save_kv_layer), and
the sender writes each ready layer range to the parked fetch.

Two model shapes: the tests' tiny 2-layer Llama and a deeper one (8 layers, 4 KV heads
of 64), on which a 3000-token prompt's forward takes about 2.5 s here: its layers are
seen written in several ranges while the forward runs. test_stream_failures.py kills
the prefill engine or its sender daemon mid-stream on the deeper one.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvxferd.engine.client import Client
from kvxferd.integrations.vllm.proxy import Instance, decode_first_params
from tests.support.conditions import wait_until
from tests.test_daemon import DaemonProcess
from tests_vllm.conftest import POOL_BLOCKS, Rig, _rig
from tests_vllm.engine import MAX_MODEL_LEN
from tests_vllm.rig import (
    DEEP,
    MODEL_LAYERS,
    TINY,
    EngineProcess,
    Shape,
    build_model,
    counter,
    sessions,
)
from tests_vllm.test_pd import DECODE_TOKENS, prompts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

BLOCK = 32
# A load that cannot finish would end by this deadline; a stream that aborts must fail
# its load long before it.
TRANSFER_TIMEOUT_S = 60.0
LONG_PROMPT = 3000  # tokens: the deep model's forward streams for about 2.5 s
DEEP_POOL_BLOCKS = 256  # 2.7 long prompts of 94 blocks, 8 layers of 64 KiB blocks


@dataclass
class Streamed:
    """A 1P1D rig of one model shape: sender, receiver, prefill and decode engines."""

    rig: Rig
    shape: Shape
    sender: DaemonProcess
    receiver: DaemonProcess
    prefill: EngineProcess
    decode: EngineProcess
    pool_blocks: int

    def instance(self) -> Instance:
        """What a proxy knows of the prefill instance: its sender's endpoint and key."""
        with Client(self.sender.engine_socket, timeout_s=10) as c:
            info = c.describe()
        return Instance((info.endpoint,), (info.public_key,))


_MODELS: dict[Shape, Path] = {}


def model_of(shape: Shape, factory: pytest.TempPathFactory) -> Path:
    if shape not in _MODELS:
        _MODELS[shape] = build_model(factory.mktemp(f"model{shape.layers}"), shape)
    return _MODELS[shape]


def start(
    rig: Rig,
    shape: Shape,
    policy: str = "recompute",
    pool_blocks: int = POOL_BLOCKS,
    env: dict[str, str] | None = None,
    extra: tuple[str, ...] = (),
) -> Streamed:
    """The daemons (``env`` added to theirs) and both engines (``extra`` arguments), started
    and ready."""
    sender = rig.daemon("sender", "tx", pool_blocks=pool_blocks, env=env)
    receiver = rig.daemon("receiver", "rx", pool_blocks=pool_blocks, env=env)
    sender.wait_ready()
    receiver.wait_ready()
    eng = [
        *extra,
        "--max-model-len",
        str(shape.max_len),
        "--kv-cache-bytes",
        str((pool_blocks + 8) * shape.layers * shape.block_bytes),
    ]
    prefill = rig.engine("prefill", "producer", sender, *eng)
    timeout = ["--transfer-timeout-s", str(TRANSFER_TIMEOUT_S), "--policy", policy]
    decode = rig.engine("decode", "consumer", receiver, *eng, *timeout)
    prefill.wait_ready()
    decode.wait_ready()
    return Streamed(rig, shape, sender, receiver, prefill, decode, pool_blocks)


@pytest.fixture(scope="module", params=[TINY, DEEP], ids=["tiny", "deep"])
def streamed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Streamed]:
    shape: Shape = request.param
    # The deep model's long prompt in one forward (not chunked): it streams for seconds.
    extra = () if shape is TINY else ("--max-batched", str(shape.max_len))
    for rig in _rig(model_of(shape, tmp_path_factory)):
        pool = POOL_BLOCKS if shape is TINY else DEEP_POOL_BLOCKS
        yield start(rig, shape, pool_blocks=pool, extra=extra)


def chosen(tag: str, n: int) -> list[tuple[str, str]]:
    """The router's choice per request: a transfer id and a fetch token."""
    return [(f"x-{tag}{i}-{secrets.token_hex(4)}", secrets.token_urlsafe(16)) for i in range(n)]


def prefill_params(tid: str, token: str) -> dict[str, Any]:
    return {
        "do_remote_decode": True,
        "kvxferd_transfer_id": tid,
        "kvxferd_token": token,
        "kvxferd_stream": True,
    }


def send_both(s: Streamed, tag: str, ps: list[list[int]], timeout: float = 300.0) -> None:
    """Decode first (every fetch parks at the sender), then prefill; replies not taken."""
    inst = s.instance()
    picks = chosen(tag, len(ps))
    dec = [
        {
            "id": f"{tag}d{i}",
            "prompt": p,
            "max_tokens": DECODE_TOKENS,
            "params": {**decode_first_params(inst, tid, tok), "kvxferd_stream": True},
        }
        for i, (p, (tid, tok)) in enumerate(zip(ps, picks, strict=True))
    ]
    pre = [
        {"id": f"{tag}p{i}", "prompt": p, "max_tokens": 1, "params": prefill_params(tid, tok)}
        for i, (p, (tid, tok)) in enumerate(zip(ps, picks, strict=True))
    ]
    s.decode.send({"op": "run", "requests": dec, "timeout_s": timeout})
    s.prefill.send({"op": "run", "requests": pre, "timeout_s": timeout})


def stats(e: EngineProcess) -> dict[str, int]:
    return e.call({"op": "stats"}, 30)["stats"]  # type: ignore[no-any-return]


def monolithic(e: EngineProcess, tag: str, ps: list[list[int]]) -> list[list[int]]:
    reqs = [
        {"id": f"{tag}{i}", "prompt": p, "max_tokens": DECODE_TOKENS, "params": None}
        for i, p in enumerate(ps)
    ]
    out = e.run(reqs, timeout=300)["outputs"]
    return [out[f"{tag}{i}"]["tokens"] for i in range(len(ps))]


def stream_writes(s: Streamed) -> float:
    """The sender's WRITEs of ready layer ranges of streamed publishes."""
    return counter(s.sender.probe_port, "kvxferd_stream_writes")


def idle(s: Streamed, receiver: DaemonProcess, bound: float) -> float:
    """Nothing left: no session on the receiver, every pool block back in the decode
    connector; the monotonic time the last block was back."""
    wait_until(lambda: sessions(receiver.probe_port) == 0, bound, "receiver sessions at zero")
    return wait_until(
        lambda: stats(s.decode)["pool_free"] == s.pool_blocks,
        bound,
        "decode pool blocks all back (none fenced)",
    )


LENGTHS = [1, 31, 32, 33, 64, 65, 127, 200, 256, 300, 500 - DECODE_TOKENS]


def test_streamed_decode_first_equals_monolithic(streamed: Streamed) -> None:
    """Prompts decoded from KV streamed layer by layer to fetches parked before the prefill equal monolithic decode token for token, every prompt's KV loaded (receiver bytes and vLLM's load count) and each receipt saying streamed."""
    s = streamed
    ps = prompts(LENGTHS, seed=41 + s.shape.layers)
    rx_bytes = counter(s.receiver.probe_port, "kvxferd_bytes")
    before_d, before_p = stats(s.decode), stats(s.prefill)
    writes = stream_writes(s)

    t0 = time.monotonic()
    send_both(s, "s", ps)
    pre = s.prefill.reply(330)["outputs"]
    dec = s.decode.reply(330)["outputs"]
    took = time.monotonic() - t0
    mono = monolithic(s.decode, "m", ps)

    n = len(ps)
    assert all(pre[f"sp{i}"]["finish_reason"] == "length" for i in range(n)), pre
    assert [dec[f"sd{i}"]["tokens"] for i in range(n)] == mono
    after_d, after_p = stats(s.decode), stats(s.prefill)
    assert after_d["loads"] - before_d["loads"] == n, after_d
    assert after_d["load_failures"] == before_d["load_failures"], after_d
    want = sum(-(-len(p) // BLOCK) for p in ps) * s.shape.layers * s.shape.block_bytes
    assert counter(s.receiver.probe_port, "kvxferd_bytes") - rx_bytes == want
    # Streamed: published before the forward, every layer marked from save_kv_layer.
    assert after_p["streams"] - before_p["streams"] == n, after_p
    assert after_p["stream_layers"] > before_p["stream_layers"], after_p
    assert after_p["saves"] - before_p["saves"] == n, after_p
    assert stream_writes(s) - writes >= n
    receipts = [
        (dec[f"sd{i}"]["kv_transfer_params"] or {}).get("kvxferd_receipt") for i in range(n)
    ]
    assert all(r and r["loaded"] and r["streamed"] for r in receipts), receipts
    layers = after_p["stream_layers"] - before_p["stream_layers"]
    per_layer = (after_p["stream_layer_us"] - before_p["stream_layer_us"]) / max(1, layers)
    print(
        f"\n{s.shape.layers}-layer model, {n} prompts decode-first streamed: {took:.2f}s; "
        f"save_kv_layer {per_layer:.0f} us per layer in the forward ({layers} layer calls); "
        f"{after_p['stream_marks_partial'] - before_p['stream_marks_partial']} partial marks"
    )
    if s.shape.max_len > LONG_PROMPT:
        layers_land_while_the_forward_runs(s)
    s.prefill.drain()
    s.decode.drain()
    wait_until(lambda: sessions(s.sender.probe_port) == 0, 30, "sender sessions at zero")
    idle(s, s.receiver, 30)
    wait_until(
        lambda: stats(s.prefill)["pool_free"] == s.pool_blocks, 30, "prefill pool blocks back"
    )


def layers_land_while_the_forward_runs(s: Streamed) -> None:
    """Streaming really happens: a long prompt's layers are marked and written to its parked
    fetch in several ranges while the prefill's forward runs (about 2.5 s on the deep model)."""
    ps = prompts([LONG_PROMPT - DECODE_TOKENS], seed=43)
    writes, before = stream_writes(s), stats(s.prefill)
    send_both(s, "l", ps)
    s.prefill.reply(330)
    dec = s.decode.reply(330)["outputs"]
    after = stats(s.prefill)
    assert dec["ld0"]["finish_reason"] == "length"
    assert after["stream_marks_partial"] - before["stream_marks_partial"] >= 2, after
    assert stream_writes(s) - writes >= 2  # more than one layer range for the one fetch
    assert dec["ld0"]["tokens"] == monolithic(s.decode, "lm", ps)[0]


def test_zero_copy_streams_vllms_own_blocks(rig: Rig) -> None:
    """Zero copy, decode first, streamed: the sender reads vLLM's own blocks as each layer is marked (nothing copied); decode equals monolithic, every load counted, and vLLM's held blocks and the scratch come back."""
    blocks = 256
    zc = ["--zero-copy", "--num-blocks", str(blocks)]
    sender = rig.daemon("sender", "tx", pool_blocks=blocks, zero_copy=True)
    receiver = rig.daemon("receiver", "rx", pool_blocks=blocks, zero_copy=True)
    sender.wait_ready()
    receiver.wait_ready()
    prefill = rig.engine("prefill", "producer", sender, *zc)
    decode = rig.engine(
        "decode", "consumer", receiver, *zc, "--transfer-timeout-s", str(TRANSFER_TIMEOUT_S)
    )
    prefill.wait_ready()
    decode.wait_ready()
    s = Streamed(rig, TINY, sender, receiver, prefill, decode, MAX_MODEL_LEN // BLOCK)
    ps = prompts([33, 100, 300], seed=45)
    send_both(s, "z", ps)
    pre = prefill.reply(330)["outputs"]
    dec = decode.reply(330)["outputs"]
    assert all(o["finish_reason"] == "length" for o in pre.values()), pre
    assert [dec[f"zd{i}"]["tokens"] for i in range(len(ps))] == monolithic(decode, "zm", ps)
    st = stats(prefill)
    assert st["streams"] == len(ps) and st["stream_layers"] >= MODEL_LAYERS, st
    assert stats(decode)["loads"] == len(ps)
    prefill.drain()  # vLLM frees the held blocks once the publishes ended
    decode.drain()
    wait_until(lambda: sessions(sender.probe_port) == 0, 30, "sender sessions at zero")
    idle(s, receiver, 30)  # the decode's scratch blocks


def test_chunked_prefill_streams_the_step_that_completes_the_prompt(rig: Rig) -> None:
    """Chunked prefill (64 tokens a step): only the step of a prompt's last chunk streams (the earlier chunks' KV is whole in every layer by then), and decode equals monolithic decode chunked the same way."""
    s = start(rig, TINY, extra=("--max-batched", "64"))
    for n in (100, 300):
        ps = prompts([n], seed=46 + n)
        before = stats(s.prefill)
        send_both(s, f"c{n}.", ps)
        pre = s.prefill.reply(330)
        dec = s.decode.reply(330)["outputs"]
        after = stats(s.prefill)
        assert pre["steps"] >= -(-n // 64), pre  # it ran in chunks
        assert after["streams"] - before["streams"] == 1, after
        assert after["stream_layers"] - before["stream_layers"] == MODEL_LAYERS, after
        assert dec[f"c{n}.d0"]["tokens"] == monolithic(s.decode, f"c{n}.m", ps)[0]
        receipt = dec[f"c{n}.d0"]["kv_transfer_params"]["kvxferd_receipt"]
        assert receipt["loaded"] and receipt["streamed"], receipt
