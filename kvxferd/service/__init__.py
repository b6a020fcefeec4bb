"""The service shell: a daemon's lifecycle, its start-up checks and its probe port.

It sits on top: it may import the transfer core and the engine side, and neither
imports it. It reads the core only through the views the core takes of itself
(kvxferd/transfer/views.py): no private attribute, no core lock (tests/test_layering.py
checks both)::

    daemon.py       the process lifecycle: startup -> serve -> drain -> teardown
    preflight.py    start-up checks that fail fast in one line (ports, hosts, ipc paths, /dev/shm)
    health.py       the probe port: /healthz /readyz /metrics /debug/state (aiohttp)
    probes.py       liveness, readiness, snapshot of a sender or receiver, read from its views only
    metrics.py      /metrics: a snapshot as Prometheus families, readiness labels
    debug_state.py  /debug/state: the hang dump, formatted from the services' unlocked views
    notify.py       systemd's notify protocol (READY, STOPPING, WATCHDOG, STATUS)
"""
