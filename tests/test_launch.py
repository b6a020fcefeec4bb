"""kvxferd/launch.py: real child processes, their events, their stderr tail, their end.

Small ``python -c`` script children cover the waits and the error paths; one real
``python -m kvxferd receiver`` shows the daemon's ready line and its clean exit.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvxferd.launch import Child, ChildExited, ChildTimeout, Daemon, daemon_command
from tests.test_daemon import STARTUP_S, daemon_env

DEADLINE_S = 30.0  # a script child's start (an interpreter, no torch)


def script(code: str) -> list[str]:
    return [sys.executable, "-u", "-c", code]


READY_LATER = (
    "import json, sys, time\n"
    "print('starting')\n"
    "print('{not json')\n"
    "print(json.dumps({'event': 'hello', 'n': 1}))\n"
    "print(json.dumps({'event': 'ready', 'port': 7}))\n"
    "print(json.dumps({'event': 'hello', 'n': 2}))\n"
    "sys.stdout.flush()\n"
    "time.sleep(60)\n"
)
EXITS_EARLY = "import sys; sys.stderr.write('boom: no pool\\n'); sys.exit(3)"
SILENT = "import time; time.sleep(60)"
DEAF = (  # ignores SIGTERM, says so once it does
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    'print(\'{"event": "ready"}\', flush=True)\n'
    "time.sleep(60)\n"
)


@pytest.fixture
def sock_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="kx")  # short: an ipc:// path must fit in sockaddr_un
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=["file", "pipe"])
def stdout(request: pytest.FixtureRequest, tmp_path: Path) -> Path | None:
    return tmp_path / "child.out" if request.param == "file" else None


@pytest.mark.timeout(60)
def test_the_ready_line_and_other_events_are_found_among_other_lines(
    tmp_path: Path, stdout: Path | None
) -> None:
    """wait_ready skips lines that are not JSON events; wait_events counts with a filter."""
    with Child(script(READY_LATER), "c", stdout=stdout, stderr=tmp_path / "c.err") as c:
        deadline = time.monotonic() + DEADLINE_S
        assert c.wait_ready(deadline) == {"event": "ready", "port": 7}
        hellos = c.wait_events("hello", 2, deadline)
        assert [e["n"] for e in hellos] == [1, 2]
        assert c.wait_event("hello", deadline, where=lambda e: e["n"] == 2)["n"] == 2
        assert "starting" in c.stdout_lines()
        assert c.alive()
    assert not c.alive() and c.exit_code == -signal.SIGKILL


@pytest.mark.timeout(60)
def test_a_child_that_exits_before_ready_raises_with_its_stderr_tail(
    tmp_path: Path, stdout: Path | None
) -> None:
    """ChildExited names the child, its exit code and its last stderr line, well before the deadline."""
    with Child(script(EXITS_EARLY), "early", stdout=stdout, stderr=tmp_path / "e.err") as c:
        t0 = time.monotonic()
        with pytest.raises(ChildExited) as err:
            c.wait_ready(t0 + DEADLINE_S)
        assert time.monotonic() - t0 < DEADLINE_S / 2
    assert "early exited with 3 before it was ready" in str(err.value)
    assert "early: boom: no pool" in str(err.value)
    with Child(script(EXITS_EARLY), "early2", stdout=stdout, stderr=tmp_path / "e2.err") as c:
        with pytest.raises(ChildExited, match="early2 exited with 3 after 0/2 'summary' events"):
            c.wait_events("summary", 2, time.monotonic() + DEADLINE_S)


@pytest.mark.timeout(60)
def test_a_child_that_misses_the_deadline_raises_and_still_runs(
    tmp_path: Path, stdout: Path | None
) -> None:
    """ChildTimeout at the deadline (not before); the child is left running for the caller to stop."""
    with Child(script(SILENT), "mute", stdout=stdout, stderr=tmp_path / "m.err") as c:
        t0 = time.monotonic()
        with pytest.raises(ChildTimeout, match="mute not ready"):
            c.wait_ready(t0 + 1.0)
        assert 1.0 <= time.monotonic() - t0 < 10.0
        assert c.alive()
        assert c.stop(time.monotonic() + 10.0) == -signal.SIGTERM
    with Child(script(SILENT), "mute2", stdout=stdout, stderr=tmp_path / "m2.err") as c:
        with pytest.raises(ChildTimeout, match="mute2: 0/1 'summary' events"):
            c.wait_event("summary", time.monotonic() + 0.5)


@pytest.mark.timeout(60)
def test_reap_kills_a_child_still_running_at_its_deadline(tmp_path: Path) -> None:
    """A child that ignores SIGTERM is SIGKILLed once the deadline passed; wait says None before."""
    with Child(script(DEAF), "deaf", stderr=tmp_path / "d.err") as c:
        c.wait_ready(time.monotonic() + DEADLINE_S)  # its SIGTERM handler is installed
        c.terminate()
        assert c.wait(time.monotonic() + 0.5) is None
        t0 = time.monotonic()
        assert c.reap(t0 + 0.5) == -signal.SIGKILL
        assert time.monotonic() - t0 < 10.0
        assert c.exit_code == -signal.SIGKILL


@pytest.mark.timeout(60)
def test_the_context_manager_leaves_no_process_behind(tmp_path: Path) -> None:
    """An exception inside ``with`` still kills and reaps the child, even a SIGSTOPped one."""
    pid = 0
    with pytest.raises(RuntimeError), Child(script(SILENT), "s", stderr=tmp_path / "s.err") as c:
        pid = c.pid
        c.signal(signal.SIGSTOP)
        raise RuntimeError("the caller failed")
    assert pid and c.exit_code == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped: the pid names no process (not even a zombie)


@pytest.mark.timeout(60)
def test_a_subclass_sees_every_pipe_line_as_it_comes(tmp_path: Path) -> None:
    """take() runs once per stdout line on the reader thread, before any wait returns it."""
    seen: list[str] = []

    class Recording(Child):
        def take(self, line: str) -> None:
            super().take(line)
            seen.append(line)

    with Recording(script(READY_LATER), "r", stderr=tmp_path / "r.err") as c:
        c.wait_ready(time.monotonic() + DEADLINE_S)
        assert seen[:4] == ["starting", "{not json", '{"event": "hello", "n": 1}', c.lines[3]]


def test_the_daemon_command_line() -> None:
    """role, name and log level first, the caller's arguments last, a prefix before python."""
    assert daemon_command("sender", "tx", ["--listen", "tcp://127.0.0.1:0"], python="py") == [
        "py", "-m", "kvxferd", "sender", "--name", "tx", "--log-level", "warning",
        "--listen", "tcp://127.0.0.1:0",
    ]  # fmt: skip
    assert daemon_command("receiver", "rx", log_level="", python="py", prefix=["ip", "x"]) == [
        "ip", "x", "py", "-m", "kvxferd", "receiver", "--name", "rx",
    ]  # fmt: skip


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_real_daemon_gets_ready_and_exits_0_on_sigterm(sock_dir: str) -> None:
    """``python -m kvxferd receiver``: the ready line names its engine socket; SIGTERM -> exit 0."""
    env = {
        **os.environ,
        **daemon_env(),
        "KVXFERD_SERVICE__ENGINE_SOCKET": f"ipc://{sock_dir}/rx.sock",
        "KVXFERD_SERVICE__PROBE_PORT": "0",
    }
    with Daemon("receiver", "rx", sock_dir, env=env) as d:
        ready = d.wait_ready(time.monotonic() + STARTUP_S)
        assert d.ready is ready and ready["event"] == "ready"
        assert ready["engine_socket"] == f"ipc://{sock_dir}/rx.sock"
        assert d.stop(time.monotonic() + 30.0) == 0, d.tail()
    assert Path(sock_dir, "rx.out").exists() and Path(sock_dir, "rx.err").exists()
