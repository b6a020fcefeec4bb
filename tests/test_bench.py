"""`kvxferd bench` machinery: the plan, the content check, and a tiny run of all three paths."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import numpy as np
import pytest

from kvxferd import bench
from kvxferd.bench import Options, Plan, Workload
from kvxferd.bench.report import evaluate_targets


def _plan(**kw: object) -> Plan:
    w = Workload("t", 4, 8, **kw)  # type: ignore[arg-type]
    return Plan.make(w, Options(rep_bytes=1 << 20, max_requests=50), tag=0)


@pytest.mark.parametrize("scattered", [True, False])
def test_plan_slots_are_disjoint_and_sources_distinct(scattered: bool) -> None:
    """Requests in flight never share a destination block, and no request repeats a source block."""
    plan = _plan(scattered=scattered, inflight=4, layers=2)
    slots = plan.slots()
    assert slots.shape == (4, 8) and np.unique(slots).size == slots.size
    src = plan.sources(rep=0, k=0)
    assert src.shape == (plan.requests, 8)
    assert all(np.unique(row).size == row.size for row in src)
    assert src.min() >= 0 and src.max() < plan.num_blocks
    assert np.array_equal(src, plan.sources(rep=0, k=0))  # every process derives the same plan


def test_verify_catches_a_missing_write() -> None:
    """Poisoned destination blocks fail the check until the right source blocks are copied in."""
    plan = _plan(inflight=2)
    shape = (1, plan.num_blocks, plan.workload.block_bytes)
    src_kv, dst_kv = np.zeros(shape, np.uint8), np.zeros(shape, np.uint8)
    bench.fill_source(src_kv, plan)
    slots, src = plan.slots(), plan.sources(0, 0)
    bench.poison(dst_kv, slots)
    assert not bench.verify(dst_kv, plan, src, count=4)[0]
    for i in range(4):  # what a correct path does: request i lands in slot i % inflight
        dst_kv[:, slots[i % 2]] = src_kv[:, src[i]]
    ok, checked, detail = bench.verify(dst_kv, plan, src, count=4)
    assert ok, detail
    assert checked == 2 * 8
    dst_kv[0, slots[1][3], 100] ^= 0xFF  # one flipped byte in a block body
    assert not bench.verify(dst_kv, plan, src, count=4)[0]


def test_plot_without_matplotlib_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--plot without matplotlib exits 2 before running anything, naming the extra to install."""
    monkeypatch.setattr("kvxferd.bench.command.plot_available", lambda: False)
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    assert bench.main_bench(p.parse_args(["--quick", "--plot", "x.png"])) == 2
    assert "kvxferd[bench]" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_tiny_bench_reports_every_path(tmp_path: Path) -> None:
    """A tiny run gives every path of every workload GB/s, latency and req/s with verified bytes,
    the ratios to both raw-NIXL baselines, and the engine path its daemons' CPU per request."""
    workloads = (
        Workload("tiny-scat", 16, 8, inflight=2, threads=2, target="bulk"),
        Workload("tiny-2rx", 4, 1, layers=2, scattered=False, receivers=2, inflight=4),
        Workload("tiny-engine", 16, 2, inflight=3, threads=2, engine=True, target="engine-w1"),
    )
    opts = Options(
        preset="test",
        workloads=workloads,
        reps=2,
        rep_bytes=1 << 20,
        max_requests=40,
        child_module="kvxferd.bench",
        timeout_s=100,
    )
    progress = io.StringIO()
    report = bench.run_bench(opts, progress=progress)

    assert "tiny-2rx: kvxferd+nixl+zmq rep 2/2" in progress.getvalue()
    assert "tiny-engine: nixl-default rep 2/2" in progress.getvalue()
    assert [w["name"] for w in report["workloads"]] == ["tiny-scat", "tiny-2rx", "tiny-engine"]
    for w in report["workloads"]:
        mine = "engine" if w["engine"] else "kvxferd"
        others = {"nixl", "nixl-default"} | (set() if w["engine"] else {"zmq"})
        assert set(w["paths"]) == {mine} | others
        for name, p in w["paths"].items():
            assert p["verified"] and p["failures"] == 0, (w["name"], name, p)
            assert 0 < p["gbps"]["min"] <= p["gbps"]["median"] <= p["gbps"]["max"]
            assert p["rps"]["median"] > 0
            assert 0 < p["latency_ms"]["p50"] <= p["latency_ms"]["p99"]
            assert len(p["reps"]) == 2
            assert all(r["requests"] == w["requests_per_rep"] * w["receivers"] for r in p["reps"])
        for base, key in (
            ("nixl", "ratio_kvxferd_nixl"),
            ("nixl-default", "ratio_kvxferd_nixl_default"),
        ):
            want = w["paths"][mine]["gbps"]["median"] / w["paths"][base]["gbps"]["median"]
            assert w[key] == pytest.approx(want)
        assert (w["ratio_kvxferd_zmq"] is None) is w["engine"]
    engine = report["workloads"][2]
    assert 0 < engine["daemon_cpu_us_per_request"]["median"] < 1e6
    assert engine["engine_cpu_us_per_request"]["median"] > 0
    assert {t["target"] for t in report["targets"]} == {
        "engine-latency",
        "engine-rate",
        "engine-cpu",
        "small-vs-nixl",
        "bulk",
        "scatter16k",
        "small4k",
        "small4k-loaded",
        "zmq",
    }
    assert next(t for t in report["targets"] if t["target"] == "engine-cpu")["met"] in (True, False)
    assert next(t for t in report["targets"] if t["target"] == "bulk")["met"] in (True, False)
    assert report["machine"]["nproc"] >= 1 and report["dataplane"]["backend"] == "UCX"

    out = tmp_path / "bench.json"
    out.write_text(json.dumps(report))  # everything in the report is plain JSON
    assert json.loads(out.read_text())["workloads"][1]["receivers"] == 2
    text = bench.format_report(report)
    assert "tiny-scat" in text and "kvxferd/NIXL" in text and "bytes verified" in text
    assert "tiny-engine" in text and "daemon CPU us/req" in text
    if bench.plot_available():
        bench.write_plot(report, str(tmp_path / "bench.png"))
        assert (tmp_path / "bench.png").stat().st_size > 1000


