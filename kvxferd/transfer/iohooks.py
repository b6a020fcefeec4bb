"""Work another component hands to a service's io thread: its sockets, its timers, calls from other threads.

A Sender's listener and a Receiver's io thread each run one poll loop. The engine
gateway (kvxferd/engine/gateway.py) is served *by that loop*, not by a thread of its
own: an engine's Fetch is read, started and its RequestData sent by one thread, and
the outcome goes back to the engine from the thread that saw it end, with no thread
hand-off on the way (issue 22: each hand-off cost 30-60 us and a GIL transfer on a
2-core host). The core does not import the engine side; the gateway attaches itself as
an :class:`IoHook`::

    service.io.attach(hook)      # any thread; the loop picks it up on its next turn
    service.io.call_soon(fn)     # any thread: fn() runs on the io thread soon (eventfd wake)
    service.io.on_io_thread()    # True on the io thread itself

The loop's side, each turn: poll its own sockets plus ``items()`` (the wake eventfd and
every hook's items), hand each ready hook item to ``dispatch``, then ``turn(now)``
runs the calls queued meanwhile and each hook's ``io_turn`` (its timers), and says how
soon the loop must turn again. When the loop ends it calls ``stop()``: each hook's
``io_stop`` (answer what is outstanding, close its sockets) runs on the io thread.

Thread rules: ``_calls`` and ``_hooks`` are guarded by ``_lock``; everything a hook owns
is touched only on the io thread (its own docstring says what it owns).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

log = logging.getLogger("kvxferd.io")

Item = tuple[Any, int]  # (zmq socket or file descriptor, zmq.POLLIN / POLLOUT flags)


class IoHook(Protocol):
    """What a component served by a service's io thread provides (all called on that thread)."""

    def io_items(self) -> Sequence[Item]:
        """What to poll, with flags; the loop re-reads it when ``IoHooks.changed`` says so."""
        ...

    def io_ready(self, item: Any, events: int, now: float) -> None:
        """One of ``io_items`` is ready."""
        ...

    def io_turn(self, now: float) -> float | None:
        """After every turn: run due timers; seconds until the next one (None: no timer)."""
        ...

    def io_stop(self) -> None:
        """The loop is ending: answer what is outstanding, close what it owns."""
        ...


class IoHooks:
    """The hooks, cross-thread calls and wake-up of one service io thread."""

    def __init__(self, guard: Any = None) -> None:
        self._lock = threading.Lock()
        self._hooks: list[IoHook] = []
        self._calls: deque[Callable[[], None]] = deque()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread: int | None = None  # the io thread's ident, once it runs
        self._items: dict[Any, IoHook] = {}  # item -> its hook (io thread only)
        self._stopped = False
        self.version = 0  # bumped when a hook's items may have changed
        self.guard = guard  # the service's Guard: a hook's unexpected error is caught there

    # -- any thread ------------------------------------------------------------------------
    def attach(self, hook: IoHook) -> None:
        with self._lock:
            if self._stopped:
                raise RuntimeError("the service's io thread has stopped")
            self._hooks.append(hook)
        self.changed()

    def detach(self, hook: IoHook) -> None:
        with self._lock:
            if hook in self._hooks:
                self._hooks.remove(hook)
        self.changed()

    @property
    def hooks(self) -> list[IoHook]:
        with self._lock:
            return list(self._hooks)

    def changed(self) -> None:
        """A hook's items changed (a connection came or went): the loop polls afresh."""
        self.version += 1
        if not self.on_io_thread():
            self._kick()

    def call_soon(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` on the io thread soon; False once the loop has stopped (it never runs)."""
        with self._lock:
            if self._stopped:
                return False
            self._calls.append(fn)
        if not self.on_io_thread():
            self._kick()
        return True

    def wake(self) -> None:
        """Wake the io thread (from another thread: work for it was queued elsewhere)."""
        if not self.on_io_thread():
            self._kick()

    def on_io_thread(self) -> bool:
        return threading.get_ident() == self._thread

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stopped

    def _kick(self) -> None:
        try:
            os.eventfd_write(self._wake, 1)
        except OSError:  # closed at the very end of the service's life
            pass

    # -- the io thread -----------------------------------------------------------------------
    def bind_thread(self) -> None:
        """The calling thread is the io thread from now on."""
        self._thread = threading.get_ident()

    @property
    def wake_fd(self) -> int:
        return self._wake

    def items(self) -> list[Item]:
        """The wake eventfd and every hook's items (refreshes the item -> hook map)."""
        import zmq

        self._items = {}
        out: list[Item] = [(self._wake, zmq.POLLIN)]
        for hook in self.hooks:
            for item in hook.io_items():
                self._items[item[0]] = hook
                out.append(item)
        return out

    def dispatch(self, item: Any, events: int, now: float) -> bool:
        """Hand a ready item to its hook; True if the item was ours (the wake fd or a hook's)."""
        if isinstance(item, int) and item == self._wake:
            try:
                os.eventfd_read(self._wake)
            except BlockingIOError:
                pass
            return True
        hook = self._items.get(item)
        if hook is None:
            return False
        try:
            hook.io_ready(item, events, now)
        except Exception:
            self._caught("io hook")
        return True

    def pending(self) -> bool:
        """Calls are queued: the loop must not sleep."""
        return bool(self._calls)

    def turn(self, now: float) -> float | None:
        """Run the queued calls, then each hook's timers; seconds until the next timer."""
        for _ in range(4096):  # bounded: calls queued by these calls wait for the next turn
            try:
                fn = self._calls.popleft()
            except IndexError:
                break
            try:
                fn()
            except Exception:
                self._caught("io call")
        nearest: float | None = None
        for hook in self.hooks:
            try:
                d = hook.io_turn(now)
            except Exception:
                self._caught("io hook timers")
                d = 0.01
            if d is not None and (nearest is None or d < nearest):
                nearest = d
        return nearest

    def stop(self) -> None:
        """The loop ends: every hook's ``io_stop`` (a hook may move to a thread of its own),
        then what was handed to us before the end runs; later ``call_soon`` calls are
        refused (False)."""
        for hook in self.hooks:
            try:
                hook.io_stop()
            except Exception:
                self._caught("io hook stop")
        with self._lock:
            self._stopped = True
            calls, self._calls = list(self._calls), deque()
        for fn in calls:
            try:
                fn()
            except Exception:
                self._caught("io call")

    def close(self) -> None:
        """Close the eventfd (after the io thread has ended)."""
        try:
            os.close(self._wake)
        except OSError:
            pass

    def _caught(self, where: str) -> None:
        if self.guard is not None:
            self.guard.caught(where)
        else:  # pragma: no cover - services always pass their guard
            log.exception("%s failed", where)
