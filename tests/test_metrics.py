"""/metrics exports every counter: the catalogue matches the source, and a real daemon pair's families move.

Two kinds of test:

* **The catalogue** (kvxferd/stats.py): an ``ast`` scan of kvxferd/ finds every
  ``stats.add(...)`` / ``stats.observe(...)`` and fails on a name (a literal, or an
  f-string's fixed prefix and suffix) that is not catalogued, so a new counter
  cannot be added without being exported; the collector is then shown to export
  every catalogued counter of each role, with its bounded label values.
* **A real pair**: ``python -m kvxferd sender|receiver`` children (real ZMQ, real
  NIXL, the engine gateway on an ipc:// socket), a few transfers, a fetch nobody
  published (the sender expires it), hostile frames from a raw DEALER; then /metrics is
  scraped over HTTP and parsed with prometheus_client, and each new family must be
  present and the counters the scenario moved must have moved.
"""

from __future__ import annotations

import ast
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvxferd.transfer import protocol as wire
from tests.support.conditions import wait_until
from tests.test_daemon import DaemonProcess, Engines, http_get
from tests.test_gateway import RawEngine

PACKAGE = Path(__file__).resolve().parent.parent / "kvxferd"
STARTUP_S = 60.0  # a child imports torch and NIXL and creates an agent
CALL_S = 10.0
WAIT_S = 10.0

# Which component's Stats a file's ``stats.add`` bumps (guard.py: every component's).
COMPONENTS: dict[str, tuple[str, ...]] = {
    "transfer/sender/api.py": ("sender",),
    "transfer/sender/listener.py": ("sender",),
    "transfer/sender/admission.py": ("sender",),
    "transfer/sender/published.py": ("sender",),
    "transfer/sender/drain.py": ("sender",),
    "transfer/sender/streams.py": ("sender",),
    "transfer/sender/handover.py": ("sender",),
    "transfer/sender/adopt.py": ("sender",),
    "transfer/worker.py": ("sender",),
    "transfer/worker_writes.py": ("sender",),
    "transfer/worker_outbox.py": ("sender",),
    "transfer/dataplane.py": ("sender",),  # only the sender hands its data plane a Stats
    "transfer/path_moves.py": ("sender",),  # the data plane's moves, with its Stats
    "transfer/peer_agents.py": ("sender",),
    "transfer/link_probes.py": ("sender",),
    "transfer/receiver/core.py": ("receiver",),
    "transfer/receiver/fetches.py": ("receiver",),
    "transfer/receiver/groups.py": ("receiver",),
    "transfer/receiver/in_doubt.py": ("receiver",),
    "transfer/receiver/links.py": ("receiver",),
    "transfer/receiver/messages.py": ("receiver",),
    "transfer/receiver/digests.py": ("receiver",),
    "transfer/receiver/shutdown.py": ("receiver",),
    "transfer/receiver/moved.py": ("receiver",),
    "transfer/link_agents.py": ("receiver",),
    "engine/gateway.py": ("gateway",),
    "engine/calls.py": ("gateway",),
    "engine/waits.py": ("gateway",),
    "engine/handles.py": ("gateway",),
    "transfer/guard.py": ("sender", "receiver", "gateway"),
    "auth.py": ("sender", "receiver", "gateway"),
}


# -- the catalogue ---------------------------------------------------------------------------


def _stats_calls(tree: ast.AST) -> Iterator[tuple[str, int, ast.expr]]:
    """(method, line, first argument) of each ``<...>stats.add/observe(...)`` call."""
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("add", "observe")
        ):
            continue
        owner = node.func.value
        name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        if name in ("stats", "_stats") and node.args:
            yield node.func.attr, node.lineno, node.args[0]


