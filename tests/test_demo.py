"""`kvxferd demo` end to end: real sender and receiver daemons, engines on the client API, verified bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


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
