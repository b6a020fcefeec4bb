"""The engine path: real sender and receiver daemons, driven by engines through ``kvxferd.engine.client``.

Each bench child plays the engine of one daemon, exactly as an inference engine
would: the ``tx`` child starts a sender daemon (``python -m kvxferd sender``),
maps its pool with :func:`~kvxferd.engine.client.attach_pool`, writes the source
blocks into it and, per request, calls ``publish_wait`` (publish, wait and close in
one round trip; a ``close`` follows only if that one could not close); each ``rx``
child starts a receiver daemon and, per request, calls ``fetch_wait`` likewise,
verifying the bytes through its own mapping of the receiver's pool: two engine calls
per request. Both engines run an :class:`~kvxferd.engine.client.AsyncClient` with one
task per request in flight::

    rx task s (of inflight)   requests s, s + inflight, ...: fetch_wait(close)
    tx task s (of 2 x inflight, so publishes run ahead of the fetches)
                              requests s, s + 2 x inflight, ...: publish_wait(close)

A request's latency runs from the engine's ``fetch`` call to the outcome's
arrival in the receiver engine, the close included (it frees the slot). Each child reads its daemon's CPU time (every thread's
``/proc/PID/task/TID/schedstat``) around the repetition, so the report carries
daemon CPU per request; the engines' own CPU is reported beside it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxferd.bench.content import fill_source
from kvxferd.bench.plan import Plan
from kvxferd.bench.side import _Destination, _result, _Side
from kvxferd.bench.workload import STEP_TIMEOUT_S, BenchError
from kvxferd.config import DataPlaneSettings
from kvxferd.launch import Daemon, LaunchError

DAEMON_READY_TIMEOUT_S = 60.0  # imports, pool, NIXL agent, sockets on a loaded 2-core machine
DAEMON_EXIT_TIMEOUT_S = 10.0  # SIGTERM -> exit (drain bounded below), then SIGKILL
CALL_TIMEOUT_S = 10.0  # one engine call to its local daemon
WAIT_TIMEOUT_S = 30.0  # one request's wait / close
DAEMON_DEADLINES = dict(drain_timeout_ms=1000, shutdown_timeout_ms=5000)


def daemon_cpu_s(pid: int) -> float:
    """CPU seconds every live thread of ``pid`` has run (schedstat, ns resolution)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # the thread ended meanwhile
    return total / 1e9


class _Daemon:
    """One ``python -m kvxferd sender|receiver`` child with the plan's pool; stopped by ``stop``."""

    def __init__(self, role: str, name: str, plan: Plan, dataplane: DataPlaneSettings) -> None:
        from kvxferd.demo import daemon_env

        self.dir = tempfile.mkdtemp(prefix="kvxb-")
        self.name = name
        env = daemon_env(self.dir, name)
        for key in [k for k in env if k.startswith("KVXFERD_POOL__")]:
            del env[key]
        for key, value in plan.pool_settings().model_dump().items():
            if value is not None:
                env[f"KVXFERD_POOL__{key.upper()}"] = str(value)
        env["KVXFERD_POOL__DEVICE"] = "cpu"
        for key, value in dataplane.model_dump().items():
            if value is not None:
                env[f"KVXFERD_DATAPLANE__{key.upper()}"] = str(value)
        for key, value in DAEMON_DEADLINES.items():
            env[f"KVXFERD_DEADLINES__{key.upper()}"] = str(value)
        args = []
        if role == "sender":
            args += ["--listen", "tcp://127.0.0.1:0", "--num-threads", str(plan.workload.threads)]
        self.child = Daemon(role, name, self.dir, args, env=env)
        self.pid = self.child.pid
        try:
            self.ready = self.child.wait_ready(time.monotonic() + DAEMON_READY_TIMEOUT_S)
        except LaunchError as e:
            self.stop()
            raise BenchError(f"daemon {self.name} did not get ready: {e}") from None

    def stop(self) -> None:
        self.child.stop(time.monotonic() + DAEMON_EXIT_TIMEOUT_S)
        shutil.rmtree(self.dir, ignore_errors=True)


class _Engine:
    """A daemon, an AsyncClient-ready socket, and the daemon's pool mapped here."""

    def __init__(self, role: str, name: str, plan: Plan, dataplane: DataPlaneSettings) -> None:
        from kvxferd.engine.client import Client, attach_pool

        self.daemon = _Daemon(role, name, plan, dataplane)
        try:
            self.socket = str(self.daemon.ready["engine_socket"])
            with Client(self.socket, timeout_s=CALL_TIMEOUT_S) as c:
                info = c.describe()
            self.kv_tensor = attach_pool(info)
        except BaseException:
            self.daemon.stop()
            raise

    def kv(self) -> npt.NDArray[np.uint8]:
        return self.kv_tensor.numpy()  # type: ignore[no-any-return]

    def cpu_s(self) -> float:
        return daemon_cpu_s(self.daemon.pid)

    def stop(self) -> None:
        self.kv_tensor.kvxferd_mapping.close()  # type: ignore[attr-defined]
        del self.kv_tensor
        self.daemon.stop()


def engine_key(role: str, plan: Plan, dataplane: DataPlaneSettings) -> str:
    """What a daemon kept across workloads must match: role, pool, workers, data plane."""
    return "|".join(
        (
            role,
            plan.pool_settings().model_dump_json(),
            str(plan.workload.threads),
            dataplane.model_dump_json(),
        )
    )


