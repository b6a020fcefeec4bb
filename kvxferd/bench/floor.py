"""``kvxferd bench --floor``: what the engine path's hops cost in Python with no kvxferd logic.

Issue 22 asks of the engine path (two daemons, two engine processes) a p50 of 0.5 ms and
0.3 ms of daemon CPU per request at 1 in flight. This measures the floor of that design:
the same processes and the same hops, written as plainly as Python allows, with nothing
of kvxferd's admission, sessions, deadlines, journal, metrics or fault handling:

    publishing engine --unix--> sender daemon            (publish; answered when written)
    fetching engine   --unix--> receiver daemon --ZMQ--> sender daemon  (the request)
    sender daemon --NIXL WRITE + notification--> receiver daemon --unix--> fetching engine

Each daemon is one thread: the sender posts one prepared WRITE (16 KiB, one descriptor)
per request and polls it to DONE; the receiver polls NIXL for the notification and
checks the bytes (each request writes a different pattern). UCX as kvxferd runs it
(error handling mode ``peer``, one worker, no progress thread). The receiver looks for a
notification every ``--floor-wait`` microseconds (0: it polls without waiting), as
kvxferd's io thread does. Daemon CPU is both daemons' ``/proc/PID/stat`` time over the
measured requests; CURVE (``--security curve``) encrypts the ZMQ hop as kvxferd does.

The figures are the best this design can do in Python on the machine that runs it: a
target below them needs another design (a native loop), not less code.
"""

from __future__ import annotations

import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZE = 16384
_LEN = struct.Struct("<I")
_WAIT_S = 10.0  # every blocking step of the measuring side: a stuck daemon fails the run


def _agent(name: str) -> tuple[Any, Any]:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    from kvxferd.transfer.dataplane import _quiet_nixl_logger

    _quiet_nixl_logger()
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "peer", "num_workers": "1"})
    buf = torch.zeros(SIZE, dtype=torch.uint8)
    agent.register_memory([buf], mem_type="DRAM")
    return agent, buf


def _desc(addr: int) -> Any:
    import numpy as np

    return np.array([[addr, SIZE, 0]], dtype=np.int64)


def _serve_unix(path: str) -> socket.socket:
    ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ls.bind(path)
    ls.listen(1)
    ls.settimeout(_WAIT_S)
    conn, _ = ls.accept()
    ls.close()
    conn.setblocking(False)
    return conn


def _sender(run: Path, port_file: Path, curve: bool) -> None:
    """Sender daemon: engine socket (publish), ROUTER (requests), one WRITE per request."""
    import zmq

    from kvxferd.transfer.poller import Poller, tight_timers

    tight_timers()
    agent, buf = _agent(f"floor-tx-{os.getpid()}")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    if curve:
        public, secret = zmq.curve_keypair()
        router.curve_server, router.curve_secretkey = True, secret
        (run / "tx.key").write_bytes(public)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    port_file.write_text(str(port))
    if not router.poll(int(_WAIT_S * 1000)):
        raise SystemExit("floor sender: no receiver")
    ident, setup = router.recv_multipart()
    peer = agent.add_remote_agent(setup[8:])
    peer = peer.decode() if isinstance(peer, bytes) else peer
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _desc(buf.data_ptr()), "DRAM")
    remote = agent.prep_xfer_dlist(peer, _desc(struct.unpack("<Q", setup[:8])[0]), "DRAM")
    router.send_multipart([ident, b"ok"])
    engine = _serve_unix(str(run / "tx.sock"))
    poller = Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(engine.fileno(), zmq.POLLIN)
    published: list[bytes] = []
    requested: list[bytes] = []
    writing: list[tuple[Any, bytes]] = []  # (handle, publish id)
    while True:
        for item, _ in poller.poll(0.0 if writing else 1.0):
            if item is router:
                while router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    _, msg = router.recv_multipart(zmq.NOBLOCK)
                    if msg == b"stop":
                        return
                    requested.append(msg)
            else:
                data = engine.recv(4096)
                if not data:
                    return
                published.append(data[_LEN.size :])
        while requested and published:  # a request may come before its publish
            msg, pub = requested.pop(0), published.pop(0)
            buf[0] = buf[SIZE - 1] = msg[-1]  # this request's pattern
            handle = agent.make_prepped_xfer("WRITE", local, [0], remote, [0], msg)
            if agent.transfer(handle) == "ERR":
                raise SystemExit("floor sender: WRITE refused")
            writing.append((handle, pub))
        for entry in list(writing):
            state = agent.check_xfer_state(entry[0])
            if state == "DONE":
                agent.release_xfer_handle(entry[0])
                writing.remove(entry)
                engine.sendall(_LEN.pack(len(entry[1])) + entry[1])
            elif state == "ERR":
                raise SystemExit("floor sender: WRITE failed")


