"""A drain that counts: real daemons, SIGTERM, what the drain waited for, dropped and said.

A sender's drain waits (up to ``drain_timeout_ms``) for requests published and
not yet fetched, and serves fetches for them while it refuses new publishes; a
receiver's drain waits for its fetches. What is still open at the deadline ends
``failed`` / ``shutting_down`` (in the engine's outcome and the journal line,
also when the engine closes its handle during the drain), and the daemon's last
log line counts it: ``drain complete: ...; exit 0`` or ``drain incomplete: ...;
exit 3``.

The daemons log JSON so each stderr line is read as fields. Helpers come from
tests/test_daemon.py.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvxferd.engine.client import Client, EngineRejected
from kvxferd.engine.engine_protocol import EngineReason
from kvxferd.errors import Reason
from kvxferd.transfer.session import TxState
from tests import test_daemon as td
from tests import test_races as races
from tests.support.conditions import wait_until

pytestmark = pytest.mark.integration

DRAIN_S = 1.5  # short: a drain that waits for nothing must still wait this long
SHUTDOWN_S = 3.0
MARGIN_S = td.MARGIN_S


def drain_env(drain_s: float = DRAIN_S, shutdown_s: float = SHUTDOWN_S) -> dict[str, str]:
    return td.daemon_env(
        KVXFERD_DEADLINES__DRAIN_TIMEOUT_MS=int(drain_s * 1000),
        KVXFERD_DEADLINES__SHUTDOWN_TIMEOUT_MS=int(shutdown_s * 1000),
        KVXFERD_SERVICE__LOG_JSON="true",
    )


@pytest.fixture
def sock_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="kx")  # short: an ipc:// path must fit in sockaddr_un
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def spawn(request: pytest.FixtureRequest, sock_dir: str) -> td.Spawn:
    """Spawn daemon children (JSON logs); every one is killed and reaped in teardown."""
    spawned: list[td.DaemonProcess] = []
    request.addfinalizer(lambda: [d.kill() for d in spawned])

    def start(role: str, name: str, env: dict[str, str] | None = None) -> td.DaemonProcess:
        args = ["--listen", "tcp://127.0.0.1:0"] if role == "sender" else []
        d = td.DaemonProcess(role, name, sock_dir, env or drain_env(), args)
        spawned.append(d)
        return d

    return start


@pytest.fixture
def engines() -> Iterator[td.Engines]:
    e = td.Engines()
    yield e
    e.close()


def log_lines(d: td.DaemonProcess) -> list[dict[str, Any]]:
    """The daemon's JSON log lines (anything else on stderr is skipped)."""
    out = []
    for line in d.stderr().splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def last_event(d: td.DaemonProcess) -> str:
    lines = log_lines(d)
    assert lines, d.describe()
    return str(lines[-1]["event"])


def journal_lines(d: td.DaemonProcess, request_id: str) -> list[dict[str, Any]]:
    return [
        e
        for e in log_lines(d)
        if e.get("logger") == "kvxferd.journal"
        and e.get("request_id") == request_id
        and e.get("kind") != "slice"
    ]


def wait_draining(d: td.DaemonProcess, ct: Client) -> None:
    """Until readiness names the drain; then a new publish must be refused with ``draining``."""
    wait_until(
        lambda: "draining" in td.http_get(d.probe_port, "/readyz", timeout=1.0)[1],
        5.0,
        f"{d.name} readiness names the drain",
    )
    with pytest.raises(EngineRejected) as e:
        ct.publish("after-sigterm", td.blocks_of(td.N_REQ - 1))
    assert e.value.reason is EngineReason.DRAINING, e.value


COUNTS = re.compile(
    r"^drain (complete|incomplete): (\d+) published requests? never fetched, "
    r"(\d+) transfers? cut, (\d+) in doubt; exit (\d+)"
)


def sender_counts(d: td.DaemonProcess) -> tuple[str, int, int, int, int]:
    """(complete|incomplete, never fetched, cut, in doubt, exit) from the daemon's last log line."""
    event = last_event(d)
    m = COUNTS.match(event)
    assert m is not None, event
    word, a, b, c, code = m.groups()
    return word, int(a), int(b), int(c), int(code)


# -- sender ----------------------------------------------------------------------------------


def test_a_request_published_before_sigterm_is_fetched_during_the_drain_and_exit_is_0(
    spawn: td.Spawn, engines: td.Engines
) -> None:
    """A request published and not fetched at SIGTERM is still served (byte-exact) to a receiver that first comes during the drain, new publishes are refused, and the sender exits 0 saying the drain completed."""
    env = drain_env(drain_s=8.0, shutdown_s=10.0)  # room for a first Register on a busy host
    tx, rx = spawn("sender", "tx", env), spawn("receiver", "rx", env)
    tx.wait_ready(), rx.wait_ready()
    ct, pt = engines.client(tx)
    cr, pr = engines.client(rx)
    ids = ["late-fetch"]
    (h,) = td.publish_all(ct, pt, ids)
    tx.signal(signal.SIGTERM)
    wait_draining(tx, ct)
    assert ct.poll(h) is None  # the drain keeps it published
    # The receiver has never talked to this sender: it registers during the drain.
    out = cr.wait(cr.fetch("late-fetch", tx.endpoint, td.blocks_of(0)), td.CALL_S)
    assert out is not None and out.state == "done", out
    assert td.verify_done(pr, ids, [out]) == 1
    code, elapsed = tx.wait_exit(10.0 + 1.0 + MARGIN_S)
    td.report("sender, request fetched during the drain", code, elapsed)
    print(f"[drain] last line: {last_event(tx)!r}")
    assert code == 0, tx.describe()
    assert sender_counts(tx) == ("complete", 0, 0, 0, 0)
    assert elapsed < 8.0, "the drain ended when its last request was fetched, not at its deadline"


