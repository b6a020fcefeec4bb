"""``kvxferd bench --curve-cost``: a small request's control round trip with CURVE on and off, in one run.

Only control messages cross ZMQ (the KV bytes go by NIXL), so CURVE costs what it
adds to the messages of a fetch: a REQUEST_DATA out and a Result back. This measures
exactly that pair, at the sizes kvxferd sends (``protocol.encode`` of a RequestData
with ``blocks`` destination ids, and of a done Result), over a DEALER -> ROUTER pair on
``tcp://127.0.0.1``, as the receiver's link and the sender's listener are::

    mode       sockets
    ---------  ----------------------------------------------------------------
    plain      no security (what ``security.mode = "off"`` runs, loopback only)
    curve      ROUTER a CURVE server, DEALER a CURVE client that knows the
               server's key (libsodium: Curve25519 + XSalsa20-Poly1305 per message)

The ROUTER runs on a thread of this process and answers each request with the Result.
Repetitions alternate plain, curve, plain, ... so that drift of the machine falls on
both alike; each repetition opens a fresh connection (its first round trip, the
handshake included, is reported as ``connect_ms``) and then times ``requests`` round
trips one at a time (latency) and ``requests`` with ``window`` in flight (throughput).
No ZAP handler runs: ZAP is asked once per connection, at the handshake, and adds
nothing per message. The report gives both modes' figures and curve / plain.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvxferd.bench.workload import BenchError
from kvxferd.transfer import protocol as wire


@dataclass(frozen=True)
class CurveCostOptions:
    requests: int = 2000  # round trips per repetition and measure
    window: int = 32  # in flight for the throughput measure
    reps: int = 5  # repetitions per mode, alternating
    blocks: int = 64  # destination block ids in the REQUEST_DATA
    timeout_s: float = 120.0  # bound on the whole run


MODES = ("plain", "curve")


def message_frames(blocks: int) -> tuple[bytes, bytes]:
    """The REQUEST_DATA a receiver sends for a ``blocks``-block request and the Result it gets."""
    request = wire.encode(
        wire.RequestData(
            request_id="bench-curve-cost-0001",
            fetch_id=123_456_789,
            dst_blocks=list(range(10_000, 10_000 + blocks)),
            deadline_unix_ms=1_900_000_000_000,
        )
    )
    result = wire.encode(
        wire.Result(
            request_id="bench-curve-cost-0001",
            fetch_id=123_456_789,
            status="done",
            nbytes=blocks * 2 * 256 * 1024,
        )
    )
    return request, result


class _Echo:
    """A ROUTER thread that answers every message with ``reply`` (owns its socket)."""

    def __init__(self, ctx: Any, reply: bytes, curve: tuple[bytes, bytes] | None) -> None:
        import zmq

        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            public, secret = curve
            self.sock.setsockopt(zmq.CURVE_SERVER, 1)
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.reply = reply
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="bench-curve-echo", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        import zmq

        try:
            while not self.stop.is_set():
                if not self.sock.poll(50):
                    continue
                for _ in range(256):
                    try:
                        rid, _msg = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.sock.send_multipart([rid, self.reply])
        finally:
            self.sock.close(linger=0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5.0)


def _dealer(ctx: Any, endpoint: str, curve: tuple[bytes, bytes, bytes] | None) -> Any:
    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        server_public, public, secret = curve
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.connect(endpoint)
    return sock


def _recv(sock: Any, deadline: float) -> None:
    left_ms = int((deadline - time.monotonic()) * 1000)
    if left_ms <= 0 or not sock.poll(left_ms):
        raise BenchError("curve-cost: no reply before the run's deadline")
    sock.recv()


def _one_rep(opts: CurveCostOptions, mode: str, deadline: float) -> dict[str, Any]:
    """One connection of ``mode``: its first round trip, then latency and throughput."""
    import zmq

    ctx: Any = zmq.Context.instance()
    request, result = message_frames(opts.blocks)
    server = zmq.curve_keypair() if mode == "curve" else None
    client = zmq.curve_keypair() if mode == "curve" else None
    echo = _Echo(ctx, result, server)
    sock = _dealer(
        ctx, echo.endpoint, None if server is None or client is None else (server[0], *client)
    )
    try:
        t0 = time.perf_counter()
        sock.send(request)
        _recv(sock, deadline)
        connect_ms = (time.perf_counter() - t0) * 1000
        lat = []
        for _ in range(opts.requests):
            t = time.perf_counter()
            sock.send(request)
            _recv(sock, deadline)
            lat.append(time.perf_counter() - t)
        sent = got = 0
        t = time.perf_counter()
        while got < opts.requests:
            while sent < opts.requests and sent - got < opts.window:
                sock.send(request)
                sent += 1
            _recv(sock, deadline)
            got += 1
        rate = opts.requests / (time.perf_counter() - t)
    finally:
        sock.close(linger=0)
        echo.close()
    lat.sort()
    return {
        "connect_ms": connect_ms,
        "p50_us": lat[len(lat) // 2] * 1e6,
        "p99_us": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6,
        "msgs_per_s": rate,
    }


def run_curve_cost(opts: CurveCostOptions) -> dict[str, Any]:
    """Both modes, alternating; the medians over repetitions and curve / plain."""
    import zmq

    if not zmq.has("curve"):
        raise BenchError("curve-cost: this libzmq has no CURVE (build it with libsodium)")
    if opts.requests < 1 or opts.reps < 1 or opts.window < 1:
        raise BenchError("curve-cost: requests, reps and window must be >= 1")
    deadline = time.monotonic() + opts.timeout_s
    reps: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for _ in range(opts.reps):
        for mode in MODES:
            reps[mode].append(_one_rep(opts, mode, deadline))
    modes = {
        m: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for m, runs in reps.items()
    }
    plain, curve = modes["plain"], modes["curve"]
    request, result = message_frames(opts.blocks)
    return {
        "kind": "curve_cost",
        "options": asdict(opts),
        "message_bytes": {"request": len(request), "reply": len(result)},
        "modes": modes,
        "reps": reps,
        "ratio": {
            "p50": curve["p50_us"] / plain["p50_us"],
            "p99": curve["p99_us"] / plain["p99_us"],
            "msgs_per_s": curve["msgs_per_s"] / plain["msgs_per_s"],
            "connect": curve["connect_ms"] / plain["connect_ms"],
        },
        "load_avg": list(os.getloadavg()),
        "cpus": os.cpu_count(),
    }


def format_curve_cost(doc: dict[str, Any]) -> str:
    """The report: one line per mode, then curve / plain."""
    o, b = doc["options"], doc["message_bytes"]
    lines = [
        f"CURVE cost on a small request's control round trip: REQUEST_DATA of {o['blocks']} "
        f"blocks ({b['request']} B) -> Result ({b['reply']} B), DEALER -> ROUTER on "
        f"tcp://127.0.0.1; median of {o['reps']} alternating repetitions, "
        f"{o['requests']} round trips each; load {doc['load_avg'][0]:.2f} on {doc['cpus']} CPUs",
        f"{'mode':<8}{'p50 us':>10}{'p99 us':>10}{'msgs/s (window ' + str(o['window']) + ')':>24}"
        f"{'connect ms':>12}",
    ]
    for mode in MODES:
        m = doc["modes"][mode]
        lines.append(
            f"{mode:<8}{m['p50_us']:>10.1f}{m['p99_us']:>10.1f}{m['msgs_per_s']:>24.0f}"
            f"{m['connect_ms']:>12.2f}"
        )
    r = doc["ratio"]
    lines.append(
        f"{'curve/plain':<8}{r['p50']:>7.2f}x{r['p99']:>9.2f}x{r['msgs_per_s']:>23.2f}x"
        f"{r['connect']:>11.2f}x"
    )
    return "\n".join(lines) + "\n"
