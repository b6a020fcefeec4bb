"""One pool per daemon: a segment a live process holds is never removed (issue 23, item 5).

The unit tests drive :func:`~kvxferd.transfer.pool.holder_alive` on real /dev/shm
segments; the integration test starts real daemons with one configured
``pool.shm_name``. Two daemons on one engine socket string keeping their own pools is
tests/test_auth.py::test_two_daemons_on_one_engine_socket_string_keep_their_own_pools.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvxferd.transfer.pool import SHM_DIR, hold, holder_alive
from tests.test_daemon import DaemonProcess, daemon_env
from tests.test_daemon import sock_dir as sock_dir  # the fixture, shared
from tests.test_preflight import assert_fails_fast

SHM = Path(SHM_DIR)


@pytest.fixture
def segment() -> Iterator[Callable[[str], Path]]:
    """A path in /dev/shm for one test's segment, removed afterwards."""
    paths: list[Path] = []

    def make(name: str) -> Path:
        p = SHM / name
        p.write_bytes(b"\0" * 64)
        paths.append(p)
        return p

    yield make
    for p in paths:
        p.unlink(missing_ok=True)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return int(proc.stdout)


def test_a_segment_whose_flock_is_held_is_alive(segment: Callable[[str], Path]) -> None:
    """A segment some process holds the flock of is live, whatever its name says."""
    path = segment(f"kvxferd-test-{dead_pid()}-{secrets.token_hex(4)}")
    fd = hold(str(path))
    assert fd is not None
    try:
        assert holder_alive(str(path))
    finally:
        os.close(fd)
    assert not holder_alive(str(path)), "the lock is gone and so is its creator"


def test_an_unlocked_segment_is_alive_only_while_the_pid_in_its_name_lives(
    segment: Callable[[str], Path],
) -> None:
    """Before its creator takes the flock, the pid in the name keeps a segment; once that
    process is gone (or a name carries no pid) an unlocked segment is a leftover."""
    live = segment(f"kvxferd-test-{os.getpid()}-{secrets.token_hex(4)}")
    gone = segment(f"kvxferd-test-{dead_pid()}-{secrets.token_hex(4)}")
    plain = segment(f"kvxferd-test-plain{secrets.token_hex(4)}")
    assert holder_alive(str(live))
    assert not holder_alive(str(gone))
    assert not holder_alive(str(plain))
    assert not holder_alive(str(SHM / f"kvxferd-test-absent-{secrets.token_hex(4)}"))


@pytest.mark.integration
def test_a_configured_shm_name_a_live_daemon_holds_is_refused(sock_dir: str) -> None:
    """``pool.shm_name``: a leftover under that name (no holder) is removed at start; a
    second daemon given the name while the first lives exits 2 in one line naming the
    setting, and the first daemon's segment stays (its engine still maps it)."""
    from kvxferd.engine.client import Client, attach_pool

    name = f"kvxferd-test-op{secrets.token_hex(4)}"
    path = SHM / name
    path.write_bytes(b"\xff" * 64)  # a killed daemon's leftover under the operator's name
    first: DaemonProcess | None = None
    client: Client | None = None
    try:
        env = daemon_env(KVXFERD_POOL__SHM_NAME=name)
        first = DaemonProcess("receiver", "first", sock_dir, env, [])
        client = Client(first.engine_socket, timeout_s=10.0)
        info = client.describe()
        assert info.shm_name == name
        kv = attach_pool(info)
        assert any(f"removed {path}" in line for line in first.stderr_tail(50)), first.describe()
        inode = path.stat().st_ino
        kv[0, 0, :8] = 0x3C
        assert_fails_fast(
            "receiver",
            sock_dir,
            "pool.shm_name",
            [repr(name), "live daemon"],
            KVXFERD_POOL__SHM_NAME=name,
        )
        assert path.stat().st_ino == inode, "the live daemon's segment was replaced"
        assert bool((kv[0, 0, :8] == 0x3C).all())
        assert first.proc.poll() is None, first.describe()
    finally:
        if client is not None:
            client.close_client()
        if first is not None:
            first.kill()
        path.unlink(missing_ok=True)


def test_start_up_refuses_a_configured_name_held_and_removes_one_left(
    segment: Callable[[str], Path],
) -> None:
    """The start-up check itself: an operator's ``pool.shm_name`` whose flock a live
    process holds is a one-line ConfigError naming the setting, and stays; the same name
    once nobody holds it is removed, so the pool can be created under it."""
    from kvxferd.config import load_receiver_settings
    from kvxferd.errors import ConfigError
    from kvxferd.service.preflight import _stale_pool

    path = segment(f"kvxferd-test-op{secrets.token_hex(4)}")
    settings = load_receiver_settings(pool={"shm_name": path.name})
    fd = hold(str(path))
    assert fd is not None
    try:
        with pytest.raises(ConfigError, match="pool.shm_name") as refused:
            _stale_pool(settings)
        assert "\n" not in str(refused.value)
        assert path.exists(), "a live holder's segment was removed"
    finally:
        os.close(fd)
    _stale_pool(settings)
    assert not path.exists(), "a leftover nobody holds should be removed"
