"""`kvxferd demo` end to end: real sender and receiver processes, real NIXL, verified bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_demo_moves_every_byte_with_two_receivers(tmp_path: Path) -> None:
    """A small demo with two receivers finishes with no failure, no mismatch and several workers busy."""
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvxferd",
            "demo",
            "--requests",
            "40",
            "--receivers",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    assert summary["requests"] == 40
    assert summary["failures"] == 0 and summary["mismatches"] == 0
    assert summary["bytes"] > 0 and summary["gbps"] > 0
    assert summary["p99_ms"] >= summary["p50_ms"] > 0
    assert summary["workers_used"] > 1, "the demo should keep more than one sender worker busy"
    assert "40 requests" in proc.stdout
