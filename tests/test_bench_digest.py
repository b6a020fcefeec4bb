"""`kvxferd bench --digest`: the digest's own speed, and kvxferd with and without it next to raw NIXL, in one run."""

from __future__ import annotations

import argparse
import json

import pytest

from kvxferd.bench.command import add_arguments, main_bench
from kvxferd.bench.digest_cost import PATHS, WORKLOADS, format_digest_cost, run_digest_cost
from kvxferd.bench.workload import MiB, Options


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_tiny_run_reports_the_function_and_the_three_paths() -> None:
    """The function's GB/s per size, then each path of the workload verified, with the
    digest path's fetches checked: the table has a row per size and per workload."""
    opts = Options(reps=1, rep_bytes=1 * MiB, max_requests=20, timeout_s=150)
    doc = run_digest_cost(opts, WORKLOADS[:1], sizes_mib=(1,))
    json.dumps(doc)  # the --json document
    [f] = doc["function"]
    assert f["mib"] == 1 and f["gbps"] > 0
    [w] = doc["workloads"]
    assert set(w["paths"]) == set(PATHS)
    for p in w["paths"].values():
        assert p["verified"] and not p["failures"], p
    computed = {k: w["paths"][k]["sender_stats"].get("digests_computed", 0) for k in PATHS[:2]}
    assert computed["kvxferd"] == 0 and computed["kvxferd-digest"] > 0, computed
    text = format_digest_cost(doc)
    assert "| 1 MiB |" in text and f"| {w['name']} |" in text
    assert "bytes verified on every path" in text


def test_digest_takes_no_preset_flags() -> None:
    """--digest runs its own workloads: --quick or --only with it is a usage error (exit 2)."""
    assert main_bench(_args("--digest", "--quick")) == 2
    assert main_bench(_args("--digest", "--only", "bulk-1m-contig")) == 2
