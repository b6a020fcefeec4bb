"""The fault suite's harness (kvxferd/faults): one short scenario with real daemons."""

from __future__ import annotations

import os

import pytest

from kvxferd.faults.report import line, table
from kvxferd.faults.scenarios import Timing, run_one

pytestmark = pytest.mark.integration

SHORT = Timing(base_s=2.5, hold_s=1.0, recover_s=0.3, soak_s=1.0, inflight=1)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie is gone for our purposes: it runs nothing
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"


@pytest.mark.timeout(90)
def test_a_sigkilled_receiver_run_verifies_bytes_and_leaves_no_daemon() -> None:
    """A kill-receiver run moves and verifies real bytes, reports every figure, and leaves no daemon running."""
    r = run_one("kill-receiver", SHORT, seed=5, ucx_tls="tcp")
    assert not r.skipped and not [b for b in r.broken if b.startswith("suite error")], r.broken
    assert r.done > 0 and r.verified_bytes > 0
    assert r.wrong_done == 0, r.extra
    assert r.exit_codes["rx-a"] == -9 and set(r.exit_codes) == {"tx", "rx-a", "rx-b"}
    assert r.b_failed >= 0 and r.base_p99_ms > 0, "peer isolation was not measured"
    assert len(r.pids) == 3 and all(_gone(pid) for pid in r.pids)
    assert r.name in line(r) and r.name in table([r])
