"""`kvxferd bench --engine-path`: the A/B of issue 22 on real daemons, and its engine driver."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvxferd.bench import engine_ab_driver as drv
from kvxferd.bench.command import add_arguments, main_bench
from kvxferd.bench.engine_ab import checkout_rev, daemon_env, this_tree


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


# -- the driver's content and its two APIs, in process ------------------------------------------
def test_the_check_passes_copied_blocks_and_catches_poison_and_a_flipped_byte() -> None:
    """A destination holding the source blocks passes; poisoned stamps or a changed body fail."""
    nb, bb = 64, 256
    src_kv, dst_kv = np.zeros((1, nb, bb), np.uint8), np.zeros((1, nb, bb), np.uint8)
    drv.fill(src_kv, seed=3)
    body = drv.tile(3, bb)[8:-8]
    srcs = drv.sources(3, tag=0, rep=0, count=10, blocks=4, nb=nb)
    dsts = drv.slots(3, inflight=2, blocks=4, nb=nb)
    assert all(len(set(s)) == 4 for s in srcs)
    assert not set(dsts[0]) & set(dsts[1])
    assert srcs == drv.sources(3, 0, 0, 10, 4, nb)  # both engines derive the same requests
    drv.poison(dst_kv, dsts[1])
    assert drv.check(dst_kv, srcs[5], dsts[1], body)
    dst_kv[:, dsts[1]] = src_kv[:, srcs[5]]
    assert drv.check(dst_kv, srcs[5], dsts[1], body) == ""
    assert drv.check(dst_kv, srcs[6], dsts[1], body)  # another request's blocks
    dst_kv[0, dsts[1][0], 100] ^= 0xFF
    assert "body" in drv.check(dst_kv, srcs[5], dsts[1], body)


class _OldClient:
    """publish / fetch, then wait(close=True); ``closed`` says whether that wait closed."""

    def __init__(self, closed: bool | None) -> None:
        self.calls: list[str] = []
        self.closed = closed

    async def publish(self, rid: str, blocks: list[int]) -> int:
        self.calls.append("publish")
        return 5

    async def fetch(self, rid: str, ep: str, blocks: list[int], *, want_aux: bool) -> int:
        self.calls.append("fetch")
        return 6

    async def wait(self, h: int, timeout: float, *, close: bool) -> Any:
        self.calls.append(f"wait {h} close={close}")
        return SimpleNamespace(ok=True, closed=self.closed, nbytes=16384, state="done")

    async def close(self, h: int, timeout: float) -> bool:
        self.calls.append(f"close {h}")
        return True


class _NewClient(_OldClient):
    """publish_wait / fetch_wait; the first fetch_wait ends before the outcome (state requested)."""

    def __init__(self, closed: bool | None) -> None:
        super().__init__(closed)
        self.pending_once = True

    async def publish_wait(
        self, rid: str, blocks: list[int], timeout: float, *, close: bool
    ) -> Any:
        self.calls.append(f"publish_wait close={close}")
        return SimpleNamespace(ok=True, closed=True, nbytes=0, state="complete")

    async def fetch_wait(
        self, rid: str, ep: str, blocks: list[int], timeout: float, *, close: bool, want_aux: bool
    ) -> Any:
        self.calls.append(f"fetch_wait close={close}")
        if self.pending_once:
            self.pending_once = False
            return SimpleNamespace(ok=False, closed=None, nbytes=0, state="requested", handle_id=9)
        return SimpleNamespace(ok=True, closed=True, nbytes=16384, state="done", handle_id=None)


def test_the_driver_uses_the_new_calls_when_the_client_has_them() -> None:
    """With publish_wait / fetch_wait: one call per request; a fetch that did not end is closed
    by its handle and counts as not ok; the old calls are never used."""
    c = _NewClient(closed=True)
    calls = drv.Calls(c)
    assert calls.new and calls.api.startswith("new")
    sent: list[int] = []

    async def go() -> tuple[bool, tuple[bool, int, float], tuple[bool, int, float]]:
        return (
            await calls.publish("r", [1], lambda: sent.append(1)),
            await calls.fetch("r", "tcp://127.0.0.1:1", [2]),
            await calls.fetch("r2", "tcp://127.0.0.1:1", [2]),
        )

    published, first, second = asyncio.run(go())
    assert published and sent == [1]
    assert first[:2] == (False, 0) and second[:2] == (True, 16384)
    assert c.calls == [
        "publish_wait close=True",
        "fetch_wait close=True",
        "close 9",
        "fetch_wait close=True",
    ]


@pytest.mark.parametrize("closed", [True, False])
def test_the_driver_uses_wait_close_on_the_old_api_and_closes_what_it_left_open(
    closed: bool,
) -> None:
    """Without the new calls: fetch + wait(close=True), and a close only when the wait did not."""
    c = _OldClient(closed=closed)
    calls = drv.Calls(c)
    assert not calls.new and calls.api.startswith("old")
    ok, nbytes, _ = asyncio.run(calls.fetch("r", "tcp://127.0.0.1:1", [2]))
    assert ok and nbytes == 16384
    assert c.calls == ["fetch", "wait 6 close=True"] + ([] if closed else ["close 6"])


def test_a_daemon_gets_the_tree_and_the_bench_settings_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tree is the only PYTHONPATH entry; no KVXFERD_* variable of the caller gets through
    (a daemon refuses settings it does not know, and the run must not depend on the shell)."""
    monkeypatch.setenv("KVXFERD_POOL__SHM_NAME", "someone-elses")
    monkeypatch.setenv("KVXFERD_SOMETHING__NEW", "1")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("PYTHONSAFEPATH", "1")
    env = daemon_env(tmp_path / "tree", tmp_path, "d", None)
    assert env["PYTHONPATH"] == str(tmp_path / "tree") and "PYTHONSAFEPATH" not in env
    assert "KVXFERD_POOL__SHM_NAME" not in env and "KVXFERD_SOMETHING__NEW" not in env
    assert env["KVXFERD_SECURITY__MODE"] == "off"
    assert env["KVXFERD_SERVICE__ENGINE_SOCKET"] == f"ipc://{tmp_path}/d.sock"
    assert env["KVXFERD_SERVICE__PROBE_HOST"] == "127.0.0.1"