def _names(arg: ast.expr) -> Iterator[tuple[str, str | None]]:
    """The counter names an argument can take: (literal, None) or (f-string prefix, suffix)."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        yield arg.value, None
    elif isinstance(arg, ast.IfExp):
        yield from _names(arg.body)
        yield from _names(arg.orelse)
    elif isinstance(arg, ast.JoinedStr):
        parts = arg.values
        head = parts[0].value if parts and isinstance(parts[0], ast.Constant) else ""
        tail = parts[-1].value if len(parts) > 1 and isinstance(parts[-1], ast.Constant) else ""
        holes = sum(1 for p in parts if isinstance(p, ast.FormattedValue))
        yield str(head), str(tail) if holes == 1 else f"<{holes} placeholders>"
    else:
        yield f"<not a literal: {ast.unparse(arg)}>", None


def test_every_counter_bumped_in_the_source_is_in_the_catalogue() -> None:
    """Each ``stats.add``/``observe`` name in kvxferd/ (literal, or an f-string's prefix and suffix) is catalogued for its component."""
    from kvxferd.stats import SAMPLES, find_counter, find_family

    missing, seen = [], 0
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for method, line, arg in _stats_calls(ast.parse(path.read_text(), str(path))):
            components = COMPONENTS.get(rel)
            if components is None:
                missing.append(f"{rel}:{line}: add {rel} to COMPONENTS (whose Stats is it?)")
                continue
            for name, suffix in _names(arg):
                seen += 1
                for component in components:
                    if method == "observe":
                        ok = suffix is None and name in SAMPLES.get(component, ())
                    elif suffix is None:
                        ok = find_counter(component, name) is not None
                    else:
                        ok = find_family(component, name, suffix) is not None
                    if not ok:
                        shown = name if suffix is None else f"{name}{{...}}{suffix}"
                        missing.append(f"{rel}:{line}: {method}({shown!r}) for {component}")
    assert seen >= 80, f"the scan found only {seen} names: is it still reading the calls?"
    assert not missing, "not in kvxferd/stats.py's catalogue:\n" + "\n".join(missing)


def test_catalogue_label_values_are_the_enums_and_tags_they_come_from() -> None:
    """Each family's bounded label values are exactly the enum or message tags its f-string takes."""
    from kvxferd.engine import engine_protocol as ep
    from kvxferd.errors import Reason
    from kvxferd.stats import find_family
    from kvxferd.transfer.session import RxState, SliceState

    def values(component: str, prefix: str, suffix: str = "") -> set[str]:
        spec = find_family(component, prefix, suffix)
        assert spec is not None, (component, prefix)
        return set(spec.values)

    def tags(union: Any) -> set[str]:
        return {t.__struct_config__.tag for t in union.__args__}

    reasons = {r.value for r in Reason}
    for role in ("sender", "receiver"):
        assert values(role, "rejected_") == reasons
    assert values("receiver", "fetch_refused_") == reasons
    assert values("receiver", "failed_") == reasons
    assert values("receiver", "peer_rejected_") == reasons
    assert values("gateway", "rejected_") == {r.value for r in ep.EngineReason}
    assert values("gateway", "calls_") == tags(ep.ToGateway)
    assert values("sender", "sent_") == {"result", "cancel_ack"}
    terminal = {SliceState.DONE, SliceState.FAILED, SliceState.IN_DOUBT}
    assert values("sender", "slices_") == {s.value for s in terminal}
    assert values("receiver", "fetches_") == {s.value for s in RxState} - {"requested"}


def test_each_stats_name_has_one_spec_and_each_family_one_meaning_per_component() -> None:
    """Within a component no plain name is also a family's value, and no two specs share a family."""
    from kvxferd.stats import CATALOGUE, find_counter, specs_for

    for component in ("sender", "receiver", "gateway"):
        specs = specs_for(component)
        metrics = [s.metric_for(component) for s in specs]
        assert len(metrics) == len(set(metrics)), (component, sorted(metrics))
        for spec in specs:
            if not spec.label:
                assert find_counter(component, spec.key) is spec, (component, spec.key)
                continue
            for v in spec.values:
                assert find_counter(component, spec.stats_key(v)) is spec, (component, spec.key, v)
    assert all(spec.help and spec.components for spec in CATALOGUE)


def _collect(snapshot: Any) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    from kvxferd.service.metrics import SnapshotCollector

    class Fixed:
        def liveness(self) -> tuple[bool, str]:
            return True, ""

        def readiness(self) -> tuple[bool, list[str]]:
            return True, []

        def snapshot(self) -> Any:
            return snapshot

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(Fixed(), {"version": "0"}))
    return generate_latest(registry).decode()


