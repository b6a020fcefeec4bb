"""The kvxferd path: a Sender with an engine thread (tx), Receivers fetching with a window (rx)."""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvxferd.bench.content import _kv_array, fill_source
from kvxferd.bench.plan import Plan
from kvxferd.bench.side import _Destination, _result, _Side, cpu_delta, thread_cpu_s
from kvxferd.bench.workload import STEP_TIMEOUT_S, BenchError
from kvxferd.config import DataPlaneSettings

if TYPE_CHECKING:
    from kvxferd.transfer.receiver import Receiver, RxHandle
    from kvxferd.transfer.sender import Sender, TxHandle


class KvxTx(_Side):
    """kvxferd's Sender, and an engine thread that publishes a window ahead and closes what ended."""

    def __init__(self, plan: Plan, dataplane: DataPlaneSettings) -> None:
        from kvxferd.config import load_sender_settings
        from kvxferd.transfer.sender import Sender

        self.plan = plan
        settings = load_sender_settings(
            listen="tcp://127.0.0.1:0",
            num_threads=plan.workload.threads,
            name=f"bench-tx-{plan.tag}",
            pool=plan.pool_settings().model_dump(),
            dataplane=dataplane.model_dump(),
            security={"mode": "off"},  # loopback only (kvxferd.bench measures CURVE apart)
        )
        self.sender: Sender | None = Sender(settings).start()
        fill_source(_kv_array(self.sender.pool), plan)
        self._engine: threading.Thread | None = None
        self._failures = 0
        self._published = threading.Event()
        self._cpu0: dict[str, float] = {}

    def info(self) -> dict[str, Any]:
        assert self.sender is not None
        return {"endpoint": self.sender.endpoint}

    def prepare(self, rep: int, count: int) -> dict[str, Any]:
        self._failures = 0
        self._published.clear()
        self._cpu0 = thread_cpu_s()
        self._engine = threading.Thread(
            target=self._publish_and_close, args=(rep, count), name="bench-engine", daemon=True
        )
        self._engine.start()
        if not self._published.wait(STEP_TIMEOUT_S):
            raise BenchError("the first requests were not published in time")
        return {}

    def _publish_and_close(self, rep: int, count: int) -> None:
        """What an engine does: publish finished requests, close each once it ended."""
        assert self.sender is not None
        sender, plan, w = self.sender, self.plan, self.plan.workload
        srcs = [plan.sources(rep, k) for k in range(w.receivers)]
        order = [(i, k) for i in range(count) for k in range(w.receivers)]
        lead = 2 * w.inflight * w.receivers  # published ahead of the receivers' fetches
        deadline = time.monotonic() + plan.run_timeout_s(count) + STEP_TIMEOUT_S
        handles: deque[TxHandle] = deque()
        nxt = 0
        try:
            while nxt < min(lead, len(order)):
                i, k = order[nxt]
                handles.append(sender.publish(plan.request_id(rep, k, i), srcs[k][i]))
                nxt += 1
            self._published.set()
            while handles:
                h = handles.popleft()
                out = h.wait(max(0.0, deadline - time.monotonic()))
                if out is None or not out.ok:
                    self._failures += 1
                h.close(timeout=max(0.0, deadline - time.monotonic()))
                if nxt < len(order):
                    i, k = order[nxt]
                    handles.append(sender.publish(plan.request_id(rep, k, i), srcs[k][i]))
                    nxt += 1
        except Exception as e:  # reported by finish(); the receivers time out on their own
            sys.stderr.write(f"bench engine thread: {e!r}\n")
            self._failures += len(order) - nxt + len(handles) + 1
            self._published.set()

    def finish(self, rep: int, count: int) -> dict[str, Any]:
        if self._engine is not None:
            self._engine.join(self.plan.run_timeout_s(count) + STEP_TIMEOUT_S)
            if self._engine.is_alive():
                raise BenchError("the engine thread did not finish")
        assert self.sender is not None
        return {
            "failures": self._failures,
            "stats": self.sender.stats.snapshot(),
            "threads_cpu_s": cpu_delta(self._cpu0, thread_cpu_s()),
        }

    def close(self) -> None:
        if self.sender is not None:
            self.sender.shutdown()
            self.sender = None


class KvxRx(_Destination):
    """kvxferd's Receiver, fetching with a window of ``inflight`` and timing each fetch
    (``digest``: each fetch checks the per-request digest, kvxferd/transfer/digest.py)."""

    def __init__(
        self, plan: Plan, dataplane: DataPlaneSettings, index: int, *, digest: bool = False
    ) -> None:
        from kvxferd.config import load_receiver_settings
        from kvxferd.transfer.receiver import Receiver

        super().__init__(plan, index)
        settings = load_receiver_settings(
            name=f"bench-rx{index}-{plan.tag}",
            pool=plan.pool_settings().model_dump(),
            dataplane=dataplane.model_dump(),
            security={"mode": "off"},  # loopback only (kvxferd.bench measures CURVE apart)
        )
        self.receiver: Receiver | None = Receiver(settings).start()
        self.endpoint = ""
        self.digest = digest

    def kv(self) -> npt.NDArray[np.uint8]:
        assert self.receiver is not None
        return _kv_array(self.receiver.pool)

    def connect(self, peers: list[dict[str, Any]]) -> None:
        self.endpoint = peers[0]["endpoint"]

    def run(self, rep: int, count: int) -> dict[str, Any]:
        assert self.receiver is not None
        rx, plan, w = self.receiver, self.plan, self.plan.workload
        window: deque[tuple[RxHandle, float]] = deque()
        lat: list[float] = []
        nbytes = failures = 0
        t0 = last = time.monotonic()
        deadline = t0 + plan.run_timeout_s(count)

        def finish_oldest() -> None:
            nonlocal nbytes, failures, last
            handle, t_ref = window.popleft()
            out = handle.wait(max(0.0, deadline - time.monotonic()))
            done_at = handle.session.completion.set_at
            if out is None or not out.ok or done_at is None:
                failures += 1
            else:
                lat.append(done_at - t_ref)
                nbytes += out.nbytes
                last = max(last, done_at)
            handle.close(timeout=max(0.0, deadline - time.monotonic()))

        for i in range(count):
            while len(window) >= w.inflight:
                finish_oldest()
            t_ref = _pace(t0, i, w.rate)
            try:
                h = rx.fetch(
                    plan.request_id(rep, self.index, i),
                    self.endpoint,
                    self.slots[i % w.inflight],
                    want_aux=False,
                    digest=self.digest,
                )
            except Exception as e:
                sys.stderr.write(f"bench: fetch refused: {e!r}\n")
                failures += 1
                continue
            window.append((h, t_ref))
        while window:
            finish_oldest()
        return _result(t0, last, lat, count, nbytes, failures)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.shutdown()
            self.receiver = None


def _pace(t0: float, i: int, rate: float) -> float:
    """Closed loop: now. Paced: sleep until request ``i``'s slot and time from it, even if late."""
    now = time.monotonic()
    if not rate:
        return now
    at = t0 + i / rate
    if at > now:
        time.sleep(at - now)
    return at
