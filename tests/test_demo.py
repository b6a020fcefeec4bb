"""`kvxferd demo` end to end: real sender and receiver daemons, engines on the client API, verified bytes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.conditions import wait_until


def _demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvxferd", "demo", *args],
        capture_output=True,
        text=True,
        timeout=220,
        env=env,
    )


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_demo_moves_every_byte_with_two_receivers(tmp_path: Path) -> None:
    """Two receiver daemons: no failure, no mismatch, the sender daemon saw every slice, clean exits."""
    out = tmp_path / "demo.json"
    env = {**os.environ, "TRTLLM_KV_TRANSFER_NUM_THREADS": "4"}
    proc = _demo("--requests", "40", "--receivers", "2", "--json", str(out), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    assert summary["requests"] == 40
    assert summary["failures"] == 0 and summary["mismatches"] == 0
    assert summary["bytes"] > 0 and summary["gbps"] > 0
    assert summary["p99_ms"] >= summary["p50_ms"] > 0
    assert summary["receivers"] == 2
    # Read from the sender daemon's /metrics: its workers, the slices it wrote, the same bytes.
    assert summary["sender_threads"] == 4
    assert summary["workers_used"] > 1, "requests spread over the sender's worker threads"
    assert summary["sender_slices_done"] == 40
    assert summary["sender_bytes_written"] == summary["bytes"]
    assert summary["exit_codes"] == [0, 0, 0], "every daemon drained and exited 0"
    assert "40 requests" in proc.stdout


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_demo_fails_cleanly_when_a_daemon_cannot_start(tmp_path: Path) -> None:
    """A daemon that exits before it is ready ends the demo with exit 1 and the reason."""
    env = {**os.environ, "KVXFERD_LIMITS__SNDHWM": "0"}  # invalid: every daemon exits 2
    proc = _demo("--requests", "4", "--json", str(tmp_path / "demo.json"), env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "exited with 2 before it was ready" in proc.stdout
    assert not (tmp_path / "demo.json").exists()


def _children(pid: int) -> list[int]:
    return [
        int(c)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for c in (task / "children").read_text().split()
    ]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_sigterm_to_the_demo_stops_its_daemons_too() -> None:
    """A demo stopped with SIGTERM mid-run exits and leaves none of its daemons running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvxferd", "demo", "--requests", "1000000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        for _ in range(200):  # progress lines, one per interval; the first means it runs
            line = proc.stderr.readline()
            if not line or line.startswith("demo: ") and "/1000000 requests" in line:
                break
        assert proc.poll() is None, "the demo ended before it ran"
        daemons = _children(proc.pid)
        assert daemons, "the demo started no child process"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) != 0
        wait_until(lambda: all(_gone(p) for p in daemons), 10, "every daemon gone")
    finally:
        proc.kill()
        proc.wait(timeout=10)
