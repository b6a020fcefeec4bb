"""The vLLM connector's worker side passes its topology through: prefill TP != decode TP, byte-exact.

vLLM's TP > 1 does not run on this machine's CPU backend, so vLLM itself is not
here: each rank is the connector's real :class:`WorkerSide` (the code vLLM's
workers run) over vLLM-shaped KV tensors (``[blocks, kv_heads, block_size,
2 * head_size]`` per layer, each backend's reading of a block), in front of a real
Sender or Receiver behind a real Gateway (real ZMQ, real NIXL). Each worker
derives its record from its tensors and what vLLM would say of the model
(:class:`ModelShard`), declares it at attach, producers publish for the decode
ranks that read them, consumers fetch naming the whole prefill instance from the
kv_transfer_params. Every decode tensor is then compared, block by block, with the
reference: the model's whole KV cache built with torch and laid out as each
rank's backend holds its heads.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvxferd.engine.client import Client
from kvxferd.errors import ConfigError
from kvxferd.integrations.vllm.geometry import KvGeometry, ModelShard
from kvxferd.integrations.vllm.metadata import Load, RemoteKv, Save, StepPlan
from kvxferd.integrations.vllm.settings import load_settings
from kvxferd.integrations.vllm.worker import WorkerSide
from kvxferd.transfer.topology import layout_of
from tests.support.conditions import wait_until
from tests.test_gateway import (  # noqa: F401 - fixtures
    CALL_S,
    Started,
    sock_dir,
    start_gateway,
)
from tests.test_hetero import Daemons
from tests.test_hetero import daemons as daemons  # the fixture

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

LAYERS, HEADS, HEAD_SIZE, BLOCK = 2, 4, 16, 4
VLLM_BLOCKS = 12  # vLLM's blocks per worker
POOL_BLOCKS = 16  # the daemon's (the connector's staging blocks in copy mode)
REQ_BLOCKS = 3
WAIT_S = 30.0


def _full(seed: int) -> torch.Tensor:
    """The model's whole KV of one request: [layers, K/V, heads, tokens, head_size]."""
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, 2, HEADS, REQ_BLOCKS * BLOCK, HEAD_SIZE)
    return torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int16).view(torch.float16)


def _blocks_of(full: torch.Tensor, layer: int, h0: int, h1: int, backend: str) -> torch.Tensor:
    """Heads [h0, h1) of ``layer`` as vLLM blocks: [request blocks, heads, block_size, 2 * D].

    CPU_ATTN reads a head's ``[block_size, 2 * D]`` as ``[2, block_size, D]`` (K rows,
    then V rows); the other backends put K and V side by side in the last dimension.
    """
    x = full[layer, :, h0:h1].reshape(2, h1 - h0, REQ_BLOCKS, BLOCK, HEAD_SIZE)
    if backend == "CPU_ATTN":  # [n, h, 2, T, D]
        x = x.permute(2, 1, 0, 3, 4)
    else:  # [n, h, T, 2, D]
        x = x.permute(2, 1, 3, 0, 4)
    return x.reshape(REQ_BLOCKS, h1 - h0, BLOCK, 2 * HEAD_SIZE)


@dataclass
class Rank:
    worker: WorkerSide
    kv: dict[str, torch.Tensor]
    shard: ModelShard


def _shard(tp_rank: int, tp: int, backend: str, model: str = "m") -> ModelShard:
    return ModelShard(
        model_id=model,
        backend=backend,
        num_layers=LAYERS,
        kv_heads_total=HEADS,
        kv_heads=HEADS // tp,
        head_size=HEAD_SIZE,
        block_size=BLOCK,
        tp_rank=tp_rank,
        tp_size=tp,
        pp_layer_bounds=(0, LAYERS),
    )


def _kv(heads: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (VLLM_BLOCKS, heads, BLOCK, 2 * HEAD_SIZE)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g).half()
        for i in range(LAYERS)
    }


