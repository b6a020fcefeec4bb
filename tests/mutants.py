"""``make mutants``: revert each guarded fix for a moment and check that its tests fail.

Each :class:`Mutant` is a hand-written revert of one fix the project guards (the
sender races of seed 004, the wake-up rule of seed 001, issue-9 guards): a few
exact text replacements and the tests that must catch it. The runner copies the
working tree (tracked and untracked, not ignored files) into a temporary
directory once, checks that every named test passes there unchanged (the
baseline), then, mutant by mutant, applies the replacements, runs only that
mutant's tests, and puts the files back.

One line per mutant::

    killed    seed004-2-reopen            7.9 s  tests failed, as they must
    survived  seed001-owner-loop          6.1 s  the tests PASSED with the fix reverted
    stale     seed004-4-cancel-unlocked   0.0 s  old text not found in kvxferd/session.py

The exit code is 0 only when every mutant was killed. A *stale* mutant (its old
text is no longer in the file, or is there more than once) fails the run too:
the code it guarded moved, so the mutant must be rewritten to follow it. Keep the
old texts short and specific, so ordinary edits around them do not make them stale.

Run: ``python tests/mutants.py`` (``--list``, ``--only NAME``, ``--keep`` to keep the copy).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTEST_TIMEOUT_S = 60  # per test (pytest-timeout): a hang under a mutant counts as a failure
RUN_TIMEOUT_S = 240  # per mutant run, as a last resort


@dataclass(frozen=True)
class Edit:
    file: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutant:
    name: str
    why: str  # the fix it reverts
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]


RACES = "tests/test_races.py::"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "seed004-1-shared-dealer",
        "workers send Results on the shared DEALER pool instead of their own DEALERs",
        (
            Edit(
                "kvxferd/worker.py",
                "send_bounded(sock, out.frame)",
                "self.host._shared.send(endpoint, out.frame)  # type: ignore[attr-defined]",
            ),
        ),
        (RACES + "test_workers_send_results_only_on_their_own_dealers",),
    ),
    Mutant(
        "seed004-2-reopen",
        "admission no longer refuses a write of an ended session (a failed session is reopened)",
        (
            Edit(
                "kvxferd/session.py",
                "if self._state in TX_TERMINAL:\n                reason = self._refusal_reason()",
                "if False:\n                reason = self._refusal_reason()",
            ),
        ),
        (RACES + "test_failed_session_refuses_a_queued_slice_and_stays_failed",),
    ),
    Mutant(
        "seed004-3-drained-ignores-writes",
        "an ended session counts as drained while an admitted write is in flight",
        (
            Edit(
                "kvxferd/session.py",
                "return self._state in TX_TERMINAL and self._writes_in_flight == 0",
                "return self._state in TX_TERMINAL",
            ),
        ),
        (RACES + "test_failed_session_keeps_its_source_until_the_other_write_returns",),
    ),
    Mutant(
        "seed004-4-admission-unlocked",
        "admission checks the session's state without the lock that commits its ending",
        (
            Edit(
                "kvxferd/session.py",
                "with self._lock:\n            if self._state in TX_TERMINAL:\n"
                "                reason = self._refusal_reason()",
                "with threading.Lock():\n            if self._state in TX_TERMINAL:\n"
                "                reason = self._refusal_reason()",
            ),
        ),
        (RACES + "test_an_ending_during_an_admission_waits_for_it",),
    ),
    Mutant(
        "seed004-4-cancel-unlocked",
        "cancel commits the session's ending without the lock admission runs under",
        (
            Edit(
                "kvxferd/session.py",
                "with self._lock:\n"
                "            committed = self._commit_locked(TxOutcome(TxState.CANCELLED,",
                "with threading.Lock():\n"
                "            committed = self._commit_locked(TxOutcome(TxState.CANCELLED,",
            ),
        ),
        (RACES + "test_an_ending_during_an_admission_waits_for_it",),
    ),
    Mutant(
        "seed004-4-fail-unlocked",
        "fail commits the session's ending without the lock admission runs under",
        (
            Edit(
                "kvxferd/session.py",
                "with self._lock:\n"
                "            committed = self._commit_locked(TxOutcome(TxState.FAILED, reason, detail))",
                "with threading.Lock():\n"
                "            committed = self._commit_locked(TxOutcome(TxState.FAILED, reason, detail))",
            ),
        ),
        (RACES + "test_an_ending_during_an_admission_waits_for_it",),
    ),
    Mutant(
        "seed004-5-completion-overwrites",
        "a later outcome (a completion) overwrites the first terminal outcome",
        (
            Edit(
                "kvxferd/session.py",
                "if self._state in TX_TERMINAL:\n            return False\n"
                "        self._state, self._outcome = outcome.state, outcome",
                "self._state, self._outcome = outcome.state, outcome",
            ),
        ),
        (RACES + "test_completion_never_overwrites_the_first_ending",),
    ),
    Mutant(
        "seed004-6-unbounded-send",
        "DEALER sends block without a deadline (SNDTIMEO -1)",
        (
            Edit(
                "kvxferd/control.py",
                "sock.setsockopt(zmq.SNDTIMEO, send_timeout_ms)",
                "sock.setsockopt(zmq.SNDTIMEO, -1)",
            ),
        ),
        (
            RACES + "test_shutdown_is_bounded_when_a_worker_send_blocks",
            RACES + "test_shutdown_is_bounded_when_a_receiver_never_reads_its_parked_refusals",
        ),
    ),
    Mutant(
        "seed004-7-thread-count",
        "a thread count below 1 is accepted",
        (
            Edit("kvxferd/config.py", "if value < 1:", "if value < -(10**9):"),
            Edit(
                "kvxferd/config.py",
                "DEFAULT_NUM_THREADS,\n        ge=1,",
                "DEFAULT_NUM_THREADS,\n        ge=-(10**9),",
            ),
        ),
        (RACES + "test_num_threads_rejects_non_positive_or_non_numeric_values",),
    ),
    Mutant(
        "seed004-8-build-failure-keeps-admission",
        "a write that was never posted does not give its admission back",
        (
            Edit(
                "kvxferd/session.py",
                "            self._writes_in_flight -= 1\n"
                "            sl.writes_in_flight -= 1\n"
                "            self._fail_slice_locked(sl, Reason.BUILD_FAILED, detail)",
                "            self._fail_slice_locked(sl, Reason.BUILD_FAILED, detail)",
            ),
        ),
        (RACES + "test_build_failure_releases_its_admission_before_reporting",),
    ),
    Mutant(
        "seed001-owner-loop",
        "every asyncio waiter is woken through the first waiter's loop",
        (
            Edit(
                "kvxferd/waiters.py",
                "loop.call_soon_threadsafe(_resolve, fut, value)",
                "futures[0][0].call_soon_threadsafe(_resolve, fut, value)",
            ),
        ),
        ("tests/test_waiters.py::test_each_waiter_wakes_on_its_own_loop",),
    ),
    Mutant(
        "issue9-endpoint-wildcard",
        "a wildcard host (tcp://0.0.0.0:P, tcp://*:P) is accepted as an endpoint to dial",
        (Edit("kvxferd/endpoints.py", "if host in _WILDCARDS:", "if False:"),),
        ("tests/test_endpoints.py",),
    ),
    Mutant(
        "issue9-endpoint-source-syntax",
        "libzmq's source syntax tcp://a:1;b:2 is accepted",
        (Edit("kvxferd/endpoints.py", 'if ";" in endpoint:', "if False:"),),
        ("tests/test_endpoints.py",),
    ),
    Mutant(
        "issue9-guard-counts",
        "an exception caught in a long-lived loop is not counted",
        (Edit("kvxferd/guard.py", 'self._stats.add("thread_errors")', "pass"),),
        ("tests/test_faults_guard.py",),
    ),
    Mutant(
        "issue9-guard-liveness",
        "an exception caught in a long-lived loop does not make the component report itself broken",
        (
            Edit(
                "kvxferd/guard.py",
                "if self._first is None:\n                import sys",
                "if False:\n                import sys",
            ),
        ),
        ("tests/test_faults_guard.py",),
    ),
)


# -- the runner ------------------------------------------------------------------------------


def copy_tree(dest: Path) -> None:
    """Tracked and untracked (not ignored) files of the working tree, as they are now."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    for rel in sorted(set(out.decode().split("\0")) - {""}):
        src = ROOT / rel
        if not src.is_file():  # deleted in the working tree, or a submodule
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def run_tests(tree: Path, tests: list[str]) -> tuple[int, float, str]:
    """pytest on ``tests`` inside ``tree``: (exit code, seconds, output tail); 124 on timeout."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        f"--timeout={PYTEST_TIMEOUT_S}",
        *tests,
    ]
    t0 = time.monotonic()
    try:
        done = subprocess.run(
            cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code, text = 124, f"timed out after {RUN_TIMEOUT_S} s: {e.stdout!r}"
    return code, time.monotonic() - t0, "\n".join(text.strip().splitlines()[-15:])


def check_edits(tree: Path, m: Mutant) -> str | None:
    """Why the mutant cannot be applied (stale or ambiguous), or None."""
    for e in m.edits:
        path = tree / e.file
        if not path.is_file():
            return f"{e.file} does not exist"
        n = path.read_text().count(e.old)
        if n != 1:
            first = e.old.strip().splitlines()[0]
            where = "not found" if n == 0 else f"found {n} times"
            return f"old text {where} in {e.file}: {first!r}"
    return None


def apply(tree: Path, m: Mutant) -> dict[Path, str]:
    originals: dict[Path, str] = {}
    for e in m.edits:
        path = tree / e.file
        text = path.read_text()
        originals.setdefault(path, text)
        path.write_text(text.replace(e.old, e.new, 1))
    return originals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--only", action="append", default=[], help="run only this mutant (repeat)")
    p.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = p.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name:42s} {m.why}\n{'':42s} tests: {' '.join(m.tests)}")
        return 0
    unknown = set(args.only) - {m.name for m in MUTANTS}
    if unknown:
        print(f"mutants: unknown mutant(s): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2

    tree = Path(tempfile.mkdtemp(prefix="kvxferd-mutants-"))
    started = time.monotonic()
    try:
        copy_tree(tree)
        tests = sorted({t for m in mutants for t in m.tests})
        code, secs, tail = run_tests(tree, tests)
        if code != 0:
            print(f"mutants: the named tests fail WITHOUT any mutant ({secs:.1f} s):\n{tail}")
            return 1
        print(f"baseline  {len(tests)} test selection(s) pass unchanged ({secs:.1f} s)")
        bad = 0
        for m in mutants:
            problem = check_edits(tree, m)
            if problem is not None:
                bad += 1
                print(f"stale     {m.name:40s}   0.0 s  {problem}: rewrite this mutant")
                continue
            originals = apply(tree, m)
            try:
                code, secs, tail = run_tests(tree, list(m.tests))
            finally:
                for path, text in originals.items():
                    path.write_text(text)
            if code == 1 or code == 124:
                how = "tests failed, as they must" if code == 1 else "tests hung (timed out)"
                print(f"killed    {m.name:40s} {secs:5.1f} s  {how}")
            elif code == 0:
                bad += 1
                print(f"survived  {m.name:40s} {secs:5.1f} s  the tests PASSED with: {m.why}")
            else:
                bad += 1
                print(
                    f"broken    {m.name:40s} {secs:5.1f} s  pytest exit {code} (not a test failure):"
                )
                print("          " + tail.replace("\n", "\n          "))
        total = time.monotonic() - started
        print(f"mutants: {len(mutants) - bad}/{len(mutants)} killed in {total:.0f} s")
        return 1 if bad else 0
    finally:
        if args.keep:
            print(f"mutants: copy kept at {tree}")
        else:
            shutil.rmtree(tree, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
