"""xPyD across namespace hosts (tests/support/hosts.py): 2 prefill x 2 decode hosts over UCX TCP, link cuts.

Prefill hosts h0, h1 each run a sender; decode hosts h2, h3 each run a receiver; this
process is the engine of all four. Every pair (p0|p1 -> d0|d1) carries requests whose
bytes are verified: all four pairs at once, through a 15 s cut of one link, and through a
one-way cut long enough to kill the sender's UCX connection (reconnected after the heal).
Root only (skipped with how to run it otherwise); about 50 s. The figures of a run are
printed (``pytest -s``) and, with ``KVXFERD_HOSTS_FIGURES=FILE``, written as JSON lines
(docs/hosts.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvxferd.faults.harness import CALL_TIMEOUT_S, FAULT_DEADLINES, Engine, p99
from tests.support.conditions import wait_until
from tests.support.hosts import FETCH_BOUND_S, HostNet, PairTraffic, report, why_no_hosts

pytestmark = pytest.mark.integration

PORT = 5555  # each sender in its own namespace: no port is shared
KV_TIMEOUT_S = FAULT_DEADLINES["kv_transfer_timeout_ms"] / 1000
# A fetch on a cut link must end (fail) within its kv_transfer deadline plus two engine calls.
FAIL_BOUND_S = KV_TIMEOUT_S + 2 * CALL_TIMEOUT_S
# The healed link must carry a good transfer again within this long, on the kernel's own TCP
# settings (no sysctl): the control plane's heartbeats reopen its connections, and the data
# plane moves a stalled receiver to a fresh connection once it is heard from (issue 13
# measured ~12 s of TCP backoff before either existed; the target is a few seconds).
RECOVER_BOUND_S = 5.0
# The same sender's other pair while one of its receivers is cut: issue 13's target is
# max(1 s, 5x its baseline p99) (reported); asserted with a margin for loaded CI hosts. A
# connect or reload that holds the data plane's lock through the cut breaks it (5 s timeouts).
OTHER_PAIR_BOUND_S = 2.5
CUT_S = 15.0  # how long the link stays cut (issue 13 measured a 15 s cut)
TCP_RTO_MAX_MS = 1000
# A link cut one way for this long: writes stall (with tuned TCP, KVXFERD_HOSTS_TUNED_TCP=1,
# the sender's UCX TCP connection dies: 5 retransmissions at most 1 s apart).
ONE_WAY_CUT_S = 8.0
# The cut pair must carry traffic again within this long of the heal.
RECONNECT_BOUND_S = 5.0


@dataclass
class Xpyd:
    net: HostNet
    prefill: list[Engine]  # p0, p1 (hosts h0, h1)
    decode: list[Engine]  # d0, d1 (hosts h2, h3)

    def traffic(self, tag: str, threads: int) -> dict[tuple[str, str], PairTraffic]:
        """Engine loops on every (prefill, decode) pair, started."""
        out = {}
        for i, tx in enumerate(self.prefill):
            ep = f"tcp://{self.net.hosts[i].ip}:{PORT}"
            for j, rx in enumerate(self.decode):
                name = f"{tag}p{i}d{j}"
                out[(f"p{i}", f"d{j}")] = self.net.pair(
                    name, tx, rx, ep, threads=threads, seed=7 * i + j + len(tag)
                )
        return out


def finish(traffic: dict[tuple[str, str], PairTraffic]) -> list[str]:
    """Stop every loop (bounded); the names of loops still running."""
    for t in traffic.values():
        t.stop.set()
    return [n for t in traffic.values() for n in t.finish(FETCH_BOUND_S + 3 * CALL_TIMEOUT_S)]


@pytest.fixture(scope="module")
def xpyd() -> Iterator[Xpyd]:
    why = why_no_hosts()
    if why is not None:
        pytest.skip(why)
    # The kernel's own TCP settings (backoff up to 120 s, 15 retries): kvxferd needs no
    # sysctl. KVXFERD_HOSTS_TUNED_TCP=1 sets docs/hosts.md's optional ones (backoff capped at
    # 1 s, a connection with unacknowledged data dropped after 5 retransmissions).
    tuned = bool(os.environ.get("KVXFERD_HOSTS_TUNED_TCP"))
    with HostNet(
        4, tcp_rto_max_ms=TCP_RTO_MAX_MS if tuned else None, tcp_retries2=5 if tuned else None
    ) as net:
        h = net.hosts
        p = [net.sender(h[0], "p0", PORT), net.sender(h[1], "p1", PORT)]
        d = [net.receiver(h[2], "d0"), net.receiver(h[3], "d1")]
        net.wait_ready()
        yield Xpyd(
            net,
            [net.engine(x, seed=10 + k) for k, x in enumerate(p)],
            [net.engine(x, seed=20 + k) for k, x in enumerate(d)],
        )
    assert not net.leftovers(), "namespaces left behind"


@pytest.mark.timeout(120)
def test_every_pair_of_2x2_hosts_moves_byte_exact_requests(xpyd: Xpyd) -> None:
    """Each of the four prefill->decode pairs, across real network hops, completes requests byte-exact."""
    want = 25
    traffic = xpyd.traffic("x", threads=2)
    try:
        wait_until(
            lambda: all(sum(f.ok for f in t.snapshot()) >= want for t in traffic.values()),
            timeout=40,
            what=f"{want} fetches done on every pair",
            poll=0.1,
        )
    finally:
        stuck = finish(traffic)
    figures: dict[str, object] = {}
    for (p, d), t in traffic.items():
        ff = t.snapshot()
        figures[f"{p}->{d}"] = {
            "fetched": len(ff),
            "byte_exact": sum(f.ok and f.verified > 0 and not f.wrong for f in ff),
            "p99_ms": round(p99([f.seconds for f in ff]) * 1000, 1),
        }
    report("2x2", figures)
    assert not stuck
    for pair, t in traffic.items():
        ff = t.snapshot()
        assert not t.errors, f"{pair}: {t.errors[:5]}"
        assert not any(f.wrong for f in ff), f"{pair}: wrong bytes"
        bad = [(f.request, f.state, f.reason) for f in ff if not f.ok]
        assert not bad, f"{pair}: {bad[:5]}"
        assert len(ff) >= want and all(f.verified > 0 for f in ff)


def counter(metrics: dict[str, float], name: str) -> int:
    """A sender's counter ``name``, from its /metrics."""
    return int(sum(v for k, v in metrics.items() if name in k))


