"""Start-up that fails fast: a daemon with a setting that cannot work exits 2 in one line.

Each test starts ``python -m kvxferd sender|receiver`` as operators do, with a
real obstacle (a listening socket on the port, a read-only directory, a live
daemon on the engine socket) and checks the exit code, that stderr is one line
naming the setting and its value, and that it came before the slow set-up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import SuiteKeys
from tests.support.child import ROOT
from tests.test_daemon import DaemonProcess, daemon_env

pytestmark = pytest.mark.integration

# Importing the CLI's dependencies takes ~2-4 s here (more on a loaded machine, plus a
# resolver's own timeout for a name that does not resolve); the NIXL agent and pool another
# ~8 s. The one-line stderr check is what shows the failure came before the set-up; the
# time bound only catches a check that waits for something.
FAIL_FAST_S = 25.0


@pytest.fixture
def sock_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="kx")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A TCP port on 127.0.0.1 with a listener on it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def start(role: str, sock_dir: str, **env: str) -> tuple[int, list[str], float]:
    """Run a daemon to its exit: (exit code, stderr lines, seconds)."""
    full = {
        **daemon_env(),
        "KVXFERD_SERVICE__ENGINE_SOCKET": f"ipc://{sock_dir}/e.sock",
        "KVXFERD_SERVICE__PROBE_PORT": "0",
        "KVXFERD_LISTEN": "tcp://127.0.0.1:0",
        **env,
    }
    if role == "receiver":
        full.pop("KVXFERD_LISTEN")
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "kvxferd", role],
        cwd=ROOT,
        env={**os.environ, **full},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        # Well above FAIL_FAST_S, well below pytest's timeout: a daemon that got past the
        # checks (allocating a huge pool, say) fails the test here, with its own message.
        timeout=40,
    )
    return proc.returncode, proc.stderr.strip().splitlines(), time.monotonic() - t0


def assert_fails_fast(role: str, sock_dir: str, setting: str, words: list[str], **env: str) -> None:
    code, lines, took = start(role, sock_dir, **env)
    print(f"{setting}: exit {code} after {took:.2f} s: {lines}")
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert setting in lines[0], lines
    for w in words:
        assert w in lines[0], lines
    assert took < FAIL_FAST_S, took


def test_sender_listen_port_in_use_exits_2_naming_listen(sock_dir: str, busy_port: int) -> None:
    """A sender whose listen port is taken exits 2 with one line naming listen and the port."""
    assert_fails_fast(
        "sender",
        sock_dir,
        "listen",
        [str(busy_port), "in use"],
        KVXFERD_LISTEN=f"tcp://127.0.0.1:{busy_port}",
    )


def test_receiver_result_endpoint_port_in_use_exits_2(sock_dir: str, busy_port: int) -> None:
    """A receiver whose result_endpoint port is taken exits 2 naming result_endpoint."""
    assert_fails_fast(
        "receiver",
        sock_dir,
        "result_endpoint",
        [str(busy_port), "in use"],
        KVXFERD_RESULT_ENDPOINT=f"tcp://127.0.0.1:{busy_port}",
    )


def test_probe_port_in_use_exits_2(sock_dir: str, busy_port: int) -> None:
    """A daemon whose probe port is taken exits 2 naming probe_port."""
    assert_fails_fast(
        "sender",
        sock_dir,
        "probe_port",
        [str(busy_port), "in use"],
        KVXFERD_SERVICE__PROBE_PORT=str(busy_port),
    )


def test_host_not_on_this_machine_exits_2(sock_dir: str, suite_keys: SuiteKeys) -> None:
    """A listen address that is not this machine's exits 2 naming listen and the host."""
    assert_fails_fast(
        "sender",
        sock_dir,
        "listen",
        ["192.0.2.1", "not an address of this machine"],
        KVXFERD_LISTEN="tcp://192.0.2.1:5555",
        **suite_keys.env,
    )


def test_host_that_does_not_resolve_exits_2(sock_dir: str, suite_keys: SuiteKeys) -> None:
    """A listen host that does not resolve exits 2 naming listen and the host."""
    assert_fails_fast(
        "sender",
        sock_dir,
        "listen",
        ["no-such-host.invalid", "does not resolve"],
        KVXFERD_LISTEN="tcp://no-such-host.invalid:5555",
        **suite_keys.env,
    )


def test_ipc_path_too_long_exits_2(sock_dir: str) -> None:
    """An engine socket path over the sockaddr_un limit exits 2 naming engine_socket."""
    long_path = f"{sock_dir}/{'x' * 120}.sock"
    assert_fails_fast(
        "sender",
        sock_dir,
        "engine_socket",
        ["limit is 107"],
        KVXFERD_SERVICE__ENGINE_SOCKET=f"ipc://{long_path}",
    )


