"""`kvxferd bench --curve-cost`: a tiny run reports CURVE's and plaintext's figures of the same run, and their ratio."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import zmq

from kvxferd.bench.command import add_arguments, main_bench
from kvxferd.bench.curve_cost import (
    MODES,
    CurveCostOptions,
    _dealer,
    _Echo,
    format_curve_cost,
    message_frames,
    run_curve_cost,
)
from kvxferd.transfer import protocol as wire

TINY = CurveCostOptions(requests=50, window=8, reps=2, blocks=64, timeout_s=60)
FIGURES = ("connect_ms", "p50_us", "p99_us", "msgs_per_s")


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.timeout(60)
def test_a_tiny_run_reports_both_modes_and_curve_over_plain() -> None:
    """Both modes have every figure (positive, p50 <= p99), each repetition is kept, the ratios are curve / plain, and the table prints both lines and the ratio."""
    doc = run_curve_cost(TINY)
    json.dumps(doc)  # the --json document
    assert set(doc["modes"]) == set(MODES) == {"plain", "curve"}
    for mode in MODES:
        m = doc["modes"][mode]
        assert all(m[k] > 0 for k in FIGURES), m
        assert m["p50_us"] <= m["p99_us"]
        assert len(doc["reps"][mode]) == TINY.reps
    plain, curve = doc["modes"]["plain"], doc["modes"]["curve"]
    assert doc["ratio"]["p50"] == pytest.approx(curve["p50_us"] / plain["p50_us"])
    assert doc["ratio"]["msgs_per_s"] == pytest.approx(curve["msgs_per_s"] / plain["msgs_per_s"])
    assert len(doc["load_avg"]) == 3
    text = format_curve_cost(doc)
    lines = text.splitlines()
    assert [ln.split()[0] for ln in lines[2:]] == ["plain", "curve", "curve/plain"]
    assert "load" in lines[0]


def test_the_messages_are_a_request_data_and_a_result_as_kvxferd_sends_them() -> None:
    """The timed frames decode as kvxferd's REQUEST_DATA (with the asked block count) and Result."""
    request, result = message_frames(64)
    msg = wire.decode_to_sender([request], 1 << 20)
    assert isinstance(msg, wire.RequestData) and len(msg.dst_blocks) == 64
    assert isinstance(wire.decode_to_receiver([result], 1 << 20), wire.Result)


@pytest.mark.timeout(10)
def test_curve_mode_sockets_are_curve_and_plain_ones_are_not() -> None:
    """The curve mode's DEALER and ROUTER use the CURVE mechanism; the plain mode's use none."""
    ctx = zmq.Context.instance()
    server, client = zmq.curve_keypair(), zmq.curve_keypair()
    for keys, mechanism in ((None, zmq.NULL), (server, zmq.CURVE)):
        echo = _Echo(ctx, b"r", keys)
        sock = _dealer(ctx, echo.endpoint, None if keys is None else (server[0], *client))
        try:
            assert sock.getsockopt(zmq.MECHANISM) == mechanism
            assert echo.sock.getsockopt(zmq.MECHANISM) == mechanism
        finally:
            sock.close(linger=0)
            echo.close()


@pytest.mark.timeout(60)
def test_the_command_prints_the_table_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvxferd bench --curve-cost --reps 1 --json PATH` exits 0, prints both modes and writes the document."""
    path = tmp_path / "cc.json"
    assert main_bench(_args("--curve-cost", "--reps", "1", "--json", str(path))) == 0
    out = capsys.readouterr().out
    assert "plain" in out and "curve/plain" in out
    doc = json.loads(path.read_text())
    assert doc["kind"] == "curve_cost" and set(doc["modes"]) == {"plain", "curve"}


def test_curve_cost_refuses_the_other_modes() -> None:
    """--curve-cost with --quick, --curves or --scale is a usage error (exit 2)."""
    for extra in ("--quick", "--curves", "--scale"):
        assert main_bench(_args("--curve-cost", extra)) == 2
