"""The prepared zero-copy check (scripts/zero_copy_check.py) runs here on DRAM, so it cannot rot before a GPU host runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "zero_copy_check.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", *args],
        capture_output=True,
        text=True,
        timeout=150,
    )


def test_zero_copy_check_is_byte_exact_on_dram() -> None:
    """Engine tensors seated on two daemons' pools move byte-exact through publish and fetch."""
    r = _run()
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["blocks_exact"] and result["untouched_block_zero"] and result["bulk_exact"]
    assert result["bulk_gbps"] > 0


def test_zero_copy_check_catches_a_wrong_byte() -> None:
    """One received element spoiled on purpose makes the check fail (exit 1)."""
    r = _run("--corrupt")
    assert r.returncode == 1, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["blocks_exact"] is False
