"""Scale-down without loss: a draining sender hands its unfetched requests to another one.

Real daemons (SIGTERM), real ZMQ, real NIXL (UCX over DRAM): the draining sender D
offers what no fetch touched to the sender T named in ``[handover] targets``; T fetches
each one it accepts into its reserved blocks (``adopt_blocks``) with kvxferd's receiver
core and publishes it again under the same id and token; a receiver that asks D is
redirected to T (a ``Moved`` message, or a ``moved`` Result). With no target it behaves
as before and says so. Daemons log JSON so each stderr line is read as fields.
"""

from __future__ import annotations

import re
import signal
import socket
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from kvxferd.config import load_receiver_settings
from kvxferd.engine.client import Client, EngineRejected
from kvxferd.engine.engine_protocol import EngineReason
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.receiver.moved import MovedTable
from kvxferd.transfer.sender.adopt import AdoptBlocks
from tests import test_daemon as td
from tests import test_drain as tdr
from tests.support.conditions import wait_until
from tests.support.peers import request_content

LAYERS, BLOCKS, BLOCK_BYTES = 2, 4, 16 << 10  # 128 KiB per request
POOL_BLOCKS = 512
N = 50
ADOPT_BLOCKS = 256  # T's top half: room for 64 requests of 4 blocks
CALL_S = 20.0

sock_dir = tdr.sock_dir
spawn = tdr.spawn


@pytest.fixture
def engines() -> Iterator[td.Engines]:
    e = td.Engines()
    yield e
    e.close()


def env(**extra: str | int) -> dict[str, str]:
    settings: dict[str, str | int] = {
        "KVXFERD_POOL__NUM_LAYERS": LAYERS,
        "KVXFERD_POOL__NUM_BLOCKS": POOL_BLOCKS,
        "KVXFERD_POOL__BLOCK_ELEMS": BLOCK_BYTES,
        "KVXFERD_DEADLINES__DRAIN_TIMEOUT_MS": 30_000,
        "KVXFERD_DEADLINES__SHUTDOWN_TIMEOUT_MS": 45_000,
        "KVXFERD_DEADLINES__KV_TRANSFER_TIMEOUT_MS": 20_000,
        "KVXFERD_SERVICE__LOG_JSON": "true",
    }
    return td.daemon_env(**{**settings, **extra})


def blocks_of(i: int) -> list[int]:
    return list(range(i * BLOCKS, (i + 1) * BLOCKS))


def content(rid: str) -> torch.Tensor:
    return request_content(rid, LAYERS, BLOCKS, BLOCK_BYTES)


def publish(ct: Client, pt: torch.Tensor, ids: list[str]) -> dict[str, str]:
    """Write each request's bytes into its blocks, publish it with a fetch token; the tokens."""
    tokens = {}
    for i, rid in enumerate(ids):
        pt[:, blocks_of(i)] = content(rid)
        tokens[rid] = ct.publish_for(rid, blocks_of(i), aux=rid.encode(), token=True).token
    return tokens


def fetch_all(
    cr: Client, pr: torch.Tensor, endpoint: str, ids: list[str], tokens: dict[str, str]
) -> None:
    """Fetch each request from ``endpoint``; every one done, byte-exact, aux included."""
    handles = [
        cr.fetch(rid, endpoint, blocks_of(i), token=tokens[rid]) for i, rid in enumerate(ids)
    ]
    deadline = time.monotonic() + CALL_S
    for i, (rid, h) in enumerate(zip(ids, handles, strict=True)):
        out = cr.wait(h, max(0.1, deadline - time.monotonic()))
        assert out is not None and out.state == "done", (rid, out)
        assert torch.equal(pr[:, blocks_of(i)], content(rid)), f"{rid}: bytes differ"
        assert out.aux == rid.encode(), (rid, out.aux)
        cr.close(h, 5.0)


def events(d: td.DaemonProcess) -> list[str]:
    return [str(e.get("event", "")) for e in tdr.log_lines(d)]


