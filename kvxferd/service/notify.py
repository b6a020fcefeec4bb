"""systemd's notify protocol (``Type=notify``, ``WatchdogSec=``), without a dependency.

The protocol is one datagram of ``KEY=value`` lines to the AF_UNIX socket named
by ``$NOTIFY_SOCKET`` (a path, or ``@name`` for an abstract socket)::

    READY=1 + STATUS=...      start-up finished (systemd starts the dependants)
    STATUS=...                free text shown by ``systemctl status``
    WATCHDOG=1                every half of ``$WATCHDOG_USEC``, while the process is healthy
    EXTEND_TIMEOUT_USEC=...   a stop (drain) that needs longer than TimeoutStopSec
    STOPPING=1 + STATUS=...   shutdown began

Sends never block (``MSG_DONTWAIT``) and never raise: a daemon must not hang
or die because systemd is slow or gone. Failures are counted in
``send_failures`` and logged.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Mapping

log = logging.getLogger("kvxferd.notify")


class Notifier:
    """Sends state changes to systemd; a no-op when not started by systemd."""

    def __init__(
        self,
        address: str | None = None,
        watchdog_interval_s: float | None = None,
    ) -> None:
        """``address``: the socket address as ``socket.sendto`` wants it (abstract: leading NUL)."""
        self._address = address
        self.watchdog_interval_s = watchdog_interval_s
        self.send_failures = 0
        self.sent = 0
        self._lock = threading.Lock()  # guards _sock (send vs close from different threads)
        self._sock: socket.socket | None = None
        if address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        """The notifier systemd asked for in ``environ`` (default ``os.environ``)."""
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        if not raw:
            return cls()
        if raw.startswith("@"):
            address = "\0" + raw[1:]
        elif raw.startswith("/"):
            address = raw
        else:  # vsock:... and relative paths are not for us
            log.warning("NOTIFY_SOCKET=%r is not a path or @abstract name; not notifying", raw)
            return cls()
        return cls(address, _watchdog_interval(env))

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def ready(self, status: str) -> None:
        self._send(f"READY=1\nSTATUS={_one_line(status)}")

    def stopping(self, status: str) -> None:
        self._send(f"STOPPING=1\nSTATUS={_one_line(status)}")

    def status(self, text: str) -> None:
        self._send(f"STATUS={_one_line(text)}")

    def watchdog(self) -> None:
        self._send("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> None:
        """Ask for ``seconds`` more before systemd's start/stop timeout kills us."""
        self._send(f"EXTEND_TIMEOUT_USEC={max(1, int(seconds * 1_000_000))}")

    def close(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _send(self, message: str) -> None:
        if self._address is None:
            return
        with self._lock:
            sock = self._sock
            if sock is None:
                return
            try:
                sock.sendto(message.encode(), socket.MSG_DONTWAIT, self._address)
            except OSError as e:
                self.send_failures += 1
                # First failure loud, the rest quiet: a missing socket must not flood the log.
                level = logging.WARNING if self.send_failures == 1 else logging.DEBUG
                log.log(level, "systemd notify failed (%d so far): %s", self.send_failures, e)
            else:
                self.sent += 1

    def __repr__(self) -> str:
        where = "disabled" if self._address is None else repr(self._address.replace("\0", "@"))
        return f"Notifier({where}, watchdog_interval_s={self.watchdog_interval_s})"


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Half of ``WATCHDOG_USEC`` in seconds, when it is meant for this process."""
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec:
        return None
    if pid and pid != str(os.getpid()):  # inherited from a parent that systemd watches
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("WATCHDOG_USEC=%r is not an integer; watchdog off", usec)
        return None
    return value / 2 / 1_000_000 if value > 0 else None


def _one_line(text: str) -> str:
    # A newline would start a new KEY=value assignment in the datagram.
    return " ".join(text.splitlines())
