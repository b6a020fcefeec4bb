"""A rolling upgrade under load: 2 senders and 2 receivers of the previous release, replaced
one process at a time by this release's while engines keep publishing and fetching.

The fleet starts on the previous release (built from its commit, tests/support/prev_release.py;
without the commit this test skips and says how to get it). Two engine loops (one per
receiver, this release's Client, which speaks engine protocol 4 to an old daemon and 5 to a
new one) publish on a sender, fetch on their receiver and check every byte, alternating
senders, without pause. Each step of the upgrade (sender 0, receiver 0, sender 1, receiver 1)
sends SIGTERM, waits for the exit, starts this release's daemon on the same endpoints (the
same launcher, kvxferd.launch.Daemon) and waits until traffic has gone through it.

The traffic is built so that only a drain can lose a request: a publish refused by a
draining (or restarting) sender is made on the other sender; a fetch refused by a draining
(or restarting) receiver is asked again of its successor (the request stays published);
a fetch whose sender went away is published and fetched again. The test asserts 0 requests
failed beyond what the drains' last log lines report dropped (each line and exit code is
printed), and that the finished fleet speaks version 4 on every link.

Figures (printed, ``-s``): requests completed, retries, the time of each step, total time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from kvxferd.engine.client import Client, attach_pool
from kvxferd.engine.errors import EngineError, EngineRejected
from kvxferd.launch import Daemon
from tests.support import engine_driver as drv
from tests.support import prev_release
from tests.support.conditions import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

STARTUP_S = 60.0
EXIT_S = 15.0  # shutdown_timeout_ms (8 s) + 1 s, and reaping on a loaded host
STEP_TRAFFIC = 6  # requests completed through a new daemon before the next step
RUN_S = 300.0  # the whole run's bound
MAX_REQUESTS = 5000  # per engine loop
SLOTS = 8  # request slots per engine loop in each pool (a pool holds 16)
RETRY_S = 60.0  # how long one request is retried through restarts before it counts failed
# Between two tries of a refused call (a daemon draining or restarting): a retry's pace,
# not a synchronisation; every try has its own bound and the request RETRY_S.
BACKOFF_S = 0.05
DRAIN_LINE = re.compile(r"drain (complete|incomplete): (.*?); exit (\d+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Member:
    """One position of the fleet: its endpoints stay, its process is replaced."""

    role: str
    name: str
    engine_socket: str
    listen: str = ""  # senders: a fixed port, so receivers find the successor there
    daemon: Daemon | None = None
    release: str = ""
    generation: int = 0
    served: int = 0  # requests completed through the current process
    lock: threading.Lock = field(default_factory=threading.Lock)
    client: Client | None = None
    pool: torch.Tensor | None = None
    pool_id: tuple[str, str] = ("", "")

    def mapped(self) -> tuple[Client, torch.Tensor]:
        """The engine's client and its view of the current process's pool (call with ``lock``):
        mapped again when another process answers (a new shared-memory segment)."""
        if self.client is None:
            self.client = Client(self.engine_socket, timeout_s=10)
        info = self.client.describe()
        if (info.shm_name, info.daemon_id) != self.pool_id or self.pool is None:
            self.pool, self.pool_id = attach_pool(info), (info.shm_name, info.daemon_id)
        return self.client, self.pool


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    counts: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def add(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.counts[what] += n


class Fleet:
    def __init__(self, old: prev_release.Built, workdir: Path) -> None:
        self.old, self.workdir = old, workdir
        self.senders = [
            Member(
                "sender", f"tx{i}", f"ipc://{workdir}/tx{i}.sock", f"tcp://127.0.0.1:{_free_port()}"
            )
            for i in range(2)
        ]
        self.receivers = [
            Member("receiver", f"rx{i}", f"ipc://{workdir}/rx{i}.sock") for i in range(2)
        ]
        self.drains: list[dict[str, Any]] = []

    def start(self, m: Member, old_release: bool) -> None:
        m.generation += 1
        env = {
            **(prev_release.clean_env() if old_release else dict(os.environ)),
            "KVXFERD_POOL__NUM_LAYERS": str(drv.LAYERS),
            "KVXFERD_POOL__NUM_BLOCKS": str(drv.NUM_BLOCKS),
            "KVXFERD_POOL__BLOCK_ELEMS": str(drv.BLOCK_BYTES),
            "KVXFERD_POOL__DTYPE": "uint8",
            "KVXFERD_NUM_THREADS": "1",
            "KVXFERD_SERVICE__PROBE_PORT": "0",
            "KVXFERD_SERVICE__ENGINE_SOCKET": m.engine_socket,
            "KVXFERD_DEADLINES__DRAIN_TIMEOUT_MS": "5000",
            "KVXFERD_DEADLINES__SHUTDOWN_TIMEOUT_MS": "8000",
            "PYTHONUNBUFFERED": "1",
        }
        args = ["--listen", m.listen] if m.listen else []
        name = f"{m.name}-g{m.generation}"
        m.daemon = Daemon(
            m.role,
            name,
            self.workdir,
            args,
            env=env,
            cwd=self.workdir,
            log_level="info",  # the drain's last line is logged at info when complete
            python=str(self.old.python) if old_release else sys.executable,
            new_session=False,
        )
        m.daemon.wait_ready(time.monotonic() + STARTUP_S)
        m.release = self.old.version if old_release else "new"
        m.served = 0

    def stop(self, m: Member) -> dict[str, Any]:
        """SIGTERM, wait for the exit; the drain's own report (its last line) and exit code."""
        d = m.daemon
        assert d is not None
        d.signal(signal.SIGTERM)
        code = d.reap(time.monotonic() + EXIT_S)
        text = Path(self.workdir / f"{d.name}.err").read_text(errors="replace")
        lines = DRAIN_LINE.findall(text)
        assert lines, f"{d.name}: no drain line; stderr tail:\n{text[-2000:]}"
        state, counts, said = lines[-1]
        dropped = sum(int(n) for n in re.findall(r"(\d+) (?!in doubt)[a-z]", counts))
        report = {
            "daemon": d.name,
            "exit": code,
            "drain": state,
            "counts": counts,
            "dropped": dropped,
        }
        assert code == int(said), report
        self.drains.append(report)
        return report

    def link_versions(self, rx: Member) -> dict[str, int]:
        """The version of each of ``rx``'s links by sender endpoint (a 0.1.0 receiver's: 3)."""
        assert rx.daemon is not None
        url = f"http://127.0.0.1:{rx.daemon.ready['probe_port']}/debug/state"
        with urllib.request.urlopen(url, timeout=10) as r:
            links = json.loads(r.read())["links"]
        return {x["endpoint"]: x.get("version", 3) for x in links if x["ready"]}

    def versions_agree(self) -> bool:
        """Every ready link speaks 4 exactly when both its ends are this release."""
        for rx in self.receivers:
            for tx in self.senders:
                want = 4 if rx.release == tx.release == "new" else 3
                got = self.link_versions(rx).get(tx.listen)
                if got is not None and got != want:
                    return False
        return True

    def members(self) -> list[Member]:
        return [*self.senders, *self.receivers]