def _figures(name: str, target: str, p50: float, p99: float, rps: float) -> dict[str, object]:
    path = {"latency_ms": {"p50": p50, "p99": p99}, "rps": {"median": rps}}
    return {
        "name": name,
        "target": target,
        "rate": 5000,
        "paths": {"kvxferd": path},
        "ratio_kvxferd_nixl": 1.0,
        "ratio_kvxferd_zmq": 2.0,
    }


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("alone_p50", "rate", "paced_p50", "met", "loaded_met"),
    [
        (0.4, 5200, 0.45, True, True),
        (0.4, 5200, 3.0, True, False),  # fast alone, queues under the offered load
        (0.6, 5200, 0.45, False, True),  # one request alone too slow
        (0.4, 4000, 0.45, False, True),  # rate short of 5000 with 16 in flight
    ],
)
def test_one_block_targets_read_the_right_workloads(
    alone_p50: float, rate: float, paced_p50: float, met: bool, loaded_met: bool
) -> None:
    """The one-block target takes latency alone and rate at 16 in flight; loaded latency is its own line."""
    workloads = [
        _figures("w16", "small4k-rate", 2.0, 6.0, rate),
        _figures("w1", "small4k-latency", alone_p50, 1.0, 1600),
        _figures("paced", "small4k-loaded", paced_p50, 1.5, 4990),
    ]
    targets = {t["target"]: t for t in evaluate_targets(workloads)}
    assert targets["small4k"]["met"] is met, targets["small4k"]
    assert targets["small4k-loaded"]["met"] is loaded_met, targets["small4k-loaded"]
    assert f"p50 {alone_p50:.3f} ms" in targets["small4k"]["detail"]
    assert targets["bulk"]["met"] is None and targets["zmq"]["met"] is True