def stalled(metrics: dict[str, float]) -> int:
    """A sender's writes_stalled counter, from its /metrics."""
    return counter(metrics, "writes_stalled")


def _figures(t: PairTraffic, t_cut: float, t_heal: float) -> dict[str, object]:
    ff = t.snapshot()
    base = [f.seconds for f in ff if f.ended is not None and f.ended < t_cut]
    during = [f for f in ff if t_cut <= f.started < t_heal]
    failed = [f for f in during if not f.ok]
    ok_during = [f.seconds for f in during if f.ok]
    base_p99 = p99(base)
    return {
        "base_n": len(base),
        "base_p99_ms": round(base_p99 * 1000, 1),
        "cut_n": len(during),
        "cut_failed": len(failed),
        "cut_reasons": sorted({f"{f.state}:{f.reason}" for f in failed}),
        "cut_fail_max_s": round(max((f.seconds for f in failed), default=0.0), 2),
        "cut_max_s": round(max((f.seconds for f in during), default=0.0), 2),
        "cut_ok_p99_ms": round(p99(ok_during) * 1000, 1),
        "p99_ratio": round(p99(ok_during) / base_p99, 1) if base and ok_during else None,
    }


@pytest.mark.timeout(120)
def test_a_cut_link_fails_only_its_pair_in_time_and_carries_traffic_after_the_heal(
    xpyd: Xpyd,
) -> None:
    """A link cut between p0 and d0 fails p0->d0's fetches within their deadline, p1's pairs keep
    succeeding, no byte is wrong, and p0->d0 carries a good transfer again after the heal."""
    net = xpyd.net
    p0_host, d0_host = net.hosts[0], net.hosts[2]
    p0_daemon = xpyd.prefill[0].daemon
    stalled_before = stalled(p0_daemon.metrics())
    traffic = xpyd.traffic("c", threads=3)
    cut_pair = traffic[("p0", "d0")]
    t_cut = t_heal = t_back = None
    try:
        time.sleep(4.0)  # the baseline: measured traffic, not a synchronisation
        t_cut = net.cut(p0_host, d0_host)
        time.sleep(CUT_S)  # measured traffic through the cut
        t_heal = healed = net.heal(p0_host, d0_host)
        try:
            t_back = wait_until(
                lambda: any(f.ok and f.started > healed for f in cut_pair.snapshot()),
                RECOVER_BOUND_S,
                "p0->d0 carries traffic again",
                0.05,
            )
        except AssertionError:
            t_back = None
    finally:
        stuck = finish(traffic)
        if t_cut is not None and t_heal is None:
            net.heal(p0_host, d0_host)
    assert t_cut is not None and t_heal is not None
    figures: dict[str, object] = {"cut_s": round(t_heal - t_cut, 2)}
    for (p, d), t in traffic.items():
        figures[f"{p}->{d}"] = _figures(t, t_cut, t_heal)
    ff = cut_pair.snapshot()
    # Started in the cut and past its deadline before the heal: must fail. (One in flight at
    # the cut may still end well: its bytes and Result may have crossed before the cut.)
    cut = [f for f in ff if t_cut <= f.started and f.started + FAIL_BOUND_S < t_heal]
    failed = [f for f in ff if not f.ok]
    figures["p0->d0 cut"] = {
        "must_fail": len(cut),
        "failed": len(failed),
        "fail_s": sorted(round(f.seconds, 2) for f in failed),
        "reasons": sorted({f"{f.state}:{f.reason}" for f in failed}),
    }
    after = p0_daemon.metrics()
    figures["p0 writes_stalled"] = stalled(after) - stalled_before
    figures["p0 fresh_paths"] = counter(after, "transport_fresh_paths")
    figures["p0 refused_stalled_path"] = counter(after, "writes_refused_stalled_path")
    first_new = next((f for f in ff if f.started >= t_heal and f.ok), None)
    first_any = min((f.ended for f in ff if f.ok and f.ended and f.ended > t_heal), default=None)
    figures["recover_s"] = round(first_any - t_heal, 2) if first_any is not None else None
    figures["recover_new_s"] = (
        round(first_new.ended - t_heal, 2) if first_new and first_new.ended else None
    )
    figures["first_new_started_s"] = round(first_new.started - t_heal, 2) if first_new else None
    figures["tcp_rto_max_ms"] = net.tcp_rto_max_ms
    report("cut", figures)

    assert not stuck
    for pair, t in traffic.items():
        ff = t.snapshot()
        assert not any(f.wrong for f in ff), f"{pair}: wrong bytes"
        assert all(f.ended is not None for f in ff), f"{pair}: a fetch never answered"
    assert cut and not any(f.ok for f in cut), "a fetch crossed a cut link"
    slow = [(f.request, round(f.seconds, 2)) for f in failed if f.seconds > FAIL_BOUND_S]
    assert not slow, f"cut-link fetches failed past {FAIL_BOUND_S:g} s: {slow}"
    for pair in (("p1", "d0"), ("p1", "d1")):  # the other sender's pairs: untouched
        during = [f for f in traffic[pair].snapshot() if t_cut <= f.started < t_heal]
        bad = [(f.request, f.state, f.reason) for f in during if not f.ok]
        assert during and not bad, f"{pair}: {bad[:5]}"
    # p0's other pair shares the sender whose writes to d0 stall: it keeps succeeding, and
    # no request of it is slow (issue 13's target, max(1 s, 5x its baseline p99), is in
    # the figures: "p0->d1" cut_max_s and p99_ratio).
    p0d1 = [f for f in traffic[("p0", "d1")].snapshot() if t_cut <= f.started < t_heal]
    bad = [(f.request, f.state, f.reason) for f in p0d1 if not f.ok]
    assert p0d1 and not bad, f"p0->d1 while p0->d0 was cut: {bad[:5]}"
    slow_other = [(f.request, round(f.seconds, 2)) for f in p0d1 if f.seconds > OTHER_PAIR_BOUND_S]
    assert not slow_other, f"p0->d1 requests slower than {OTHER_PAIR_BOUND_S:g} s: {slow_other}"
    assert t_back is not None, f"no new p0->d0 fetch succeeded within {RECOVER_BOUND_S:g} s"


