"""``kvxferd bench --floor``: the engine path's hops without kvxferd, on real processes."""

from __future__ import annotations

import pytest

from kvxferd.bench.floor import measure

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.mark.parametrize(("wait_s", "curve"), [(0.0, False), (60e-6, True)])
def test_the_floor_moves_real_bytes_and_reports_its_figures(wait_s: float, curve: bool) -> None:
    out = measure(requests=60, wait_s=wait_s, curve=curve, warmup=5)
    # every request's bytes (a pattern of its own) were checked by the receiver daemon
    assert out["bad_bytes"] == 0
    assert out["requests"] == 60
    assert out["security"] == ("curve" if curve else "off")
    assert 0 < out["p50_ms"] <= out["p99_ms"]
    assert out["daemon_cpu_us"] > 0
