"""``kvxferd bench --engine-path``: issue 22's engine-path figures, before and after, CURVE off and on.

Three figures, for requests of 16 KiB blocks (1 and 4 per request), through real daemons
started from the command line on loopback, with engines as separate processes that use
``kvxferd.engine.client`` only:

* p50 latency at 1 request in flight (the receiver engine's fetch call to the outcome),
* requests/s at 16 in flight,
* daemon CPU per request, both daemons together (every thread,
  ``/proc/PID/task/*/schedstat``), at 1 and at 16 in flight; the engines' beside it.

Each with security off and with CURVE on (a key pair per daemon, each allowing the other),
and for two trees: **after**, the tree this command runs from, and **before**, another
checkout (``--before PATH``) or a git revision (``--before-rev REV``, checked out with
``git worktree add`` into a temporary directory and removed at the end). Without either,
only the tree this command runs from is measured.

Every process of a tree runs that tree's code: its two daemons (``python -m kvxferd
sender|receiver``) and its two engines (:mod:`kvxferd.bench.engine_ab_driver`, run as a
file, which imports only the public client API of the tree under test) start with the
tree as working directory and ``PYTHONPATH``. Before anything is measured, a child started
the daemons' way and each engine report the ``kvxferd`` they imported; a tree whose
processes import another tree fails the run.

A security mode starts the processes of both trees (8 processes: 2 daemons and 2 engines
per tree) and keeps them for all its workloads. Each workload gets one warm-up repetition
per tree, then ``reps`` repetitions alternating before, after, before, after, ... One
repetition is::

    tx engine   publish: ``2 x inflight`` tasks, publishes run ahead of the fetches
    rx engine   fetch: ``inflight`` tasks, each request timed, a sample verified
    tx engine   finish: every publish ended (ok or counted as a failure)

with the CPU of the four processes read (schedstat) before the publishes and after the
finish. The report gives per figure the median and [min-max] over the repetitions, the
ratio after/before of the medians, the targets of issue 22, and the host's load average
at the start and end of the run and of each workload (the host may be shared).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, Any

import numpy as np

from kvxferd.bench.child import _LineReader
from kvxferd.bench.engine_path import daemon_cpu_s
from kvxferd.bench.report import machine_info
from kvxferd.bench.workload import BenchError
from kvxferd.launch import Daemon, LaunchError

KiB = 1 << 10
BLOCK_KIB = 16
POOL_BLOCKS = 4096  # 64 MiB of 16 KiB blocks: small requests should not all sit in a cache
SENDER_THREADS = 4  # as the bench's other engine workloads
# Bounded, so a request that goes wrong fails in seconds, and a stop drains quickly.
DAEMON_DEADLINES = dict(
    kv_transfer_timeout_ms=30_000,
    publish_ttl_ms=30_000,
    pending_fetch_ttl_ms=30_000,
    register_timeout_ms=5_000,
    drain_timeout_ms=1_000,
    shutdown_timeout_ms=5_000,
)

READY_TIMEOUT_S = 90.0  # daemons and engines of both trees starting at once on 2 loaded cores
STEP_TIMEOUT_S = 60.0  # one publish start / one probe
EXIT_TIMEOUT_S = 10.0  # SIGTERM -> exit, then SIGKILL
GIT_TIMEOUT_S = 120.0  # a worktree checkout of the whole tree

TARGET_P50_MS = 0.5  # at 1 in flight
TARGET_RPS = 5000.0  # at 16 in flight
TARGET_DAEMON_CPU_US = 300.0  # both daemons, per request, at 1 and at 16 in flight

MODES = ("off", "curve")
TREES = ("before", "after")
DRIVER = Path(__file__).with_name("engine_ab_driver.py")
# ``python -c BOOT DRIVER ROLE SPEC``: the driver runs as __main__ with argv [DRIVER, ROLE, SPEC],
# and sys.path[0] is '' (the working directory, the tree), not the driver's directory.
BOOT = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


@dataclass(frozen=True)
class Case:
    """One workload: ``blocks`` blocks of 16 KiB per request, ``inflight`` requests in flight."""

    name: str
    blocks: int
    inflight: int
    requests: int  # per repetition

    @property
    def request_bytes(self) -> int:
        return self.blocks * BLOCK_KIB * KiB


CASES: tuple[Case, ...] = (
    Case("16k-x1-w1", 1, 1, 1000),
    Case("16k-x1-w16", 1, 16, 2000),
    Case("16k-x4-w1", 4, 1, 1000),
    Case("16k-x4-w16", 4, 16, 2000),
)


@dataclass(frozen=True)
class Tree:
    """A checkout whose daemons and engines are measured."""

    label: str  # "before" | "after"
    path: Path
    source: str  # how it was chosen: "this tree", "--before", "--before-rev REV"


@dataclass(frozen=True)
class AbOptions:
    after: Path
    before: Path | None = None
    before_source: str = "--before"
    cases: tuple[Case, ...] = CASES
    modes: tuple[str, ...] = MODES
    reps: int = 5
    seed: int = 1
    verify_every: int = 8  # the rx engine checks the bytes of every 8th request of each slot
    timeout_s: float = 3600.0  # the whole run

    def trees(self) -> list[Tree]:
        after = Tree("after", self.after, "this tree")
        if self.before is None:
            return [after]
        return [Tree("before", self.before, self.before_source), after]


def this_tree() -> Path:
    """The checkout this code runs from (the directory that holds the ``kvxferd`` package)."""
    import kvxferd

    return Path(kvxferd.__file__).resolve().parent.parent


# -- git ------------------------------------------------------------------------------------
def _git(repo: Path, *args: str, check: bool = True) -> str:
    try:
        r = subprocess.run(
            ["git", "-C", str(repo), *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        if check:
            raise BenchError(f"git {' '.join(args)}: {e}") from None
        return ""
    if r.returncode and check:
        raise BenchError(f"git {' '.join(args)}: {r.stderr.strip()[-500:]}")
    return r.stdout.strip() if not r.returncode else ""


def describe_tree(path: Path) -> dict[str, Any]:
    """The tree's commit, branch and whether tracked files differ from it ('' where not git)."""
    rev = _git(path, "rev-parse", "--short", "HEAD", check=False)
    return {
        "path": str(path),
        "rev": rev,
        "branch": _git(path, "rev-parse", "--abbrev-ref", "HEAD", check=False) if rev else "",
        "dirty": bool(_git(path, "status", "--porcelain", "--untracked-files=no", check=False))
        if rev
        else False,
    }


