"""A ``_bench-tx`` / ``_bench-rx`` child: JSON commands in on stdin, JSON replies out on stdout."""

from __future__ import annotations

import gc
import json
import os
import select
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from kvxferd.bench.engine_path import EngineRx, EngineTx
from kvxferd.bench.kvxferd_path import KvxRx, KvxTx
from kvxferd.bench.nixl_path import RawRx, RawTx
from kvxferd.bench.plan import Plan
from kvxferd.bench.side import _Side
from kvxferd.bench.zmq_path import ZmqRx, ZmqTx
from kvxferd.config import DataPlaneSettings


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
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
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
        return 0

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        what = cmd["cmd"]
        if what == "setup":
            self.teardown()
            plan = Plan.from_json(cmd["plan"])
            self._make_sides(plan, cmd.get("paths") or list(plan.workload.paths))
            return {"info": {p: s.info() for p, s in self.sides.items()}}
        if what == "teardown":
            self.teardown()
            return {}
        side = self.sides[cmd["path"]]
        if what == "connect":
            side.connect(cmd["peers"])
            return {}
        rep, count = int(cmd["rep"]), int(cmd["count"])
        step = {"prepare": side.prepare, "run": side.run, "finish": side.finish}[what]
        return step(rep, count)

    def _make_sides(self, plan: Plan, paths: list[str]) -> None:
        """The sides of ``paths``, into ``self.sides`` as each starts (a failed setup tears down)."""
        dp, k, tx = self.dataplane, self.index, self.role == "tx"
        make: dict[str, Callable[[], _Side]] = {
            "kvxferd": (lambda: KvxTx(plan, dp)) if tx else (lambda: KvxRx(plan, dp, k)),
            "engine": (lambda: EngineTx(plan, dp)) if tx else (lambda: EngineRx(plan, dp, k)),
            "nixl": (lambda: RawTx(plan, True)) if tx else (lambda: RawRx(plan, k, True)),
            "nixl-default": (lambda: RawTx(plan, False)) if tx else (lambda: RawRx(plan, k, False)),
            "zmq": (lambda: ZmqTx(plan)) if tx else (lambda: ZmqRx(plan, k)),
        }
        for path in paths:
            self.sides[path] = make[path]()

    def teardown(self) -> None:
        for side in self.sides.values():
            try:
                side.close()
            except Exception as e:
                sys.stderr.write(f"bench {self.role}: close failed: {e!r}\n")
        self.sides = {}
        gc.collect()  # drop NIXL agents and pool mappings before the next workload


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
