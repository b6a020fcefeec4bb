"""`kvxferd bench --curves`: a tiny sweep of every axis, end to end, and the targets it states."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kvxferd import bench
from kvxferd.bench import BenchError, Options, Plan, Workload
from kvxferd.bench.curves import AXES, CurveOptions, affine_fit, format_curves, run_curves
from kvxferd.bench.side import _Group, _Side

TINY = CurveOptions(
    inflight=(1, 2),
    workers=(1, 2),
    blocks=(1, 16),
    peers=(1, 2),
    reps=1,
    engine_requests=8,
    small_requests=16,
    bulk_requests=4,
    blocks_bytes=64 << 10,
    peer_requests=8,
    peer_procs=1,  # both receivers of the 2-peer point in one process: a receiver group
    prep_reps=50,
    prep_layers=(1, 2),
    child_module="kvxferd.bench",
    timeout_s=100,
)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_tiny_curves_report_every_axis(tmp_path: Path) -> None:
    """Every axis gets its points with positive rates and verified bytes on both paths, the
    blocks axis rises in blocks and request size, and the three cost-growth targets are stated."""
    progress = io.StringIO()
    doc = run_curves(TINY, progress=progress)

    assert set(doc["axes"]) == set(AXES)
    want_x = {
        "inflight": [1, 2],
        "workers-small": [1, 2],
        "workers-bulk": [1, 2],
        "blocks": [1, 16],
        "peers": [1, 2],
    }
    for axis, ax in doc["axes"].items():
        assert [p["x"] for p in ax["points"]] == want_x[axis]
        for p in ax["points"]:
            assert not p["skipped"], (axis, p)
            assert set(p["paths"]) == {ax["path"], "nixl"}
            for name, f in p["paths"].items():
                assert f["verified"] and f["failures"] == 0, (axis, p["x"], name, f)
                assert f["rps"] > 0 and f["gbps"] > 0 and f["us_per_block"] > 0
                assert 0 < f["p50_ms"] <= f["p99_ms"]
            assert p["ratio_rps_nixl"] > 0
    blocks = doc["axes"]["blocks"]["points"]
    assert blocks[0]["request_bytes"] < blocks[1]["request_bytes"]
    peers = doc["axes"]["peers"]["points"]
    assert peers[1]["requests_per_rep"] == 2 * peers[0]["requests_per_rep"]
    assert doc["axes"]["inflight"]["points"][0]["daemon_cpu_us_per_request"] > 0
    assert {(q["layers"], q["ids"]) for q in doc["prep"]} == {
        (1, "scattered"),
        (2, "scattered"),
        (1, "contiguous"),
    }
    assert all(0 < q["min_us"] <= q["median_us"] <= q["p99_us"] for q in doc["prep"])
    targets = {t["target"]: t for t in doc["targets"]}
    assert set(targets) == {"workers", "blocks-linear", "prep-1000"}
    assert all(t["met"] in (True, False) for t in targets.values())
    assert len(doc["load_start"]) == 3 and doc["elapsed_s"] > 0

    out = tmp_path / "curves.json"
    out.write_text(json.dumps(doc))  # plain JSON throughout
    assert json.loads(out.read_text())["axes"]["peers"]["points"][1]["x"] == 2
    text = format_curves(doc)
    assert "blocks per request" in text and "1000-block request" in text
    if bench.plot_available():
        bench.write_curves_plot(doc, str(tmp_path / "curves.png"))
        assert (tmp_path / "curves.png").stat().st_size > 1000


@pytest.mark.timeout(10)
def test_budget_skips_points_not_begun() -> None:
    """A point not begun within the time budget is reported as skipped, not measured."""
    from kvxferd.bench.curves import _point, curve_points

    pts = curve_points(CurveOptions(inflight=(1,), workers=(), blocks=(), peers=()))
    (axis, x, w) = pts[0]
    p = _point(x, w, None)
    assert axis == "inflight" and p["skipped"] and "paths" not in p


@pytest.mark.timeout(10)
def test_affine_fit_recovers_a_line() -> None:
    """The blocks-axis fit returns the fixed and per-block cost of an exactly linear cost."""
    xs = [1.0, 4.0, 16.0, 256.0, 4096.0, 65536.0]
    a, c = affine_fit(xs, [50.0 + 0.5 * x for x in xs])
    assert a == pytest.approx(50.0) and c == pytest.approx(0.5)


@pytest.mark.timeout(10)
def test_receivers_spread_over_processes() -> None:
    """Receiver k lives in rx process k mod procs, every receiver in exactly one process."""
    w = Workload("p", 4, 1, receivers=10, rx_procs=4)
    assert w.procs == 4
    hosted = [w.hosted_by(j) for j in range(w.procs)]
    assert hosted[0] == [0, 4, 8] and hosted[3] == [3, 7]
    assert sorted(k for h in hosted for k in h) == list(range(10))
    assert Workload("q", 4, 1, receivers=3).procs == 3  # default: one process per receiver


class _FakeRx(_Side):
    def __init__(self, t0: float, t1: float, n: int, fail: bool = False) -> None:
        self.t0, self.t1, self.n, self.fail = t0, t1, n, fail

    def run(self, rep: int, count: int) -> dict[str, object]:
        if self.fail:
            raise RuntimeError("boom")
        return {
            "t0": self.t0,
            "t1": self.t1,
            "requests": self.n,
            "bytes": 10 * self.n,
            "failures": 0,
            "lat_us": [1.0] * self.n,
        }

    def finish(self, rep: int, count: int) -> dict[str, object]:
        return {"verified": self.n != 3, "checked_blocks": self.n, "detail": f"rx{self.n}"}


@pytest.mark.timeout(10)
def test_receiver_group_merges_its_members() -> None:
    """A group's run spans its members' first start to last end and sums their requests; its
    check fails if one member's fails; a member that raises fails the whole run."""
    plan = Plan.make(Workload("g", 4, 1), Options(max_requests=4), tag=0)
    group = _Group(plan)
    group.members = [_FakeRx(1.0, 3.0, 2), _FakeRx(0.5, 2.0, 3)]
    out = group.run(0, 4)
    assert (out["t0"], out["t1"], out["requests"], out["bytes"]) == (0.5, 3.0, 5, 50)
    assert len(out["lat_us"]) == 5
    fin = group.finish(0, 4)
    assert not fin["verified"] and fin["checked_blocks"] == 5 and "rx3" in fin["detail"]
    group.members.append(_FakeRx(0.0, 1.0, 1, fail=True))
    with pytest.raises(BenchError, match="boom"):
        group.run(0, 4)
