"""What every discovery backend offers to advertise this daemon: a registrar and its flag.

``registered`` says whether peers can find this daemon through discovery right
now; the daemon's readiness should include it (docs/discovery.md). It changes
only on the registrar's own thread (or in start/stop for :class:`NullRegistrar`),
under ``_cond``, and each change calls ``on_change(registered)`` outside the
lock, on that thread; an exception in the callback is logged and counted.

:class:`NullRegistrar` serves the backends where the daemon advertises nothing
itself (``none``; ``static``: an operator writes the file; ``dns``: Kubernetes
publishes the pod's address while it is Ready): registered from start to stop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kvxferd.discovery.record import PeerRecord, check_record

log = logging.getLogger("kvxferd.discovery")

ChangeCallback = Callable[[bool], None]


class Registrar:
    """Keeps ``record`` advertised from start() to stop(); ``registered`` says if it is now."""

    backend = "none"

    def __init__(self, record: PeerRecord, on_change: ChangeCallback | None = None) -> None:
        self._record = check_record(record)
        self._on_change = on_change
        self._cond = threading.Condition()
        self._registered = False
        self.counts: dict[str, int] = {"registrations": 0, "losses": 0, "callback_errors": 0}

    @property
    def record(self) -> PeerRecord:
        with self._cond:
            return self._record

    @property
    def registered(self) -> bool:
        return self._registered

    def start(self) -> Registrar:
        self._set_registered(True)
        return self

    def stop(self, timeout: float = 5.0) -> bool:
        """Withdraw the record; True when everything stopped within ``timeout`` seconds."""
        self._set_registered(False, "stopped")
        return True

    def update(self, record: PeerRecord) -> None:
        """Advertise ``record`` from now on (same role and name; say, new topology)."""
        check_record(record)
        with self._cond:
            if (record.role, record.name) != (self._record.role, self._record.name):
                raise ValueError("a registrar keeps its role and name; start another one")
            self._record = record

    def wait_registered(self, value: bool, timeout: float) -> bool:
        """True once ``registered == value`` (within ``timeout`` seconds)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._registered == value, timeout)

    def state(self) -> dict[str, Any]:
        """For /debug/state."""
        with self._cond:
            return {
                "backend": self.backend,
                "registered": self._registered,
                "name": self._record.name,
                "incarnation": self._record.incarnation,
                "counts": dict(self.counts),
            }

    def _set_registered(self, value: bool, why: str = "") -> None:
        with self._cond:
            if self._registered == value:
                return
            self._registered = value
            if value or why != "stopped":
                self.counts["registrations" if value else "losses"] += 1
            self._cond.notify_all()
        if value:
            log.info("discovery %s: registered %s", self.backend, self._record.name)
        else:
            log.warning("discovery %s: not registered%s", self.backend, f" ({why})" if why else "")
        if self._on_change is None:
            return
        try:
            self._on_change(value)
        except Exception:
            log.exception("discovery %s: the registered callback failed", self.backend)
            with self._cond:
                self.counts["callback_errors"] += 1


class NullRegistrar(Registrar):
    """Nothing to advertise here: registered from start() to stop()."""