def _receiver(run: Path, port: int, wait_s: float, curve: bool) -> None:
    """Receiver daemon: engine socket (fetch), DEALER (requests), NIXL notifications."""
    import zmq

    from kvxferd.transfer.poller import Poller, tight_timers

    tight_timers()
    agent, buf = _agent(f"floor-rx-{os.getpid()}")
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    if curve:
        public, secret = zmq.curve_keypair()
        dealer.curve_serverkey = (run / "tx.key").read_bytes()
        dealer.curve_publickey, dealer.curve_secretkey = public, secret
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(struct.pack("<Q", buf.data_ptr()) + agent.get_agent_metadata())
    if not dealer.poll(int(_WAIT_S * 1000)) or dealer.recv() != b"ok":
        raise SystemExit("floor receiver: no sender")
    engine = _serve_unix(str(run / "rx.sock"))
    poller = Poller()
    poller.register(engine.fileno(), zmq.POLLIN)
    waiting: dict[bytes, int] = {}  # notification -> the pattern its bytes carry
    seq = 0
    while True:
        if poller.poll(wait_s if waiting else 1.0):
            data = engine.recv(4096)
            if not data:
                dealer.send(b"stop")
                return
            seq += 1
            key = b"%d:" % seq + bytes([seq % 251 + 1])
            waiting[key] = seq % 251 + 1
            dealer.send(key, zmq.NOBLOCK)
        if waiting:
            for msgs in agent.get_new_notifs().values():
                for m in msgs:
                    want = waiting.pop(m, None)
                    if want is None:
                        continue
                    ok = int(buf[0]) == want and int(buf[SIZE - 1]) == want
                    reply = b"ok" if ok else b"bad bytes"
                    engine.sendall(_LEN.pack(len(reply)) + reply)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _frame(sock: socket.socket) -> bytes:
    head = b""
    while len(head) < _LEN.size:
        got = sock.recv(_LEN.size - len(head))
        if not got:
            raise RuntimeError("floor: a daemon closed its engine socket")
        head += got
    (n,) = _LEN.unpack(head)
    body = b""
    while len(body) < n:
        got = sock.recv(n - len(body))
        if not got:
            raise RuntimeError("floor: a daemon closed its engine socket")
        body += got
    return body


def _connect(path: Path, proc: subprocess.Popen[bytes]) -> socket.socket:
    deadline = time.monotonic() + _WAIT_S
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(_WAIT_S)
        try:
            s.connect(str(path))
            return s
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"floor: no daemon at {path.name}") from None
            time.sleep(0.01)  # polling for a socket file to appear, bounded above


