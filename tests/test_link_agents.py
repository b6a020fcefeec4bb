"""A receiver's NIXL agent per sender link: a torn-down agent takes no write, so its doubts end.

Real NIXL over UCX's TCP transport in one process: a sender's data plane writes into
a link agent; after the teardown every later write toward it fails and not one byte
lands, although the sender still holds the agent's metadata and tries for a while.
The link agent runs NIXL's progress thread here, so an agent that were left alive
would take those writes without anyone polling it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvxferd.config import DataPlaneSettings, PoolSettings
from kvxferd.stats import Stats
from kvxferd.transfer.dataplane import NixlDataPlane, wait_xfer
from kvxferd.transfer.layout import Descs
from kvxferd.transfer.link_agents import LinkAgents, teardown_proves
from kvxferd.transfer.pool import KvPool

pytestmark = pytest.mark.timeout(60)

BLOCKS, LAYERS, BLOCK_ELEMS = 8, 2, 1024  # 2 KiB blocks of float16
TRIES_S = 2.0  # the sender keeps trying this long after the teardown


@pytest.mark.parametrize(
    ("tls", "proves"),
    [
        (None, False),  # UCX's default: every transport, cma among them
        ("", False),
        ("tcp", True),
        ("rc,ud,tcp", True),
        ("rc_x,dc_x,posix,sysv,self,cuda_copy", True),
        ("^cma,knem,xpmem,cuda_ipc,rocm_ipc,ze_ipc", True),
        ("^sm,cuda,rocm,ze", True),
        ("^cma,knem,xpmem", False),  # cuda_ipc left in
        ("shm", False),
        ("sm,tcp", False),
        ("tcp,cma", False),
        ("all", False),
        ("cuda", False),
        ("tcp,some_new_transport", False),  # not known here: no proof claimed
        ("\\tcp", True),
    ],
)
def test_which_transports_a_teardown_revokes(tls: str | None, proves: bool) -> None:
    assert teardown_proves(tls) is proves


def _pool(tag: str) -> KvPool:
    return KvPool(
        PoolSettings(
            num_layers=LAYERS,
            num_blocks=BLOCKS,
            block_elems=BLOCK_ELEMS,
            dtype="float16",
            aux_slots=2,
            aux_slot_bytes=256,
        ),
        owner=tag,
    )


class _World:
    """A sender's data plane and a receiver's link agents, over UCX's TCP transport."""

    def __init__(self) -> None:
        tag = f"{time.monotonic_ns()}"
        self.src, self.dst = _pool("latest-tx"), _pool("latest-rx")
        self.spare, self.torn = threading.Event(), threading.Event()
        self.torn_gens: list[int] = []

        def on_torn(gen: int) -> None:
            self.torn_gens.append(gen)
            self.torn.set()

        self.stats = Stats()
        self.agents = LinkAgents(
            f"latest-rx-{tag}",
            DataPlaneSettings(progress_thread=True),
            self.dst,
            self.stats,
            on_spare=self.spare.set,
            on_torn=on_torn,
        )
        self.tx = NixlDataPlane(f"latest-tx-{tag}", DataPlaneSettings(), self.src)
        src = self.src.kv_bytes_view()
        src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8))

    def descs(self, pool: KvPool, block: int) -> Descs:
        size = pool.layout.block_bytes
        return np.array([(pool.kv_base + block * size, size, 0)], dtype=np.int64)

    def write(self, peer: str, block: int, deadline_s: float) -> str:
        """Post a WRITE of our block ``block`` to theirs; its end state (or the raise)."""
        try:
            xfer, state = self.tx.post_write(
                peer, self.descs(self.src, block), self.descs(self.dst, block), "DRAM", "DRAM"
            )
        except Exception as e:
            return f"raised {type(e).__name__}"
        deadline = time.monotonic() + deadline_s
        end: str = state
        while end == "PROC" and time.monotonic() < deadline:
            got = wait_xfer(xfer, "PROC", time.monotonic() + 0.001)
            end = xfer.poll() if got == "STALLED" else got
        xfer.release()
        return end

    def block(self, pool: KvPool, block: int) -> torch.Tensor:
        """The bytes of ``block`` (bytes: random float16 bits hold NaNs, never equal)."""
        return pool.kv.view(LAYERS * BLOCKS, -1)[block].view(torch.uint8).clone()

    def close(self) -> None:
        self.tx.close()
        self.agents.close()
        self.src.close()
        self.dst.close()


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[_World]:
    monkeypatch.setenv("UCX_TLS", "tcp")  # undone after the test: other tests keep theirs
    w = _World()
    yield w
    w.close()


def test_a_torn_down_link_agent_takes_no_write(world: _World) -> None:
    """Writes land through a linked agent; after its teardown none does, whatever the sender tries."""
    w = world
    assert w.agents.proves
    agent = w.agents.take()
    assert agent is not None and agent.name.endswith(".l1")
    peer = w.tx.add_peer(agent.metadata)
    assert peer == agent.name
    assert w.write(peer, 0, 10) == "DONE"
    assert torch.equal(w.block(w.dst, 0), w.block(w.src, 0))  # linked: it lands

    marker = torch.full_like(w.block(w.dst, 1), 7)
    w.dst.kv.view(LAYERS * BLOCKS, -1)[1].view(torch.uint8).copy_(marker)
    w.agents.tear_down(agent)
    assert w.torn.wait(20), "the agent was not torn down"
    assert w.torn_gens == [agent.gen]
    assert w.stats.get("link_agents_torn_down") == 1

    ends: list[str] = []
    until = time.monotonic() + TRIES_S
    while time.monotonic() < until:
        ends.append(w.write(peer, 1, 0.5))
        if ends[-1] == "DONE":
            break
    assert "DONE" not in ends, ends
    assert ends, "no write was tried"
    assert torch.equal(w.block(w.dst, 1), marker), "a write landed"


def test_each_link_gets_its_own_agent_and_spares_are_made_again(world: _World) -> None:
    """Two links, two agents (their own names and metadata); a spare is made after each take."""
    w = world
    a = w.agents.take()
    assert a is not None
    assert w.spare.wait(20), "no spare made after the first take"
    w.spare.clear()
    b = w.agents.take()
    assert b is not None
    assert (a.gen, b.gen) == (1, 2) and a.name != b.name and a.metadata != b.metadata
    assert w.agents.linked() == 2
    peer = w.tx.add_peer(b.metadata)
    assert w.write(peer, 2, 10) == "DONE"  # the second link's agent takes writes
    assert torch.equal(w.block(w.dst, 2), w.block(w.src, 2))
    w.agents.tear_down(a)
    assert w.torn.wait(20)
    assert w.agents.linked() == 1
    assert w.write(peer, 3, 10) == "DONE"  # the other link is untouched by the teardown
    assert torch.equal(w.block(w.dst, 3), w.block(w.src, 3))