class EngineTx(_Side):
    """The sender engine: publish -> wait -> close per request, 2 x inflight tasks, one loop thread.

    ``engine``: a daemon kept from an earlier workload (``keep_daemons``); its owner stops it.
    """

    def __init__(
        self, plan: Plan, dataplane: DataPlaneSettings, engine: _Engine | None = None
    ) -> None:
        self.plan = plan
        self.owned = engine is None
        self.engine = engine or _Engine("sender", f"bench-etx{plan.tag}", plan, dataplane)
        fill_source(self.engine.kv(), plan)
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._failures = 0
        self._cpu0 = self._engine_cpu0 = 0.0

    def info(self) -> dict[str, Any]:
        return {"endpoint": self.engine.daemon.ready["endpoint"]}

    def prepare(self, rep: int, count: int) -> dict[str, Any]:
        self._failures = 0
        self._started.clear()
        self._cpu0, self._engine_cpu0 = self.engine.cpu_s(), time.process_time()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._publish_all(rep, count)),
            name="bench-engine-tx",
            daemon=True,
        )
        self._thread.start()
        if not self._started.wait(STEP_TIMEOUT_S):
            raise BenchError("the sender engine did not publish its first requests in time")
        return {}

    async def _publish_all(self, rep: int, count: int) -> None:
        from kvxferd.engine.client import AsyncClient

        plan, w = self.plan, self.plan.workload
        srcs = [plan.sources(rep, k) for k in range(w.receivers)]
        order = [(i, k) for i in range(count) for k in range(w.receivers)]
        lead = min(len(order), 2 * w.inflight * w.receivers)
        client = AsyncClient(self.engine.socket, timeout_s=CALL_TIMEOUT_S)
        first = asyncio.Event()
        published = 0

        async def task(s: int) -> None:
            nonlocal published
            for n in range(s, len(order), lead):
                i, k = order[n]
                rid = plan.request_id(rep, k, i)
                published += 1  # counted as it is sent: one call carries publish and wait
                if published >= lead:
                    first.set()
                try:
                    out = await client.publish_wait(rid, srcs[k][i], WAIT_TIMEOUT_S)
                    if not out.ok:
                        self._failures += 1
                    if not out.closed and not await client.close(out.handle_id, WAIT_TIMEOUT_S):
                        self._failures += 1
                except Exception as e:
                    sys.stderr.write(f"bench engine publish: {e!r}\n")
                    self._failures += 1

        tasks = [asyncio.create_task(task(s)) for s in range(lead)]
        waiter = asyncio.create_task(first.wait())
        await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
        self._started.set()
        await asyncio.gather(*tasks)
        waiter.cancel()
        await client.aclose()

    def finish(self, rep: int, count: int) -> dict[str, Any]:
        if self._thread is not None:
            self._thread.join(self.plan.run_timeout_s(count) + STEP_TIMEOUT_S)
            if self._thread.is_alive():
                raise BenchError("the sender engine did not finish")
        return {
            "failures": self._failures,
            "daemon_cpu_s": self.engine.cpu_s() - self._cpu0,
            "engine_cpu_s": time.process_time() - self._engine_cpu0,
        }

    def close(self) -> None:
        if self.owned:
            self.engine.stop()


class EngineRx(_Destination):
    """The receiver engine: fetch -> wait -> close per request, ``inflight`` tasks; timed."""

    def __init__(
        self,
        plan: Plan,
        dataplane: DataPlaneSettings,
        index: int,
        engine: _Engine | None = None,
    ) -> None:
        super().__init__(plan, index)
        self.owned = engine is None
        self.engine = engine or _Engine("receiver", f"bench-erx{index}-{plan.tag}", plan, dataplane)
        self.endpoint = ""

    def kv(self) -> npt.NDArray[np.uint8]:
        return self.engine.kv()

    def connect(self, peers: list[dict[str, Any]]) -> None:
        self.endpoint = peers[0]["endpoint"]

    def run(self, rep: int, count: int) -> dict[str, Any]:
        cpu0, engine0 = self.engine.cpu_s(), time.process_time()
        result = asyncio.run(self._fetch_all(rep, count))
        result["daemon_cpu_s"] = self.engine.cpu_s() - cpu0
        result["engine_cpu_s"] = time.process_time() - engine0
        return result

    async def _fetch_all(self, rep: int, count: int) -> dict[str, Any]:
        from kvxferd.engine.client import AsyncClient

        plan, w = self.plan, self.plan.workload
        client = AsyncClient(self.engine.socket, timeout_s=CALL_TIMEOUT_S)
        lat: list[float] = []
        nbytes = failures = 0
        t0 = last = time.monotonic()

        async def task(s: int) -> None:
            nonlocal nbytes, failures, last
            for i in range(s, count, w.inflight):
                t = time.monotonic()
                try:
                    out = await client.fetch_wait(
                        plan.request_id(rep, self.index, i),
                        self.endpoint,
                        self.slots[s],
                        WAIT_TIMEOUT_S,
                        want_aux=False,
                    )
                    done_at = time.monotonic()
                    if not out.ok:
                        failures += 1
                    else:
                        lat.append(done_at - t)
                        nbytes += out.nbytes
                        last = max(last, done_at)
                    if not out.closed and not await client.close(out.handle_id, WAIT_TIMEOUT_S):
                        raise BenchError(f"slot {s} not reusable after close")
                except BenchError:
                    raise
                except Exception as e:
                    sys.stderr.write(f"bench engine fetch: {e!r}\n")
                    failures += 1

        await asyncio.gather(*(task(s) for s in range(min(w.inflight, count))))
        await client.aclose()
        return _result(t0, last, lat, count, nbytes, failures)

    def close(self) -> None:
        if self.owned:
            self.engine.stop()