def test_requests_the_drain_drops_end_shutting_down_are_counted_and_exit_3(
    spawn: td.Spawn, engines: td.Engines
) -> None:
    """A request never fetched holds the drain to drain_timeout_ms and one its engine closes during the drain is let go at once; both end failed/shutting_down (engine outcome and journal line, never cancelled), the last log line counts 2 never fetched, and the sender exits 3."""
    tx = spawn("sender", "tx")
    ct, pt = engines.client(tx)
    h_open, h_closed = td.publish_all(ct, pt, ["never-fetched", "closed-in-drain"])
    t0 = tx.signal(signal.SIGTERM)
    wait_draining(tx, ct)
    assert ct.close(h_closed, 2.0) is True  # the engine (stopping too) takes its blocks back
    assert tx.alive(), "the drain ended while a published request was still open"
    out = ct.wait(h_open, DRAIN_S + 2.0)  # the gateway still answers a Wait during the drain
    ended = time.monotonic() - t0
    code, elapsed = tx.wait_exit(SHUTDOWN_S + 1.0 + MARGIN_S)
    td.report("sender, a request never fetched and one closed during the drain", code, elapsed)
    print(f"[drain] outcome {out}; last line: {last_event(tx)!r}")
    assert out is not None, "no outcome before the drain deadline"
    assert (out.state, out.reason) == ("failed", EngineReason.SHUTTING_DOWN), out
    assert ended >= DRAIN_S - 0.1, f"ended {ended:.2f}s after SIGTERM: the drain did not wait"
    (line,) = journal_lines(tx, "never-fetched")
    assert (line["outcome"], line["reason"]) == ("failed", "shutting_down"), line
    assert "drain deadline" in line["detail"], line
    (line,) = journal_lines(tx, "closed-in-drain")
    assert (line["outcome"], line["reason"]) == ("failed", "shutting_down"), line
    assert line["detail"] == "closed by the engine during the drain", line
    assert code == 3, tx.describe()
    assert sender_counts(tx) == ("incomplete", 2, 0, 0, 3)
    assert DRAIN_S - 0.1 <= elapsed <= SHUTDOWN_S + 1.0 + MARGIN_S, elapsed


# -- receiver --------------------------------------------------------------------------------


def test_a_receiver_fetch_open_at_the_drain_deadline_ends_shutting_down_and_exits_3(
    spawn: td.Spawn, engines: td.Engines
) -> None:
    """A receiver's fetch still open at drain_timeout_ms ends failed/shutting_down (engine outcome and journal, not cancelled by the engine), is counted in the last log line, and the receiver exits 3."""
    tx, rx = spawn("sender", "tx"), spawn("receiver", "rx")
    tx.wait_ready(), rx.wait_ready()
    cr, _ = engines.client(rx)
    g = cr.fetch("not-published-yet", tx.endpoint, td.blocks_of(0))  # parked at the sender
    assert cr.poll(g) is None
    t0 = rx.signal(signal.SIGTERM)
    out = cr.wait(g, DRAIN_S + 2.0)
    ended = time.monotonic() - t0
    code, elapsed = rx.wait_exit(SHUTDOWN_S + 1.0 + MARGIN_S)
    td.report("receiver, a fetch open at the drain deadline", code, elapsed)
    print(f"[drain] outcome {out}; last line: {last_event(rx)!r}")
    assert out is not None and (out.state, out.reason) == ("failed", EngineReason.SHUTTING_DOWN)
    assert ended >= DRAIN_S - 0.1, ended
    (line,) = journal_lines(rx, "not-published-yet")
    assert (line["outcome"], line["reason"]) == ("failed", "shutting_down"), line
    assert code == 3, rx.describe()
    assert re.match(r"^drain incomplete: 1 fetch cut, 0 in doubt; exit 3", last_event(rx)), (
        last_event(rx)
    )


# -- the counts, in process ------------------------------------------------------------------


@pytest.fixture
def h(monkeypatch: pytest.MonkeyPatch) -> Iterator[races.Harness]:
    harness = races.Harness(monkeypatch)
    try:
        yield harness
    finally:
        harness.close()


def test_the_shutdown_report_and_counters_count_each_kind_of_drop(h: races.Harness) -> None:
    """At the drain deadline a request never fetched counts as never fetched, one whose write is held counts as cut and, its write still in flight at the end, in doubt; the report and the drain_dropped_* counters agree and the report is not complete."""
    sx, dp = h.sender(num_threads=1, deadlines=dict(drain_timeout_ms=300, shutdown_timeout_ms=1000))
    p = h.peer(sx, "peer-a")
    unfetched = sx.publish("req-unfetched", races.BLOCKS)
    cut = sx.publish("req-cut", [6, 7, 8])
    p.fetch("req-cut", 1, [6, 7, 8])
    x = dp.wait_posted(1)  # held: in flight through the drain and after it
    report = sx.shutdown()
    try:
        assert (report.never_fetched, report.transfers_cut, report.requests_in_doubt) == (1, 1, 1)
        assert report.writes_in_doubt == 1 and not report.complete
        assert report.counts() == ("1 published request never fetched, 1 transfer cut, 1 in doubt")
        stats = sx.stats.snapshot()
        assert (
            stats["drain_dropped_never_fetched"],
            stats["drain_dropped_cut"],
            stats["drain_dropped_in_doubt"],
        ) == (1, 1, 1)
        for hd in (unfetched, cut):
            out = hd.wait(0)
            assert out is not None and (out.state, out.reason) == (
                TxState.FAILED,
                Reason.SHUTTING_DOWN,
            ), out
    finally:
        x.finish(True)
        sx.pool.close()  # the write returned; shutdown rightly kept the pool registered
