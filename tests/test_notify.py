"""systemd notify: real AF_UNIX datagram sockets stand in for systemd's NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from collections.abc import Iterator

import pytest

from kvxferd.service.notify import Notifier

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
def systemd() -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket playing systemd, and its path (short: sun_path is 108 bytes)."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="kvx-") as d:
        path = os.path.join(d, "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.settimeout(5)
        try:
            yield sock, path
        finally:
            sock.close()


def recv(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_datagrams_arrive_in_order_with_the_protocol_keys(
    systemd: tuple[socket.socket, str],
) -> None:
    """READY, STATUS, WATCHDOG and STOPPING each arrive as one datagram, in the order sent."""
    sock, path = systemd
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert n.enabled
    n.ready("serving on tcp://x")
    n.status("3 sessions")
    n.watchdog()
    n.stopping("draining")
    n.close()
    assert [recv(sock) for _ in range(4)] == [
        "READY=1\nSTATUS=serving on tcp://x",
        "STATUS=3 sessions",
        "WATCHDOG=1",
        "STOPPING=1\nSTATUS=draining",
    ]
    assert n.sent == 4 and n.send_failures == 0


def test_abstract_socket_name_is_reached() -> None:
    """An '@name' NOTIFY_SOCKET addresses the abstract socket 'name'."""
    name = f"kvxferd-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        n.ready("up")
        assert recv(sock) == "READY=1\nSTATUS=up"
        n.close()
    finally:
        sock.close()


def test_unset_notify_socket_gives_a_silent_no_op() -> None:
    """Without NOTIFY_SOCKET every call does nothing and nothing fails."""
    n = Notifier.from_env({"WATCHDOG_USEC": "2000000"})
    assert not n.enabled
    n.ready("x")
    n.status("y")
    n.watchdog()
    n.stopping("z")
    n.close()
    assert n.sent == 0 and n.send_failures == 0


def test_watchdog_interval_is_half_of_watchdog_usec(systemd: tuple[socket.socket, str]) -> None:
    """WATCHDOG_USEC=3 s gives a 1.5 s interval; absent gives None."""
    _, path = systemd
    assert (
        Notifier.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "3000000"}).watchdog_interval_s
        == 1.5
    )
    assert Notifier.from_env({"NOTIFY_SOCKET": path}).watchdog_interval_s is None


def test_watchdog_pid_of_another_process_disables_the_watchdog(
    systemd: tuple[socket.socket, str],
) -> None:
    """WATCHDOG_PID names the watched process: ours enables the watchdog, another's does not."""
    _, path = systemd
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"}
    mine = Notifier.from_env({**env, "WATCHDOG_PID": str(os.getpid())})
    other = Notifier.from_env({**env, "WATCHDOG_PID": str(os.getpid() + 1)})
    assert mine.watchdog_interval_s == 0.5
    assert other.watchdog_interval_s is None


def test_failed_send_is_counted_not_raised() -> None:
    """A NOTIFY_SOCKET nobody listens on costs a counter, never an exception."""
    n = Notifier.from_env({"NOTIFY_SOCKET": f"/tmp/kvx-missing-{uuid.uuid4().hex}"})
    n.ready("x")
    n.watchdog()
    assert n.send_failures == 2 and n.sent == 0
    n.close()


def test_status_with_newlines_stays_one_assignment(systemd: tuple[socket.socket, str]) -> None:
    """A newline in a status text cannot inject another KEY=value line."""
    sock, path = systemd
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    n.status("line one\nREADY=1")
    assert recv(sock) == "STATUS=line one READY=1"
    n.close()


def test_send_after_close_is_a_no_op(systemd: tuple[socket.socket, str]) -> None:
    """After close() nothing is sent and nothing fails."""
    _, path = systemd
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    n.close()
    n.watchdog()
    assert n.sent == 0 and n.send_failures == 0