# -- --before-rev: a git worktree, removed afterwards ---------------------------------------------
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.timeout(60)
def test_before_rev_checks_out_a_worktree_and_removes_it(tmp_path: Path) -> None:
    """The revision is checked out (its files, not the work tree's), and gone afterwards."""
    repo = tmp_path / "repo"
    (repo / "kvxferd").mkdir(parents=True)

    def git(*a: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *a],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout

    git("init", "-q")
    (repo / "kvxferd" / "__init__.py").write_text("V = 1\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    (repo / "kvxferd" / "__init__.py").write_text("V = 2\n")
    with checkout_rev(repo, "HEAD") as before:
        assert (before / "kvxferd" / "__init__.py").read_text() == "V = 1\n"
        assert len(git("worktree", "list").splitlines()) == 2
    assert not before.exists()
    assert len(git("worktree", "list").splitlines()) == 1


def test_engine_path_flags_that_do_not_combine_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """--before with --before-rev, an unknown workload or --curves: bad usage, nothing started."""
    for argv in (
        ("--before", ".", "--before-rev", "HEAD"),
        ("--only", "nope"),
        ("--curves",),
        ("--requests", "0"),
    ):
        assert main_bench(_args("--engine-path", *argv)) == 2, argv
    assert "kvxferd bench:" in capsys.readouterr().err


# -- tiny runs on real daemons ---------------------------------------------------------------------
TINY = ("--reps", "1", "--requests", "24", "--only", "16k-x1-w1,16k-x1-w16")


def _figures_ok(tree: dict[str, Any]) -> None:
    assert tree["failures"] == 0 and tree["verified"] and tree["checked"] > 0
    for fig in ("p50_ms", "rps", "daemon_cpu_us", "engine_cpu_us"):
        assert tree[fig]["median"] > 0, (fig, tree[fig])


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_tiny_run_of_this_tree_reports_both_security_modes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Security off and CURVE on, this tree only: every figure, bytes checked, the targets, the
    load average, and engines that imported this tree."""
    out = tmp_path / "ab.json"
    assert main_bench(_args("--engine-path", *TINY, "--json", str(out))) == 0
    doc = json.loads(out.read_text())
    assert set(doc["trees"]) == {"after"}
    assert Path(doc["trees"]["after"]["engine_kvxferd_file"]).is_relative_to(this_tree())
    assert set(doc["modes"]) == {"off", "curve"}
    for md in doc["modes"].values():
        assert set(md["cases"]) == {"16k-x1-w1", "16k-x1-w16"}
        for c in md["cases"].values():
            _figures_ok(c["trees"]["after"])
            assert c["ratio_after_before"] == {}
    assert len(doc["load_avg"]["start"]) == 3 and len(doc["load_avg"]["end"]) == 3
    assert {t["figure"] for t in doc["targets"]} == {"p50_ms", "rps", "daemon_cpu_us"}
    text = capsys.readouterr().out
    assert "load average" in text and "| target (issue 22)" in text and "NOT met" in text


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_before_runs_the_other_tree_in_every_process_of_its_side(tmp_path: Path) -> None:
    """--before a copy of this tree: the before side's daemons and engines import the copy, the
    after side's this tree; both sides measured, and the ratios are after / before."""
    copy = tmp_path / "before"
    shutil.copytree(
        this_tree() / "kvxferd", copy / "kvxferd", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path / "ab.json"
    argv = ("--engine-path", "--before", str(copy), "--security", "off", *TINY)
    assert main_bench(_args(*argv, "--json", str(out))) == 0
    doc = json.loads(out.read_text())
    before, after = doc["trees"]["before"], doc["trees"]["after"]
    for key in ("kvxferd_file", "engine_kvxferd_file"):
        assert Path(before[key]).is_relative_to(copy), before
        assert Path(after[key]).is_relative_to(this_tree()), after
    for c in doc["modes"]["off"]["cases"].values():
        _figures_ok(c["trees"]["before"])
        _figures_ok(c["trees"]["after"])
        b, a = c["trees"]["before"], c["trees"]["after"]
        assert c["ratio_after_before"]["rps"] == pytest.approx(
            a["rps"]["median"] / b["rps"]["median"]
        )
