"""docs/operations.md is the runbook: every metric family, readiness label and exit code is in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvxferd.service.daemon import EXIT_NOT_DRAINED
from kvxferd.service.metrics import (
    READINESS_REASONS,
    GatewayReading,
    ReadinessCollector,
    Snapshot,
    SnapshotCollector,
)
from tests.support.child import ROOT

RUNBOOK = ROOT / "docs" / "operations.md"


class _Fixed:
    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap

    def liveness(self) -> tuple[bool, str]:
        return True, ""

    def readiness(self) -> tuple[bool, list[str]]:
        return True, []

    def snapshot(self) -> Snapshot:
        return self.snap


def exported_families(role: str) -> set[str]:
    """The family names /metrics exports for ``role`` (with its engine gateway)."""
    snap = Snapshot(
        role=role,
        stats={},
        sessions_by_state={},
        queue_depths=[0],
        writes_in_flight=0,
        peers=0,
        gateway=GatewayReading(stats={}, handles=0, calls_in_flight=0),
    )
    probe = _Fixed(snap)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(probe, {"version": "0"}))
    registry.register(ReadinessCollector(probe.readiness))
    text = generate_latest(registry).decode()
    return set(re.findall(r"^# TYPE (\S+) ", text, re.M))


def runbook() -> str:
    return Path(RUNBOOK).read_text()


@pytest.mark.parametrize("role", ["sender", "receiver"])
def test_every_exported_family_is_in_the_runbook(role: str) -> None:
    """Each metric family a sender or receiver exports is named in docs/operations.md (so an operator can look it up)."""
    text = runbook()
    families = exported_families(role)
    assert len(families) > 40  # a broken scrape must not pass silently
    missing = sorted(f for f in families if f"`{f}" not in text)
    assert not missing, f"not in docs/operations.md: {missing}"


def test_every_readiness_label_is_in_the_runbook() -> None:
    """Each ``kvxferd_not_ready{reason}`` label has a row in the runbook's readiness table."""
    text = runbook()
    rows = [line for line in text.splitlines() if line.startswith("|")]
    for label in READINESS_REASONS:
        assert any(f"| {label} |" in row for row in rows), label


def test_every_exit_code_is_in_the_runbook() -> None:
    """The exit codes the daemon uses (0, 2 and the drain's) each have a row in the exit-code table."""
    rows = [line for line in runbook().splitlines() if line.startswith("| ")]
    for code in (0, 2, EXIT_NOT_DRAINED):
        assert any(row.startswith(f"| {code} |") for row in rows), code
