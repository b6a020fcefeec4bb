"""The parent: starts the children, runs each workload's repetitions in alternation, reports."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from kvxferd.bench.child import _LineReader
from kvxferd.bench.plan import Plan
from kvxferd.bench.report import build_report, summarize_workload
from kvxferd.bench.workload import (
    CHILD_START_TIMEOUT_S,
    SETUP_TIMEOUT_S,
    SPINNING_PATHS,
    STEP_TIMEOUT_S,
    BenchError,
    Options,
    Workload,
)


class _Child:
    """A child process: commands in as JSON lines on stdin, replies out as JSON lines on stdout."""

    def __init__(self, module: str, role: str, spec: dict[str, Any]) -> None:
        self.name = f"{role}{spec.get('index', '')}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, f"_bench-{role}", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        self._lines = _LineReader(self.proc.stdout.fileno())

    def send(self, cmd: str, **fields: Any) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"cmd": cmd, **fields}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise BenchError(f"child {self.name} exited (code {self.proc.poll()})") from None

    def reply(self, timeout: float) -> dict[str, Any]:
        """The next JSON line; other lines go to stderr. BenchError on error, exit or timeout."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.readline(max(0.0, deadline - time.monotonic()))
            except EOFError:
                raise BenchError(f"child {self.name} exited (code {self.proc.wait(5)})") from None
            if line is None:
                raise BenchError(f"child {self.name}: no reply within {timeout:.0f} s")
            if not line.startswith(b"{"):
                sys.stderr.buffer.write(line + b"\n")
                continue
            msg: dict[str, Any] = json.loads(line)
            if msg.get("event") == "error":
                raise BenchError(msg.get("detail", "child error"))
            return msg

    def ask(self, timeout: float, cmd: str, **fields: Any) -> dict[str, Any]:
        self.send(cmd, **fields)
        return self.reply(timeout)

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send("exit")
                self.proc.wait(20)
        except (BenchError, subprocess.TimeoutExpired, OSError):
            self.proc.kill()
            self.proc.wait(10)


def _ask_all(
    children: Sequence[_Child], timeout: float, cmd: str, **fields: Any
) -> list[dict[str, Any]]:
    """Send to every child first, then collect: the children work in parallel."""
    for c in children:
        c.send(cmd, **fields)
    return [c.reply(timeout) for c in children]