@pytest.mark.parametrize("role", ["sender", "receiver"])
def test_every_catalogued_counter_is_exported_for_its_role(role: str) -> None:
    """A snapshot with no counts still exports every catalogued counter of the role and of its gateway, each label value once, zero included."""
    from kvxferd.service.metrics import GatewayReading, Snapshot
    from kvxferd.stats import CATALOGUE

    snap = Snapshot(
        role=role,
        stats={},
        sessions_by_state={},
        queue_depths=[0, 0],
        writes_in_flight=0,
        peers=0,
        gateway=GatewayReading(stats={}, handles=3, calls_in_flight=1),
    )
    text = _collect(snap)
    names = re.findall(r"^# TYPE (\S+) ", text, re.M)
    assert len(names) == len(set(names)), "a family is exported twice"
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for spec in CATALOGUE:
        for component in spec.components:
            if component not in (role, "gateway"):
                continue
            fam = fams.get(spec.metric_for(component))
            assert fam is not None, f"{spec.key} ({component}) not exported"
            assert fam.type == "counter", spec.key
            if spec.label:
                got = {s.labels.get(spec.label) for s in fam.samples if s.name.endswith("_total")}
                want = set(spec.values) if spec.values else {"0", "1"}  # workers: queue_depths
                assert got == want, (spec.key, got)
    assert fams["kvxferd_gateway_handles"].samples[0].value == 3
    assert fams["kvxferd_gateway_calls_in_flight"].samples[0].value == 1


# -- in-flight states and reclaims, driven step by step ------------------------------------------


POOL = dict(num_layers=2, num_blocks=16, block_elems=16, aux_slots=4, aux_slot_bytes=64)


@pytest.fixture
def stalling_pair(request: pytest.FixtureRequest) -> Any:
    """A Sender (writes stall after 300 ms) and a Receiver on data planes the test drives."""
    from kvxferd.config import load_receiver_settings, load_sender_settings
    from kvxferd.testing import ControlledDataPlane
    from kvxferd.transfer.receiver import Receiver
    from kvxferd.transfer.sender import Sender

    deadlines = dict(drain_timeout_ms=500, shutdown_timeout_ms=3000, xfer_stall_timeout_ms=300)
    dp = ControlledDataPlane("mx-tx")
    sx = Sender(
        load_sender_settings(
            name="mx-tx", listen="tcp://127.0.0.1:0", pool=POOL, deadlines=deadlines
        ),
        dataplane=dp,
    ).start()
    request.addfinalizer(lambda: sx.shutdown(timeout=3))
    rx = Receiver(
        load_receiver_settings(
            name="mx-rx",
            result_endpoint="tcp://127.0.0.1:0",
            pool=POOL,
            deadlines=dict(drain_timeout_ms=500, shutdown_timeout_ms=2000),
        ),
        dataplane=ControlledDataPlane("mx-rx"),
    ).start()
    request.addfinalizer(lambda: rx.shutdown(timeout=3))
    return sx, rx, dp