class Instance:
    """One vLLM instance of ``tp`` workers: a daemon, a gateway and a WorkerSide per rank."""

    def __init__(
        self,
        daemons: Daemons,
        start: Callable[..., Started],
        sock_dir: str,  # noqa: F811
        side: str,
        tp: int,
        backend: str,
        decode_tp: int | None = None,
        model: str = "m",
    ) -> None:
        self.tp, self.side = tp, side
        self.ranks: list[Rank] = []
        self.daemons: list[Any] = []  # each rank's Sender or Receiver
        producer = side == "p"
        settings = load_settings(
            {
                "engine_socket": f"ipc://{sock_dir}/run/{side}{{rank}}.sock",
                "transfer_timeout_s": 10.0,
                "call_timeout_s": 5.0,
                **({"decode_tp_size": decode_tp} if decode_tp else {}),
            }
        )
        pool = dict(
            num_layers=LAYERS,
            num_blocks=POOL_BLOCKS,
            block_elems=2 * (HEADS // tp) * BLOCK * HEAD_SIZE,
            dtype="float16",
            aux_slots=2,
            aux_slot_bytes=64,
        )
        for r in range(tp):
            service = daemons.sender(None, pool) if producer else daemons.receiver(None, pool)
            self.daemons.append(service)
            start(service, f"{side}{r}")
            shard = _shard(r, tp, backend, model)
            w = WorkerSide(settings, producer=producer, consumer=not producer, shard=shard)
            kv = _kv(HEADS // tp, seed=100 * (side == "p") + r)
            w.register(kv, VLLM_BLOCKS, REQ_BLOCKS)
            self.ranks.append(Rank(w, kv, shard))
        self.endpoints = [r.worker.attachment.daemon.info.endpoint for r in self.ranks]  # type: ignore[union-attr]

    def close(self) -> None:
        for r in self.ranks:
            r.worker.shutdown()


@pytest.fixture
def instances() -> Iterator[list[Instance]]:
    made: list[Instance] = []
    yield made
    for i in made:
        i.close()


def _transfer(
    prefill: Instance, decode: Instance, full: torch.Tensor, backend: str, req: str = "req-1"
) -> tuple[set[str], set[str]]:
    """Publish ``full`` from every prefill rank, load it on every decode rank; the decode
    ranks' (finished, failed) request ids."""
    p_ids = [5, 0, 9]
    for r in prefill.ranks:
        h0 = r.shard.tp_rank * r.shard.kv_heads
        for i, t in enumerate(r.kv.values()):
            t[p_ids] = _blocks_of(full, i, h0, h0 + r.shard.kv_heads, backend)
    tid, token = f"t-{req}", f"token-of-{req}-0123456789"
    eps = prefill.endpoints
    remote = RemoteKv(
        tid, eps[0], REQ_BLOCKS * BLOCK, REQ_BLOCKS, token, "", tuple(eps), ("",) * len(eps)
    )
    params = RemoteKv.from_params(remote.to_params())  # what the decode request carries
    assert params == remote
    for r in prefill.ranks:
        r.worker.save(StepPlan(saves=[Save(req, tid, tuple(p_ids), token)]))
    d_ids = (7, 2, 11)
    for r in decode.ranks:
        r.worker.start_step(StepPlan(loads=[Load(req, params, d_ids)]))
    done: list[set[str]] = [set() for _ in decode.ranks]
    failed: set[str] = set()

    def ended() -> bool:
        for i, r in enumerate(decode.ranks):
            _, fin, bad = r.worker.results()
            done[i] |= fin
            failed.update(bad)
        return all(req in d for d in done)

    wait_until(ended, WAIT_S, "every decode rank's load ended")
    return set.intersection(*done), failed


def _check_decode(decode: Instance, full: torch.Tensor, backend: str) -> None:
    d_ids = [7, 2, 11]
    for r in decode.ranks:
        h0 = r.shard.tp_rank * r.shard.kv_heads
        for i, t in enumerate(r.kv.values()):
            want = _blocks_of(full, i, h0, h0 + r.shard.kv_heads, backend)
            assert torch.equal(t[d_ids].view(torch.int16), want.view(torch.int16)), (
                f"decode rank {r.shard.tp_rank} layer {i}"
            )


CASES = [(1, 2, "CPU_ATTN"), (2, 1, "CPU_ATTN"), (2, 4, "FLASH_ATTN"), (4, 2, "FLASH_ATTN")]


@pytest.mark.parametrize(("p_tp", "d_tp", "backend"), CASES, ids=lambda x: str(x))
def test_prefill_and_decode_shard_differently(
    daemons: Daemons,
    start_gateway: Callable[..., Started],  # noqa: F811
    sock_dir: str,  # noqa: F811
    instances: list[Instance],
    p_tp: int,
    d_tp: int,
    backend: str,
) -> None:
    """Every decode rank's vLLM blocks hold exactly its heads of the prefill instance's KV,
    each rank's record reaching its daemon, and every prefill rank's staging blocks come back."""
    prefill = Instance(daemons, start_gateway, sock_dir, "p", p_tp, backend, decode_tp=d_tp)
    decode = Instance(daemons, start_gateway, sock_dir, "d", d_tp, backend)
    instances += [prefill, decode]
    for inst in (prefill, decode):
        for r in inst.ranks:
            t = r.worker.topology
            assert t is not None and t.tp_size == inst.tp and t.tp_rank == r.shard.tp_rank
            c = Client(r.worker.engine_socket, timeout_s=CALL_S)
            try:
                assert c.describe().topology == t, "the daemon holds the worker's record"
            finally:
                c.close_client()
    readers = [r.worker.readers for r in prefill.ranks]
    assert readers == [max(1, d_tp // p_tp)] * p_tp
    full = _full(seed=p_tp * 10 + d_tp)
    finished, failed = _transfer(prefill, decode, full, backend)
    assert failed == set() and finished == {"req-1"}
    _check_decode(decode, full, backend)
    for r in prefill.ranks:  # every reader came: each publish ended and gave its blocks back
        wait_until(
            lambda w=r.worker: w.pool_free() == POOL_BLOCKS, WAIT_S, "prefill staging blocks back"
        )
    for r in decode.ranks:
        assert r.worker.stats.snapshot()["loads"] == 1


def _stream(
    prefill: Instance, decode: Instance, full: torch.Tensor, backend: str, req: str = "req-s"
) -> None:
    """Decode first: every decode rank fetches (parked at the prefill ranks' senders), then
    every prefill rank streams its shard layer by layer as vLLM's forward would: published
    before the forward (begin_step), each layer copied and marked (save_layer), the rest at
    wait_for_save (save). No decode rank may finish before the last layer is marked."""
    p_ids = [5, 0, 9]
    tid, token = f"t-{req}", f"token-of-{req}-0123456789"
    eps = prefill.endpoints
    remote = RemoteKv(
        tid, eps[0], REQ_BLOCKS * BLOCK, REQ_BLOCKS, token, "", tuple(eps), ("",) * len(eps)
    )
    d_ids = (7, 2, 11)
    for r in decode.ranks:
        r.worker.start_step(StepPlan(loads=[Load(req, remote, d_ids)]))
    plan = StepPlan(saves=[Save(req, tid, tuple(p_ids), token, stream=True)])
    for r in prefill.ranks:
        r.worker.begin_step(plan)
    for layer, name in enumerate(next(iter(prefill.ranks)).kv):
        for r in prefill.ranks:  # the forward computes this layer's KV, then save_kv_layer
            h0 = r.shard.tp_rank * r.shard.kv_heads
            r.kv[name][p_ids] = _blocks_of(full, layer, h0, h0 + r.shard.kv_heads, backend)
            r.worker.save_layer(name)
        if layer == 0:  # layer 0 is written to every reader while the rest is computed
            pairs = max(prefill.tp, decode.tp)  # (prefill rank, decode rank) that pair
            wait_until(
                lambda n=pairs: sum(tx.stats.get("stream_writes") for tx in prefill.daemons) >= n,
                WAIT_S,
                "layer 0 written to every decode rank",
            )
        for r in decode.ranks if layer < LAYERS - 1 else ():
            _, fin, bad = r.worker.results()
            assert not fin and not bad, "a load ended before its last layer was marked"
    for r in prefill.ranks:
        r.worker.save(plan)
    done: list[set[str]] = [set() for _ in decode.ranks]

    def ended() -> bool:
        for i, r in enumerate(decode.ranks):
            _, fin, bad = r.worker.results()
            assert not bad, bad
            done[i] |= fin
        return all(req in d for d in done)

    wait_until(ended, WAIT_S, "every decode rank's load ended")


@pytest.mark.parametrize(("p_tp", "d_tp", "backend"), CASES[:2], ids=lambda x: str(x))
def test_each_prefill_rank_streams_its_shard(
    daemons: Daemons,
    start_gateway: Callable[..., Started],  # noqa: F811
    sock_dir: str,  # noqa: F811
    instances: list[Instance],
    p_tp: int,
    d_tp: int,
    backend: str,
) -> None:
    """Streamed, decode first, TP differing: each prefill rank streams its own heads layer
    by layer to fetches parked before it published; every decode rank ends with exactly
    its heads, a layer lands before the next is computed, and the staging blocks come back."""
    prefill = Instance(daemons, start_gateway, sock_dir, "p", p_tp, backend, decode_tp=d_tp)
    decode = Instance(daemons, start_gateway, sock_dir, "d", d_tp, backend)
    instances += [prefill, decode]
    full = _full(seed=p_tp * 10 + d_tp + 5)
    _stream(prefill, decode, full, backend)
    _check_decode(decode, full, backend)
    for r in prefill.ranks:
        st = r.worker.stats.snapshot()
        assert st["streams"] == 1 and st["stream_layers"] == LAYERS, st
        wait_until(
            lambda w=r.worker: w.pool_free() == POOL_BLOCKS, WAIT_S, "prefill staging blocks back"
        )
    writes = sum(s.stats.get("stream_writes") for s in prefill.daemons)
    assert writes >= 2 * max(p_tp, d_tp), "each pair's layers written in two ranges"


def test_each_pipeline_stage_streams_its_own_layers(
    daemons: Daemons,
    start_gateway: Callable[..., Started],  # noqa: F811
    sock_dir: str,  # noqa: F811
) -> None:
    """Prefill PP 2 (4 layers: stage 0 holds layers 0-1, stage 1 layers 2-3, each in a pool
    of its own 2 layers) -> decode PP 1, streamed, decode first: each stage marks its local
    layers as its forward computes them (stage 1 after stage 0, as a pipeline runs), no
    load ends before the last stage's last mark, and the decode rank holds all 4 layers."""
    layers, stages, heads = 4, 2, HEADS
    per = layers // stages
    g = torch.Generator().manual_seed(77)
    full = torch.randint(
        -(2**15), 2**15, (layers, 2, heads, REQ_BLOCKS * BLOCK, HEAD_SIZE), generator=g,
        dtype=torch.int16,
    ).view(torch.float16)  # fmt: skip
    settings = load_settings(
        {"engine_socket": f"ipc://{sock_dir}/run/pp{{rank}}.sock", "transfer_timeout_s": 10.0}
    )

    def pool(n_layers: int) -> dict[str, Any]:
        return dict(
            num_layers=n_layers,
            num_blocks=POOL_BLOCKS,
            block_elems=2 * heads * BLOCK * HEAD_SIZE,
            dtype="float16",
            aux_slots=2,
            aux_slot_bytes=64,
        )

    def shard(stage: int, pp: int) -> ModelShard:
        return ModelShard(
            model_id="m", backend="CPU_ATTN", num_layers=layers, kv_heads_total=heads,
            kv_heads=heads, head_size=HEAD_SIZE, block_size=BLOCK, pp_stage=stage,
            pp_size=pp, pp_layer_bounds=tuple(range(0, layers + 1, layers // pp)),
        )  # fmt: skip

    def tensors(first: int, n: int) -> dict[str, torch.Tensor]:
        shape = (VLLM_BLOCKS, heads, BLOCK, 2 * HEAD_SIZE)
        return {f"model.layers.{i}.self_attn.attn": torch.zeros(shape).half() for i in
                range(first, first + n)}  # fmt: skip

    workers, kvs, txs = [], [], []
    for stage in range(stages):
        tx = daemons.sender(None, pool(per))
        start_gateway(tx, f"pp{stage}")
        w = WorkerSide(settings, producer=True, consumer=False, shard=shard(stage, stages))
        kv = tensors(stage * per, per)
        w.register(kv, VLLM_BLOCKS, REQ_BLOCKS)
        workers.append(w)
        kvs.append(kv)
        txs.append(tx)
    rx = daemons.receiver(None, pool(layers))
    start_gateway(rx, "ppd")
    d_settings = load_settings({"engine_socket": f"ipc://{sock_dir}/run/ppd.sock"})
    dw = WorkerSide(d_settings, producer=False, consumer=True, shard=shard(0, 1))
    d_kv = tensors(0, layers)
    dw.register(d_kv, VLLM_BLOCKS, REQ_BLOCKS)
    try:
        assert [w.topology.layer_begin for w in workers] == [0, per]  # type: ignore[union-attr]
        req, tid, token = "req-pp", "t-req-pp", "token-of-req-pp-0123456789"
        eps = tuple(w.attachment.daemon.info.endpoint for w in workers)  # type: ignore[union-attr]
        remote = RemoteKv(tid, eps[0], REQ_BLOCKS * BLOCK, REQ_BLOCKS, token, "", eps, ("",) * 2)
        d_ids, p_ids = (7, 2, 11), [5, 0, 9]
        dw.start_step(StepPlan(loads=[Load(req, remote, d_ids)]))
        plan = StepPlan(saves=[Save(req, tid, tuple(p_ids), token, stream=True)])
        for stage, (w, kv, tx) in enumerate(zip(workers, kvs, txs, strict=True)):
            w.begin_step(plan)
            for j, name in enumerate(kv):  # this stage's forward: its layers, in order
                kv[name][p_ids] = _blocks_of(full, stage * per + j, 0, heads, "CPU_ATTN")
                w.save_layer(name)
                # Its local layers [0, j + 1) are written while the rest is computed.
                wait_until(
                    lambda t=tx, n=j + 1: t.stats.get("stream_writes") >= n,
                    WAIT_S,
                    f"stage {stage}: local layer {j} written",
                )
                if (stage, j) != (stages - 1, per - 1):  # not yet the whole model's last layer
                    _, fin, bad = dw.results()
                    assert not fin and not bad, "the load ended before the last layer was marked"
            w.save(plan)
            assert w.stats.snapshot()["stream_layers"] == per
        done: set[str] = set()

        def ended() -> bool:
            _, fin, bad = dw.results()
            assert not bad, bad
            done.update(fin)
            return req in done

        wait_until(ended, WAIT_S, "the decode rank's load ended")
        for i, t in enumerate(d_kv.values()):
            want = _blocks_of(full, i, 0, heads, "CPU_ATTN")
            assert torch.equal(t[list(d_ids)].view(torch.int16), want.view(torch.int16)), i
        for w in workers:
            wait_until(lambda w=w: w.pool_free() == POOL_BLOCKS, WAIT_S, "stage blocks back")
    finally:
        for w in [*workers, dw]:
            w.shutdown()


def test_a_decode_abort_mid_stream_ends_it_and_frees_both_sides(
    daemons: Daemons,
    start_gateway: Callable[..., Started],  # noqa: F811
    sock_dir: str,  # noqa: F811
    instances: list[Instance],
) -> None:
    """A decode request aborted while the prefill's layers stream: its load is reported
    cancelled (never loaded), the stream's publish ends, and the prefill's staging blocks
    come back only once its step ended on the engine thread (it copies into them until
    then), then every block of both sides is free."""
    prefill = Instance(daemons, start_gateway, sock_dir, "p", 1, "CPU_ATTN")
    decode = Instance(daemons, start_gateway, sock_dir, "d", 1, "CPU_ATTN")
    instances += [prefill, decode]
    p, d = prefill.ranks[0], decode.ranks[0]
    req, tid, token = "req-a", "t-req-a", "token-of-req-a-0123456789"
    ep = prefill.endpoints[0]
    remote = RemoteKv(tid, ep, REQ_BLOCKS * BLOCK, REQ_BLOCKS, token, "", (ep,), ("",))
    d.worker.start_step(StepPlan(loads=[Load(req, remote, (7, 2, 11))]))
    plan = StepPlan(saves=[Save(req, tid, (5, 0, 9), token, stream=True)])
    p.worker.begin_step(plan)
    names = list(p.kv)
    p.worker.save_layer(names[0])
    tx = prefill.daemons[0]
    wait_until(lambda: tx.stats.get("stream_writes") >= 1, WAIT_S, "layer 0 written")
    d.worker.start_step(StepPlan(cancel_loads=[req]))  # vLLM aborted the decode request
    ended: set[str] = set()

    def reported() -> bool:
        _, fin, bad = d.worker.results()
        assert not bad, "a cancelled load is not a failed one"
        ended.update(fin)
        return req in ended

    wait_until(reported, WAIT_S, "the cancelled load reported")
    assert d.worker.stats.snapshot()["loads"] == 0
    # The publish ended with its only reader and was closed; the engine still runs its step.
    wait_until(lambda: tid not in p.worker.io._cancels, WAIT_S, "the stream's publish closed")
    assert p.worker.pool_free() == POOL_BLOCKS - REQ_BLOCKS, "given back mid-step"
    for name in names[1:]:
        p.worker.save_layer(name)
    p.worker.save(plan)  # wait_for_save: the step ends
    wait_until(lambda: p.worker.pool_free() == POOL_BLOCKS, WAIT_S, "prefill blocks back")
    wait_until(lambda: d.worker.pool_free() == POOL_BLOCKS, WAIT_S, "decode blocks back")


def test_a_decode_instance_of_another_model_is_refused_not_garbled(
    daemons: Daemons,
    start_gateway: Callable[..., Started],  # noqa: F811
    sock_dir: str,  # noqa: F811
    instances: list[Instance],
) -> None:
    """Records with different model identities do not pair: the load fails (and vLLM
    recomputes) instead of landing another model's bytes."""
    prefill = Instance(daemons, start_gateway, sock_dir, "p", 2, "CPU_ATTN", decode_tp=1)
    decode = Instance(daemons, start_gateway, sock_dir, "d", 1, "CPU_ATTN", model="other")
    instances += [prefill, decode]
    before = [t.clone() for t in decode.ranks[0].kv.values()]
    finished, failed = _transfer(prefill, decode, _full(seed=3), "CPU_ATTN")
    assert failed == {"req-1"} and finished == {"req-1"}
    assert all(torch.equal(a, b) for a, b in zip(before, decode.ranks[0].kv.values(), strict=True))
    assert decode.ranks[0].worker.stats.snapshot()["load_failures"] == 1
    refused = sum(s.stats.get("topology_refused") for s in daemons.senders)
    assert refused >= 1, "refused at registration, for the record's compat hash"


# -- the record a worker derives ------------------------------------------------------------
@pytest.mark.parametrize(
    ("backend", "memory", "zero_copy", "layout"),
    [
        ("CPU_ATTN", "HNC", False, "heads_planes_tokens"),
        ("FLASH_ATTN", "HNC", False, "heads_tokens_planes"),
        ("FLASH_ATTN", "NHC", False, "heads_tokens_planes"),  # copy mode: logical order
        ("FLASH_ATTN", "NHC", True, "tokens_heads_planes"),  # zero copy: memory order
        ("FLASH_ATTN", "HNC", True, "heads_tokens_planes"),
    ],
)
def test_record_from_vllm_tensors(backend: str, memory: str, zero_copy: bool, layout: str) -> None:
    """The layout in the record is the block's order as the backend reads it, and it is
    the order the bytes really have (layout_of over the same memory agrees)."""
    sizes = {"H": 2, "N": BLOCK, "C": 2 * HEAD_SIZE}
    mem = torch.zeros(VLLM_BLOCKS, *(sizes[d] for d in memory))
    view = mem.permute(0, *(1 + memory.index(d) for d in "HNC"))  # logical [B, H, N, C]
    geo = KvGeometry({f"model.layers.{i}.attn": view for i in range(LAYERS)}, VLLM_BLOCKS)
    shard = ModelShard("m", backend, LAYERS, HEADS, 2, HEAD_SIZE, BLOCK, 1, 2, zero_copy=zero_copy)
    t = geo.topology(shard)
    assert (t.layout, t.tp_rank, t.kv_heads, t.head_range) == (layout, 1, 2, (2, 4))
    assert t.block_bytes == geo.block_bytes
    # What a block of the pool holds, seen as [planes, heads, tokens, head_size]:
    block = view[0] if not zero_copy else mem[0]
    if backend == "CPU_ATTN":
        pht = block.reshape(2, 2, BLOCK, HEAD_SIZE).transpose(0, 1)
    elif zero_copy and memory == "NHC":
        pht = block.reshape(BLOCK, 2, 2, HEAD_SIZE).permute(2, 1, 0, 3)
    else:
        pht = block.contiguous().reshape(2, BLOCK, 2, HEAD_SIZE).permute(2, 0, 1, 3)
    assert layout_of(pht, 2, 2, BLOCK, HEAD_SIZE) == layout


def test_records_need_vllms_block_shape() -> None:
    """Tensors not shaped [blocks, kv_heads, block_size, 2 * head_size] get no record, with
    a ConfigError naming the shape expected; so do heads the TP size cannot split."""
    kv = {"l.0": torch.zeros(2, VLLM_BLOCKS, BLOCK, 2, HEAD_SIZE)}  # an old K/V-first layout
    geo = KvGeometry(kv, VLLM_BLOCKS)
    with pytest.raises(ConfigError, match=r"not \[blocks, kv_heads, block_size, 2 \* head_size\]"):
        geo.topology(ModelShard("m", "X", 1, 2, 2, HEAD_SIZE, BLOCK))
    geo = KvGeometry({"l.0": torch.zeros(VLLM_BLOCKS, 2, BLOCK, 2 * HEAD_SIZE)}, VLLM_BLOCKS)
    with pytest.raises(ConfigError, match="stage 0 holds layers"):
        geo.topology(ModelShard("m", "X", 3, 2, 2, HEAD_SIZE, BLOCK))
    bad = ModelShard("m", "X", 1, 3, 2, HEAD_SIZE, BLOCK, tp_rank=0, tp_size=2)
    with pytest.raises(ConfigError, match="no topology record"):
        geo.topology(bad)
    assert math.prod(geo.block_shape) == geo.block_elems


# -- kv_transfer_params ---------------------------------------------------------------------
def test_params_name_every_prefill_rank_and_refuse_malformed_lists() -> None:
    """The params carry every prefill rank's endpoint and key in rank order; lists that do
    not start with the rank-0 sender, differ in length or hold non-strings are not ours."""
    r = RemoteKv("t", "tcp://a:1", 8, 2, "tok", "k0", ("tcp://a:1", "tcp://b:1"), ("k0", "k1"))
    params = r.to_params()
    assert params["kvxferd_senders"] == ["tcp://a:1", "tcp://b:1"]
    assert RemoteKv.from_params(params) == r
    for bad in (
        {"kvxferd_senders": ["tcp://b:1", "tcp://a:1"]},  # rank 0 is not kvxferd_sender
        {"kvxferd_sender_keys": ["k0"]},  # one key for two ranks
        {"kvxferd_senders": ["tcp://a:1", 5]},
        {"kvxferd_senders": "tcp://a:1"},
    ):
        assert RemoteKv.from_params({**params, **bad}) is None, bad
    old = RemoteKv("t", "tcp://a:1", 8, 2).to_params()  # an older connector: one sender
    assert "kvxferd_senders" not in old
    assert RemoteKv.from_params(old) == RemoteKv("t", "tcp://a:1", 8, 2)


def test_a_restarted_rank_is_named_in_later_params() -> None:
    """A sender daemon of rank 1 that restarted on another endpoint replaces rank 1's entry."""
    from kvxferd.integrations.vllm.scheduler import SchedulerSide

    s = SchedulerSide(
        producer=True,
        consumer=False,
        block_size=BLOCK,
        sender="tcp://a:1",
        senders=["tcp://a:1", "tcp://b:1"],
        sender_keys=["", ""],
    )
    s.sender_moved(1, "tcp://b:2")
    assert (s.sender, s.senders) == ("tcp://a:1", ["tcp://a:1", "tcp://b:2"])
    s.sender_moved(0, "tcp://a:2")
    assert (s.sender, s.senders) == ("tcp://a:2", ["tcp://a:2", "tcp://b:2"])


def test_pool_config_per_worker(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """pool-config for TP 2 x PP 2 prints one [pool] per stage: each worker's KV heads and
    its stage's layers as vLLM partitions them (5 layers: 3 then 2)."""
    from kvxferd.integrations.vllm.__main__ import main

    cfg = {
        "num_hidden_layers": 5,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "hidden_size": 128,
        "torch_dtype": "float16",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = ["pool-config", "--model", str(tmp_path), "--block-size", "16", "--num-blocks", "10"]
    assert main([*argv, "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]) == 0
    sections = capsys.readouterr().out.split("\n# ")
    pools = [tomllib.loads(s if s.startswith("#") else "# " + s)["pool"] for s in sections]
    assert [(p["num_layers"], p["block_elems"]) for p in pools] == [(3, 1024), (2, 1024)]
    assert main([*argv, "--tensor-parallel-size", "3"]) == 2, "3 ranks cannot split 4 KV heads"