@dataclass
class Rep:
    """One repetition of one path."""

    path: str
    rep: int
    requests: int
    bytes: int
    elapsed_s: float
    failures: int
    verified: bool
    detail: str
    lat_us: list[float]
    sender_stats: dict[str, int] = field(default_factory=dict)  # kvxferd only: Sender counters
    daemon_cpu_s: float = 0.0  # engine path: CPU of every daemon over the repetition
    engine_cpu_s: float = 0.0  # engine path: CPU of the engine processes
    tx_threads_cpu_s: dict[str, float] = field(default_factory=dict)  # kvxferd: tx CPU by thread
    rx_cpu_s: float = 0.0  # kvxferd, engine: CPU of the rx processes over the run

    @property
    def gbps(self) -> float:
        return self.bytes / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0

    @property
    def rps(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s > 0 else 0.0


class _Runner:
    """Starts the children once, then runs each workload's repetitions in alternation."""

    def __init__(self, opts: Options, progress: IO[str]) -> None:
        self.opts, self.progress = opts, progress
        self.tty = progress.isatty()
        self.children: list[_Child] = []

    def say(self, text: str, final: bool = True) -> None:
        if self.tty:
            self.progress.write("\r\x1b[2K" + text + ("\n" if final else ""))
        else:
            self.progress.write(text + "\n")
        self.progress.flush()

    def run(self) -> dict[str, Any]:
        started = time.time()
        results = [r for r in self.run_workloads() if r is not None]  # nothing is skipped
        return build_report(self.opts, results, started)

    def run_workloads(self, skip_after_s: float | None = None) -> list[dict[str, Any] | None]:
        """Each workload's summary, in order. Past ``skip_after_s`` (from the start) the
        workloads not yet begun are skipped (None); past ``timeout_s`` the run fails."""
        opts = self.opts
        t_start = time.monotonic()
        deadline = t_start + opts.timeout_s
        nrx = max(w.procs for w in opts.workloads)
        spec = {"dataplane": opts.dataplane.model_dump(), "max_s": opts.timeout_s + 600}
        self.say(f"bench: starting 1 tx and {nrx} rx processes")
        try:
            self.children = [_Child(opts.child_module, "tx", spec)] + [
                _Child(opts.child_module, "rx", {**spec, "index": k}) for k in range(nrx)
            ]
            for c in self.children:
                c.reply(CHILD_START_TIMEOUT_S)
            results: list[dict[str, Any] | None] = []
            for n, w in enumerate(opts.workloads):
                if time.monotonic() > deadline:
                    raise BenchError(f"the run passed its {opts.timeout_s:.0f} s bound")
                if skip_after_s is not None and time.monotonic() - t_start > skip_after_s:
                    self.say(f"bench: {w.name} skipped (the run passed {skip_after_s:.0f} s)")
                    results.append(None)
                    continue
                results.append(self._workload(n, w))
        finally:
            for c in self.children:
                c.stop()
        return results

    def _workload(self, n: int, w: Workload) -> dict[str, Any]:
        opts = self.opts
        plan = Plan.make(w, opts, n)
        head = f"bench [{n + 1}/{len(opts.workloads)}] {w.name}"
        self.say(
            f"{head}: setting up ({w.label()}; {plan.requests} requests/rep/receiver)", final=False
        )
        reps: dict[str, list[Rep]] = {p: [] for p in w.paths}
        # NIXL's default agent runs a progress thread that spins a core: its phase runs alone,
        # after the others (which alternate), so it never slows another path down.
        alone = [p for p in w.paths if p in SPINNING_PATHS]
        for phase in ([p for p in w.paths if p not in alone], alone):
            if phase:
                self._phase(plan, phase, reps, head)
        return summarize_workload(plan, reps)

    def _phase(
        self, plan: Plan, paths: Sequence[str], reps: dict[str, list[Rep]], head: str
    ) -> None:
        """Set up ``paths`` in every child, warm each up, run their repetitions alternated."""
        w, opts = plan.workload, self.opts
        tx, rxs = self.children[0], self.children[1 : 1 + w.procs]
        tx.send("setup", plan=plan.to_json(), paths=paths)
        for j, rx in enumerate(rxs):
            rx.send("setup", plan=plan.to_json(), paths=paths, indices=w.hosted_by(j))
        infos = [c.reply(SETUP_TIMEOUT_S)["info"] for c in [tx, *rxs]]
        tx_info, rx_infos = infos[0], infos[1:]
        # An rx child answers one info per receiver it hosts; the tx side wants them by index.
        by_index = {
            k: info
            for j, i in enumerate(rx_infos)
            for k, info in zip(w.hosted_by(j), i["members"], strict=True)
        }
        for path in paths:
            peers = [by_index[k][path] for k in range(w.receivers)]
            tx.ask(STEP_TIMEOUT_S, "connect", path=path, peers=peers)
            _ask_all(rxs, STEP_TIMEOUT_S, "connect", path=path, peers=[tx_info[path]])
        warmup = min(plan.requests, 2 * w.inflight)
        for path in paths:
            self._rep(plan, path, -1, warmup)
        for r in range(opts.reps):
            for path in paths:
                reps[path].append(self._rep(plan, path, r, plan.requests))
            figures = ", ".join(
                f"{p} {reps[p][-1].rps:.0f} req/s"
                if w.engine
                else f"{p} {reps[p][-1].gbps:.2f} GB/s"
                for p in paths
            )
            self.say(f"{head}: {'+'.join(paths)} rep {r + 1}/{opts.reps}: {figures}", final=False)
        _ask_all(rxs, STEP_TIMEOUT_S, "teardown")  # receivers first: nothing is in flight now
        tx.ask(STEP_TIMEOUT_S, "teardown")

    def _rep(self, plan: Plan, path: str, rep: int, count: int) -> Rep:
        w = plan.workload
        tx, rxs = self.children[0], self.children[1 : 1 + w.procs]
        everyone = [tx, *rxs]
        step = dict(path=path, rep=rep, count=count)
        _ask_all(everyone, STEP_TIMEOUT_S, "prepare", **step)
        drivers = rxs if path in ("kvxferd", "kvxferd-digest", "engine") else [tx]
        runs = _ask_all(drivers, plan.run_timeout_s(count) + STEP_TIMEOUT_S, "run", **step)
        finals = _ask_all(everyone, plan.run_timeout_s(count) + STEP_TIMEOUT_S, "finish", **step)
        bad = [f["detail"] for f in finals[1:] if not f["verified"]]
        return Rep(
            path=path,
            rep=rep,
            requests=sum(r["requests"] for r in runs),
            bytes=sum(r["bytes"] for r in runs),
            elapsed_s=max(r["t1"] for r in runs) - min(r["t0"] for r in runs),
            failures=sum(r["failures"] for r in runs) + int(finals[0].get("failures", 0)),
            verified=not bad,
            detail="; ".join(bad),
            lat_us=[x for r in runs for x in r["lat_us"]],
            sender_stats=finals[0].get("stats", {}),
            daemon_cpu_s=sum(float(x.get("daemon_cpu_s", 0.0)) for x in [*runs, finals[0]]),
            engine_cpu_s=sum(float(x.get("engine_cpu_s", 0.0)) for x in [*runs, finals[0]]),
            tx_threads_cpu_s=finals[0].get("threads_cpu_s", {}),
            rx_cpu_s=sum(float(r.get("proc_cpu_s", 0.0)) for r in runs) if drivers is rxs else 0.0,
        )


def run_bench(opts: Options, progress: IO[str] | None = None) -> dict[str, Any]:
    """Run every workload of ``opts`` and return the report (what ``--json`` writes)."""
    return _Runner(opts, progress or sys.stderr).run()
