"""``kvxferd bench --scale``: receivers attached to one real sender daemon, what each peer costs it.

One ``python -m kvxferd sender`` (as an operator runs it, default workers) and
``Receiver`` objects spread over a few ``rx`` processes (receiver k in process
k % rx_procs, one thread each while fetching). The peers are attached in steps
(1, then up to 8, 32, 64: each step adds the new ones) and every step measures::

    figure              how                                                     where
    ------------------  ------------------------------------------------------  ------------------
    set-up per peer     create: Receiver(settings).start() (pool, NIXL agent,   rx processes
                        result ROUTER); register: discovery's PeerAdded to the
                        first RegisterReply ok (the sender's listener loads the
                        NIXL remote agent and prepares its descriptor list in
                        that round trip); first fetch: its latency against the
                        median of the others (the UCX endpoint is made then)
    sender per peer     VmRSS, open fds by kind (socket, eventfd, ...), threads  /proc/PID of the
                        before and after the step's registers, and after its     sender daemon
                        fetches (each worker that sent a receiver a Result holds
                        a DEALER to it); the sender's own count of peers and
                        prepared lists from /debug/state
    throughput          ``requests`` 16 KiB fetches over all attached receivers,  rx processes
                        ``inflight`` per receiver, bytes checked; requests/s
                        against the 1-peer step
    receiver per link   one fresh Receiver in rx process 0 registers with      rx processes 0, 1
                        ``links`` Sender objects in rx process 1 and fetches
                        from each: its process's fds, RSS before and after
    NIXL cost           in one rx process: add_remote_agent of a receiver's       rx process 0
                        metadata, prep_xfer_dlist of layers x blocks descriptors
                        (16 Ki, 256 Ki; in address order as kvxferd prepares
                        them, and shuffled), time and VmRSS per prepared list

The parent is the sender's engine (``kvxferd.engine.client``: publish, wait with close)
and talks to each rx process through JSON lines on its stdin / stdout, as the
other bench children do. Every wait is bounded (``step_timeout_s``, the run's
``timeout_s``); the daemon and the children are stopped on every exit path.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from kvxferd.bench.workload import BenchError
from kvxferd.config import DataPlaneSettings
from kvxferd.launch import Daemon, LaunchError

KiB = 1024
SENDER_READY_TIMEOUT_S = 90.0  # imports, pool, NIXL agent on a loaded 2-core machine
CHILD_HELLO_TIMEOUT_S = 90.0
SENDER_EXIT_TIMEOUT_S = 15.0
CALL_TIMEOUT_S = 10.0  # one engine call
PROBE_TIMEOUT_S = 5.0  # one HTTP GET of /debug/state
NIXL_COST_DESCS = (16384, 262144)  # descriptors per prepared list (layers x blocks)
NIXL_COST_LISTS = 4  # prepared lists held at once per size (memory per list = delta / this)


@dataclass(frozen=True)
class ScaleOptions:
    """The peer counts, the work per step, and the bounds of the run."""

    peers: tuple[int, ...] = (1, 8, 32, 64)
    rx_procs: int = 4  # processes hosting the receivers
    requests: int = 512  # fetched per step, all receivers together (at least min_per_peer each)
    min_per_peer: int = 4
    inflight: int = 4  # per receiver
    block_kib: int = 16  # one block per request, one layer
    pool_blocks: int = 64  # sender's and each receiver's pool
    nixl_cost_descs: tuple[int, ...] = NIXL_COST_DESCS
    links: int = 8  # receiver side: senders (library objects in rx process 1) one receiver links to
    link_fetches: int = 8  # fetched from each of them (so every sender worker sends it a Result)
    step_timeout_s: float = 60.0  # one command to the children, one wait for the sender
    timeout_s: float = 240.0  # the whole run fails past this
    dataplane: DataPlaneSettings = field(default_factory=DataPlaneSettings)

    def pool(self) -> dict[str, Any]:
        return dict(
            num_layers=1,
            num_blocks=self.pool_blocks,
            block_elems=self.block_kib * KiB,
            dtype="uint8",
            aux_slots=1,
        )


def pattern(block: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """What source block ``block`` holds: a byte ramp that differs per block."""
    return ((np.arange(nbytes, dtype=np.int64) * 31 + block * 7919) % 251).astype(np.uint8)


# -- the sender's process, read from /proc ---------------------------------------------
def proc_usage(pid: int) -> dict[str, int]:
    """VmRSS (KiB), threads, open fds and their kinds (socket, eventfd, pipe, ...) of ``pid``."""
    out: dict[str, int] = {"rss_kib": 0, "threads": 0, "fds": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for ln in f:
                if ln.startswith("VmRSS:"):
                    out["rss_kib"] = int(ln.split()[1])
        out["threads"] = len(os.listdir(f"/proc/{pid}/task"))
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError as e:
        raise BenchError(f"cannot read /proc/{pid}: {e}") from None
    kinds: dict[str, int] = {}
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        kinds[fd_kind(target)] = kinds.get(fd_kind(target), 0) + 1
    out["fds"] = sum(kinds.values())
    for kind, n in kinds.items():
        out[f"fd_{kind}"] = n
    return out


def fd_kind(target: str) -> str:
    """socket, eventfd, eventpoll, pipe, shm, dev, file or anon from a /proc/PID/fd link."""
    if target.startswith("socket:"):
        return "socket"
    if target.startswith("anon_inode:"):
        what = target.split(":", 1)[1].strip("[]")
        return what if what in ("eventfd", "eventpoll") else "anon"
    if target.startswith("pipe:"):
        return "pipe"
    if target.startswith("/dev/shm/"):
        return "shm"
    if target.startswith("/dev/"):
        return "dev"
    return "file"


def _delta(a: dict[str, int], b: dict[str, int], n: int) -> dict[str, float]:
    """(b - a) / n for every key of either."""
    return {k: (b.get(k, 0) - a.get(k, 0)) / n for k in sorted(set(a) | set(b))}


# -- the sender daemon ---------------------------------------------------------------------
class _SenderDaemon:
    """``python -m kvxferd sender`` on loopback with the run's pool; ``stop`` ends it."""

    def __init__(self, opts: ScaleOptions, tmp: str) -> None:
        from kvxferd.demo import daemon_env

        env = daemon_env(tmp, "scale-tx")
        for key in [k for k in env if k.startswith("KVXFERD_POOL__")]:
            del env[key]
        for key, value in opts.pool().items():
            env[f"KVXFERD_POOL__{key.upper()}"] = str(value)
        env["KVXFERD_POOL__DEVICE"] = "cpu"
        for key, value in opts.dataplane.model_dump().items():
            if value is not None:
                env[f"KVXFERD_DATAPLANE__{key.upper()}"] = str(value)
        env["KVXFERD_DEADLINES__DRAIN_TIMEOUT_MS"] = "1000"
        env["KVXFERD_DEADLINES__SHUTDOWN_TIMEOUT_MS"] = "5000"
        self.t0 = time.monotonic()
        self.child = Daemon(
            "sender", "scale-tx", tmp, ["--listen", "tcp://127.0.0.1:0"], env=env, new_session=False
        )
        self.pid = self.child.pid
        self.ready: dict[str, Any] = {}
        self.ready_s = 0.0

    def wait_ready(self, deadline: float) -> dict[str, Any]:
        try:
            self.ready = self.child.wait_ready(deadline)
        except LaunchError as e:
            raise BenchError(f"the sender daemon did not get ready: {e}") from None
        self.ready_s = time.monotonic() - self.t0
        return self.ready

    def debug_state(self) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.ready['probe_port']}/debug/state"
        with urllib.request.urlopen(
            url, timeout=PROBE_TIMEOUT_S
        ) as r:  # the probe port, on loopback
            doc: dict[str, Any] = json.loads(r.read())
        return doc

    def stop(self) -> None:
        self.child.stop(time.monotonic() + SENDER_EXIT_TIMEOUT_S)


