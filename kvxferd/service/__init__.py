"""The service shell: a daemon's lifecycle, its start-up checks and its probe port.

It sits on top: it may import the transfer core and the engine side, and neither
imports it (tests/test_layering.py checks it)::

    daemon.py       the process lifecycle: startup -> serve -> drain -> teardown
    preflight.py    start-up checks that fail fast in one line (ports, hosts, ipc paths, /dev/shm)
    health.py       the probe port: /healthz /readyz /metrics /debug/state (aiohttp)
    probes.py       what the probe port reads of a sender or receiver: liveness, readiness, snapshot
    metrics.py      /metrics: a snapshot as Prometheus families, readiness labels
    debug_state.py  /debug/state: the hang dump, from copies taken without the services' locks
    notify.py       systemd's notify protocol (READY, STOPPING, WATCHDOG, STATUS)
"""
