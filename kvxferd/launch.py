"""One child process of kvxferd's tools and tests: a daemon (``python -m kvxferd sender|receiver``)
or any child that prints JSON event lines; its ready line, its stderr tail, its end.

The demo, the fault suite, the benchmarks and the tests start their daemons through
:class:`Daemon` (any other JSON-lines child through :class:`Child`) and wait for its
``{"event": "ready", ...}`` line on stdout. stdout goes to a file (``stdout=PATH``: the
file keeps every line, waits read it back) or to a pipe (``stdout=None``) read line by line
on a reader thread, for users that want the lines as they come; stderr always goes to a
file, whose last lines every error message carries.

A child's life, as this module sees it::

    running --(it exits; poll/wait reap it)--> exited (returncode set)
    running --terminate()/signal()/kill()--> (still running until it exits)
    any     --close()--> exited, reader joined, files closed (SIGKILL if it still ran)

Every wait has a deadline (``time.monotonic()``): :meth:`Child.wait_event` raises
:class:`ChildExited` when the child ended before the event, :class:`ChildTimeout` past the
deadline (both :class:`LaunchError`, message with the stderr tail); :meth:`Child.reap`
SIGKILLs a child still running at its deadline. ``with Child(...)`` (or :meth:`Child.close`)
never leaves a process behind. Nothing here imports the transfer core
(tests/test_layering.py checks it): tools, tests and the demo share it.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

POLL_S = 0.05  # how often a wait re-reads a stdout file
KILL_REAP_S = 10.0  # SIGKILL -> reaped (the kernel's part; a bound, never reached in practice)
READER_JOIN_S = 5.0  # the pipe reader, after the child exited

Where = Callable[[dict[str, Any]], bool]


class LaunchError(Exception):
    """A child did not print what its parent waited for."""


class ChildExited(LaunchError):
    """The child ended before the event came."""


class ChildTimeout(LaunchError):
    """The deadline passed before the event came; the child still runs."""


def parse_event(line: str) -> dict[str, Any] | None:
    """The JSON object of a stdout line with an ``event`` key, or None for any other line."""
    if not line.startswith("{"):
        return None
    try:
        msg = json.loads(line)
    except ValueError:
        return None
    return msg if isinstance(msg, dict) and "event" in msg else None


def _any(event: dict[str, Any]) -> bool:
    return True


class Child:
    """One child process: JSON events on its stdout, stderr to a file, bounded waits, signals.

    ``cmd``: the command line; ``env``: its whole environment (default: this process's);
    ``stdout``: a file to write stdout to, or None for a pipe read on a thread named
    ``read-NAME`` (:meth:`take` sees each line as it comes); ``append``: open the files for
    appending (a restarted child keeps its predecessor's stderr); ``new_session``: its own
    session and process group, so a Ctrl-C in a terminal reaches the parent only, which
    then stops its children.
    """

    def __init__(
        self,
        cmd: Sequence[str],
        name: str,
        *,
        stderr: Path,
        stdout: Path | None = None,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        append: bool = False,
        new_session: bool = True,
    ) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.stdout_path = stdout
        self.stderr_path = stderr
        self.lines: list[str] = []  # pipe mode: every stdout line, without its newline
        self._events: list[dict[str, Any]] = []  # pipe mode: the JSON events among them
        self._cond = threading.Condition()
        self._eof = stdout is not None  # a file needs no reader
        self.exit_code: int | None = None
        mode = "ab" if append else "wb"
        out: IO[bytes] | int = subprocess.PIPE
        with contextlib.ExitStack() as files:
            err = files.enter_context(open(stderr, mode))
            if stdout is not None:
                out = files.enter_context(open(stdout, mode))
            self.started = time.monotonic()
            self.proc = subprocess.Popen(
                self.cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=env,
                cwd=cwd,
                start_new_session=new_session,
            )
        self.pid = self.proc.pid
        self._reader: threading.Thread | None = None
        if stdout is None:
            self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
            self._reader.start()

    # -- stdout ----------------------------------------------------------------------------
    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                with self._cond:
                    self.take(line)
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._eof = True
                self._cond.notify_all()

    def take(self, line: str) -> None:
        """One stdout line (pipe mode), on the reader thread with the condition held.

        A subclass may extend it (a timestamp per event, say); it must call this one.
        """
        self.lines.append(line)
        event = parse_event(line)
        if event is not None:
            self._events.append(event)

    def stdout_lines(self) -> list[str]:
        """Every stdout line so far (read back from the file, or the pipe's lines)."""
        if self.stdout_path is not None:
            try:
                return self.stdout_path.read_text(errors="replace").splitlines()
            except OSError:
                return []
        with self._cond:
            return list(self.lines)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The JSON events the child printed so far (of ``kind``), in order."""
        if self.stdout_path is None:
            with self._cond:
                out = list(self._events)
        else:
            out = [e for e in map(parse_event, self.stdout_lines()) if e is not None]
        return [e for e in out if kind is None or e["event"] == kind]

    def wait_events(
        self, kind: str, count: int, deadline: float, where: Where = _any
    ) -> list[dict[str, Any]]:
        """The first ``count`` events of ``kind`` that match ``where``, waiting until ``deadline``.

        :class:`ChildExited` once the child ended (its stdout read to the end) without them,
        :class:`ChildTimeout` past the deadline.
        """
        while True:
            # Whether it ended, before reading: a line printed just before the exit counts.
            ended = self._eof and self.proc.poll() is not None
            found = [e for e in self.events(kind) if where(e)]
            if len(found) >= count:
                return found[:count]
            what = f"{len(found)}/{count} {kind!r} events"
            if ended:
                code = self.proc.returncode
                if kind == "ready":
                    raise ChildExited(
                        f"{self.name} exited with {code} before it was ready{self.tail()}"
                    )
                raise ChildExited(f"{self.name} exited with {code} after {what}{self.tail()}")
            left = deadline - time.monotonic()
            if left <= 0:
                since = f"{time.monotonic() - self.started:.0f} s after its start"
                if kind == "ready":
                    raise ChildTimeout(f"{self.name} not ready {since}{self.tail()}")
                raise ChildTimeout(f"{self.name}: {what} {since}{self.tail()}")
            with self._cond:
                self._cond.wait(min(left, POLL_S))

    def wait_event(self, kind: str, deadline: float, where: Where = _any) -> dict[str, Any]:
        """The first event of ``kind`` that matches ``where`` (see :meth:`wait_events`)."""
        return self.wait_events(kind, 1, deadline, where)[0]

    def wait_ready(self, deadline: float) -> dict[str, Any]:
        """The ``{"event": "ready", ...}`` line, waiting until ``deadline``."""
        return self.wait_event("ready", deadline)

    # -- stderr ----------------------------------------------------------------------------
    def stderr_lines(self, lines: int = 15) -> list[str]:
        """The last ``lines`` lines of the child's stderr (none when unreadable)."""
        try:
            return self.stderr_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return []

    def tail(self, lines: int = 15) -> str:
        """The last lines of stderr for an error message: one ``\\n  NAME: line`` each."""
        return "".join(f"\n  {self.name}: {t}" for t in self.stderr_lines(lines))

    # -- the process -----------------------------------------------------------------------
    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Send ``sig`` if the child still runs."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def terminate(self) -> None:
        """SIGTERM (a daemon drains and exits within its shutdown bound)."""
        self.signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGCONT (a SIGSTOPped child could not die otherwise), then SIGKILL."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)

    def wait(self, deadline: float) -> int | None:
        """The exit code, waiting until ``deadline``; None while it still runs.

        Once it exited, the pipe's last lines are read too (its reader joined, bounded).
        """
        try:
            self.exit_code = self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None
        if self._reader is not None:
            self._reader.join(timeout=READER_JOIN_S)
        return self.exit_code

    def reap(self, deadline: float) -> int:
        """The exit code, waiting until ``deadline``; SIGKILLed (negative) past it."""
        code = self.wait(deadline)
        if code is None:
            self.kill()
            code = self.proc.wait(timeout=KILL_REAP_S)
            self.exit_code = code
        return code

    def stop(self, deadline: float) -> int:
        """SIGTERM, then the exit code by ``deadline`` (SIGKILL past it)."""
        self.terminate()
        return self.reap(deadline)

    def close(self) -> None:
        """Whatever state it is in: killed if it still runs, reaped, its pipe reader joined."""
        if self.proc.poll() is None:
            self.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.exit_code = self.proc.wait(timeout=KILL_REAP_S)
        if self._reader is not None:
            self._reader.join(timeout=READER_JOIN_S)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def daemon_command(
    role: str,
    name: str,
    args: Iterable[str] = (),
    *,
    log_level: str = "warning",
    python: str = sys.executable,
    prefix: Sequence[str] = (),
) -> list[str]:
    """``[*prefix, python, -m, kvxferd, ROLE, --name, NAME, --log-level, LEVEL, *args]``.

    ``prefix``: a command that execs the daemon (``ip netns exec NS``: the pid stays the
    daemon's); ``log_level=""``: the daemon's configured level.
    """
    cmd = [*prefix, python, "-m", "kvxferd", role, "--name", name]
    if log_level:
        cmd += ["--log-level", log_level]
    return [*cmd, *args]


class Daemon(Child):
    """``python -m kvxferd ROLE --name NAME ARGS``; ``ready`` holds its ready line once seen.

    ``python``: the interpreter (another release's venv runs that release; give it an
    ``env`` and ``cwd`` that do not put this tree's kvxferd first).

    stdout goes to ``workdir/NAME.out`` (``pipe=True``: a pipe), stderr to
    ``workdir/NAME.err`` unless the caller names another file.
    """

    def __init__(
        self,
        role: str,
        name: str,
        workdir: str | Path,
        args: Iterable[str] = (),
        *,
        env: dict[str, str] | None = None,
        log_level: str = "warning",
        prefix: Sequence[str] = (),
        pipe: bool = False,
        stderr: Path | None = None,
        cwd: str | Path | None = None,
        append: bool = False,
        new_session: bool = True,
        python: str = sys.executable,
    ) -> None:
        self.role = role
        self.ready: dict[str, Any] = {}
        workdir = Path(workdir)
        super().__init__(
            daemon_command(role, name, args, log_level=log_level, python=python, prefix=prefix),
            name,
            stdout=None if pipe else workdir / f"{name}.out",
            stderr=stderr or workdir / f"{name}.err",
            env=env,
            cwd=cwd,
            append=append,
            new_session=new_session,
        )

    def wait_ready(self, deadline: float) -> dict[str, Any]:
        self.ready = super().wait_ready(deadline)
        return self.ready