# -- an rx process -------------------------------------------------------------------------
_CHILD_CODE = (
    "import sys; from kvxferd.bench.scale_rx import rx_child; sys.exit(rx_child(sys.argv[1]))"
)


class _RxProc:
    """One rx process: JSON commands on its stdin, one JSON reply per command on its stdout."""

    def __init__(self, index: int, spec: dict[str, Any], tmp: str) -> None:
        from kvxferd.bench.child import _LineReader

        self.index = index
        self.err_path = Path(tmp) / f"rx{index}.err"
        with open(self.err_path, "wb") as se:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD_CODE, json.dumps({**spec, "index": index})],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=se,
            )
        assert self.proc.stdout is not None
        self.reader = _LineReader(self.proc.stdout.fileno())

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise BenchError(f"rx{self.index} is gone: {self._tail()}") from None

    def reply(self, timeout: float) -> dict[str, Any]:
        try:
            line = self.reader.readline(timeout)
        except EOFError:
            raise BenchError(f"rx{self.index} exited: {self._tail()}") from None
        if line is None:
            raise BenchError(f"rx{self.index} did not answer within {timeout:.0f} s")
        msg: dict[str, Any] = json.loads(line)
        if msg.get("event") == "error":
            raise BenchError(str(msg.get("detail")))
        return msg

    def _tail(self) -> str:
        try:
            return self.err_path.read_text(errors="replace")[-1500:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "exit"})
                self.proc.wait(20)
            except (BenchError, subprocess.TimeoutExpired, OSError):
                self.proc.kill()
                self.proc.wait(10)


