"""A poll loop's wait: ZMQ sockets and plain file descriptors, with sub-millisecond timeouts.

``zmq.Poller`` waits in whole milliseconds (``zmq_poll``), which the io threads cannot
afford: a fetch's notification comes tens of microseconds after its WRITE, and a 1 ms
wait per request was most of the engine path's latency (issue 22). :class:`Poller` has
zmq.Poller's interface with the timeout in seconds (a float): it asks each ZMQ socket
for its ``EVENTS`` first (which also processes the socket's pending commands), and
only when none is ready waits in ``select`` on the sockets' file descriptors and the
plain ones. ZMQ's file descriptor is edge-triggered: a message that arrives after the
``EVENTS`` check signals it, so the wait ends; one that came before is seen by the
check. Waits of a millisecond or more (and any wait once a descriptor is past
``select``'s limit) go to ``select.poll``.
"""

from __future__ import annotations

import ctypes
import select
import threading
from typing import Any

import zmq

_POLLIN, _POLLOUT = zmq.POLLIN, zmq.POLLOUT
_SELECT_MAX_FD = 1023  # FD_SETSIZE - 1
_PR_SET_TIMERSLACK = 29


def tight_timers() -> None:
    """Let this thread's short sleeps and waits end on time (timer slack 1 us, not 50 us).

    Linux lets a thread's timed waits run late by its timer slack; at 50 us a 25 us wait
    took 75. Best effort: where prctl is not there, waits are only a little later.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


class Poller:
    """``zmq.Poller``'s register/poll over ZMQ sockets and file descriptors; float timeouts.

    Owned by one thread (the io thread that polls with it).
    """

    def __init__(self) -> None:
        self._zmq: list[tuple[zmq.Socket[Any], int, int]] = []  # (socket, flags, its fd)
        self._fds: list[tuple[int, int]] = []  # (fd, flags)
        self._rlist: list[int] = []
        self._wlist: list[int] = []
        self._by_fd: dict[int, zmq.Socket[Any]] = {}
        self._big = False  # a descriptor select() cannot take
        self._poll: Any = None  # select.poll, built when needed
        self.owner = threading.get_ident()

    def register(self, obj: Any, flags: int = _POLLIN) -> None:
        if isinstance(obj, zmq.Socket):
            fd = int(obj.getsockopt(zmq.FD))
            self._zmq.append((obj, flags, fd))
            self._by_fd[fd] = obj
            self._rlist.append(fd)
        else:
            fd = int(obj)
            self._fds.append((fd, flags))
            if flags & _POLLIN:
                self._rlist.append(fd)
            if flags & _POLLOUT:
                self._wlist.append(fd)
        self._big = self._big or fd > _SELECT_MAX_FD
        self._poll = None

    def poll(self, timeout_s: float | None, check_zmq: bool = True) -> list[tuple[Any, int]]:
        """What is ready, as (socket or fd, events); waits up to ``timeout_s`` (None: forever).

        ``check_zmq=False``: the caller knows that no ZMQ socket was used since the last
        poll found none of them ready, so their ``EVENTS`` still hold and only a new
        message (which signals the socket's descriptor) can change them; the check is
        skipped. Any send or receive on a socket may consume that signal: poll with the
        check after one.
        """
        ready = self._zmq_ready() if check_zmq else []
        if ready:
            timeout_s = 0.0
        if self._big or (timeout_s is not None and timeout_s >= 0.001) or timeout_s is None:
            fds_ready = self._wait_poll(timeout_s)
        else:
            r, w, _ = select.select(self._rlist, self._wlist, (), max(0.0, timeout_s))
            fds_ready = self._events(r, w)
        zmq_woke = False
        out = ready
        for fd, ev in fds_ready:
            if fd in self._by_fd:
                zmq_woke = True
            else:
                out.append((fd, ev))
        if zmq_woke and not ready:
            out += self._zmq_ready()
        return out

    def _zmq_ready(self) -> list[tuple[Any, int]]:
        ready: list[tuple[Any, int]] = []
        for sock, flags, _ in self._zmq:
            if sock.closed:
                continue
            ev = int(sock.getsockopt(zmq.EVENTS)) & flags
            if ev:
                ready.append((sock, ev))
        return ready

    def _events(self, r: list[int], w: list[int]) -> list[tuple[int, int]]:
        if not w:
            return [(fd, _POLLIN) for fd in r]
        ev: dict[int, int] = {}
        for fd in r:
            ev[fd] = ev.get(fd, 0) | _POLLIN
        for fd in w:
            ev[fd] = ev.get(fd, 0) | _POLLOUT
        return list(ev.items())

    def _wait_poll(self, timeout_s: float | None) -> list[tuple[int, int]]:
        if self._poll is None:
            p = select.poll()
            for _, _, fd in self._zmq:
                p.register(fd, select.POLLIN)
            for fd, flags in self._fds:
                mask = (select.POLLIN if flags & _POLLIN else 0) | (
                    select.POLLOUT if flags & _POLLOUT else 0
                )
                p.register(fd, mask)
            self._poll = p
        ms = None if timeout_s is None else max(0, int(timeout_s * 1000 + 0.999))
        out: list[tuple[int, int]] = []
        for fd, mask in self._poll.poll(ms):
            ev = 0
            if mask & (select.POLLIN | select.POLLHUP | select.POLLERR):
                ev |= _POLLIN
            if mask & select.POLLOUT:
                ev |= _POLLOUT
            out.append((fd, ev))
        return out