def test_a_stalled_write_shows_as_writing_then_in_doubt_and_its_reclaim_is_counted(
    stalling_pair: Any,
) -> None:
    """A write is ``writing``, then after its stall ``in_doubt`` on both sides (aux slot quarantined, oldest age growing); when NIXL lets go, both count the reclaim and the gauges return to zero."""
    from kvxferd.service.probes import ReceiverProbe, SenderProbe

    sx, rx, dp = stalling_pair
    tx_probe, rx_probe = SenderProbe(sx, sx.settings), ReceiverProbe(rx, rx.settings)
    sx.publish("mx-stall", [1], aux=b"aux")
    h = rx.fetch("mx-stall", sx.endpoint, [2])
    xfer = dp.wait_posted(1)
    snap = tx_probe.snapshot()
    assert snap.in_flight == {"parked": 0, "queued": 0, "writing": 1, "in_doubt": 0}
    assert snap.oldest_in_flight_s > 0
    assert rx_probe.snapshot().in_flight == {"requested": 1, "fenced": 0, "in_doubt": 0}
    out = h.wait(WAIT_S)  # the stall: the sender reports the slice in doubt
    assert out is not None and out.state.value == "failed", out
    wait_until(lambda: rx.in_doubt() == 1, WAIT_S, "the fetch in doubt on the receiver")
    snap = tx_probe.snapshot()
    assert snap.in_flight["in_doubt"] == 1 and snap.in_flight["writing"] == 0
    assert snap.oldest_in_flight_s >= 0.3  # the session ended, its write did not
    rsnap = rx_probe.snapshot()
    assert rsnap.in_flight == {"requested": 0, "fenced": 0, "in_doubt": 1}
    assert rsnap.aux_slots == {"free": 3, "in_use": 0, "quarantined": 1}
    fams = {f.name: f for f in text_string_to_metric_families(_collect(rsnap))}
    assert value(fams, "kvxferd_aux_slots", state="quarantined") == 1
    assert value(fams, "kvxferd_fetches_in_doubt") == 1
    assert value(fams, "kvxferd_aux_slots_quarantined") == 1
    assert value(fams, "kvxferd_transfers_in_flight", state="in_doubt") == 1

    xfer.finish(True)  # NIXL lets go: the sender tells the receiver, both reclaim
    wait_until(lambda: rx.in_doubt() == 0, WAIT_S, "the in-doubt fetch resolved")
    fams = {f.name: f for f in text_string_to_metric_families(_collect(tx_probe.snapshot()))}
    assert value(fams, "kvxferd_writes_stalled") == 1
    assert value(fams, "kvxferd_in_doubt_resolved") == 1
    assert value(fams, "kvxferd_transfers_in_flight") == 0
    assert value(fams, "kvxferd_oldest_in_flight_seconds") == 0
    assert value(fams, "kvxferd_outcomes", outcome="in_doubt") == 1
    fams = {f.name: f for f in text_string_to_metric_families(_collect(rx_probe.snapshot()))}
    assert value(fams, "kvxferd_in_doubt_resolved") == 1
    assert value(fams, "kvxferd_aux_slots_released") == 1
    assert value(fams, "kvxferd_aux_slots", state="quarantined") == 0
    assert value(fams, "kvxferd_transfers_in_flight") == 0
    assert hist_count(fams, "kvxferd_peer_end_to_end_seconds", peer=sx.endpoint) == 1


# -- a real daemon pair ---------------------------------------------------------------------------


def pair_env() -> dict[str, str]:
    """A small, fast pair: 2 MiB pool, one worker, short deadlines."""
    env = {
        "KVXFERD_POOL__NUM_LAYERS": 2,
        "KVXFERD_POOL__NUM_BLOCKS": 32,
        "KVXFERD_POOL__BLOCK_ELEMS": 32 << 10,
        "KVXFERD_POOL__DTYPE": "uint8",
        "KVXFERD_NUM_THREADS": 1,
        "KVXFERD_DEADLINES__DRAIN_TIMEOUT_MS": 1000,
        "KVXFERD_DEADLINES__SHUTDOWN_TIMEOUT_MS": 3000,
        "KVXFERD_DEADLINES__KV_TRANSFER_TIMEOUT_MS": 8000,
        "KVXFERD_DEADLINES__CANCEL_FENCE_MS": 2000,
        # A fetch of a request never published is expired by the sender after this, long
        # before its own timeout (8 s): the outcome is failed/expired, never a race.
        "KVXFERD_DEADLINES__PENDING_FETCH_TTL_MS": 2000,
    }
    return {k: str(v) for k, v in env.items()}


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Any:
    """A ready sender and receiver daemon; both SIGKILLed and reaped in teardown."""
    sock_dir = tempfile.mkdtemp(prefix="km")  # short: an ipc path must fit in sockaddr_un
    request.addfinalizer(lambda: shutil.rmtree(sock_dir, ignore_errors=True))
    tx = DaemonProcess("sender", "tx", sock_dir, pair_env(), ["--listen", "tcp://127.0.0.1:0"])
    rx = DaemonProcess("receiver", "rx", sock_dir, pair_env(), [])
    request.addfinalizer(tx.kill)
    request.addfinalizer(rx.kill)
    tx.wait_ready(STARTUP_S), rx.wait_ready(STARTUP_S)
    return tx, rx


@pytest.fixture
def engines() -> Iterator[Engines]:
    e = Engines()
    yield e
    e.close()


def scrape(port: int) -> dict[str, Any]:
    status, body = http_get(port, "/metrics")
    assert status == 200, body
    return {f.name: f for f in text_string_to_metric_families(body)}