@pytest.fixture
def old() -> prev_release.Built:
    try:
        return prev_release.build()
    except prev_release.NotBuildable as e:
        pytest.skip(f"previous release not available: {e}")


@pytest.fixture
def fleet(old: prev_release.Built) -> Iterator[Fleet]:
    workdir = Path(tempfile.mkdtemp(prefix="kxr"))
    f = Fleet(old, workdir)
    yield f
    for m in f.members():
        if m.client is not None:
            m.client.close_client()
        if m.daemon is not None:
            m.daemon.close()
    shutil.rmtree(workdir, ignore_errors=True)


class Loop(threading.Thread):
    """One engine: publish on a sender (the other when it refuses), fetch on its receiver,
    check the bytes; a request is retried through restarts for RETRY_S, then counts failed.
    ``stop`` ends the loop between requests: the one under way is finished."""

    def __init__(self, fleet: Fleet, r: int, tally: Tally, stop: threading.Event) -> None:
        super().__init__(name=f"engine-{r}", daemon=True)
        self.fleet, self.r, self.tally, self.stop_ = fleet, r, tally, stop

    def run(self) -> None:
        for k in range(MAX_REQUESTS):
            if self.stop_.is_set():
                return
            rid = f"r{self.r}-{k}"
            slot = self.r * SLOTS + k % SLOTS  # this loop's blocks in every pool
            try:
                self.one(rid, slot, k % 2)
            except Exception as e:  # a bug of the test: reported, never hidden
                with self.tally.lock:
                    self.tally.failures.append(f"{rid}: {type(e).__name__}: {e}")

    def one(self, rid: str, slot: int, first: int) -> None:
        deadline = time.monotonic() + RETRY_S
        data = drv.content(rid)
        while time.monotonic() < deadline:
            sent = self.publish(rid, slot, first, data)
            if sent is None:
                self.tally.add("publish_retries")
                time.sleep(BACKOFF_S)  # both refused: one is restarting (poll, bounded by deadline)
                continue
            sender, handle = sent
            outcome = self.fetch(rid, sender, slot, data, deadline)
            with contextlib.suppress(EngineError), sender.lock:
                sender.mapped()[0].close(handle, 2.0)
            if outcome == "exact":
                self.tally.add("completed")
                return
            if outcome == "mismatch":
                with self.tally.lock:
                    self.tally.failures.append(f"{rid}: wrong bytes")
                return
            self.tally.add("republished")  # the sender went away before the fetch: again
            time.sleep(BACKOFF_S)  # (its link is down until it redials: poll, bounded)
        with self.tally.lock:
            self.tally.failures.append(f"{rid}: not fetched within {RETRY_S}s")

    def publish(self, rid: str, slot: int, first: int, data: bytes) -> tuple[Member, int] | None:
        for i in (first, 1 - first):
            sender = self.fleet.senders[i]
            try:
                with sender.lock:
                    client, pool = sender.mapped()
                    view = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                    pool[:, drv.blocks(slot)] = view.reshape(
                        drv.LAYERS, drv.BLOCKS, drv.BLOCK_BYTES
                    )
                    handle = client.publish(rid, drv.blocks(slot), aux=rid.encode())
                return sender, handle
            except EngineError as e:
                self.tally.add(f"publish_refused_{e.reason}")
        return None

    def fetch(self, rid: str, sender: Member, slot: int, data: bytes, deadline: float) -> str:
        """ "exact", "mismatch", or "gone" (the request is not at its sender any more)."""
        rx = self.fleet.receivers[self.r]
        endpoint = sender.listen
        while time.monotonic() < deadline:
            try:
                with rx.lock:
                    client, pool = rx.mapped()
                generation = rx.generation
                out = client.fetch_wait(rid, endpoint, drv.blocks(slot), 20.0)
            except EngineRejected as e:
                self.tally.add(f"fetch_refused_{e.reason}")
                time.sleep(BACKOFF_S)  # a draining receiver: its successor is asked (bounded)
                continue
            except EngineError as e:
                self.tally.add(f"fetch_unavailable_{e.reason}")
                time.sleep(BACKOFF_S)
                continue
            if out.ok:
                got = pool[:, drv.blocks(slot)].contiguous().numpy().tobytes()
                if got != data or out.aux != rid.encode():
                    return "mismatch"
                if rx.generation == generation:
                    rx.served += 1
                sender.served += 1
                return "exact"
            self.tally.add(f"fetch_failed_{out.reason}")
            if out.reason in ("peer_lost", "peer_restarted", "unknown_request", "expired"):
                return "gone"
            time.sleep(BACKOFF_S)
        return "gone"