def test_engine_socket_directory_not_writable_exits_2(sock_dir: str) -> None:
    """An engine socket in a directory the daemon cannot write exits 2 naming the directory."""
    ro = Path(sock_dir) / "ro"
    ro.mkdir(mode=0o500)
    target = str(ro)
    if os.access(target, os.W_OK):  # root ignores mode bits; a read-only kernel tree does not
        target = "/proc/sys"
        if os.access(target, os.W_OK):
            pytest.skip("no directory this user cannot write")
    assert_fails_fast(
        "sender",
        sock_dir,
        "engine_socket",
        [target, "not writable"],
        KVXFERD_SERVICE__ENGINE_SOCKET=f"ipc://{target}/kx/e.sock",
    )


def test_engine_socket_under_a_file_exits_2(sock_dir: str) -> None:
    """An engine socket whose directory is a regular file exits 2 naming engine_socket."""
    f = Path(sock_dir) / "file"
    f.write_text("")
    assert_fails_fast(
        "receiver",
        sock_dir,
        "engine_socket",
        [str(f), "not a directory"],
        KVXFERD_SERVICE__ENGINE_SOCKET=f"ipc://{f}/e.sock",
    )


def test_pool_larger_than_dev_shm_exits_2(sock_dir: str) -> None:
    """A cpu pool that cannot fit in /dev/shm's free bytes exits 2 naming the pool and sizes."""
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    # 2 layers x 32 MiB blocks, four times the free bytes: other processes' use may vary meanwhile
    blocks = min(1 << 22, free // (16 << 20) + 1)
    assert 2 * blocks * (32 << 20) > free
    assert_fails_fast(
        "receiver",
        sock_dir,
        "pool",
        ["/dev/shm", "needs", "free"],
        KVXFERD_POOL__NUM_BLOCKS=str(blocks),
        KVXFERD_POOL__BLOCK_ELEMS=str(32 << 20),
    )


def test_second_daemon_on_a_live_engine_socket_refuses_and_first_stays_reachable(
    sock_dir: str,
) -> None:
    """A second daemon given a live daemon's engine socket exits 2; the first still answers."""
    from kvxferd.engine.client import Client

    first = DaemonProcess(
        "sender", "first", sock_dir, daemon_env(), ["--listen", "tcp://127.0.0.1:0"]
    )
    try:
        engine_socket = first.engine_socket
        assert_fails_fast(
            "receiver",
            sock_dir,
            "engine_socket",
            [engine_socket, "live daemon"],
            KVXFERD_SERVICE__ENGINE_SOCKET=engine_socket,
        )
        c = Client(engine_socket, timeout_s=10.0)
        try:
            assert c.describe()  # the first daemon still owns its socket
        finally:
            c.close_client()
    finally:
        first.kill()


def test_stale_engine_socket_file_is_replaced(sock_dir: str) -> None:
    """A socket file nobody listens on (a crashed daemon's) does not stop a new daemon."""
    path = f"{sock_dir}/stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()  # the file stays; nothing listens
    d = DaemonProcess(
        "receiver",
        "fresh",
        sock_dir,
        {**daemon_env(), "KVXFERD_SERVICE__ENGINE_SOCKET": f"ipc://{path}"},
        [],
    )
    try:
        assert d.engine_socket == f"ipc://{path}"
    finally:
        d.kill()


def test_a_killed_daemons_pool_segment_is_removed_by_its_successor(sock_dir: str) -> None:
    """A daemon SIGKILLed leaves its pool in /dev/shm; the next daemon on the same engine socket removes it (logged) and serves under a name of its own, so restarts never pile up pools."""
    from kvxferd.engine.client import Client

    def shm_name(d: DaemonProcess) -> str:
        c = Client(d.engine_socket, timeout_s=10.0)
        try:
            return str(c.describe().shm_name)
        finally:
            c.close_client()

    first = DaemonProcess("receiver", "first", sock_dir, daemon_env(), [])
    second: DaemonProcess | None = None
    try:
        name = shm_name(first)
        path = Path("/dev/shm") / name
        # As a container's end kills every process in it: the daemon and its helper
        # processes (Python's resource tracker would otherwise unlink the segment).
        children = [
            pid
            for task in Path(f"/proc/{first.pid}/task").iterdir()
            for pid in (task / "children").read_text().split()
        ]
        os.kill(first.pid, signal.SIGSTOP)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(child), signal.SIGKILL)
        first.kill()  # SIGKILL: no unlink
        assert path.exists(), f"{path} should be left behind by a SIGKILL"
        inode = path.stat().st_ino
        assert inode
        second = DaemonProcess("receiver", "first", sock_dir, daemon_env(), [])
        assert shm_name(second) != name  # each daemon instance names its own segment
        assert not path.exists()
        assert any(f"removed {path}" in line for line in second.stderr_tail(50)), second.describe()
    finally:
        first.kill()
        if second is not None:
            second.kill()
        with contextlib.suppress(FileNotFoundError, UnboundLocalError):
            path.unlink()


def test_adopt_blocks_taking_the_whole_pool_exits_2(sock_dir: str) -> None:
    """A sender whose handover.adopt_blocks leaves no block for the engine exits 2 naming it."""
    assert_fails_fast(
        "sender",
        sock_dir,
        "handover.adopt_blocks",
        ["64", "no block"],
        KVXFERD_POOL__NUM_BLOCKS="64",
        KVXFERD_HANDOVER__ADOPT_BLOCKS="64",
    )
