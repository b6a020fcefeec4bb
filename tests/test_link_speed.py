"""Links that prove their speed: real daemons measure the link over UCX shared memory and over TCP, and readiness follows ``min_link_gbps``.

The same sender/receiver pair (``python -m kvxferd sender|receiver`` children, real
NIXL) runs once with ``dataplane.ucx_tls = "shm"`` (and ``ucx_error_handling_mode =
"none"``: UCX refuses shared memory alone with peer error handling) and once with
``"tcp"``; one request
moves, which makes the link; the sender's probe WRITEs into the receiver's scratch
region give each link its figure (``kvxferd_link_gbps``, ``/debug/state``). The figures
must be clearly apart on this host (else the test fails, naming both: a floor between
them would prove nothing). Then each pair starts again with ``min_link_gbps`` between
them: the shared-memory pair is ready, the TCP pair's ``/readyz`` says ``link_slow``
with the peer and its figure.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

import pytest

from tests.support.conditions import wait_until
from tests.test_daemon import (
    CALL_S,
    Engines,
    Spawn,
    blocks_of,
    daemon_env,
    http_get,
    metrics,
    publish_all,
    verify_done,
)
from tests.test_daemon import daemons as daemons  # the fixtures, shared
from tests.test_daemon import engines as engines
from tests.test_daemon import sock_dir as sock_dir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

APART = 1.5  # the shared-memory link must measure at least this many times the TCP one
PROBE_S = 30.0
SLOW = re.compile(
    r"^link_slow: (?P<peer>\S+) measured (?P<gbps>\S+) GB/s < min_link_gbps=(?P<floor>\S+) "
)


def measure(
    daemons: Spawn, engines: Engines, tls: str, tag: str, floor: float | None = None
) -> dict[str, Any]:
    """Start a pair on ``tls``, move one request, wait for the link's figure: what the
    sender's probe port shows (figure, /readyz, /metrics sample, /debug/state link)."""
    extra: dict[str, str | int] = {"KVXFERD_DATAPLANE__UCX_TLS": tls}
    if tls == "shm":  # UCX's shared-memory transports have no peer failure handler
        extra["KVXFERD_DATAPLANE__UCX_ERROR_HANDLING_MODE"] = "none"
    if floor is not None:
        extra["KVXFERD_DATAPLANE__MIN_LINK_GBPS"] = f"{floor:.4f}"
    env = daemon_env(**extra)
    tx, rx = daemons("sender", f"tx-{tag}", env), daemons("receiver", f"rx-{tag}", env)
    tx.wait_ready(), rx.wait_ready()
    ct, pt = engines.client(tx)
    cr, pr = engines.client(rx)
    rid = f"{tag}-0"
    publish_all(ct, pt, [rid])
    out = cr.wait(cr.fetch(rid, tx.endpoint, blocks_of(0)), CALL_S)
    assert verify_done(pr, [rid], [out]) == 1, out

    def links() -> list[dict[str, Any]]:
        status, body = http_get(tx.probe_port, "/debug/state")
        assert status == 200, body
        return list(json.loads(body)["links"])

    wait_until(
        lambda: any(k["state"] != "probing" for k in links()), PROBE_S, f"{tag}: link probed"
    )
    [link] = links()
    assert link["state"] == "ok" and link["gbps"], (link, tx.describe())
    fams = metrics(tx.probe_port)
    samples = [(s.labels, s.value) for s in fams["kvxferd_link_gbps"].samples]
    probes = {s.labels["result"]: s.value for s in fams["kvxferd_link_probes"].samples}
    readyz = http_get(tx.probe_port, "/readyz")
    # The engines' view: the sender's daemon names the link and its figure, the receiver's
    # its sender link, unmeasured.
    [info] = ct.links()
    assert (info.peer, info.state, info.gbps) == (rx.endpoint, "ok", link["gbps"]), info
    assert info.transport == link["transport"] and info.measured_at == pytest.approx(
        link["measured_at"], abs=1e-3
    )
    [rinfo] = asyncio.run(engines.async_client(rx).links())
    assert (rinfo.peer, rinfo.state, rinfo.gbps) == (tx.endpoint, "unmeasured", None), rinfo
    print(f"\n[{tag}] link {link}\n[{tag}] kvxferd_link_gbps {samples}, probes {probes}")
    print(f"[{tag}] /readyz {readyz}")
    assert link["peer"] == rx.endpoint and link["transport"] == f"UCX_TLS={tls}", link
    assert samples == [({"peer": rx.endpoint}, pytest.approx(link["gbps"], rel=1e-2))]
    assert probes == {"ok": 1, "failed": 0, "timeout": 0, "dropped": 0}, probes
    for d in (tx, rx):
        d.kill()
    return {"gbps": float(link["gbps"]), "link": link, "readyz": readyz}


def test_readiness_follows_the_link_floor_between_shared_memory_and_tcp(
    daemons: Spawn, engines: Engines
) -> None:
    """Shared memory and TCP measure clearly apart; with min_link_gbps between them the shm pair is ready and the TCP pair's /readyz names the peer and its figure (link_slow)."""
    shm = measure(daemons, engines, "shm", "shm")
    tcp = measure(daemons, engines, "tcp", "tcp")
    figures = f"shm {shm['gbps']:.3f} GB/s, tcp {tcp['gbps']:.3f} GB/s"
    print(f"\n[figures] {figures}")
    assert shm["gbps"] >= APART * tcp["gbps"], f"links not clearly apart on this host: {figures}"
    assert shm["readyz"][0] == tcp["readyz"][0] == 200  # no floor: the figure is no reason
    floor = math.sqrt(shm["gbps"] * tcp["gbps"])  # between them, the same ratio from each
    shm2 = measure(daemons, engines, "shm", "shm-floor", floor)
    tcp2 = measure(daemons, engines, "tcp", "tcp-floor", floor)
    again = f"floor {floor:.3f}; again: shm {shm2['gbps']:.3f}, tcp {tcp2['gbps']:.3f} GB/s"
    assert shm2["gbps"] > floor > tcp2["gbps"], f"a figure crossed the floor: {again}"
    assert shm2["readyz"] == (200, "ready\n"), shm2["readyz"]
    status, body = tcp2["readyz"]
    slow = [m for line in body.splitlines() if (m := SLOW.match(line))]
    link = tcp2["link"]
    assert status == 503 and len(slow) == 1, body
    assert slow[0]["peer"] == link["peer"], body
    assert float(slow[0]["gbps"]) == pytest.approx(link["gbps"], rel=0.01), body
    assert float(slow[0]["floor"]) == pytest.approx(floor, rel=1e-3), body
