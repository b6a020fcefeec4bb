"""A child process a test talks to through its stdout lines and signals.

:class:`ChildProcess` is the part every spawned child shares, on
:class:`kvxferd.launch.Child`: stdout read line by line on the launcher's reader
thread, each line handed to a subclass's :meth:`ChildProcess._take` under the
launcher's condition variable, stderr to a file (read back for failure messages),
bounded waits, and a kill that also frees a SIGSTOPped child. :class:`tests.support.peers.PeerProcess`
(the test peers) and ``DaemonProcess`` in tests/test_daemon.py (the real daemon)
build on it.

Spawn from the test's main thread: a child's parent-death signal follows the
thread that started it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from kvxferd.launch import Child

ROOT = Path(__file__).resolve().parents[2]


class _Lines(Child):
    """The launcher's child, handing each stdout line to its owner once the owner is ready."""

    owner: ChildProcess | None = None

    def take(self, line: str) -> None:
        super().take(line)
        if self.owner is not None:
            self.owner._take(line)


class ChildProcess:
    """``python -m MODULE ARGS...`` from the repository root; a subclass handles its stdout lines."""

    def __init__(
        self, module: str, args: list[str], stderr_path: Path, name: str, env: dict[str, str]
    ) -> None:
        self.name = name
        self.stderr_path = stderr_path
        self.child = _Lines(
            [sys.executable, "-m", module, *args],
            name,
            stderr=stderr_path,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            cwd=ROOT,
            new_session=False,
        )
        self.proc = self.child.proc
        self.pid = self.proc.pid

    @property
    def _cond(self) -> threading.Condition:
        return self.child._cond

    @property
    def _eof(self) -> bool:
        return self.child._eof

    def _start_reader(self) -> None:
        """Hand stdout lines to :meth:`_take` (those read so far first); a subclass calls it
        once its own state exists."""
        with self._cond:
            self.child.owner = self
            for line in self.child.lines:
                self._take(line)
            self._cond.notify_all()

    def _take(self, line: str) -> None:
        """One stdout line without its newline, called with ``self._cond`` held (which then
        notifies every waiter); a subclass that handles lines overrides it and calls
        :meth:`_start_reader` (the launcher keeps every line and event regardless)."""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _wait_exit_code(self, timeout: float, error: type[Exception]) -> int:
        """The exit code; ``error`` with the child's stderr tail if still running after ``timeout``."""
        code = self.child.wait(time.monotonic() + timeout)
        if code is None:
            raise error(f"{self.name} still running after {timeout}s\n{self.describe()}")
        return code

    def kill(self) -> None:
        """SIGCONT (a stopped child), SIGKILL, reap; safe to call twice."""
        self.child.close()

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def stderr_tail(self, lines: int = 25) -> list[str]:
        return self.stderr().splitlines()[-lines:]

    def describe(self, lines: int = 25) -> str:
        tail = "\n  ".join(self.stderr_tail(lines))
        return f"[{self.name} pid {self.pid} exit {self.proc.poll()}]\nstderr tail:\n  {tail}"