@contextmanager
def checkout_rev(repo: Path, rev: str) -> Iterator[Path]:
    """``rev`` of ``repo`` checked out (``git worktree add --detach``) into a temporary directory;
    the worktree is removed (and pruned) on the way out."""
    if not rev or rev.startswith("-"):
        raise BenchError(f"not a revision: {rev!r}")
    sha = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
    if not sha:
        raise BenchError(f"{rev!r} is not a commit of the repository at {repo}")
    tmp = Path(tempfile.mkdtemp(prefix="kvxferd-before-"))
    dest = tmp / f"before-{sha[:12]}"
    try:
        _git(repo, "worktree", "add", "--detach", "--quiet", str(dest), sha)
        yield dest
    finally:
        if dest.exists():
            _git(repo, "worktree", "remove", "--force", str(dest), check=False)
        shutil.rmtree(tmp, ignore_errors=True)
        _git(repo, "worktree", "prune", check=False)


# -- processes --------------------------------------------------------------------------------
def tree_env(tree: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (or this environment) with ``tree`` as the only PYTHONPATH entry."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = str(tree)
    env.pop("PYTHONSAFEPATH", None)  # -m and -c must put the working directory (the tree) first
    env.pop("PYTHONHOME", None)
    return env


def probe_import(tree: Path) -> str:
    """``kvxferd.__file__`` as a child started the daemons' way (cwd, PYTHONPATH) imports it."""
    try:
        r = subprocess.run(
            [sys.executable, "-c", "import kvxferd; print(kvxferd.__file__)"],
            cwd=tree,
            env=tree_env(tree),
            capture_output=True,
            text=True,
            timeout=STEP_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise BenchError(
            f"importing kvxferd from {tree} took over {STEP_TIMEOUT_S:.0f} s"
        ) from None
    if r.returncode:
        raise BenchError(f"importing kvxferd from {tree} failed: {r.stderr.strip()[-500:]}")
    return r.stdout.strip().splitlines()[-1]


def _inside(file: str, tree: Path) -> bool:
    return Path(file).resolve().is_relative_to(tree.resolve())


POOL = dict(
    num_layers=1,
    num_blocks=POOL_BLOCKS,
    block_elems=BLOCK_KIB * KiB,
    dtype="uint8",
    aux_slots=4,
    aux_slot_bytes=64,
    device="cpu",
)


def daemon_env(
    tree: Path, workdir: Path, name: str, security: dict[str, str] | None
) -> dict[str, str]:
    """A daemon's environment: the bench's pool and deadlines, its sockets in ``workdir``.

    Written out here, not taken from the demo's helper: a daemon refuses a setting it does
    not know, so both trees get only settings that both know (none from this environment:
    no ``KVXFERD_*`` variable of the caller reaches a daemon). ``security``: the
    ``KVXFERD_SECURITY__*`` variables of :func:`~kvxferd.demo.demo_keys`.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVXFERD_")}
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):  # not a systemd unit
        env.pop(key, None)
    for key, value in POOL.items():
        env[f"KVXFERD_POOL__{key.upper()}"] = str(value)
    for key, value in DAEMON_DEADLINES.items():
        env[f"KVXFERD_DEADLINES__{key.upper()}"] = str(value)
    env["KVXFERD_SERVICE__ENGINE_SOCKET"] = f"ipc://{workdir}/{name}.sock"
    env["KVXFERD_SERVICE__PROBE_HOST"] = "127.0.0.1"
    env["KVXFERD_SERVICE__PROBE_PORT"] = "0"
    env.update(security or {"KVXFERD_SECURITY__MODE": "off"})
    return tree_env(tree, env)


class _Daemon:
    """``python -m kvxferd sender|receiver`` of one tree (a :class:`kvxferd.launch.Daemon` run
    from the tree's directory); stdout and stderr to files."""

    def __init__(
        self, tree: Path, role: str, name: str, workdir: Path, security: dict[str, str] | None
    ) -> None:
        self.name = name
        env = daemon_env(tree, workdir, name, security)
        args = []
        if role == "sender":
            args += ["--listen", "tcp://127.0.0.1:0", "--num-threads", str(SENDER_THREADS)]
        self.child = Daemon(role, name, workdir, args, env=env, cwd=tree)
        self.proc = self.child.proc
        self.ready: dict[str, Any] = {}

    def wait_ready(self, deadline: float) -> None:
        try:
            self.ready = self.child.wait_ready(deadline)
        except LaunchError as e:
            raise BenchError(str(e)) from None

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise BenchError(
                f"daemon {self.name} exited ({self.proc.returncode}):{self.child.tail()}"
            )

    def terminate(self) -> None:
        self.child.terminate()

    def reap(self) -> None:
        self.child.reap(time.monotonic() + EXIT_TIMEOUT_S)


class _Engine:
    """An engine process of one tree: the driver file, JSON lines in and out."""

    def __init__(self, tree: Path, role: str, spec: dict[str, Any]) -> None:
        self.name = f"{role} engine"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                BOOT,
                str(DRIVER),
                role,
                json.dumps({**spec, "tree": str(tree)}),
            ],
            cwd=tree,
            env=tree_env(tree),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        self._lines = _LineReader(self.proc.stdout.fileno())
        self.hello: dict[str, Any] = {}

    def send(self, cmd: str, **fields: Any) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"cmd": cmd, **fields}) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise BenchError(f"{self.name} exited (code {self.proc.poll()})") from None

    def reply(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.readline(max(0.0, deadline - time.monotonic()))
            except EOFError:
                raise BenchError(f"{self.name} exited (code {self.proc.wait(5)})") from None
            if line is None:
                raise BenchError(f"{self.name}: no reply within {timeout:.0f} s")
            if not line.startswith(b"{"):
                sys.stderr.buffer.write(line + b"\n")
                continue
            msg: dict[str, Any] = json.loads(line)
            if msg.get("event") == "error":
                raise BenchError(msg.get("detail", "engine error"))
            return msg

    def ask(self, timeout: float, cmd: str, **fields: Any) -> dict[str, Any]:
        self.send(cmd, **fields)
        return self.reply(timeout)

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send("exit")
                self.proc.wait(EXIT_TIMEOUT_S)
        except (BenchError, subprocess.TimeoutExpired, OSError):
            self.proc.kill()
            self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


def _run_timeout_s(count: int) -> float:
    return 60.0 + count * 0.05  # a floor of 20 requests/s


class _Stack:
    """One tree in one security mode: its sender and receiver daemons and their two engines."""

    def __init__(self, tree: Tree, mode: str, opts: AbOptions, run: str) -> None:
        self.tree, self.mode, self.opts = tree, mode, opts
        self.dir = Path(tempfile.mkdtemp(prefix="kvxab-"))  # short: ipc socket paths
        self.daemons: list[_Daemon] = []
        self.engines: list[_Engine] = []
        self.spec = {"seed": opts.seed, "run": run, "max_s": opts.timeout_s + 600}
        sname, rname = f"ab-{tree.label}-{mode}-tx", f"ab-{tree.label}-{mode}-rx"
        security: dict[str, dict[str, str]] = {}
        if mode == "curve":
            from kvxferd.demo import demo_keys

            security = demo_keys(self.dir / "keys", sname, [rname])
        try:
            for role, name in (("sender", sname), ("receiver", rname)):
                self.daemons.append(_Daemon(tree.path, role, name, self.dir, security.get(name)))
        except BaseException:
            self.stop()
            raise

    @property
    def sender(self) -> _Daemon:
        return self.daemons[0]

    @property
    def receiver(self) -> _Daemon:
        return self.daemons[1]

    def start_engines(self, deadline: float) -> None:
        for d in self.daemons:
            d.wait_ready(deadline)
        for role, d in (("tx", self.sender), ("rx", self.receiver)):
            self.engines.append(
                _Engine(self.tree.path, role, {**self.spec, "socket": d.ready["engine_socket"]})
            )

    def hello(self, deadline: float) -> dict[str, Any]:
        """The engines' hellos, checked: each imported kvxferd from this stack's tree."""
        for e in self.engines:
            e.hello = e.reply(max(1.0, deadline - time.monotonic()))
            if not _inside(e.hello["kvxferd_file"], self.tree.path):
                raise BenchError(
                    f"the {self.tree.label} {e.name} imported {e.hello['kvxferd_file']}, "
                    f"not the tree at {self.tree.path}"
                )
        tx, rx = self.engines
        if tx.hello["api"] != rx.hello["api"]:
            raise BenchError(f"the {self.tree.label} engines differ: {tx.hello} {rx.hello}")
        if rx.hello["num_blocks"] != tx.hello["num_blocks"]:
            raise BenchError("the two daemons' pools differ")
        return {"engine_api": tx.hello["api"], "engine_kvxferd_file": tx.hello["kvxferd_file"]}

    def cpu(self) -> list[float]:
        """CPU seconds so far: sender, receiver, tx engine, rx engine (every thread)."""
        pids = [d.proc.pid for d in self.daemons] + [e.proc.pid for e in self.engines]
        return [daemon_cpu_s(p) for p in pids]

    def rep(self, tag: int, rep: int, case: Case, count: int) -> dict[str, Any]:
        for d in self.daemons:
            d.alive()
        tx, rx = self.engines
        timeout = _run_timeout_s(count)
        step = dict(tag=tag, rep=rep, count=count, blocks=case.blocks)
        cpu0 = self.cpu()
        tx.ask(STEP_TIMEOUT_S, "publish", lead=2 * case.inflight, **step)
        got = rx.ask(
            timeout + 5,
            "fetch",
            inflight=case.inflight,
            endpoint=self.sender.ready["endpoint"],
            verify_every=self.opts.verify_every,
            timeout_s=timeout,
            **step,
        )
        fin = tx.ask(timeout + 5, "finish", timeout_s=timeout)
        cpu = [b - a for a, b in zip(cpu0, self.cpu(), strict=True)]
        lat = (
            np.asarray(got["lat_us"], dtype=float) / 1000 if got["lat_us"] else np.asarray([np.nan])
        )
        elapsed = got["t1"] - got["t0"]
        return {
            "rep": rep,
            "requests": count,
            "ok": got["ok"],
            "failures": got["failures"] + fin["failures"],
            "bytes": got["bytes"],
            "elapsed_s": elapsed,
            "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)),
            "rps": got["ok"] / elapsed if elapsed > 0 else 0.0,
            "daemon_cpu_us": (cpu[0] + cpu[1]) / count * 1e6,
            "sender_cpu_us": cpu[0] / count * 1e6,
            "receiver_cpu_us": cpu[1] / count * 1e6,
            "engine_cpu_us": (cpu[2] + cpu[3]) / count * 1e6,
            "checked": got["checked"],
            "bad": got["bad"],
            "load_1min": _load()[0],  # at the end of the repetition
            "verified": not got["bad"]
            and got["checked"] > 0
            and got["bytes"] == got["ok"] * case.request_bytes,
        }

    def stop(self) -> None:
        for e in self.engines:
            e.stop()
        for d in self.daemons:
            d.terminate()
        for d in self.daemons:
            d.reap()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- the run ----------------------------------------------------------------------------------
FIGURES = (
    "p50_ms",
    "p99_ms",
    "rps",
    "daemon_cpu_us",
    "engine_cpu_us",
    "sender_cpu_us",
    "receiver_cpu_us",
)


def _spread(values: Sequence[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max())}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def summarize(reps: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {f: _spread([r[f] for r in reps]) for f in FIGURES}
    out["failures"] = sum(r["failures"] for r in reps)
    out["checked"] = sum(r["checked"] for r in reps)
    out["verified"] = all(r["verified"] for r in reps)
    out["reps"] = reps
    return out


def _ratios(trees: dict[str, Any]) -> dict[str, float | None]:
    if "before" not in trees:
        return {}
    out: dict[str, float | None] = {}
    for f in FIGURES:
        den = trees["before"][f]["median"]
        out[f] = trees["after"][f]["median"] / den if den > 0 else None
    return out


class _Run:
    def __init__(self, opts: AbOptions, progress: IO[str]) -> None:
        self.opts, self.progress = opts, progress
        self.deadline = time.monotonic() + opts.timeout_s
        self.run_id = f"{int(time.time()) % 100000}"

    def say(self, text: str) -> None:
        self.progress.write(text + "\n")
        self.progress.flush()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise BenchError(f"the run passed its {self.opts.timeout_s:.0f} s bound")

    def run(self) -> dict[str, Any]:
        opts = self.opts
        started, load_start = time.time(), _load()
        trees: dict[str, Any] = {}
        for t in opts.trees():
            info = {**describe_tree(t.path), "source": t.source}
            info["kvxferd_file"] = probe_import(t.path)
            if not _inside(info["kvxferd_file"], t.path):
                raise BenchError(
                    f"the {t.label} tree's daemons would import {info['kvxferd_file']}, "
                    f"not the tree at {t.path}"
                )
            trees[t.label] = info
        self.say(
            "bench --engine-path: "
            + "; ".join(f"{k} {_tree_text(v)}" for k, v in trees.items())
            + f"; load average {_load_text(load_start)}"
        )
        modes: dict[str, Any] = {}
        for m, mode in enumerate(opts.modes):
            self.check_time()
            modes[mode] = self._mode(m, mode, trees)
        doc = {
            "version": 1,
            "command": "kvxferd bench --engine-path",
            "started_unix": started,
            "elapsed_s": time.time() - started,
            "load_avg": {"start": load_start, "end": _load()},
            "machine": machine_info(),
            "reps": opts.reps,
            "seed": opts.seed,
            "block_bytes": BLOCK_KIB * KiB,
            "pool_blocks": POOL_BLOCKS,
            "sender_threads": SENDER_THREADS,
            "verify_every": opts.verify_every,
            "trees": trees,
            "modes": modes,
        }
        doc["targets"] = evaluate_targets(doc)
        doc["ok"] = all(
            t["failures"] == 0 and t["verified"]
            for md in modes.values()
            for c in md["cases"].values()
            for t in c["trees"].values()
        )
        return doc

    def _mode(self, m: int, mode: str, trees: dict[str, Any]) -> dict[str, Any]:
        opts = self.opts
        self.say(f"bench --engine-path: security {mode}: starting daemons and engines")
        stacks: dict[str, _Stack] = {}
        try:
            for t in opts.trees():
                stacks[t.label] = _Stack(t, mode, opts, self.run_id)
            deadline = time.monotonic() + READY_TIMEOUT_S
            for s in stacks.values():
                s.start_engines(deadline)
            for label, s in stacks.items():
                for k, v in s.hello(deadline).items():
                    if trees[label].setdefault(k, v) != v:
                        raise BenchError(f"the {label} tree's {k} changed between modes")
            cases: dict[str, Any] = {}
            for n, case in enumerate(opts.cases):
                self.check_time()
                cases[case.name] = self._case(m * 100 + n, mode, case, stacks)
        finally:
            for s in stacks.values():
                s.stop()
        return {"cases": cases}

    def _case(self, tag: int, mode: str, case: Case, stacks: dict[str, _Stack]) -> dict[str, Any]:
        opts = self.opts
        load0 = _load()
        warmup = min(case.requests, max(64, 4 * case.inflight))
        for s in stacks.values():
            s.rep(tag, -1, case, warmup)
        reps: dict[str, list[dict[str, Any]]] = {label: [] for label in stacks}
        for r in range(opts.reps):
            self.check_time()
            for label, s in stacks.items():  # before, after, before, after, ...
                reps[label].append(s.rep(tag, r, case, case.requests))
            figs = ", ".join(
                f"{label} {reps[label][-1]['p50_ms']:.3f} ms p50, {reps[label][-1]['rps']:.0f} req/s, "
                f"daemons {reps[label][-1]['daemon_cpu_us']:.0f} us/req"
                for label in stacks
            )
            self.say(
                f"  {mode} {case.name} rep {r + 1}/{opts.reps}: {figs} (load {_load()[0]:.2f})"
            )
        by_tree = {label: summarize(rs) for label, rs in reps.items()}
        return {
            **asdict(case),
            "request_bytes": case.request_bytes,
            "load_avg": {"start": load0, "end": _load()},
            "trees": by_tree,
            "ratio_after_before": _ratios(by_tree),
        }


@contextmanager
def _terminated_as_exit() -> Iterator[None]:
    """SIGTERM ends the run through its ``finally`` blocks (daemons stopped, worktree removed)."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    try:
        old = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: nothing to install
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_engine_ab(opts: AbOptions, progress: IO[str] | None = None) -> dict[str, Any]:
    """Run the A/B and return its document (what ``--json`` writes)."""
    with _terminated_as_exit():
        return _Run(opts, progress or sys.stderr).run()


# -- targets and the report -------------------------------------------------------------------
def evaluate_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 22's targets per security mode and request size, met or not by the after tree."""
    out: list[dict[str, Any]] = []
    for mode, md in doc["modes"].items():
        for c in md["cases"].values():
            checks: list[tuple[str, str, float, bool]] = []
            if c["inflight"] == 1:
                checks.append(
                    (f"p50 <= {TARGET_P50_MS} ms at 1 in flight", "p50_ms", TARGET_P50_MS, False)
                )
            if c["inflight"] == 16:
                checks.append(
                    (f">= {TARGET_RPS:.0f} req/s at 16 in flight", "rps", TARGET_RPS, True)
                )
            checks.append(
                (
                    f"daemon CPU <= {TARGET_DAEMON_CPU_US / 1000} ms/request at {c['inflight']} in flight",
                    "daemon_cpu_us",
                    TARGET_DAEMON_CPU_US,
                    False,
                )
            )
            for text, fig, bound, at_least in checks:
                values = {k: v[fig]["median"] for k, v in c["trees"].items()}
                after = values["after"]
                out.append(
                    {
                        "target": f"{fig}@{c['name']}/{mode}",
                        "text": text,
                        "security": mode,
                        "case": c["name"],
                        "figure": fig,
                        "bound": bound,
                        "before": values.get("before"),
                        "after": after,
                        "met": after >= bound if at_least else after <= bound,
                    }
                )
    return out


UNITS = {
    "p50_ms": ("p50 ms", 3),
    "p99_ms": ("p99 ms", 3),
    "rps": ("req/s", 0),
    "daemon_cpu_us": ("daemon CPU us/req", 0),
    "engine_cpu_us": ("engine CPU us/req", 0),
}


def _target_value(fig: str, value: float | None) -> str:
    if value is None:
        return "-"
    if fig == "rps":
        return f"{value:.0f} req/s"
    if fig == "daemon_cpu_us":
        return f"{value / 1000:.3f} ms"
    return f"{value:.3f} ms"


def _tree_text(t: dict[str, Any]) -> str:
    rev = t["rev"] or "not a git checkout"
    if t["rev"] and t["branch"] and t["branch"] != "HEAD":
        rev = f"{t['branch']}@{rev}"
    dirty = " + uncommitted changes" if t.get("dirty") else ""
    return f"{rev}{dirty} ({t['source']}, {t['path']})"


def _load_text(load: Sequence[float]) -> str:
    return " ".join(f"{x:.2f}" for x in load)


def format_engine_ab(doc: dict[str, Any]) -> str:
    m, trees = doc["machine"], doc["trees"]
    both = "before" in trees
    lines = [
        f"kvxferd bench --engine-path: 16 KiB blocks, real daemons on loopback, engines through "
        f"kvxferd.engine.client; {doc['reps']} repetitions"
        + (" alternating before/after" if both else "")
        + f", median [min-max]; {doc['elapsed_s']:.0f} s",
        f"load average (1/5/15 min): {_load_text(doc['load_avg']['start'])} at start, "
        f"{_load_text(doc['load_avg']['end'])} at end; {m['nproc']} CPUs ({m['cpu_model']})",
    ]
    for label, t in trees.items():
        lines.append(f"{label}: {_tree_text(t)}; engine API {t.get('engine_api', '-')}")
    lines += [
        "",
        "| security | request | in flight | figure | before | after | after/before | load (1 min) |",
        "|---|---|--:|---|--:|--:|--:|---|",
    ]

    def cell(t: dict[str, Any] | None, fig: str) -> str:
        if t is None:
            return "-"
        d = UNITS[fig][1]
        s = t[fig]
        flag = "" if t["verified"] and not t["failures"] else " (!)"
        return f"{s['median']:.{d}f} [{s['min']:.{d}f}-{s['max']:.{d}f}]{flag}"

    for mode, md in doc["modes"].items():
        for c in md["cases"].values():
            la = c["load_avg"]
            for j, fig in enumerate(UNITS):
                r = c["ratio_after_before"].get(fig)
                head = (
                    f"| {mode} | 16 KiB x {c['blocks']} | {c['inflight']} " if j == 0 else "| | | "
                )
                load = f"{la['start'][0]:.2f}-{la['end'][0]:.2f}" if j == 0 else ""
                lines.append(
                    f"{head}| {UNITS[fig][0]} | {cell(c['trees'].get('before'), fig)} "
                    f"| {cell(c['trees']['after'], fig)} | {'-' if r is None else f'{r:.2f}'} "
                    f"| {load} |"
                )
    problems = [
        f"{mode} {c['name']} {label}: {t['failures']} failed requests, verified={t['verified']}"
        + "".join(f"; {b}" for r in t["reps"] for b in r["bad"][:1])
        for mode, md in doc["modes"].items()
        for c in md["cases"].values()
        for label, t in c["trees"].items()
        if t["failures"] or not t["verified"]
    ]
    checked = sum(
        t["checked"]
        for md in doc["modes"].values()
        for c in md["cases"].values()
        for t in c["trees"].values()
    )
    lines += [
        "",
        f"bytes verified through the engines' pool mappings: {checked} sampled requests "
        f"(1 in {doc['verify_every']} per slot)"
        if not problems
        else "PROBLEMS:",
    ]
    lines += [f"  {p}" for p in problems]
    lines += [
        "",
        "| target (issue 22) | security | request | before | after | met (after) |",
        "|---|---|---|--:|--:|---|",
    ]
    blocks = {c["name"]: c["blocks"] for md in doc["modes"].values() for c in md["cases"].values()}
    for t in doc["targets"]:
        lines.append(
            f"| {t['text']} | {t['security']} | 16 KiB x {blocks[t['case']]} "
            f"| {_target_value(t['figure'], t['before'])} | {_target_value(t['figure'], t['after'])} "
            f"| {'yes' if t['met'] else 'NOT met'} |"
        )
    return "\n".join(lines) + "\n"


# -- the command line ---------------------------------------------------------------------------
def options_from_args(args: Any) -> AbOptions:
    """The run ``kvxferd bench --engine-path`` flags ask for (BenchError on a bad combination)."""
    if args.before and args.before_rev:
        raise BenchError("--engine-path takes --before or --before-rev, not both")
    cases = CASES
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        known = {c.name: c for c in CASES}
        missing = [n for n in names if n not in known]
        if missing:
            raise BenchError(f"unknown engine-path workload(s) {missing}; known: {sorted(known)}")
        cases = tuple(known[n] for n in names)
    reps = 3 if args.quick else 5
    if args.reps is not None:
        if args.reps < 1:
            raise BenchError("--reps must be >= 1")
        reps = args.reps
    if args.requests is not None:
        if args.requests < 1:
            raise BenchError("--requests must be >= 1")
        cases = tuple(replace(c, requests=args.requests) for c in cases)
    elif args.quick:
        cases = tuple(replace(c, requests=c.requests // 2) for c in cases)
    modes = MODES if args.security == "both" else (args.security,)
    before: Path | None = None
    source = ""
    if args.before:
        before = Path(args.before).resolve()
        if not (before / "kvxferd" / "__init__.py").is_file():
            raise BenchError(f"--before {args.before}: no kvxferd package there")
        source = "--before"
    elif args.before_rev:
        source = f"--before-rev {args.before_rev}"
    return AbOptions(
        after=this_tree(),
        before=before,
        before_source=source,
        cases=cases,
        modes=modes,
        reps=reps,
        seed=args.seed,
        timeout_s=args.timeout_s,
    )


def main_engine_ab(args: Any) -> int:
    """``kvxferd bench --engine-path``: run, print, --json. 0 ok, 1 failed, 2 bad usage."""
    others = [
        flag
        for flag, on in (
            ("--plot", args.plot_path),
            ("--curves", args.curves),
            ("--scale", args.scale),
            ("--hetero", args.hetero),
            ("--curve-cost", args.curve_cost),
            ("--ucx-tls", args.ucx_tls),
            ("--ucx-error-handling-mode", args.ucx_error_handling_mode),
            ("--ucx-num-workers", args.ucx_num_workers),
            ("--sync-mode", args.sync_mode),
        )
        if on
    ]
    if others:
        print(f"kvxferd bench: --engine-path does not take {', '.join(others)}", file=sys.stderr)
        return 2
    try:
        opts = options_from_args(args)
    except BenchError as e:
        print(f"kvxferd bench: {e}", file=sys.stderr)
        return 2
    try:
        if args.before_rev:
            with checkout_rev(opts.after, args.before_rev) as before:
                doc = run_engine_ab(replace(opts, before=before))
        else:
            doc = run_engine_ab(opts)
    except BenchError as e:
        print(f"kvxferd bench: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(format_engine_ab(doc))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if doc["ok"] else 1


__all__ = [
    "CASES",
    "AbOptions",
    "Case",
    "checkout_rev",
    "evaluate_targets",
    "format_engine_ab",
    "main_engine_ab",
    "run_engine_ab",
]
