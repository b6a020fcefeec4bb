"""`kvxferd bench --hetero`: a tiny run reports 1P1D, 1P2D and 2P1D of the same run, their ratios, and checked bytes."""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import pytest

from kvxferd.bench import hetero
from kvxferd.bench.command import add_arguments, main_bench
from kvxferd.bench.hetero import (
    BASELINE,
    CASES,
    HeteroOptions,
    _Case,
    _full,
    format_hetero,
    run_hetero,
)
from kvxferd.bench.workload import BenchError

pytestmark = pytest.mark.integration

TINY = dict(
    layers=2, heads=2, head_size=8, tokens_per_block=4, blocks=2, requests=4, window=2, reps=2
)
FIGURES = ("gbps", "requests_per_s", "p50_ms", "p99_ms")


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.timeout(60)
def test_a_tiny_run_reports_every_case_and_its_ratio_to_equal_tp() -> None:
    """Every case has every figure (positive, p50 <= p99) and at least one byte-exact request,
    each repetition is kept, and each heterogeneous case's ratios are its figures over 1P1D's."""
    doc = run_hetero(HeteroOptions(**TINY))  # type: ignore[arg-type]
    json.dumps(doc)  # the --json document
    assert set(doc["cases"]) == set(CASES) == {"1P1D", "1P2D", "2P1D"}
    for name, f in doc["cases"].items():
        assert all(f[k] > 0 for k in FIGURES), (name, f)
        assert f["p50_ms"] <= f["p99_ms"]
        assert f["verified_requests"] >= 1
        assert len(doc["reps"][name]) == TINY["reps"]
        assert (f["prefill_tp"], f["decode_tp"]) == CASES[name]
        assert len(f["descriptors_per_piece"]) == {"1P1D": 1, "1P2D": 2, "2P1D": 2}[name]
        # every KV write went through the pieces' prepared lists (none built per request)
        assert f["posts"]["piece"] > 0 and f["posts"]["descs"] == 0, (name, f["posts"])
    base = doc["cases"][BASELINE]
    assert set(doc["ratio"]) == {"1P2D", "2P1D"}
    for name, r in doc["ratio"].items():
        f = doc["cases"][name]
        assert r["gbps"] == pytest.approx(f["gbps"] / base["gbps"])
        assert r["requests_per_s"] == pytest.approx(f["requests_per_s"] / base["requests_per_s"])
        assert r["p50"] == pytest.approx(f["p50_ms"] / base["p50_ms"])
        assert r["p99"] == pytest.approx(f["p99_ms"] / base["p99_ms"])
    assert len(doc["load_avg"]) == 3
    lines = format_hetero(doc).splitlines()
    assert [ln.split()[0] for ln in lines[2:]] == [
        "1P1D",
        "1P2D",
        "2P1D",
        "1P2D/1P1D",
        "2P1D/1P1D",
    ]
    assert "load" in lines[0]


@pytest.mark.timeout(60)
def test_every_case_moves_the_same_bytes_per_request() -> None:
    """The decode ranks of every case together hold the request's whole KV cache: the same
    bytes per request in 1P1D, 1P2D and 2P1D."""
    o = HeteroOptions(**TINY)  # type: ignore[arg-type]
    full = _full(o)
    for name in CASES:
        c = _Case(name, o, full)
        try:
            assert sum(w.numel() for w in c.want) == o.request_bytes, name
            assert (len(c.senders), len(c.receivers)) == CASES[name]
        finally:
            c.close()


@pytest.mark.timeout(60)
def test_a_wrong_byte_fails_the_check() -> None:
    """One byte changed in a prefill rank's published blocks makes the verified request fail
    with a BenchError naming the case: the check compares what arrived, not what was sent."""
    o = HeteroOptions(**TINY)  # type: ignore[arg-type]
    c = _Case("2P1D", o, _full(o))
    try:
        c.verified_request(time.monotonic() + 30)  # intact: passes
        view = c.senders[1].pool.kv_bytes_view()
        view[0, c.ids(0)[0], 0] ^= 0xFF
        with pytest.raises(BenchError, match="2P1D: decode rank 0 differs"):
            c.verified_request(time.monotonic() + 30)
    finally:
        c.close()


@pytest.mark.timeout(60)
def test_the_command_prints_the_table_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvxferd bench --hetero --reps 1 --json PATH` exits 0, prints every case and writes the document."""
    monkeypatch.setattr(hetero, "HeteroOptions", functools.partial(HeteroOptions, **TINY))
    path = tmp_path / "h.json"
    assert main_bench(_args("--hetero", "--reps", "1", "--json", str(path))) == 0
    out = capsys.readouterr().out
    assert "2P1D/1P1D" in out and "1P2D/1P1D" in out
    doc = json.loads(path.read_text())
    assert doc["kind"] == "hetero" and set(doc["cases"]) == set(CASES)
    assert doc["options"]["reps"] == 1


def test_hetero_refuses_the_other_modes() -> None:
    """--hetero with --quick, --curves or --scale is a usage error (exit 2)."""
    for extra in ("--quick", "--curves", "--scale"):
        assert main_bench(_args("--hetero", extra)) == 2