def _ask_all(procs: list[_RxProc], cmds: dict[int, dict[str, Any]], timeout: float) -> list[Any]:
    """Send each process its command (all first, so they run at once), then read every reply."""
    for j, cmd in cmds.items():
        procs[j].send(cmd)
    return [procs[j].reply(timeout) for j in cmds]


# -- the run -------------------------------------------------------------------------------
def _uptime() -> str:
    try:
        return subprocess.run(
            ["uptime"], capture_output=True, text=True, timeout=5, check=False
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else 0.0


def run_scale(opts: ScaleOptions, progress: IO[str] | None = None) -> dict[str, Any]:
    """Attach the receivers step by step to one sender daemon; the ``--json`` document."""
    out = progress or sys.stderr
    peers = sorted(set(opts.peers))
    if not peers or peers[0] < 1:
        raise BenchError("--scale needs peer counts >= 1")
    started, t_start = time.time(), time.monotonic()
    deadline = t_start + opts.timeout_s
    load_start, uptime_start = [round(x, 2) for x in os.getloadavg()], _uptime()
    tmp = tempfile.mkdtemp(prefix="kvxs-")
    nprocs = max(1, min(opts.rx_procs, peers[-1]))
    spec = {
        "pool": opts.pool(),
        "dataplane": opts.dataplane.model_dump(),
        "max_s": opts.timeout_s + 60,
    }
    sender: _SenderDaemon | None = None
    procs: list[_RxProc] = []
    try:
        out.write(f"scale: a sender daemon and {nprocs} rx processes\n")
        sender = _SenderDaemon(opts, tmp)
        for j in range(nprocs):
            procs.append(_RxProc(j, spec, tmp))  # each one stopped below, whatever fails
        from kvxferd.engine.client import Client, attach_pool  # torch: imported while they start

        sender.wait_ready(time.monotonic() + SENDER_READY_TIMEOUT_S)
        for p in procs:
            p.reply(CHILD_HELLO_TIMEOUT_S)
        endpoint = str(sender.ready["endpoint"])
        with Client(str(sender.ready["engine_socket"]), timeout_s=CALL_TIMEOUT_S) as client:
            kv = attach_pool(client.describe())
            block_bytes = opts.block_kib * KiB
            arr = kv.numpy()
            for b in range(opts.pool_blocks):
                arr[0, b, :] = pattern(b, block_bytes)
            base = proc_usage(sender.pid)
            points: list[dict[str, Any]] = []
            attached = 0
            prev_fetch = base
            for n in peers:
                if time.monotonic() > deadline:
                    raise BenchError(f"the run passed its {opts.timeout_s:.0f} s bound")
                out.write(f"scale: {n} peer(s): attaching {n - attached}\n")
                point = _step(opts, sender, procs, client, endpoint, attached, n, base, prev_fetch)
                points.append(point)
                attached, prev_fetch = n, point["sender_after_fetch"]
            out.write("scale: timing NIXL's add_remote_agent and prep_xfer_dlist\n")
            procs[0].send({"cmd": "nixl_cost", "descs": list(opts.nixl_cost_descs)})
            nixl_cost = procs[0].reply(opts.step_timeout_s)["cost"]
            links = _receiver_links(opts, procs, out)
            kv.kvxferd_mapping.close()  # type: ignore[attr-defined]
            del kv, arr
        state = sender.debug_state()
        doc: dict[str, Any] = {
            "version": 1,
            "started_unix": started,
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
            "elapsed_s": 0.0,
            "load_start": load_start,
            "uptime_start": uptime_start,
            "options": {k: v for k, v in asdict(opts).items() if k != "dataplane"},
            "dataplane": opts.dataplane.model_dump(),
            "rx_procs": nprocs,
            "sender": {
                "pid": sender.pid,
                "ready_s": sender.ready_s,
                "num_threads": len(state.get("workers", [])),
                "usage_start": base,
                "stats": state.get("stats", {}),
            },
            "points": points,
            "nixl_cost": nixl_cost,
            "receiver_links": links,
        }
    finally:
        for p in procs:
            p.stop()
        if sender is not None:
            sender.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    from kvxferd.bench.report import machine_info

    doc["machine"] = machine_info()
    doc["load_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["uptime_end"] = _uptime()
    doc["elapsed_s"] = time.monotonic() - t_start
    doc["summary"] = scale_summary(doc)
    return doc


def _step(
    opts: ScaleOptions,
    sender: _SenderDaemon,
    procs: list[_RxProc],
    client: Any,
    endpoint: str,
    attached: int,
    n: int,
    base: dict[str, int],
    prev_fetch: dict[str, int],
) -> dict[str, Any]:
    """Attach receivers ``attached .. n-1``, read the sender, fetch with all ``n``, read it again."""
    nprocs = len(procs)
    before = proc_usage(sender.pid)
    new = list(range(attached, n))
    cmds = {
        j: {"cmd": "attach", "indices": [k for k in new if k % nprocs == j], "endpoint": endpoint}
        for j in range(nprocs)
        if any(k % nprocs == j for k in new)
    }
    t0 = time.monotonic()
    members = [m for r in _ask_all(procs, cmds, opts.step_timeout_s) for m in r["members"]]
    attach_wall = time.monotonic() - t0
    state = _wait_peers(sender, n, time.monotonic() + opts.step_timeout_s)
    after_attach = proc_usage(sender.pid)

    # First fetch of each new receiver (the sender makes its UCX endpoint to it then):
    # timed on its own, so the throughput below is the steady state.
    warm = {k: [(f"w{n}-k{k}", k % opts.pool_blocks)] for k in new}
    firsts_res, warm_failures = _fetch_round(opts, procs, client, endpoint, warm)
    after_first = proc_usage(sender.pid)

    # Requests: receiver k fetches `per` of them; request i's source block differs per (k, i).
    per = max(opts.min_per_peer, opts.requests // n)
    work = {
        k: [(f"s{n}-k{k}-i{i}", (k * 13 + i) % opts.pool_blocks) for i in range(per)]
        for k in range(n)
    }
    results, engine_failures = _fetch_round(opts, procs, client, endpoint, work)
    after_fetch = proc_usage(sender.pid)
    state = sender.debug_state()

    lat = [x for r in results for x in r["lat_us"]]
    firsts = [r["first_us"] for r in firsts_res if r["first_us"] > 0]
    ok = sum(int(r["ok"]) for r in results)
    span = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    return {
        "peers": n,
        "new": len(new),
        "setup": {
            "create_ms": _dist([m["create_s"] * 1e3 for m in members]),
            "register_ms": _dist([m["register_s"] * 1e3 for m in members]),
            "total_ms": _dist([(m["create_s"] + m["register_s"]) * 1e3 for m in members]),
            "first_fetch_ms": _dist([x / 1e3 for x in firsts]),
            "attach_wall_s": attach_wall,
            "metadata_bytes": max(int(m["metadata_bytes"]) for m in members),
        },
        "sender_before_attach": before,
        "sender_after_attach": after_attach,
        "sender_after_first_fetch": after_first,
        "sender_after_fetch": after_fetch,
        # per new peer: what its registration added, and what registration + fetching added
        "per_new_peer_register": _delta(before, after_attach, len(new)),
        "per_new_peer_first_fetch": _delta(after_attach, after_first, len(new)),
        "per_new_peer_fetch": _delta(prev_fetch, after_fetch, len(new)),
        # per attached peer: everything above the daemon before any peer
        "per_peer_total": _delta(base, after_fetch, n),
        "sender_peers": len(state.get("peers", [])),
        "sender_prepped": sum(1 for p in state.get("peers", []) if p.get("prepped")),
        "sender_registers_accepted": int(state.get("stats", {}).get("registers_accepted", 0)),
        "throughput": {
            "requests": sum(len(v) for v in work.values()),
            "per_peer": per,
            "ok": ok,
            "failures": sum(int(r["failures"]) for r in (*results, *firsts_res))
            + engine_failures
            + warm_failures,
            "mismatches": sum(int(r["mismatches"]) for r in (*results, *firsts_res)),
            "span_s": span,
            "rps": ok / span if span > 0 else 0.0,
            "p50_ms": _pct(lat, 50) / 1e3,
            "p99_ms": _pct(lat, 99) / 1e3,
        },
    }


def _receiver_links(opts: ScaleOptions, procs: list[_RxProc], out: IO[str]) -> dict[str, Any]:
    """What one receiver pays per sender it links to: ``links`` Sender objects in rx process 1,
    a fresh Receiver in rx process 0 registering with each, then fetching from each."""
    if opts.links < 1 or len(procs) < 2:
        return {"links": 0}
    out.write(f"scale: one receiver linked to {opts.links} senders\n")
    procs[1].send({"cmd": "senders", "count": opts.links, "per": opts.link_fetches})
    endpoints = procs[1].reply(opts.step_timeout_s)["endpoints"]
    try:
        procs[0].send({"cmd": "links", "endpoints": endpoints, "per": opts.link_fetches})
        got: dict[str, Any] = procs[0].reply(opts.step_timeout_s + 30)["links"]
    finally:
        procs[1].send({"cmd": "close_senders"})
        failures = int(procs[1].reply(opts.step_timeout_s)["failures"])
    got["sender_failures"] = failures
    return got


def _fetch_round(
    opts: ScaleOptions,
    procs: list[_RxProc],
    client: Any,
    endpoint: str,
    work: dict[int, list[tuple[str, int]]],
) -> tuple[list[dict[str, Any]], int]:
    """Publish ``work`` (receiver -> [(request id, source block)]), have every receiver fetch
    its share at once, then wait for and close each publish; (receivers' results, failures seen
    by the engine)."""
    nprocs = len(procs)
    handles = [client.publish(rid, [src]) for reqs in work.values() for rid, src in reqs]
    cmds: dict[int, dict[str, Any]] = {}
    for k, reqs in work.items():
        cmd = cmds.setdefault(
            k % nprocs,
            {
                "cmd": "fetch",
                "work": {},
                "inflight": opts.inflight,
                "timeout_s": opts.step_timeout_s,
                "endpoint": endpoint,
            },
        )
        cmd["work"][str(k)] = reqs
    results = [r for rep in _ask_all(procs, cmds, opts.step_timeout_s + 30) for r in rep["results"]]
    failures = 0
    for h in handles:
        outcome = client.wait(h, CALL_TIMEOUT_S, close=True)
        if outcome is None or not outcome.ok:
            failures += 1
        if outcome is None or not outcome.closed:
            client.close(h, CALL_TIMEOUT_S)
    return results, failures


def _dist(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0, "median": 0.0, "p90": 0.0, "max": 0.0}
    return {
        "n": len(xs),
        "median": statistics.median(xs),
        "p90": _pct(xs, 90),
        "max": max(xs),
    }


def _wait_peers(sender: _SenderDaemon, n: int, deadline: float) -> dict[str, Any]:
    """/debug/state once the sender lists ``n`` peers; BenchError at ``deadline``."""
    while True:
        state = sender.debug_state()
        if len(state.get("peers", [])) >= n:
            return state
        if time.monotonic() > deadline:
            raise BenchError(f"the sender lists {len(state.get('peers', []))} peers, {n} expected")
        time.sleep(0.05)


def scale_summary(doc: dict[str, Any]) -> dict[str, Any]:
    """Headline figures: the sender's cost per peer past the first step, throughput ratios.

    Per peer, weighted by the new peers of every step after the first (the first step also
    pays one-off costs: the local prepared list, the first UCX context use, allocator
    growth): what a REGISTER added, what the first fetch added, and everything once the
    peer fetched (the steps' fetch deltas).
    """
    pts = doc["points"]
    later = pts[1:] or pts

    def weighted(before: str, after: str) -> dict[str, float]:
        new = sum(p["new"] for p in later)
        keys = {k for p in later for k in (*p[before], *p[after])}
        return {
            k: sum(p[after].get(k, 0) - p[before].get(k, 0) for p in later) / new
            for k in sorted(keys)
        }

    one = pts[0]["throughput"]["rps"]
    fetch = {
        k: sum(p["per_new_peer_fetch"].get(k, 0) * p["new"] for p in later)
        / sum(p["new"] for p in later)
        for k in later[0]["per_new_peer_fetch"]
    }
    return {
        "peers": [p["peers"] for p in pts],
        "per_peer_after_register": weighted("sender_before_attach", "sender_after_attach"),
        "per_peer_after_first_fetch": weighted("sender_after_attach", "sender_after_first_fetch"),
        "per_peer_after_fetch": fetch,
        "register_ms_median": statistics.median(p["setup"]["register_ms"]["median"] for p in pts),
        "create_ms_median": statistics.median(p["setup"]["create_ms"]["median"] for p in pts),
        # keyed by str(peers): the same after a JSON round trip
        "rps": {str(p["peers"]): p["throughput"]["rps"] for p in pts},
        "rps_vs_1": {str(p["peers"]): (p["throughput"]["rps"] / one if one else 0.0) for p in pts},
        "ok": doc.get("receiver_links", {}).get("failures", 0) == 0
        and doc.get("receiver_links", {}).get("sender_failures", 0) == 0
        and all(
            p["throughput"]["failures"] == 0
            and p["throughput"]["mismatches"] == 0
            and p["sender_peers"] == p["peers"]
            for p in pts
        ),
    }


def format_scale(doc: dict[str, Any]) -> str:
    """Markdown: set-up, the sender's cost per peer, throughput, NIXL's per-peer cost."""
    s = doc["summary"]
    lines = [
        f"kvxferd bench --scale: {doc['date_utc']} UTC, {doc['elapsed_s']:.0f} s, "
        f"load average {doc['load_start']} -> {doc['load_end']}; sender daemon ready in "
        f"{doc['sender']['ready_s']:.1f} s with {doc['sender']['num_threads']} workers, "
        f"receivers in {doc['rx_procs']} processes",
        "",
        "| peers | new | create ms (median / max) | register ms (median / p90 / max) "
        "| first fetch ms (median) | sender peers / prepared |",
        "|--:|--:|--:|--:|--:|--:|",
    ]
    for p in doc["points"]:
        st = p["setup"]
        lines.append(
            f"| {p['peers']} | {p['new']} | {st['create_ms']['median']:.1f} / "
            f"{st['create_ms']['max']:.1f} | {st['register_ms']['median']:.1f} / "
            f"{st['register_ms']['p90']:.1f} / {st['register_ms']['max']:.1f} "
            f"| {st['first_fetch_ms']['median']:.2f} | {p['sender_peers']} / "
            f"{p['sender_prepped']} |"
        )
    lines += [
        "",
        "sender daemon, per new peer of each step: after its REGISTER / after its first fetch "
        "(UCX endpoint, workers' DEALERs) / after the step's fetches (against the last step's):",
        "",
        "| peers | RSS KiB | fds | sockets | eventfds | threads | sender RSS MiB, fds, threads "
        "after |",
        "|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for p in doc["points"]:
        r, w = p["per_new_peer_register"], p["per_new_peer_first_fetch"]
        f, a = p["per_new_peer_fetch"], p["sender_after_fetch"]
        ds = (r, w, f)
        lines.append(
            f"| {p['peers']} | {_three('rss_kib', '.0f', ds)} | {_three('fds', '.2f', ds)} "
            f"| {_three('fd_socket', '.2f', ds)} | {_three('fd_eventfd', '.2f', ds)} "
            f"| {_three('threads', '.2f', ds)} | {a['rss_kib'] / 1024:.0f}, {a['fds']}, "
            f"{a['threads']} |"
        )
    lines.append("")
    for key, what in (
        ("per_peer_after_register", "its REGISTER"),
        ("per_peer_after_first_fetch", "its first fetch"),
        ("per_peer_after_fetch", "its fetches (all told)"),
    ):
        m = s[key]
        lines.append(
            f"- per peer past the first step, {what}: RSS {m['rss_kib']:.0f} KiB, fds "
            f"{m['fds']:.2f} (sockets {m.get('fd_socket', 0):.2f}, eventfds "
            f"{m.get('fd_eventfd', 0):.2f}), threads {m['threads']:.2f}"
        )
    lines += [
        "",
        "| peers | requests | req/s | x of 1 peer | p50 / p99 ms | failures | bytes wrong |",
        "|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for p in doc["points"]:
        t = p["throughput"]
        lines.append(
            f"| {p['peers']} | {t['requests']} | {t['rps']:.0f} | "
            f"{s['rps_vs_1'][str(p['peers'])]:.2f} | {t['p50_ms']:.2f} / {t['p99_ms']:.2f} "
            f"| {t['failures']} | {t['mismatches']} |"
        )
    c = doc["nixl_cost"]
    lines += [
        "",
        f"NIXL per peer (in an rx process): add_remote_agent {c['add_peer_ms']:.2f} ms for "
        f"{c['metadata_bytes']} bytes of metadata; remove {c['remove_peer_ms']:.2f} ms",
        "",
        "| descriptors per list | addresses | prep_xfer_dlist ms | RSS KiB per list "
        "| bytes per descriptor |",
        "|--:|---|--:|--:|--:|",
    ]
    for q in c["lists"]:
        lines.append(
            f"| {q['descs']} | {q['order']} | {q['prep_ms']:.2f} | {q['rss_kib_per_list']:.0f} "
            f"| {q['bytes_per_desc']:.0f} |"
        )
    lk = doc.get("receiver_links", {})
    if lk.get("links"):
        r, f = lk["per_link_register"], lk["per_link_fetch"]
        lines += [
            "",
            f"one receiver linked to {lk['links']} senders, per link: registered: fds "
            f"{r['fds']:.2f} (sockets {r.get('fd_socket', 0):.2f}, eventfds "
            f"{r.get('fd_eventfd', 0):.2f}), RSS {r['rss_kib']:.0f} KiB; having fetched: fds "
            f"{f['fds']:.2f} (sockets {f.get('fd_socket', 0):.2f}, eventfds "
            f"{f.get('fd_eventfd', 0):.2f}), RSS {f['rss_kib']:.0f} KiB, threads "
            f"{f['threads']:.2f}; failures {lk['failures']}",
        ]
    lines.append("")
    lines.append(f"uptime before: {doc['uptime_start']}")
    lines.append(f"uptime after:  {doc['uptime_end']}")
    return "\n".join(lines) + "\n"


def _three(key: str, fmt: str, ds: tuple[dict[str, float], ...]) -> str:
    return " / ".join(format(d.get(key, 0), fmt) for d in ds)


# -- the command ---------------------------------------------------------------------------
def main_scale(args: Any) -> int:
    """``kvxferd bench --scale``: the steps, their tables, --json. 0 ok, 1 failed, 2 bad usage."""
    from pydantic import ValidationError

    if args.quick or args.only or args.plot_path:
        print("kvxferd bench: --scale takes neither --quick, --only nor --plot", file=sys.stderr)
        return 2
    try:
        peers = tuple(int(x) for x in str(args.scale_peers).split(",") if x.strip())
        dp_fields = ("ucx_tls", "ucx_error_handling_mode", "ucx_num_workers", "sync_mode")
        dp = DataPlaneSettings(
            **{f: getattr(args, f) for f in dp_fields if getattr(args, f, None) is not None}
        )
    except (ValueError, ValidationError) as e:
        print(f"kvxferd bench: bad --scale option: {e}", file=sys.stderr)
        return 2
    if not peers or min(peers) < 1:
        print("kvxferd bench: --scale-peers takes counts >= 1, e.g. 1,8,32,64", file=sys.stderr)
        return 2
    timeout = min(args.timeout_s, ScaleOptions.timeout_s) if args.timeout_s else 240.0
    opts = ScaleOptions(peers=peers, dataplane=dp, timeout_s=timeout)
    try:
        doc = run_scale(opts)
    except BenchError as e:
        print(f"kvxferd bench: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(format_scale(doc))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if doc["summary"]["ok"] else 1


__all__ = [
    "ScaleOptions",
    "format_scale",
    "main_scale",
    "proc_usage",
    "run_scale",
    "scale_summary",
]
