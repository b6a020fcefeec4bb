"""A child process a test talks to through its stdout lines and signals.

:class:`ChildProcess` is the part every spawned child shares: stderr to a file
(read back for failure messages), stdout read line by line on a reader thread
into a subclass's :meth:`ChildProcess._take` under a condition variable, bounded
waits, and a kill that also frees a SIGSTOPped child. :class:`tests.peers.PeerProcess`
(the test peers) and ``DaemonProcess`` in tests/test_daemon.py (the real daemon)
build on it.

Spawn from the test's main thread: a child's parent-death signal follows the
thread that started it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent


class ChildProcess:
    """``python -m MODULE ARGS...`` from the repository root; a subclass handles its stdout lines."""

    def __init__(
        self, module: str, args: list[str], stderr_path: Path, name: str, env: dict[str, str]
    ) -> None:
        self.name = name
        self.stderr_path = stderr_path
        self._stderr: IO[bytes] = open(stderr_path, "wb")  # closed in kill()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            text=True,
        )
        self.pid = self.proc.pid
        self._cond = threading.Condition()
        self._eof = False
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)

    def _start_reader(self) -> None:
        """Start reading stdout; a subclass calls it once its own state exists."""
        self._reader.start()

    def _take(self, line: str) -> None:
        """One stdout line, called with ``self._cond`` held (which then notifies every waiter)."""
        raise NotImplementedError

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                with self._cond:
                    self._take(line)
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._eof = True
                self._cond.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _wait_exit_code(self, timeout: float, error: type[Exception]) -> int:
        """The exit code; ``error`` with the child's stderr tail if still running after ``timeout``."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise error(f"{self.name} still running after {timeout}s\n{self.describe()}") from None
        self._reader.join(timeout=5)
        return code

    def kill(self) -> None:
        """SIGCONT (a stopped child), SIGKILL, reap; safe to call twice."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()

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
