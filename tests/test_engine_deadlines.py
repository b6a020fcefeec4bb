"""Engine calls against a daemon that was frozen: real ``python -m kvxferd`` children, real SIGSTOP.

The engine's promise (docs/engine-api.md, "After a timeout"): a call whose
deadline passed before the daemon read it did not happen, and a retry with the
same key is safe. Here the sender daemon is stopped while the engine publishes,
so the publish reaches it only after the engine gave up; the engine then reuses
its source blocks, and the receiver must get the new bytes, never the old ones.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from kvxferd.engine.client import Client, EngineUnavailable
from kvxferd.engine.engine_protocol import EngineReason
from tests import test_daemon
from tests.support.conditions import wait_until
from tests.test_daemon import CALL_S, Engines, Spawn, daemon_env, gauge

pytestmark = pytest.mark.integration

# The real-daemon fixtures of tests/test_daemon.py: children SIGCONTed and SIGKILLed at teardown.
sock_dir = test_daemon.sock_dir
daemons = test_daemon.daemons
engines = test_daemon.engines

LAYERS, BLOCKS, BLOCK_BYTES = 2, 64, 16 << 10
FROZEN_CALL_S = 0.5  # the engine's bound on the publish that meets a frozen daemon


def stopped(pid: int) -> bool:
    """Every thread of ``pid`` is stopped. kill(SIGSTOP) returns before the threads stop:
    one running on the other core answered a call sent just after it."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return all(state in ("T", "t") for state in states)


def small_env() -> dict[str, str]:
    return daemon_env(
        KVXFERD_POOL__NUM_BLOCKS=BLOCKS,
        KVXFERD_POOL__BLOCK_ELEMS=BLOCK_BYTES,
        KVXFERD_DEADLINES__KV_TRANSFER_TIMEOUT_MS=30_000,
    )


def content(seed: int, blocks: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (LAYERS, blocks, BLOCK_BYTES), generator=g).to(torch.uint8)


def test_publish_read_after_its_deadline_by_a_frozen_daemon_never_happens(
    daemons: Spawn, engines: Engines
) -> None:
    """A publish that a SIGSTOPped sender reads after the engine gave up is not executed: no session, the old bytes never reach the receiver, and the retry makes one session."""
    tx, rx = daemons("sender", "tx", small_env()), daemons("receiver", "rx", small_env())
    tx.wait_ready(), rx.wait_ready()
    ct, pt = engines.client(tx)
    cr, pr = engines.client(rx)
    src, dst = [0, 1], [2, 3]

    # Warm up: the receiver registers with the sender, so the later fetch needs no handshake.
    pt[:, src] = content(1, 2)
    h = ct.publish("warm", src)
    out = cr.wait(cr.fetch("warm", tx.endpoint, dst), CALL_S)
    assert out is not None and out.ok, out
    assert ct.close(h, CALL_S)

    rid = "frozen-0"
    g = cr.fetch(rid, tx.endpoint, dst)  # waits on the sender for its publish
    old, new = content(2, 2), content(3, 2)
    pt[:, src] = old
    short = Client(tx.engine_socket, timeout_s=FROZEN_CALL_S)
    try:
        tx.signal(signal.SIGSTOP)
        try:
            wait_until(lambda: stopped(tx.pid), 5, "the sender daemon stopped")
            with pytest.raises(EngineUnavailable) as ei:
                short.publish(rid, src)
            assert ei.value.reason is EngineReason.TIMEOUT
        finally:
            tx.signal(signal.SIGCONT)
        # The same connection: the daemon reads the late publish before this lookup.
        short.timeout_s = CALL_S
        assert short.lookup(rid) is None, "the late publish ran"
    finally:
        short.close_client()
    assert gauge(tx.probe_port, "kvxferd_sessions") == 0

    # The publish did not happen: the engine may reuse its blocks, then publish again.
    pt[:, src] = new
    h = ct.publish(rid, src)
    assert ct.publish(rid, src) == h  # a second retry: the same handle, still one session
    assert gauge(tx.probe_port, "kvxferd_sessions") == 1
    out = cr.wait(g, CALL_S)
    assert out is not None and out.ok, out
    assert torch.equal(pr[:, dst], new), "the receiver got bytes of the publish that timed out"
    assert ct.close(h, CALL_S) and cr.close(g, CALL_S)