def test_a_fleet_upgraded_one_process_at_a_time_under_traffic_loses_nothing(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    t0 = time.monotonic()
    for m in fleet.members():
        fleet.start(m, old_release=True)
    tally, stop = Tally(), threading.Event()
    loops = [Loop(fleet, r, tally, stop) for r in range(2)]
    for loop in loops:
        loop.start()
    steps = []
    try:
        wait_until(lambda: tally.counts["completed"] >= 4, 60, "traffic before the first step")
        order = [fleet.senders[0], fleet.receivers[0], fleet.senders[1], fleet.receivers[1]]
        for m in order:
            s0 = time.monotonic()
            report = fleet.stop(m)
            fleet.start(m, old_release=False)
            wait_until(
                lambda m=m: m.served >= STEP_TRAFFIC,
                90,
                f"{STEP_TRAFFIC} requests through the new {m.name}",
            )
            steps.append({**report, "step_s": round(time.monotonic() - s0, 2)})
            wait_until(lambda: fleet.versions_agree(), 30, f"link versions after {m.name}")
    finally:
        stop.set()
        for loop in loops:
            loop.join(RETRY_S + 30)
    elapsed = time.monotonic() - t0
    dropped = sum(d["dropped"] for d in fleet.drains)
    with capsys.disabled():
        print(f"\nrolling upgrade: {dict(tally.counts)} in {elapsed:.1f} s")
        for s in steps:
            print(f"  {s}")
    assert all(not loop.is_alive() for loop in loops)
    assert len(tally.failures) <= dropped, (tally.failures, fleet.drains)
    assert tally.counts["completed"] >= 4 * STEP_TRAFFIC
    # The finished fleet is all this release: every link speaks 4.
    for rx in fleet.receivers:
        assert set(fleet.link_versions(rx).values()) == {4}
