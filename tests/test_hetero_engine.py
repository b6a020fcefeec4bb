"""Heterogeneous sharding through the engine API: Describe declares the record, Fetch names the instance.

Real Senders and Receivers (real NIXL) behind real Gateways, driven with
``kvxferd.engine.client.Client`` as an engine would: each rank declares its topology at
attach (``describe(topology=...)``), the prefill engines publish with
``readers_for``, the decode engine fetches with ``sender_endpoints``; refusals come
back as typed outcomes or errors, never as a hang.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from kvxferd.engine.client import Client, EngineRejected
from kvxferd.engine.engine_protocol import EngineReason
from kvxferd.transfer.reshard import readers_for
from kvxferd.transfer.topology import Topology
from tests.test_gateway import (  # noqa: F401 - fixtures
    CALL_S,
    Started,
    sock_dir,
    start_gateway,
)
from tests.test_hetero import BASE, SWEEP, Daemons, _pool, _World
from tests.test_hetero import daemons as daemons  # the fixture

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
def client_of(start_gateway: Callable[..., Started]) -> Iterator[Callable[..., Client]]:  # noqa: F811
    made: list[Client] = []

    def make(service: object, name: str) -> Client:
        _, _, endpoint = start_gateway(service, name)
        c = Client(endpoint, timeout_s=CALL_S)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close_client()


def test_1p2d_through_the_engine_api(daemons: Daemons, client_of: Callable[..., Client]) -> None:
    """Engines declare records at attach, publish for readers_for readers and fetch the
    instance: each decode pool equals the reference's reshard."""
    w = _World(SWEEP["1P2D (TP1->TP2)"], 9)
    p = w.prefill[0]
    s = daemons.sender(None, _pool(p, w.num_blocks[("p", 0)]))
    w.fill("p", p, s.pool.kv_bytes_view())
    tx = client_of(s, "tx")
    info = tx.describe(topology=p)
    assert info.topology == p
    assert tx.describe().topology == p, "declared once, kept"
    readers = readers_for(w.decode[0], p)
    assert readers == 2
    tx.publish("req-e", w.ids[("p", 0)].tolist(), expected_fetches=readers)
    handles = []
    for d in w.decode:
        r = daemons.receiver(None, _pool(d, w.num_blocks[("d", d.rank)]))
        w.fill("d", d, r.pool.kv_bytes_view())
        rx = client_of(r, f"rx{d.rank}")
        rx.describe(topology=d)
        hid = rx.fetch(
            "req-e",
            s.endpoint,
            w.ids[("d", d.rank)].tolist(),
            sender_endpoints=[s.endpoint],
            want_aux=False,
        )
        handles.append((d, r, rx, hid))
    for d, r, rx, hid in handles:
        out = rx.wait(hid, CALL_S * 2)
        assert out is not None and out.ok, out
        assert out.reusable and not out.in_doubt
        assert torch.equal(r.pool.kv_bytes_view(), w.want[d.rank]), f"decode rank {d.rank}"


def test_a_refused_pair_reaches_the_engine_typed(
    daemons: Daemons, client_of: Callable[..., Client]
) -> None:
    """A block-size mismatch the mapping refuses at REGISTER ends the engine's fetch failed
    incompatible, with the mapping's text, and its blocks reusable."""
    p = BASE.prefill[0]
    d: Topology = BASE.instance(1, 1, "heads_major", tokens_per_block=8)[0]
    s = daemons.sender(p, _pool(p, 8))
    r = daemons.receiver(None, _pool(d, 8))
    tx, rx = client_of(s, "tx"), client_of(r, "rx")
    rx.describe(topology=d)
    tx.publish("req-x", [0, 1])
    hid = rx.fetch("req-x", s.endpoint, [2, 3], sender_endpoints=[s.endpoint], want_aux=False)
    out = rx.wait(hid, CALL_S * 2)
    assert out is not None and out.state == "failed"
    assert out.reason is EngineReason.INCOMPATIBLE
    assert "tokens_per_block: prefill 4 != decode 8" in out.detail
    assert out.reusable


def test_describe_refuses_a_record_that_is_not_the_pool(
    daemons: Daemons, client_of: Callable[..., Client]
) -> None:
    """Declaring a record whose block size or layer count is not the pool's is an
    Error(incompatible); declaring another record after one is too."""
    c = SWEEP["1P2D (TP1->TP2)"]
    r = daemons.receiver(None, _pool(c.decode[0], 8))
    rx = client_of(r, "rx")
    with pytest.raises(EngineRejected) as e:
        rx.describe(topology=c.prefill[0])
    assert e.value.reason is EngineReason.INCOMPATIBLE
    rx.describe(topology=c.decode[0])
    with pytest.raises(EngineRejected) as e:
        rx.describe(topology=c.decode[1])
    assert e.value.reason is EngineReason.INCOMPATIBLE and "already declared" in e.value.detail