def measure(requests: int, wait_s: float, curve: bool, warmup: int = 200) -> dict[str, Any]:
    """One floor run at 1 request in flight: p50/p99 ms, daemons' CPU µs per request."""
    with tempfile.TemporaryDirectory(prefix="kvxferd-floor-") as tmp:
        run = Path(tmp)
        port_file = run / "port"
        flag = ["--curve"] if curve else []
        me = [sys.executable, "-m", "kvxferd.bench.floor"]
        tx = subprocess.Popen([*me, "tx", str(run), *flag])
        rx: subprocess.Popen[bytes] | None = None
        try:
            deadline = time.monotonic() + _WAIT_S
            while not port_file.exists() or not port_file.read_text():
                if tx.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("floor: the sender did not start")
                time.sleep(0.01)  # polling for the port file, bounded above
            rx = subprocess.Popen([*me, "rx", str(run), port_file.read_text(), str(wait_s), *flag])
            fetcher = _connect(run / "rx.sock", rx)
            publisher = _connect(run / "tx.sock", tx)
            lat: list[float] = []
            bad = 0
            c0 = e0 = 0.0
            for i in range(warmup + requests):
                if i == warmup:
                    c0, e0 = _cpu_s(tx.pid) + _cpu_s(rx.pid), time.process_time()
                t = time.perf_counter()
                body = b"req%d" % i
                publisher.sendall(_LEN.pack(len(body)) + body)
                fetcher.sendall(_LEN.pack(5) + b"fetch")
                bad += _frame(fetcher) != b"ok"
                lat.append(time.perf_counter() - t)
                if _frame(publisher) != body:
                    raise RuntimeError("floor: publish answered out of order")
            c1, e1 = _cpu_s(tx.pid) + _cpu_s(rx.pid), time.process_time()
            fetcher.close()
            publisher.close()
            tx.wait(_WAIT_S)
            rx.wait(_WAIT_S)
        finally:
            for p in (tx, rx):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()
    lat = sorted(lat[warmup:])
    return {
        "requests": requests,
        "wait_us": wait_s * 1e6,
        "security": "curve" if curve else "off",
        "p50_ms": statistics.median(lat) * 1e3,
        "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3,
        "daemon_cpu_us": (c1 - c0) / requests * 1e6,
        "engine_cpu_us": (e1 - e0) / requests * 1e6,
        "bad_bytes": bad,
        "load": os.getloadavg()[0],
    }


def main_floor(args: Any) -> int:
    """``kvxferd bench --floor``: each (security, wait) ``--reps`` times, median [min-max]."""
    reps = max(1, int(getattr(args, "reps", None) or 3))
    requests = int(getattr(args, "requests", None) or 3000)
    waits = [0.0, 60e-6]
    securities = ["off", "curve"] if args.security == "both" else [args.security]
    print(f"kvxferd bench --floor: {requests} requests x {reps} at 1 in flight, 16 KiB")
    print("| security | notification wait | p50 ms | p99 ms | daemon CPU us/req | load |")
    print("|---|--:|--:|--:|--:|--:|")
    bad = 0
    for sec in securities:
        for wait in waits:
            runs = [measure(requests, wait, sec == "curve") for _ in range(reps)]
            bad += sum(r["bad_bytes"] for r in runs)

            def cell(key: str, runs: list[dict[str, Any]] = runs) -> str:
                v = [r[key] for r in runs]
                return f"{statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]"

            cpu = [r["daemon_cpu_us"] for r in runs]
            print(
                f"| {sec} | {wait * 1e6:.0f} us | {cell('p50_ms')} | {cell('p99_ms')} | "
                f"{statistics.median(cpu):.0f} [{min(cpu):.0f}-{max(cpu):.0f}] | "
                f"{runs[0]['load']:.2f}-{runs[-1]['load']:.2f} |"
            )
    print(f"bytes checked on every request: {bad} wrong")
    return 1 if bad else 0


def _main(argv: list[str]) -> None:
    curve = "--curve" in argv
    argv = [a for a in argv if a != "--curve"]
    if argv[0] == "tx":
        _sender(Path(argv[1]), Path(argv[1]) / "port", curve)
    elif argv[0] == "rx":
        _receiver(Path(argv[1]), int(argv[2]), float(argv[3]), curve)
    else:
        raise SystemExit(f"unknown role {argv[0]!r}")


if __name__ == "__main__":
    _main(sys.argv[1:])