def value(fams: dict[str, Any], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples (``_total`` for a counter) whose labels include ``labels``."""
    fam = fams[name]
    want = {"counter": name + "_total", "gauge": name}.get(fam.type, name)
    return float(
        sum(
            s.value
            for s in fam.samples
            if s.name == want and all(s.labels.get(k) == v for k, v in labels.items())
        )
    )


def hist_count(fams: dict[str, Any], name: str, **labels: str) -> float:
    return float(
        sum(
            s.value
            for s in fams[name].samples
            if s.name == name + "_count" and all(s.labels.get(k) == v for k, v in labels.items())
        )
    )


def raw_dealer(endpoint: str) -> zmq.Socket[bytes]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(WAIT_S * 1000))
    sock.connect(endpoint)
    return sock


def moved(port: int, check: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
    """Scrape until ``check`` holds (the daemon counts asynchronously); the last scrape."""
    last: dict[str, Any] = {}

    def ok() -> bool:
        nonlocal last
        last = scrape(port)
        return check(last)

    wait_until(ok, WAIT_S, what, poll=0.05)
    return last


@pytest.mark.integration
def test_daemon_pair_exports_every_family_and_the_counters_move(
    pair: tuple[DaemonProcess, DaemonProcess], engines: Engines
) -> None:
    """After transfers, a fetch of a request never published and hostile frames, each new family is on both daemons' /metrics and the counters they caused moved."""
    tx, rx = pair
    ct, pt = engines.client(tx)
    cr, _pr = engines.client(rx)
    # 1. three transfers that succeed
    ids = [f"mx-ok-{i}" for i in range(3)]
    gets = []
    for i, rid in enumerate(ids):
        ct.publish(rid, [i], aux=b"x")
        gets.append(cr.fetch(rid, tx.endpoint, [i]))
    for h in gets:
        out = cr.wait(h, CALL_S)
        assert out is not None and out.state == "done", out
    # 2. a fetch nobody published: parked at the sender, in flight here, until the sender
    # expires it (pending_fetch_ttl_ms)
    lost = cr.fetch("mx-lost", tx.endpoint, [9])
    fams = moved(
        rx.probe_port,
        lambda f: value(f, "kvxferd_transfers_in_flight", state="requested") == 1,
        "the unpublished fetch in flight on the receiver",
    )
    assert value(fams, "kvxferd_oldest_in_flight_seconds") > 0
    moved(
        tx.probe_port,
        lambda f: value(f, "kvxferd_transfers_in_flight", state="parked") == 1,
        "the unpublished fetch parked on the sender",
    )
    out = cr.wait(lost, CALL_S)
    assert out is not None and out.state == "failed" and out.reason == "expired", out
    # 3. a request nobody fetches ages on the sender
    ct.publish("mx-idle", [20])
    # 4. hostile frames: garbage to both listeners and the engine gateway; a Result for
    # a fetch the receiver never had; a REGISTER with a wildcard result endpoint.
    late = wire.Result(request_id="nobody", fetch_id=987_654_321, status="done")
    bad_register = wire.Register(
        receiver_id="metrics-test",
        result_endpoint="tcp://0.0.0.0:1",
        agent_metadata=b"",
        layout=wire.WireLayout(
            num_layers=2, num_blocks=1, block_bytes=1, dtype="uint8", aux_slots=1, aux_slot_bytes=64
        ),
        kv_base=0,
        aux_base=0,
    )
    with_tx, with_rx = raw_dealer(tx.endpoint), raw_dealer(rx.endpoint)
    with_gw = RawEngine(tx.engine_socket)  # the engine socket: a unix stream
    try:
        with_tx.send(b"not a kvxferd frame")
        with_tx.recv()  # its Reject
        with_tx.send(wire.encode(bad_register))
        reply = wire.decode_to_receiver([with_tx.recv()], 1 << 20)
        assert isinstance(reply, wire.RegisterReply) and not reply.ok, reply
        with_rx.send(b"not a kvxferd frame")
        with_rx.send(wire.encode(late))
        with_gw.send_frame(b"not an engine frame")
        with_gw.recv_frame()  # its Error
    finally:
        with_tx.close(linger=0)  # both its frames were answered
        # Nothing answers the two frames sent to the receiver: linger so that they still
        # go out if the connection was not up yet (linger 0 dropped them once).
        with_rx.close(linger=int(WAIT_S * 1000))
        with_gw.sock.close()

    # -- the sender --------------------------------------------------------------------
    fams = moved(
        tx.probe_port,
        lambda f: value(f, "kvxferd_oldest_in_flight_seconds") > 0.05,
        "the unfetched request ages",
    )
    rx_results = rx.endpoint  # the sender's peer label is the receiver's result endpoint
    for name in ("post", "transfer", "end_to_end"):
        got = hist_count(fams, f"kvxferd_peer_{name}_seconds", peer=rx_results)
        assert got >= 3, (name, fams[f"kvxferd_peer_{name}_seconds"].samples)
    assert value(fams, "kvxferd_registers_accepted") >= 1
    assert value(fams, "kvxferd_registers_refused") == 1
    assert value(fams, "kvxferd_rejections", reason="bad_endpoint") == 1
    assert value(fams, "kvxferd_rejections") >= 2  # the garbage frame too
    # The three done slices were told by NIXL notification; no Result went for them.
    assert value(fams, "kvxferd_slices_done_notified") == 3
    assert value(fams, "kvxferd_messages_sent", message="result") == 0
    assert value(fams, "kvxferd_parked_fetches_expired") == 1
    assert value(fams, "kvxferd_rejections", reason="expired") == 1
    assert value(fams, "kvxferd_published") == 4
    assert value(fams, "kvxferd_peer_cache_entries", kind="peers") == 1
    assert value(fams, "kvxferd_peer_cache_entries", kind="nixl_agents") == 1
    assert value(fams, "kvxferd_transfers_in_flight") == 0  # the parked fetch is gone
    assert value(fams, "kvxferd_aux_slots", state="free") >= 1
    for name in (
        "kvxferd_send_timeouts",
        "kvxferd_send_errors",
        "kvxferd_reply_dropped",
        "kvxferd_writes_stalled",
        "kvxferd_writes_in_doubt",
        "kvxferd_in_doubt_resolved",
        "kvxferd_sessions_expired",
        "kvxferd_parked_fetches_expired",
        "kvxferd_peers_evicted",
        "kvxferd_thread_errors",
        "kvxferd_gateway_reply_dropped",
        "kvxferd_gateway_internal_errors",
        "kvxferd_gateway_recv_errors",
    ):
        assert fams[name].type == "counter", name
    assert value(fams, "kvxferd_gateway_calls", call="publish") == 4
    assert value(fams, "kvxferd_gateway_rejections") >= 1  # the garbage frame
    assert value(fams, "kvxferd_gateway_handles") >= 1  # nobody closed the handles

    # -- the receiver -------------------------------------------------------------------
    fams = moved(
        rx.probe_port,
        lambda f: value(f, "kvxferd_late_messages") >= 1,
        "the Result for an unknown fetch counted late",
    )
    assert value(fams, "kvxferd_rejections") >= 1  # the garbage frame
    e2e = hist_count(fams, "kvxferd_peer_end_to_end_seconds", peer=tx.endpoint)
    assert e2e == 4, fams["kvxferd_peer_end_to_end_seconds"].samples
    assert value(fams, "kvxferd_outcomes", outcome="failed") == 1
    assert value(fams, "kvxferd_outcomes", outcome="done") == 3
    assert value(fams, "kvxferd_register_replies", result="ok") >= 1
    assert value(fams, "kvxferd_registers_sent") >= 1
    assert value(fams, "kvxferd_requests_sent") == 4
    assert value(fams, "kvxferd_peer_cache_entries", kind="links") == 1
    assert value(fams, "kvxferd_peer_cache_entries", kind="ready_links") == 1
    assert value(fams, "kvxferd_transfers_in_flight") == 0
    assert value(fams, "kvxferd_oldest_in_flight_seconds") == 0
    for name in (
        "kvxferd_connect_errors",
        "kvxferd_reconnects",
        "kvxferd_disconnects",
        "kvxferd_links_dropped",
        "kvxferd_fences_in_doubt",
        "kvxferd_aux_slots_quarantined",
        "kvxferd_aux_slots_released",
        "kvxferd_fetch_refusals",
        "kvxferd_fetch_failures",
        "kvxferd_peer_rejections",
    ):
        assert fams[name].type == "counter", name
    assert value(fams, "kvxferd_gateway_calls", call="fetch") == 4
    started = time.monotonic()
    for d in (tx, rx):  # request ids never label a series
        body = http_get(d.probe_port, "/metrics")[1]
        assert "mx-" not in body
    assert time.monotonic() - started < WAIT_S
