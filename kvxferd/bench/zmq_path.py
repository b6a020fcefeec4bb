"""The plain ZMQ path: zero-copy frames over tcp://127.0.0.1, copied into the destination blocks."""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvxferd.bench.content import _kv_array, fill_source
from kvxferd.bench.plan import Plan
from kvxferd.bench.side import _Destination, _result, _Side
from kvxferd.bench.workload import STEP_TIMEOUT_S, BenchError
from kvxferd.transfer.layout import write_descriptors

if TYPE_CHECKING:
    import zmq


def _offsets(plan: Plan, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64]) -> tuple[Any, Any]:
    """Byte offsets and lengths of each run, on both sides (the same runs NIXL would get)."""
    s, d = write_descriptors(plan.layout, 0, src, 0, dst, 0, plan.workload.layers)
    return s[:, :2].tolist(), d[:, :2].tolist()


class ZmqTx(_Side):
    """One DEALER per receiver; each request is a header plus one zero-copy frame per run of blocks."""

    def __init__(self, plan: Plan) -> None:
        from kvxferd.transfer.pool import KvPool

        self.plan = plan
        self.pool = KvPool(plan.pool_settings(), owner=f"bench-zmq-tx{plan.tag}")
        self.buf = _kv_array(self.pool).reshape(-1).data  # a memoryview: frames are slices of it
        fill_source(_kv_array(self.pool), plan)
        self.dealers: list[zmq.Socket[bytes]] = []

    def connect(self, peers: list[dict[str, Any]]) -> None:
        import zmq

        from kvxferd.transfer.control import process_context

        for p in peers:
            sock = process_context().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(STEP_TIMEOUT_S * 1000))
            sock.connect(p["endpoint"])
            self.dealers.append(sock)

    def run(self, rep: int, count: int) -> dict[str, Any]:
        import zmq

        plan, w = self.plan, self.plan.workload
        slots = plan.slots()
        srcs = [plan.sources(rep, k) for k in range(len(self.dealers))]
        poller = zmq.Poller()
        for sock in self.dealers:
            poller.register(sock, zmq.POLLIN)
        sent: list[dict[int, float]] = [{} for _ in self.dealers]  # request -> t_ref
        nxt = [0] * len(self.dealers)
        lat: list[float] = []
        nbytes = failures = 0
        t0 = last = time.monotonic()
        deadline = t0 + plan.run_timeout_s(count)
        while any(n < count for n in nxt) or any(sent):
            now = time.monotonic()
            if now > deadline:
                raise BenchError(f"zmq: repetition still running after {deadline - t0:.0f} s")
            for k, sock in enumerate(self.dealers):
                while (
                    len(sent[k]) < w.inflight
                    and nxt[k] < count
                    and (not w.rate or now >= t0 + nxt[k] / w.rate)
                ):
                    i = nxt[k]
                    t_ref = t0 + i / w.rate if w.rate else time.monotonic()
                    runs, _ = _offsets(plan, srcs[k][i], slots[i % w.inflight])
                    frames = [self.buf[off : off + n] for off, n in runs]
                    sock.send_multipart([json.dumps([rep, i]).encode(), *frames], copy=False)
                    sent[k][i] = t_ref
                    nxt[k] += 1
            wait_ms = 100
            if w.rate and any(n < count for n in nxt):
                wait_ms = 0 if any(len(s) < w.inflight for s in sent) else 100
            events = dict(poller.poll(wait_ms))
            if not events and wait_ms == 0:
                time.sleep(50e-6)  # paced and idle: zmq_poll counts in whole milliseconds
            for k, sock in enumerate(self.dealers):
                if sock not in events:
                    continue
                for _ in range(w.inflight):
                    try:
                        ack = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    done_at = time.monotonic()
                    ok, i = json.loads(ack)
                    t_ref = sent[k].pop(i)
                    if ok:
                        lat.append(done_at - t_ref)
                        nbytes += w.request_bytes
                        last = max(last, done_at)
                    else:
                        failures += 1
        return _result(t0, last, lat, count * len(self.dealers), nbytes, failures)

    def close(self) -> None:
        for sock in self.dealers:
            sock.close(linger=0)
        try:
            self.buf.release()
        except BufferError:  # zmq may still hold a zero-copy frame; the mapping dies with it
            pass
        self.pool.close()


class ZmqRx(_Destination):
    """A ROUTER thread that copies each request's frames into the destination blocks and acks it."""

    def __init__(self, plan: Plan, index: int) -> None:
        import zmq

        from kvxferd.transfer.control import process_context
        from kvxferd.transfer.pool import KvPool

        super().__init__(plan, index)
        self.pool = KvPool(plan.pool_settings(), owner=f"bench-zmq-rx{index}-{plan.tag}")
        self.router = process_context().socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
        self._sources: tuple[int, npt.NDArray[np.int64]] | None = None
        self._stop = threading.Event()
        # Owns self.router from here on; the main thread touches the pool only between repetitions.
        self._thread = threading.Thread(target=self._serve, name="bench-zmq-rx", daemon=True)
        self._thread.start()

    def kv(self) -> npt.NDArray[np.uint8]:
        return _kv_array(self.pool)

    def info(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint}

    def _serve(self) -> None:
        import zmq

        flat = _kv_array(self.pool).reshape(-1)
        slots, inflight = self.slots, self.plan.workload.inflight
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(50):
                    continue
                for _ in range(256):
                    try:
                        ident, header, *data = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    rep, i = json.loads(header.bytes)
                    if self._sources is None or self._sources[0] != rep:
                        self._sources = (rep, self.plan.sources(rep, self.index))
                    _, runs = _offsets(self.plan, self._sources[1][i], slots[i % inflight])
                    ok = len(runs) == len(data)
                    for (off, n), frame in zip(runs, data, strict=False):
                        buf = np.frombuffer(frame.buffer, dtype=np.uint8)
                        ok = ok and buf.size == n
                        flat[off : off + min(n, buf.size)] = buf[:n]
                    self.router.send_multipart([ident.bytes, json.dumps([ok, i]).encode()])
        finally:
            self.router.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.pool.close()
