"""Connects toward new peers: the probe agents and the ``kvxferd-tx-connect`` threads.

Loading a peer's NIXL metadata connects to it, and over UCX TCP that connect blocks until the
kernel gives up toward a peer whose packets vanish (127 s of SYN retries with the kernel's
defaults; the data plane's docstring has the figures). NIXL's own agent lock (sync modes
strict and rw) holds every other call on that agent meanwhile, writes included. So a new peer
is first reached from a *probe agent*: a NIXL agent with no memory registered and no write,
one per concurrent connect, kept for reuse. Once the probe connected (and let go), loading
the peer on a path agent takes milliseconds.

:meth:`PeerConnects.probe` blocks its caller for the whole connect. :meth:`PeerConnects.start`
does not: it runs the probe and then ``load`` on a thread of its own (``kvxferd-tx-connect``,
one per connect, so one silent peer never holds another's), and returns a future. Each
connect goes through::

    probing --probe reached the peer, deadline not passed--> loading --load returned--> done(name)
    probing --probe raised--> failed(PeerUnreachable)
    probing --deadline passed (the probe still blocked in NIXL)--> failed(PeerUnreachable)
    probing --close()--> failed(PeerUnreachable)
    loading --load raised--> failed(that error)

A probe that reaches the peer after its future failed loads nothing. Once loading, the
deadline no longer applies (the probe just reached the peer: the load takes milliseconds).

**Locking rule.** ``_lock`` guards the idle probe agents, the connects in flight and their
states, and ``_closed``; it is never held across a NIXL call or ``load``, and this module
never takes the data plane's lock (``load`` takes it itself). ``counts`` counts each
transition above (``started``, ``loaded``, ``unreachable``, ``expired``, ``closed``,
``load_failed``).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger("kvxferd.dataplane")


class PeerUnreachable(RuntimeError):
    """The peer's NIXL metadata could not be connected to: NIXL refused it, the deadline
    passed while the connect still waited, or the data plane closed meanwhile."""


class _Connect:
    """One connect in flight: its future, whether it is loading, whether it ended (the first
    of the thread, the deadline and ``close`` to end it sets the future; ``_lock`` held)."""

    __slots__ = ("future", "loading", "ended", "timer")

    def __init__(self) -> None:
        self.future: Future[str] = Future()
        self.loading = False
        self.ended = False
        self.timer: threading.Timer | None = None


class PeerConnects:
    """The probe agents of data plane ``name`` and its connects in flight.

    ``new_agent(name)`` makes a NIXL agent with the data plane's backend and settings.
    """

    def __init__(self, name: str, new_agent: Callable[[str], Any]) -> None:
        self.name = name
        self._new_agent = new_agent
        self._lock = threading.Lock()
        self._probes: list[Any] = []  # idle probe agents, made on first use
        self._seq = itertools.count(1)
        self._inflight: set[_Connect] = set()
        self._closed = False
        self.counts: Counter[str] = Counter()

    def probe(self, metadata: bytes) -> str:
        """Connect to a peer from a probe agent (no pool, no write), disconnect; its name.

        Raises as ``add_remote_agent`` does, after the whole connect toward an unreachable
        peer. Holds no lock of its own (nor the data plane's) meanwhile: each caller takes
        its own probe agent.
        """
        with self._lock:
            agent = self._probes.pop() if self._probes else None
        if agent is None:
            agent = self._new_agent(f"{self.name}.probe{next(self._seq)}")
        try:
            name = agent.add_remote_agent(metadata)
            try:
                agent.remove_remote_agent(name)
            except Exception:
                log.warning("a probe agent kept the remote agent %s", name, exc_info=True)
        finally:
            with self._lock:
                self._probes.append(agent)
        return name.decode() if isinstance(name, bytes) else str(name)

    def start(
        self, metadata: bytes, timeout_s: float, load: Callable[[bytes, str], str]
    ) -> Future[str]:
        """Probe the peer, then ``load(metadata, name)``, on a ``kvxferd-tx-connect`` thread.

        Returns at once. The future ends with ``load``'s result, or fails: with
        :class:`PeerUnreachable` when the probe failed, when ``timeout_s`` passed before it
        reached the peer (at the deadline, the probe still blocked in NIXL), or on
        :meth:`close`; with ``load``'s error when it raised. Callbacks added with
        ``add_done_callback`` run on the thread that ended it.
        """
        c = _Connect()
        c.future.set_running_or_notify_cancel()
        with self._lock:
            closed = self._closed
            if not closed:
                self._inflight.add(c)
                self.counts["started"] += 1
                c.timer = threading.Timer(timeout_s, self._expire, (c, timeout_s))
                c.timer.name = "kvxferd-tx-connect-deadline"
                c.timer.daemon = True
        if closed:
            c.future.set_exception(PeerUnreachable("the data plane is closed"))
            return c.future
        assert c.timer is not None
        c.timer.start()
        thread = threading.Thread(
            target=self._run, args=(c, metadata, load), name="kvxferd-tx-connect", daemon=True
        )
        thread.start()
        return c.future

    def _run(self, c: _Connect, metadata: bytes, load: Callable[[bytes, str], str]) -> None:
        try:
            name = self.probe(metadata)
        except Exception as e:
            self._end(c, "unreachable", error=PeerUnreachable(f"NIXL metadata not accepted: {e}"))
            return
        with self._lock:
            if c.ended:  # expired or closed while the probe waited: load nothing
                self._inflight.discard(c)
                return
            c.loading = True
        try:
            result = load(metadata, name)
        except Exception as e:
            self._end(c, "load_failed", error=e)
            return
        self._end(c, "loaded", result=result)

    def _expire(self, c: _Connect, timeout_s: float) -> None:
        why = f"no connect within {timeout_s:g} s (the peer's address does not answer)"
        self._end(c, "expired", error=PeerUnreachable(why), thread_done=False)

    def _end(
        self,
        c: _Connect,
        count: str | None,
        *,
        result: str | None = None,
        error: BaseException | None = None,
        thread_done: bool = True,
    ) -> None:
        """End ``c`` (if nothing ended it yet, and, for the deadline, if it is not loading);
        the future is set outside ``_lock``: its callbacks may call back in."""
        with self._lock:
            if thread_done:
                self._inflight.discard(c)
            if c.ended or (not thread_done and c.loading):
                return
            c.ended = True
            if count is not None:
                self.counts[count] += 1
        if c.timer is not None:
            c.timer.cancel()
        if error is None:
            c.future.set_result(result)  # type: ignore[arg-type]
        else:
            c.future.set_exception(error)

    def in_flight(self) -> int:
        """Connects whose thread has not ended yet (one expired may still wait in NIXL)."""
        with self._lock:
            return len(self._inflight)

    def close(self) -> None:
        """Fail every connect not loading yet; later ``start`` calls fail at once. Threads
        still in NIXL end when their connect does (they load nothing)."""
        with self._lock:
            self._closed = True
            pending = [c for c in self._inflight if not c.loading]
        for c in pending:
            self._end(
                c, "closed", error=PeerUnreachable("the data plane is closed"), thread_done=False
            )
