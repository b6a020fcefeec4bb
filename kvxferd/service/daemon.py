"""The daemon: one sender or receiver process with its engine gateway, probe port and systemd notify.

Told top-down, as ``run -> startup -> serve -> drain -> teardown``:

* **startup** first runs :func:`kvxferd.service.preflight.check` (ports, hosts, ipc
  paths, a live daemon on the engine socket, /dev/shm room: one-line
  ConfigError, exit 2), then builds the Sender or Receiver (pool registered once, sockets
  bound, NIXL agent up), starts the engine gateway and the probe port, then
  tells systemd ``READY=1`` and prints one JSON ``ready`` line on stdout.
* **serve** waits for SIGTERM/SIGINT (SIGHUP re-reads the allow-lists of
  ``security.allowed_keys_dir``, nothing else); meanwhile a watchdog task sends
  ``WATCHDOG=1`` at half of ``WATCHDOG_USEC`` *only while* liveness holds (the
  listener and every worker made progress, and neither the service nor the
  gateway met an unexpected exception: ``broken()``), and a status line every
  few seconds.
* **drain** (first signal): ``STOPPING=1``; readiness drops; the gateway
  refuses new publishes and fetches with DRAINING but still serves Wait, Poll,
  Cancel and Close. The service's own shutdown waits up to ``drain_timeout_ms``
  (a sender: for its published requests to be fetched, serving those fetches,
  and for attached transfers to finish; a receiver: for its open fetches), ends
  what is still open ``failed``/``shutting_down`` with the reason sent to peers
  (a request its engine lets go of during the drain too), counts it
  (``drain_dropped_*``), joins its threads and deregisters memory only when no
  write can touch it. It runs in a thread so the loop keeps answering probes.
* **teardown** stops the gateway and the probe port.

The last log line says what the drain dropped and the exit code::

    drain complete: 0 published requests never fetched, 0 transfers cut, 0 in doubt; exit 0 after 0.231 s
    drain incomplete: 1 fetch cut, 0 in doubt; exit 3 after 1.554 s     (a receiver)

The process always exits within ``shutdown_timeout_ms`` + 1 s. Exit 0 means the
drain dropped nothing: every published request was fetched (or ended by
itself), every transfer finished, no outcome is in doubt and every thread
stopped. Anything else, a second signal included, is :data:`EXIT_NOT_DRAINED`
(3); when the counts are not the reason, the line ends with it (``; a thread
did not stop in time``, ``; forced exit before the drain ended``, ...).
An outcome in doubt has no code of its own: the line says it, and the action
(read the line, look at the peer) is the same.

The async side runs on uvloop when it is importable, asyncio otherwise; the
daemon installs its signal handlers on the loop and removes them on exit.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Literal

from kvxferd import __version__
from kvxferd.config import ReceiverSettings, SenderSettings

log = logging.getLogger("kvxferd.daemon")

EXIT_OK = 0
EXIT_NOT_DRAINED = 3
_STATUS_EVERY_S = 5.0


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (the daemon's loop), the standard loop otherwise."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class Daemon:
    """A sender or receiver service with everything an operator needs around it."""

    def __init__(
        self, role: Literal["sender", "receiver"], settings: SenderSettings | ReceiverSettings
    ) -> None:
        self.role = role
        self.settings = settings
        self._stop = asyncio.Event()
        self._signals = 0
        self.drain_started: float | None = None  # monotonic time of the first signal
        self._forced = threading.Event()
        self.registrar: Any = None  # discovery (kvxferd/discovery): set at start-up
        self.watcher: Any = None

    # -- run ---------------------------------------------------------------------------
    def run(self) -> int:
        """Run until a signal, then drain; returns the process exit code."""
        loop = _new_event_loop()
        try:
            return loop.run_until_complete(self._main())
        finally:
            loop.close()

    async def _main(self) -> int:
        from kvxferd import logs
        from kvxferd.service.notify import Notifier

        logs.configure(self.settings.log_level, self.settings.service.log_json)
        self._stop = asyncio.Event()
        self.notifier = Notifier.from_env()
        loop = asyncio.get_running_loop()
        try:
            await self._startup()  # installs the signal handlers before it says ready
            watchdog = asyncio.create_task(self._watchdog())
            await self._stop.wait()
            watchdog.cancel()
            return await self._drain_and_teardown()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            self.notifier.close()

    def _on_reload(self) -> None:
        """SIGHUP: re-read the allow-lists (keys added or removed); everything else stays."""
        from kvxferd.auth import reload_allow_lists

        reload_allow_lists()

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals == 1:
            self.drain_started = time.monotonic()
            self.probe_server.draining = True  # readiness drops now, before the drain begins
            log.info("signal %s: draining", signal.Signals(sig).name)
            self._stop.set()
        else:
            log.warning("second signal: forcing a bounded exit")
            self._forced.set()

    # -- startup -----------------------------------------------------------------------
    async def _startup(self) -> None:
        from kvxferd.engine.gateway import Gateway
        from kvxferd.service import preflight
        from kvxferd.service.health import ProbeServer
        from kvxferd.service.probes import ReceiverProbe, SenderProbe

        preflight.check(self.settings)  # one-line ConfigError (exit 2) before the slow set-up
        if self.settings.security.mode == "off":
            log.warning(
                'security.mode is "off": the control plane is plaintext and unauthenticated'
                " (accepted because every endpoint is loopback or ipc)"
            )
        # A name of this daemon instance (or the operator's): the next daemon on this socket
        # removes what a killed one left, and only what no live process holds (preflight).
        pool = self.settings.pool.model_copy(
            update={"shm_name": preflight.pool_name(self.settings)}
        )
        self.settings = self.settings.model_copy(update={"pool": pool})
        svc = self.settings.service
        if self.role == "sender":
            from kvxferd.transfer.sender import Sender

            assert isinstance(self.settings, SenderSettings)
            sender = await asyncio.to_thread(Sender, self.settings)
            self.service: Any = sender.start()
            endpoint = sender.endpoint
            probe: Any = SenderProbe(sender, self.settings)
        else:
            from kvxferd.transfer.receiver import Receiver

            assert isinstance(self.settings, ReceiverSettings)
            receiver = await asyncio.to_thread(Receiver, self.settings)
            self.service = receiver.start()
            endpoint = receiver.result_endpoint
            probe = ReceiverProbe(receiver, self.settings)
        self.gateway = Gateway(
            self.service,
            svc.engine_socket,
            max_inflight=svc.max_client_inflight,
            transport=self.service.transport,
            engine_keys_dir=self.settings.security.engine_keys_dir,
        )
        probe.gateway = self.gateway  # a broken gateway fails liveness (and the watchdog)
        engine_socket = self.gateway.start()
        await asyncio.to_thread(self._start_discovery, probe, endpoint)
        self.probe_server = ProbeServer(
            probe,
            svc.probe_host,
            svc.probe_port,
            build_info={"version": __version__, "role": self.role},
            loop_stall_s=svc.liveness_stall_ms / 1000,
        )
        self.probe_port = await self.probe_server.start()
        self.probe = probe
        # Before the ready announcement, not after: a SIGTERM right after "ready" must drain.
        # With the handlers installed after it, a signal in between got the default action
        # (killed at once, nothing drained; seen under load as a receiver gone 0.05 s after
        # its SIGTERM with a fetch open).
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._on_reload)
        status = f"ready: {self.role} at {endpoint}, engines at {engine_socket}"
        self.notifier.ready(status)
        log.info(status)
        _tune_gc()
        sys.stdout.write(
            json.dumps(
                {
                    "event": "ready",
                    "role": self.role,
                    "endpoint": endpoint,
                    "engine_socket": engine_socket,
                    "probe_port": self.probe_port,
                    "pid": os.getpid(),
                }
            )
            + "\n"
        )
        sys.stdout.flush()

    def _start_discovery(self, probe: Any, endpoint: str) -> None:
        """Advertise this daemon (its advertised endpoint, this incarnation); a receiver also
        watches senders, and so does a sender with ``[handover] discover`` (its targets).

        The registrar's ``registered`` feeds readiness (``discovery: not registered``);
        backend ``none`` changes nothing. The watcher's events reach the receiver's io
        thread (Receiver.on_peer_event).
        """
        from kvxferd.discovery import make_registrar, make_watcher, own_record

        disc = self.settings.discovery
        self.watcher = None
        if disc.backend == "none":
            self.registrar = None
            return
        incarnation = self.service.sender_id if self.role == "sender" else self.service.receiver_id
        record = own_record(
            self.role,
            self.settings.name,
            incarnation,
            endpoint,
            public_key=self.service.public_key,
        )
        self.registrar = make_registrar(disc, record).start()
        probe.registrar = self.registrar
        if self.role == "receiver":
            self.watcher = make_watcher(disc, "sender", self.service.on_peer_event)
            if self.watcher is not None:
                self.watcher.start()
        elif isinstance(self.settings, SenderSettings) and self.settings.handover.discover:
            # the senders it may hand its unfetched requests to (sender/handover.py)
            self.watcher = make_watcher(disc, "sender")
            if self.watcher is not None:
                watcher, name = self.watcher.start(), self.settings.name
                self.service.handover.discovered = lambda: [
                    r.endpoints.get("listen", "")
                    for n, r in watcher.snapshot().peers.items()
                    if n != name
                ]

    # -- serve ---------------------------------------------------------------------------
    async def _watchdog(self) -> None:
        """WATCHDOG=1 only while the workers make progress; a readable STATUS= now and then."""
        interval = self.notifier.watchdog_interval_s
        tick = min(interval, _STATUS_EVERY_S) if interval else _STATUS_EVERY_S
        last_status = 0.0
        while True:
            alive, detail = self.probe_server.liveness()  # workers, listener and this loop
            if interval and alive:
                self.notifier.watchdog()
            elif interval:
                log.error("watchdog withheld: %s", detail)
            now = time.monotonic()
            if now - last_status >= _STATUS_EVERY_S:
                last_status = now
                self.notifier.status(self._status_line())
            await asyncio.sleep(tick)

    def _status_line(self) -> str:
        stats = self.service.stats.snapshot()
        if self.role == "sender":
            return (
                f"serving: {self.service.session_count()} sessions, "
                f"{self.service.writes_in_flight()} writes in flight, "
                f"{stats.get('bytes_written', 0) / 1e9:.2f} GB sent"
            )
        return (
            f"serving: {self.service.fetches_in_flight()} fetches in flight, "
            f"{stats.get('bytes_received', 0) / 1e9:.2f} GB received"
        )

    # -- drain and teardown ----------------------------------------------------------------
    async def _drain_and_teardown(self) -> int:
        d = self.settings.deadlines
        t0 = time.monotonic()
        hard_deadline = t0 + d.shutdown_timeout_ms / 1000 + 0.5
        self.notifier.stopping("draining: finishing published requests and transfers")
        self.gateway.refuse_new("draining")
        if self.registrar is not None:  # peers stop choosing us now (etcd: the lease is revoked)
            # A quarter of the shutdown bound at most: an etcd that does not answer must not
            # eat the drain (the lease then expires by itself after its TTL).
            await asyncio.to_thread(self.registrar.stop, min(1.0, d.shutdown_timeout_ms / 4000))
        # The service's shutdown is bounded by shutdown_timeout_ms; keep a little for teardown.
        budget = max(0.1, d.shutdown_timeout_ms / 1000 - 0.5 - (time.monotonic() - t0))
        loop = asyncio.get_running_loop()
        if self.role == "sender":
            worker = loop.run_in_executor(None, self.service.shutdown, budget)
        else:
            worker = loop.run_in_executor(None, self.service.shutdown_report, budget)
        forced = loop.run_in_executor(None, self._forced.wait, budget + 1)
        done, _ = await asyncio.wait({worker, forced}, return_when=asyncio.FIRST_COMPLETED)
        ok, counts, why = False, self._counts_now(), "forced exit before the drain ended"
        if worker in done:
            result = worker.result()
            if result is not None:
                ok, counts = result.complete, result.counts()
                why = "" if result.threads_joined else "a thread did not stop in time"
            else:
                why = "the service's shutdown did not finish in time"
        self._forced.set()  # release the waiter thread
        remaining = max(0.05, hard_deadline - time.monotonic())
        try:
            await asyncio.wait_for(self._teardown(min(1.0, remaining / 2)), remaining)
        except TimeoutError:
            ok, why = False, why or "the gateway or probe port did not stop in time"
        code = EXIT_OK if ok else EXIT_NOT_DRAINED
        # The last line: what the drain dropped and the exit code (docs/operations.md).
        log.log(
            logging.INFO if ok else logging.WARNING,
            "drain %s: %s; exit %d after %.3f s%s",
            "complete" if ok else "incomplete",
            counts,
            code,
            time.monotonic() - t0,
            f"; {why}" if why else "",
        )
        return code

    def _counts_now(self) -> str:
        """What an exit now would drop, in the words of the last log line (a forced exit)."""
        from kvxferd.transfer.drain import DROPPED_CUT, drain_counts, rx_drain_counts

        if self.role == "sender":
            return drain_counts(*self.service.drain_counts_now())
        cut = self.service.stats.get(DROPPED_CUT) + self.service.fetches_in_flight()
        return rx_drain_counts(cut, self.service.in_doubt())

    async def _teardown(self, linger: float = 0.0) -> None:
        """Stop discovery, the gateway (after ``linger`` s at most for engines to collect and
        close what they still hold) and the probe port."""
        if self.watcher is not None:
            await asyncio.to_thread(self.watcher.stop, 1.0)
        await asyncio.to_thread(self.gateway.stop, 0.3, linger)
        await self.probe_server.stop()


def _tune_gc() -> None:
    """Fewer garbage collections in the serving daemon: what start-up built lives for good.

    Each request allocates a few hundred short-lived objects; with CPython's defaults the
    collector ran every 700 allocations and walked everything start-up built, a tenth
    of each io thread's time per small request (issue 22). Start-up's objects are frozen
    out of the collector; young collections come 30x less often. Reference cycles are
    still collected, later.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