@pytest.mark.timeout(90)
def test_a_ucx_connection_that_died_in_a_cut_is_reconnected_after_the_heal(xpyd: Xpyd) -> None:
    """A link cut one way (prefill -> decode) stalls the sender's writes to that receiver while
    its fetches still arrive; after the heal the pair carries traffic again within a few
    seconds without restarting anything (the data plane moves the receiver to a fresh
    connection, or reconnects one that died: the log says which), and no other pair fails."""
    net = xpyd.net
    p0_host, d0_host = net.hosts[0], net.hosts[2]
    p0 = xpyd.prefill[0].daemon
    log_before = p0.stderr_path.read_text(errors="replace")
    reconnects_before = log_before.count("reconnected") + log_before.count("fresh connection")
    traffic = xpyd.traffic("r", threads=2)
    cut_pair = traffic[("p0", "d0")]
    t_cut = t_heal = t_back = None
    try:
        time.sleep(2.0)  # traffic before the cut: measured, not a synchronisation
        t_cut = net.cut(p0_host, d0_host, both=False)
        time.sleep(ONE_WAY_CUT_S)  # writes posted into the cut until TCP gives up
        t_heal = healed = net.heal(p0_host, d0_host)
        try:
            t_back = wait_until(
                lambda: any(f.ok and f.started > healed for f in cut_pair.snapshot()),
                RECONNECT_BOUND_S,
                "p0->d0 carries traffic again",
                0.05,
            )
        except AssertionError:
            t_back = None
    finally:
        stuck = finish(traffic)
        if t_cut is not None and t_heal is None:
            net.heal(p0_host, d0_host)
    assert t_cut is not None and t_heal is not None
    log = p0.stderr_path.read_text(errors="replace")
    reconnects = log.count("reconnected") + log.count("fresh connection")
    ff = cut_pair.snapshot()
    after = [f for f in ff if f.started >= t_heal]
    figures: dict[str, object] = {
        "cut_s": round(t_heal - t_cut, 2),
        "reconnects": reconnects - reconnects_before,
        "cut_failed": sum(not f.ok for f in ff if f.ended and f.ended > t_cut),
        "cut_reasons": sorted({f"{f.state}:{f.reason}" for f in ff if not f.ok}),
        "recover_s": round(t_back - t_heal, 2) if t_back is not None else None,
        "failed_after_heal": sum(not f.ok for f in after),
        "reconnect_lines": [
            ln[-80:] for ln in log.splitlines() if "reconnected" in ln or "fresh conn" in ln
        ][-3:],
    }
    for pair in (("p0", "d1"), ("p1", "d0"), ("p1", "d1")):
        during = [f for f in traffic[pair].snapshot() if t_cut <= f.started < t_heal]
        figures[f"{pair[0]}->{pair[1]} max_s"] = round(
            max((f.seconds for f in during), default=0), 2
        )
    report("one-way cut", figures)

    assert not stuck
    for pair, t in traffic.items():
        ff = t.snapshot()
        assert not any(f.wrong for f in ff), f"{pair}: wrong bytes"
        assert all(f.ended is not None for f in ff), f"{pair}: a fetch never answered"
        if pair != ("p0", "d0"):
            bad = [(f.request, f.state, f.reason) for f in ff if not f.ok]
            assert not bad, f"{pair}: {bad[:5]}"
    assert t_back is not None, f"no new p0->d0 fetch succeeded within {RECONNECT_BOUND_S:g} s"
