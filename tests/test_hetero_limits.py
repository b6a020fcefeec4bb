"""An instance fetch's pieces are fetches in flight: they count against ``max_fetches_in_flight``.

Real Senders and a real Receiver (real ZMQ, real NIXL), 2P1D: the decode rank reads a
piece from each prefill rank, so one fetch of the instance is two fetches in flight.
"""

from __future__ import annotations

import pytest
import torch

from kvxferd.config import load_receiver_settings
from kvxferd.errors import Reason
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.session import RxState
from tests.test_hetero import DEADLINES, WAIT_S, Daemons, _pool
from tests.test_hetero import daemons as daemons  # the fixture
from tests.test_topology_reshard import SWEEP, _World

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.mark.parametrize("limit", [1, 2])
def test_pieces_count_against_max_fetches_in_flight(daemons: Daemons, limit: int) -> None:
    """With room for one fetch in flight the two-piece fetch fails ``busy`` at planning
    (counted, blocks untouched); with room for two it is done, byte-exact."""
    w = _World(SWEEP["2P1D (TP2->TP1)"], 7)
    senders = []
    for t in w.prefill:
        s = daemons.sender(t, _pool(t, w.num_blocks[("p", t.rank)]))
        w.fill("p", t, s.pool.kv_bytes_view())
        s.publish("req-1", w.ids[("p", t.rank)].tolist())
        senders.append(s)
    d = w.decode[0]
    settings = load_receiver_settings(
        deadlines=DEADLINES,
        pool=_pool(d, w.num_blocks[("d", 0)]),
        limits={"max_fetches_in_flight": limit},
    )
    r = Receiver(settings, topology=d).start()
    daemons.receivers.append(r)
    w.fill("d", d, r.pool.kv_bytes_view())
    before = r.pool.kv_bytes_view().clone()
    h = r.fetch(
        "req-1",
        senders[0].endpoint,
        w.ids[("d", 0)].tolist(),
        sender_endpoints=[s.endpoint for s in senders],
        want_aux=False,
    )
    out = h.wait(WAIT_S)
    assert out is not None
    if limit == 1:
        assert (out.state, out.reason) == (RxState.FAILED, Reason.BUSY), out
        assert "reads 2 pieces" in out.detail
        assert r.stats.get("instance_fetches_busy") == 1
        assert torch.equal(r.pool.kv_bytes_view(), before)
        assert r.fetches_in_flight() == 0
    else:
        assert out.state is RxState.DONE, out
        assert torch.equal(r.pool.kv_bytes_view(), w.want[0])
        assert r.stats.get("instance_fetches_busy") == 0