def serve(role: Literal["sender", "receiver"], settings: SenderSettings | ReceiverSettings) -> int:
    """Run a daemon to completion and return its exit code, within shutdown_timeout + 1 s."""
    daemon = Daemon(role, settings)
    done = threading.Event()
    bound = settings.deadlines.shutdown_timeout_ms / 1000 + 0.9

    def guard() -> None:
        # Last line of defence: whatever hangs (a native call, a wedged thread), the process
        # exits within its bound once a signal started the drain.
        while not done.wait(0.05):
            started = daemon.drain_started
            if started is not None and time.monotonic() > started + bound:
                sys.stderr.write("kvxferd: shutdown bound reached, exiting\n")
                sys.stderr.flush()
                os._exit(EXIT_NOT_DRAINED)

    # The guard outlives run(): interpreter exit joins executor threads, and a forced exit may
    # leave one inside the service's (bounded) shutdown.
    threading.Thread(target=guard, name="kvxferd-exit-guard", daemon=True).start()
    code = daemon.run()
    if daemon.drain_started is not None:
        # The service is shut down (or, after a forced exit, still inside its bounded shutdown
        # in an executor thread that interpreter exit would join). Interpreter finalization
        # (joins, NIXL/UCX and torch teardown) takes 0.5-1.5 s more here and is not bounded:
        # end the process now so the shutdown bound holds. The kernel unmaps the pool and the
        # resource tracker unlinks a segment left registered because a write was in doubt.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
