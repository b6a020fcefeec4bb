"""A ``_bench-tx`` / ``_bench-rx`` child: JSON commands in on stdin, JSON replies out on stdout."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from kvxferd.bench.engine_path import EngineRx, EngineTx, _Engine, engine_key
from kvxferd.bench.kvxferd_path import KvxRx, KvxTx
from kvxferd.bench.nixl_path import RawRx, RawTx
from kvxferd.bench.plan import Plan
from kvxferd.bench.side import _Group, _Side
from kvxferd.bench.zmq_path import ZmqRx, ZmqTx
from kvxferd.config import DataPlaneSettings
from kvxferd.engine.channel import wait_fd


class _LineReader:
    """Whole lines from a file descriptor, each read bounded by a timeout (no buffered-IO surprises)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = b""

    def readline(self, timeout: float) -> bytes | None:
        """The next line without its newline; None after ``timeout``; EOFError once the peer closed."""
        deadline = time.monotonic() + timeout
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                line, self._buf = self._buf[:nl], self._buf[nl + 1 :]
                return line
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if wait_fd(self.fd, left):
                chunk = os.read(self.fd, 1 << 20)
                if not chunk:
                    raise EOFError
                self._buf += chunk


class _ChildServer:
    """The command loop of a ``_bench-tx`` / ``_bench-rx`` child; replies on a private stdout."""

    def __init__(self, role: str, spec: dict[str, Any], out: IO[str]) -> None:
        self.role, self.out = role, out
        self.index = int(spec.get("index", 0))
        self.dataplane = DataPlaneSettings(**spec["dataplane"])
        self.sides: dict[str, _Side] = {}
        self.parent = os.getppid()
        # Engine-path daemons kept across workloads that ask for it (keep_daemons), by
        # engine_key; stopped when a workload needs another one, and at exit.
        self.engines: dict[str, _Engine] = {}

    def emit(self, event: str, **fields: Any) -> None:
        self.out.write(json.dumps({"event": event, **fields}) + "\n")
        self.out.flush()

    def serve(self, max_s: float) -> int:
        self.emit("hello", role=self.role, pid=os.getpid())
        commands = _LineReader(sys.stdin.fileno())
        deadline = time.monotonic() + max_s
        while time.monotonic() < deadline:
            if os.getppid() != self.parent:  # the parent died: nobody will read us
                break
            try:
                line = commands.readline(1.0)
            except EOFError:
                break
            if line is None:
                continue
            cmd = json.loads(line)
            if cmd["cmd"] == "exit":
                break
            try:
                self.emit("ok", **self.handle(cmd))
            except Exception as e:
                self.emit("error", detail=f"{self.role}[{self.index}] {cmd['cmd']}: {e!r}"[:2000])
        self.teardown()
        self._stop_engines(keep=())
        return 0

    def _stop_engines(self, keep: tuple[str, ...]) -> None:
        for key in [k for k in self.engines if k not in keep]:
            try:
                self.engines.pop(key).stop()
            except Exception as e:
                sys.stderr.write(f"bench {self.role}: stopping a kept daemon failed: {e!r}\n")

    def _engine_side(self, plan: Plan, k: int) -> _Side:
        """An engine-path side; with ``keep_daemons``, on the daemon kept for this pool."""
        dp, tx = self.dataplane, self.role == "tx"
        if not plan.workload.keep_daemons:
            self._stop_engines(keep=())
            return EngineTx(plan, dp) if tx else EngineRx(plan, dp, k)
        key = engine_key(f"{'tx' if tx else 'rx'}{k}", plan, dp)
        self._stop_engines(keep=(key,))
        if key not in self.engines:
            role = "sender" if tx else "receiver"
            self.engines[key] = _Engine(role, f"bench-e{role[0]}x{k}-{plan.tag}", plan, dp)
        engine = self.engines[key]
        return EngineTx(plan, dp, engine) if tx else EngineRx(plan, dp, k, engine)

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        what = cmd["cmd"]
        if what == "setup":
            self.teardown()
            plan = Plan.from_json(cmd["plan"])
            paths = cmd.get("paths") or list(plan.workload.paths)
            if "engine" not in paths or not plan.workload.keep_daemons:
                self._stop_engines(keep=())  # a kept daemon must not idle beside other paths
            if self.role == "tx":
                self._make_sides(plan, paths, [0])
                return {"info": {p: s.info() for p, s in self.sides.items()}}
            indices = [int(k) for k in cmd.get("indices") or [self.index]]
            self._make_sides(plan, paths, indices)
            members = [
                {p: _members(s)[j].info() for p, s in self.sides.items()}
                for j in range(len(indices))
            ]
            return {"info": {"members": members}}
        if what == "teardown":
            self.teardown()
            return {}
        side = self.sides[cmd["path"]]
        if what == "connect":
            side.connect(cmd["peers"])
            return {}
        rep, count = int(cmd["rep"]), int(cmd["count"])
        step = {"prepare": side.prepare, "run": side.run, "finish": side.finish}[what]
        cpu0 = time.process_time()
        out = step(rep, count)
        if what == "run":  # this whole process's CPU over the run (every receiver it hosts)
            out["proc_cpu_s"] = time.process_time() - cpu0
        return out

    def _make_sides(self, plan: Plan, paths: list[str], indices: list[int]) -> None:
        """The sides of ``paths``, into ``self.sides`` as each starts (a failed setup tears down).

        An rx child hosting several receivers (``indices``) gets a :class:`_Group` per path.
        """
        dp, tx = self.dataplane, self.role == "tx"

        def make(path: str, k: int) -> _Side:
            kinds: dict[str, Callable[[], _Side]] = {
                "kvxferd": (lambda: KvxTx(plan, dp)) if tx else (lambda: KvxRx(plan, dp, k)),
                "kvxferd-digest": (lambda: KvxTx(plan, dp))
                if tx
                else (lambda: KvxRx(plan, dp, k, digest=True)),
                "engine": lambda: self._engine_side(plan, k),
                "nixl": (lambda: RawTx(plan, True)) if tx else (lambda: RawRx(plan, k, True)),
                "nixl-default": (lambda: RawTx(plan, False))
                if tx
                else (lambda: RawRx(plan, k, False)),
                "zmq": (lambda: ZmqTx(plan)) if tx else (lambda: ZmqRx(plan, k)),
            }
            return kinds[path]()

        for path in paths:
            if len(indices) == 1:
                self.sides[path] = make(path, indices[0])
                continue
            group = _Group(plan)
            self.sides[path] = group  # closed by teardown even if a later member fails
            for k in indices:
                group.members.append(make(path, k))

    def teardown(self) -> None:
        for side in self.sides.values():
            try:
                side.close()
            except Exception as e:
                sys.stderr.write(f"bench {self.role}: close failed: {e!r}\n")
        self.sides = {}
        gc.collect()  # drop NIXL agents and pool mappings before the next workload


def _members(side: _Side) -> list[_Side]:
    return side.members if isinstance(side, _Group) else [side]


def run_child(role: str, spec_json: str) -> int:
    """Entry of ``python -m kvxferd _bench-tx|_bench-rx SPEC_JSON``."""
    # Our replies get a private copy of stdout; whatever a library prints to fd 1 goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    spec = json.loads(spec_json)
    return _ChildServer(role.removeprefix("_bench-"), spec, out).serve(
        float(spec.get("max_s", 7200))
    )