def wait_event(d: td.DaemonProcess, pattern: str, timeout: float) -> re.Match[str]:
    found: list[re.Match[str]] = []

    def seen() -> bool:
        found[:] = [m for e in events(d) if (m := re.search(pattern, e))]
        return bool(found)

    wait_until(seen, timeout, f"{d.name} logs {pattern!r}")
    return found[0]


def counter(d: td.DaemonProcess, family: str, **labels: str) -> float:
    fam = td.metrics(d.probe_port)[family]
    return float(
        sum(
            s.value
            for s in fam.samples
            if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items())
        )
    )


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_fifty_unfetched_requests_move_to_another_sender_and_the_drain_exits_0(
    spawn: td.Spawn, engines: td.Engines
) -> None:
    """50 requests published with tokens and unfetched at SIGTERM: D hands them to T, a receiver that asks D gets all 50 byte-exact from T, D exits 0 saying 50 moved, T's reserved blocks are free again, and a fetch at T with a wrong token is refused."""
    t = spawn("sender", "t", env(KVXFERD_HANDOVER__ADOPT_BLOCKS=ADOPT_BLOCKS))
    t.wait_ready()
    d = spawn(
        "sender",
        "d",
        env(
            KVXFERD_HANDOVER__TARGETS=f'["{t.endpoint}"]',
            KVXFERD_HANDOVER__REDIRECT_WINDOW_MS=3000,
        ),
    )
    r = spawn("receiver", "r", env())
    d.wait_ready(), r.wait_ready()
    cd, pd = engines.client(d)
    ctt, _ = engines.client(t)
    cr, pr = engines.client(r)
    # An engine publish naming a reserved block is refused.
    with pytest.raises(EngineRejected) as e:
        ctt.publish("reserved", [POOL_BLOCKS - 1])
    assert e.value.reason is EngineReason.BAD_BLOCKS, e.value
    # The receiver has talked to D before.
    warm = publish(cd, pd, ["warm-up"])
    fetch_all(cr, pr, d.endpoint, ["warm-up"], warm)
    ids = [f"req-{i}" for i in range(N)]
    tokens = publish(cd, pd, ids)
    t0 = d.signal(signal.SIGTERM)
    m = wait_event(d, r"^handover: (\d+) requests? moved \((\d+) bytes\) in ([0-9.]+) s", 60.0)
    moved_at = time.monotonic()
    assert int(m.group(1)) == N, m.group(0)
    # The moved requests keep their tokens at T.
    h = cr.fetch(ids[0], t.endpoint, blocks_of(N), token="wrong-token-0123456789")
    out = cr.wait(h, CALL_S)
    assert out is not None and out.state == "failed" and out.reason == "not_authorized", out
    cr.close(h, 5.0)
    # The receiver asks D's endpoint: all 50 come from T.
    t1 = time.monotonic()
    fetch_all(cr, pr, d.endpoint, ids, tokens)
    fetched_s = time.monotonic() - t1
    code, elapsed = d.wait_exit(60.0)
    assert code == 0, d.describe()
    last = tdr.last_event(d)
    assert re.match(
        r"^drain complete: 0 published requests never fetched, 0 transfers cut, 0 in doubt, "
        rf"{N} moved; exit 0",
        last,
    ), last
    assert counter(r, "kvxferd_moved_followed") + counter(r, "kvxferd_fetches_redirected") >= N
    assert counter(t, "kvxferd_handover_requests", result="adopted") == N
    wait_until(
        lambda: counter(t, "kvxferd_adopt_blocks_returned") == N * BLOCKS,
        10.0,
        "T's reserved blocks are free again",
    )
    assert counter(t, "kvxferd_adopt_blocks_taken") == N * BLOCKS
    print(
        f"\n[handover] {N} requests, {m.group(2)} bytes moved in {m.group(3)} s "
        f"(SIGTERM to moved: {moved_at - t0:.2f} s); fetched from T in {fetched_s:.2f} s; "
        f"D exited {code} after {elapsed:.2f} s"
    )


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_target_with_too_few_blocks_takes_some_and_the_rest_stay_with_the_draining_sender(
    spawn: td.Spawn, engines: td.Engines
) -> None:
    """T has room for 3 of 5: those 3 move, 2 stay with D; a receiver that never talked to D gets the moved ones by a moved Result redirect and the others from D, all byte-exact, and D exits 0 saying 3 moved."""
    t = spawn("sender", "t", env(KVXFERD_HANDOVER__ADOPT_BLOCKS=3 * BLOCKS))
    t.wait_ready()
    d = spawn("sender", "d", env(KVXFERD_HANDOVER__TARGETS=f'["{t.endpoint}"]'))
    r = spawn("receiver", "r", env())
    d.wait_ready(), r.wait_ready()
    cd, pd = engines.client(d)
    cr, pr = engines.client(r)
    ids = [f"part-{i}" for i in range(5)]
    tokens = publish(cd, pd, ids)
    d.signal(signal.SIGTERM)
    m = wait_event(d, r"^handover: (\d+) requests? moved", 60.0)
    assert int(m.group(1)) == 3, m.group(0)
    assert any(re.search(r"3 requests offered and taken, 2 kept here", e) for e in events(d))
    fetch_all(cr, pr, d.endpoint, ids, tokens)
    assert counter(r, "kvxferd_fetches_redirected") == 3
    code, _ = d.wait_exit(60.0)
    assert code == 0, d.describe()
    assert re.search(r"0 in doubt, 3 moved; exit 0", tdr.last_event(d)), tdr.last_event(d)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_target_whose_fetch_fails_frees_its_blocks_and_the_request_stays_with_the_drain(
    spawn: td.Spawn, engines: td.Engines
) -> None:
    """T takes 2 requests but its fetch from D is refused (its pool's blocks are another size): T counts them adopt_failed and its reserved blocks come back, D keeps them and serves them to a receiver during its drain, byte-exact, and exits 0 with nothing moved."""
    t = spawn(
        "sender",
        "t",
        env(KVXFERD_HANDOVER__ADOPT_BLOCKS=64, KVXFERD_POOL__BLOCK_ELEMS=BLOCK_BYTES // 2),
    )
    t.wait_ready()
    d = spawn("sender", "d", env(KVXFERD_HANDOVER__TARGETS=f'["{t.endpoint}"]'))
    r = spawn("receiver", "r", env())
    d.wait_ready(), r.wait_ready()
    cd, pd = engines.client(d)
    cr, pr = engines.client(r)
    ids = ["fail-0", "fail-1"]
    tokens = publish(cd, pd, ids)
    d.signal(signal.SIGTERM)
    wait_event(d, r"^handover: 2 requests offered and taken, 0 kept here", 60.0)
    wait_until(
        lambda: counter(t, "kvxferd_handover_requests", result="adopt_failed") == 2,
        30.0,
        "T's fetches failed",
    )
    wait_until(
        lambda: counter(t, "kvxferd_adopt_blocks_returned") == 2 * BLOCKS,
        10.0,
        "T's reserved blocks are free again",
    )
    assert counter(t, "kvxferd_handover_requests", result="adopted") == 0
    fetch_all(cr, pr, d.endpoint, ids, tokens)
    code, _ = d.wait_exit(60.0)
    assert code == 0, d.describe()
    last = tdr.last_event(d)
    assert re.match(
        r"^drain complete: 0 published requests never fetched, 0 transfers cut, 0 in doubt; exit 0",
        last,
    ), last


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_target_found_through_discovery_takes_the_requests(
    spawn: td.Spawn, engines: td.Engines, sock_dir: str
) -> None:
    """With no target configured and handover.discover on, D hands its requests to the sender its discovery file lists (and not to itself), and a receiver gets them byte-exact via D's endpoint."""
    t = spawn("sender", "t", env(KVXFERD_HANDOVER__ADOPT_BLOCKS=16, KVXFERD_NAME="tx-t"))
    t.wait_ready()
    peers = f"{sock_dir}/peers.toml"
    with open(peers, "w") as f:
        # D's own record first, at an address nothing answers: asking it would take the
        # whole reply_timeout_ms.
        for name, endpoint in [("tx-d", "tcp://127.0.0.1:1"), ("tx-t", t.endpoint)]:
            f.write(f'[[peers]]\nrole = "sender"\nname = "{name}"\n')
            f.write(f'endpoints = {{ listen = "{endpoint}" }}\n')
    d = spawn(
        "sender",
        "d",
        env(
            KVXFERD_NAME="tx-d",
            KVXFERD_HANDOVER__DISCOVER="true",
            KVXFERD_DISCOVERY__BACKEND="static",
            KVXFERD_DISCOVERY__STATIC_FILE=peers,
            KVXFERD_HANDOVER__REPLY_TIMEOUT_MS=25_000,
        ),
    )
    r = spawn("receiver", "r", env())
    d.wait_ready(), r.wait_ready()
    cd, pd = engines.client(d)
    cr, pr = engines.client(r)
    ids = ["disc-0", "disc-1"]
    tokens = publish(cd, pd, ids)
    d.signal(signal.SIGTERM)
    m = wait_event(d, r"^handover: (\d+) requests? moved", 20.0)
    assert int(m.group(1)) == 2, m.group(0)
    fetch_all(cr, pr, d.endpoint, ids, tokens)
    assert counter(t, "kvxferd_handover_requests", result="adopted") == 2
    code, _ = d.wait_exit(60.0)
    assert code == 0, d.describe()


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_fetch_that_comes_while_its_request_moves_is_held_then_sent_to_the_new_sender(
    spawn: td.Spawn, engines: td.Engines
) -> None:
    """A receiver asks D for a request the target is taking: D holds the fetch (nothing attached, no duplicate), and once the target's fetch of it is done answers moved, and the receiver follows to the target (here the test plays the target: its ROUTER takes the Handover, an in-process receiver core fetches the request)."""
    target = zmq.Context.instance().socket(zmq.ROUTER)
    target.linger = 0
    target.bind("tcp://127.0.0.1:*")
    target_ep = target.getsockopt_string(zmq.LAST_ENDPOINT)
    d = spawn(
        "sender",
        "d",
        # the target's fetch must come within reply_timeout_ms: room for a loaded host
        env(
            KVXFERD_HANDOVER__TARGETS=f'["{target_ep}"]', KVXFERD_HANDOVER__REPLY_TIMEOUT_MS=30_000
        ),
    )
    r = spawn("receiver", "r", env())
    d.wait_ready(), r.wait_ready()
    mover = Receiver(
        load_receiver_settings(
            pool={
                "num_layers": LAYERS,
                "num_blocks": POOL_BLOCKS,
                "block_elems": BLOCK_BYTES,
                "dtype": "uint8",
            },
            result_endpoint="tcp://127.0.0.1:0",
        )
    ).start()
    try:
        cd, pd = engines.client(d)
        cr, pr = engines.client(r)
        tokens = publish(cd, pd, ["held-0"])
        d.signal(signal.SIGTERM)
        assert target.poll(20_000), "no Handover came"
        routing_id, frame = target.recv_multipart()
        handover = wire.decode_to_sender([frame], 1 << 22)
        assert isinstance(handover, wire.Handover), handover
        assert [i.request_id for i in handover.items] == ["held-0"]
        reply = wire.HandoverReply(receiver_id=mover.receiver_id, accepted=["held-0"])
        target.send_multipart([routing_id, wire.encode(reply)])
        wait_event(d, r"^handover: 1 request offered and taken, 0 kept here", 20.0)
        # The receiver asks D while the move is under way: held, not attached.
        h = cr.fetch("held-0", d.endpoint, blocks_of(0), token=tokens["held-0"])
        wait_until(
            lambda: counter(d, "kvxferd_fetches_held_moving") == 1, 10.0, "D holds the fetch"
        )
        assert cr.poll(h) is None
        # The target's fetch: done, so the move is; the held fetch is answered moved.
        got = mover.fetch("held-0", d.endpoint, blocks_of(0), token=tokens["held-0"])
        out = got.wait(CALL_S)
        assert out is not None and out.state == "done", out
        assert target.poll(20_000), "the receiver did not follow the move"
        _, frame = target.recv_multipart()
        register = wire.decode_to_sender([frame], 1 << 22)
        assert isinstance(register, wire.Register), register
        assert counter(r, "kvxferd_fetches_redirected") == 1
        cr.cancel(h)
        code, _ = d.wait_exit(60.0)
        assert code == 0, d.describe()
        assert re.search(r"0 in doubt, 1 moved; exit 0", tdr.last_event(d)), tdr.last_event(d)
    finally:
        mover.shutdown(5.0)
        target.close()


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_with_no_target_reachable_the_drain_behaves_as_before_and_says_so(
    spawn: td.Spawn, engines: td.Engines
) -> None:
    """The only target does not answer: the handover says no target was reachable, the unfetched requests are dropped at drain_timeout_ms as before, and D exits 3."""
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    d = spawn(
        "sender",
        "d",
        env(
            KVXFERD_HANDOVER__TARGETS=f'["{dead}"]',
            KVXFERD_HANDOVER__REPLY_TIMEOUT_MS=500,
            KVXFERD_DEADLINES__DRAIN_TIMEOUT_MS=1500,
            KVXFERD_DEADLINES__SHUTDOWN_TIMEOUT_MS=4000,
        ),
    )
    d.wait_ready()
    cd, pd = engines.client(d)
    publish(cd, pd, ["kept-0", "kept-1"])
    d.signal(signal.SIGTERM)
    code, _ = d.wait_exit(10.0)
    assert code == 3, d.describe()
    assert any(
        "0 requests offered and taken, 2 kept here (no target reachable)" in e for e in events(d)
    )
    assert tdr.sender_counts(d) == ("incomplete", 2, 0, 0, 3)


# -- the tables, on their own --------------------------------------------------------------


def test_the_moved_table_follows_an_entry_until_its_ttl_and_stays_bounded() -> None:
    """A learnt move redirects fetches toward the old endpoint only, until its TTL; the oldest entry goes first beyond the bound."""
    t = MovedTable(max_entries=2)
    t.learn("tcp://d:1", "a", "tcp://t:2", 30.0)
    t.learn("tcp://d:1", "b", "tcp://t:2", 0.05)
    assert t.target("tcp://d:1", "a") == "tcp://t:2"
    assert t.target("tcp://other:1", "a") is None  # only the sender that said so
    wait_until(lambda: t.target("tcp://d:1", "b") is None, 5.0, "the short entry expires")
    t.learn("tcp://d:1", "c", "tcp://t:2", 30.0)
    t.learn("tcp://d:1", "e", "tcp://t:2", 30.0)
    assert len(t) == 2
    assert t.target("tcp://d:1", "a") is None  # the oldest went first
    assert t.target("tcp://d:1", "e") == "tcp://t:2"
    t.learn("tcp://t:2", "x", "tcp://t:2", 30.0)  # a move to itself is no move
    assert t.target("tcp://t:2", "x") is None


def test_reserved_blocks_are_taken_whole_and_come_back() -> None:
    """The reserved blocks are handed out only when all of a request's blocks are free, never twice, and come back."""
    b = AdoptBlocks(first=100, count=8)
    one = b.take(5)
    assert one is not None and sorted(one.tolist()) == [100, 101, 102, 103, 104]
    assert b.take(4) is None  # 3 left: nothing partial
    two = b.take(3)
    assert two is not None and set(two.tolist()).isdisjoint(one.tolist())
    assert b.free == 0
    b.give_back(one)
    assert b.free == 5
