"""The engine of one daemon in ``kvxferd bench --engine-path``: a self-contained driver.

The A/B bench runs two trees of kvxferd side by side, and each tree's engines must
speak that tree's engine API. This file is therefore run *as a file* (never imported
from the package by the engines), by every engine process of both trees, with the tree
under test as its working directory and first on ``sys.path``::

    python -c "import runpy; runpy.run_path(DRIVER, run_name='__main__')" tx|rx SPEC_JSON

It imports nothing of kvxferd but the public client API (``AsyncClient``,
``attach_pool``), and works with both versions of it:

    old API   tx: publish -> wait(close=True)        rx: fetch -> wait(close=True)
    new API   tx: publish_wait(close=True)           rx: fetch_wait(close=True)
              (one call per request, answered at the outcome; used when the client has them)

A ``close`` follows only when the outcome did not close the handle (a wait that
timed out, or a close that could not finish). One :class:`AsyncClient`, one event loop,
one task per request in flight: the driver's own cost per request stays small (it runs
on the same cores as the daemons). Its CPU is measured from outside, with the daemons'.

Commands come as JSON lines on stdin, replies go as JSON lines to a private copy of
stdout (whatever a library prints on fd 1 goes to stderr)::

    both  -> {"event": "hello", pid, kvxferd_file, client_file, api, num_blocks, block_bytes}
    tx    publish {tag, rep, count, blocks, lead}  -> started (the first ``lead`` are out)
          finish                                   -> {published, failures}
    rx    fetch {tag, rep, count, blocks, inflight, endpoint, verify_every}
                                                   -> {t0, t1, requests, ok, failures, bytes,
                                                       lat_us, checked, bad}
    both  exit

Content. The sender engine fills its pool once: every block the same random tile, an
8-byte stamp of the block id at its head and its complement at its tail. Request ``i``
of (tag, rep) reads ``blocks`` source blocks both sides derive from the seed, and lands
in slot ``i % inflight`` of the receiver's pool (disjoint slots). The receiver engine
checks a sample through its own mapping of the receiver daemon's pool: the first
request of each slot and every ``verify_every``-th after it, poisoned before the fetch,
head and tail stamps of every block and the body of the first block after it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from typing import IO, Any

import numpy as np
import numpy.typing as npt

WAIT_S = 30.0  # one request's wait / close, and one call of the new API
CALL_TIMEOUT_S = 10.0  # one engine call to the local daemon (the client adds it to waits)
STARTED_TIMEOUT_S = 60.0  # the first publishes of a repetition
STAMP_TAG = 0x4B56  # "KV"


class DriverError(RuntimeError):
    """The driver cannot go on with this repetition (a slot that cannot be reused)."""


# -- the plan both engines derive ---------------------------------------------------------
def stamps(blocks: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The head stamp of each block id."""
    return (np.int64(STAMP_TAG) << np.int64(48)) | blocks.astype(np.int64)


def tile(seed: int, block_bytes: int) -> npt.NDArray[np.uint8]:
    return np.random.default_rng([seed, 3]).integers(0, 256, size=block_bytes, dtype=np.uint8)


def fill(kv: npt.NDArray[np.uint8], seed: int) -> None:
    """Every block of ``kv`` (``[layers, blocks, bytes]``): the tile, head and tail stamps."""
    layers, nb, bb = kv.shape
    kv[:] = tile(seed, bb)
    head = np.broadcast_to(stamps(np.arange(nb, dtype=np.int64)), (layers, nb))
    kv[:, :, :8] = np.ascontiguousarray(head).view(np.uint8).reshape(layers, nb, 8)
    kv[:, :, -8:] = np.ascontiguousarray(~head).view(np.uint8).reshape(layers, nb, 8)


def sources(seed: int, tag: int, rep: int, count: int, blocks: int, nb: int) -> list[list[int]]:
    """Source blocks of each request of (tag, rep): distinct within a request, scattered."""
    starts = np.random.default_rng([seed, tag, rep + 1000]).integers(0, nb, size=count)
    perm = np.random.default_rng([seed, 11]).permutation(nb).astype(np.int64)
    ids = perm[(starts[:, None] + np.arange(blocks)[None, :]) % nb]
    return ids.tolist()  # type: ignore[no-any-return]


def slots(seed: int, inflight: int, blocks: int, nb: int) -> list[list[int]]:
    """Destination blocks of each slot (``inflight`` disjoint slots of ``blocks``)."""
    if inflight * blocks > nb:
        raise DriverError(f"the pool has {nb} blocks, {inflight} x {blocks} are needed")
    perm = np.random.default_rng([seed, 7]).permutation(nb).astype(np.int64)
    return perm[: inflight * blocks].reshape(inflight, blocks).tolist()  # type: ignore[no-any-return]


def request_id(run: str, tag: int, rep: int, i: int) -> str:
    return f"ab{run}.{tag}.{rep}.{i}"


def poison(kv: npt.NDArray[np.uint8], dst: list[int]) -> None:
    kv[:, dst, :8] = 0
    kv[:, dst, -8:] = 0


def check(
    kv: npt.NDArray[np.uint8], src: list[int], dst: list[int], body: npt.NDArray[np.uint8]
) -> str:
    """'' when the destination blocks hold the source blocks' stamps (and the tile), else what differs."""
    want = stamps(np.asarray(src, dtype=np.int64))
    head = np.ascontiguousarray(kv[:, dst, :8]).view(np.int64)[..., 0]
    tail = np.ascontiguousarray(kv[:, dst, -8:]).view(np.int64)[..., 0]
    if not (
        np.array_equal(head, np.broadcast_to(want, head.shape)) and np.array_equal(tail, ~head)
    ):
        return f"blocks {dst} do not hold the stamps of source blocks {src}"
    if not np.array_equal(kv[:, dst[0], 8:-8], np.broadcast_to(body, kv[:, dst[0], 8:-8].shape)):
        return f"block {dst[0]} (from {src[0]}): the body differs from the source"
    return ""


# -- the two engine APIs ------------------------------------------------------------------
class Calls:
    """One request's engine calls on either API; the outcome always closed (or a DriverError)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.new = hasattr(client, "fetch_wait") and hasattr(client, "publish_wait")

    @property
    def api(self) -> str:
        return "new (publish_wait / fetch_wait)" if self.new else "old (publish|fetch + wait)"

    async def _settle(self, out: Any, handle: int | None) -> bool:
        """Whether the request ended ok; closes its handle when the outcome did not."""
        ok = out is not None and bool(out.ok)
        if out is not None and out.closed:
            return ok
        if handle is None:
            handle = getattr(out, "handle_id", None)
        if handle is None:
            raise DriverError(f"an outcome neither closed nor with a handle: {out!r}")
        if not await self.client.close(handle, WAIT_S):
            raise DriverError(f"handle {handle} not reusable after close")
        return ok

    async def publish(self, rid: str, blocks: list[int], sent: Callable[[], None]) -> bool:
        c = self.client
        if self.new:
            sent()
            out = await c.publish_wait(rid, blocks, WAIT_S, close=True)
            return await self._settle(out, None)
        h = await c.publish(rid, blocks)
        sent()
        return await self._settle(await c.wait(h, WAIT_S, close=True), h)

    async def fetch(self, rid: str, endpoint: str, blocks: list[int]) -> tuple[bool, int, float]:
        """(ok, bytes, when the outcome arrived)."""
        c = self.client
        if self.new:
            out = await c.fetch_wait(rid, endpoint, blocks, WAIT_S, close=True, want_aux=False)
            done = time.perf_counter()
            h = None
        else:
            h = await c.fetch(rid, endpoint, blocks, want_aux=False)
            out = await c.wait(h, WAIT_S, close=True)
            done = time.perf_counter()
        ok = await self._settle(out, h)
        return ok, int(out.nbytes) if ok else 0, done


# -- the two engines ----------------------------------------------------------------------
class Driver:
    def __init__(self, role: str, spec: dict[str, Any], out: IO[str]) -> None:
        self.role, self.spec, self.out = role, spec, out
        self.seed = int(spec.get("seed", 1))
        self.run = str(spec.get("run", "0"))
        self.failures = self.published = 0
        self.pub_task: asyncio.Task[None] | None = None

    def emit(self, event: str, **fields: Any) -> None:
        self.out.write(json.dumps({"event": event, **fields}) + "\n")
        self.out.flush()

    async def serve(self) -> int:
        import kvxferd
        from kvxferd.engine import client as client_mod

        self.client = client_mod.AsyncClient(self.spec["socket"], timeout_s=CALL_TIMEOUT_S)
        self.calls = Calls(self.client)
        info = await self.client.describe()
        self.kv_tensor = client_mod.attach_pool(info)
        self.kv: npt.NDArray[np.uint8] = self.kv_tensor.numpy()
        self.nb, self.bb = int(self.kv.shape[1]), int(self.kv.shape[2])
        self.body = tile(self.seed, self.bb)[8:-8]
        if self.role == "tx":
            fill(self.kv, self.seed)
        self.emit(
            "hello",
            pid=os.getpid(),
            kvxferd_file=kvxferd.__file__,
            client_file=client_mod.__file__,
            api=self.calls.api,
            num_blocks=self.nb,
            block_bytes=self.bb,
        )
        try:
            await self._commands(float(self.spec.get("max_s", 7200)))
        finally:
            await self.client.aclose()
        return 0

    async def _commands(self, max_s: float) -> None:
        loop = asyncio.get_running_loop()
        lines: asyncio.Queue[bytes | None] = asyncio.Queue()
        buf = b""

        def readable() -> None:
            nonlocal buf
            chunk = os.read(0, 1 << 16)
            if not chunk:
                loop.remove_reader(0)
                lines.put_nowait(None)
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                lines.put_nowait(line)

        loop.add_reader(0, readable)
        deadline = loop.time() + max_s
        try:
            while True:
                try:
                    line = await asyncio.wait_for(lines.get(), max(0.1, deadline - loop.time()))
                except TimeoutError:
                    return  # past our bound: nobody drives us any more
                if line is None:
                    return  # the bench went away
                cmd = json.loads(line)
                if cmd["cmd"] == "exit":
                    return
                try:
                    self.emit("ok", **await self._handle(cmd))
                except Exception as e:
                    self.emit("error", detail=f"{self.role} {cmd['cmd']}: {e!r}"[:2000])
        finally:
            loop.remove_reader(0)

    async def _handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        what = cmd["cmd"]
        if self.role == "tx" and what == "publish":
            return await self._start_publishing(cmd)
        if self.role == "tx" and what == "finish":
            if self.pub_task is None:
                raise DriverError("finish without publish")
            task, self.pub_task = self.pub_task, None
            await asyncio.wait_for(task, float(cmd["timeout_s"]))
            return {"published": self.published, "failures": self.failures}
        if self.role == "rx" and what == "fetch":
            return await asyncio.wait_for(self._fetch_all(cmd), float(cmd["timeout_s"]))
        raise DriverError(f"unknown command {what!r} for {self.role}")

    async def _start_publishing(self, cmd: dict[str, Any]) -> dict[str, Any]:
        tag, rep, count = int(cmd["tag"]), int(cmd["rep"]), int(cmd["count"])
        lead = max(1, min(int(cmd["lead"]), count))
        srcs = sources(self.seed, tag, rep, count, int(cmd["blocks"]), self.nb)
        rids = [request_id(self.run, tag, rep, i) for i in range(count)]
        self.failures = self.published = 0
        started = asyncio.Event()

        def sent() -> None:
            self.published += 1
            if self.published >= lead:
                started.set()

        async def task(s: int) -> None:
            for i in range(s, count, lead):
                try:
                    if not await self.calls.publish(rids[i], srcs[i], sent):
                        self.failures += 1
                except Exception as e:
                    sys.stderr.write(f"engine-path tx {rids[i]}: {e!r}\n")
                    self.failures += 1

        async def publish_all() -> None:
            await asyncio.gather(*(task(s) for s in range(lead)))

        self.pub_task = asyncio.create_task(publish_all())
        waiter = asyncio.create_task(started.wait())
        done, _ = await asyncio.wait(
            [waiter, self.pub_task], timeout=STARTED_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
        )
        waiter.cancel()
        if not done:
            raise DriverError("the first publishes did not go out in time")
        # The new API answers a publish only at its outcome: let the first frames reach the daemon.
        await asyncio.sleep(0.02)
        return {"lead": lead}

    async def _fetch_all(self, cmd: dict[str, Any]) -> dict[str, Any]:
        tag, rep, count = int(cmd["tag"]), int(cmd["rep"]), int(cmd["count"])
        blocks, inflight = int(cmd["blocks"]), max(1, int(cmd["inflight"]))
        every, endpoint = max(1, int(cmd["verify_every"])), str(cmd["endpoint"])
        srcs = sources(self.seed, tag, rep, count, blocks, self.nb)
        dsts = slots(self.seed, inflight, blocks, self.nb)
        rids = [request_id(self.run, tag, rep, i) for i in range(count)]
        kv, calls = self.kv, self.calls
        lat: list[float] = []
        bad: list[str] = []
        ok_count = failures = nbytes = checked = 0
        t0 = last = time.perf_counter()

        async def task(s: int) -> None:
            nonlocal ok_count, failures, nbytes, checked, last
            dst = dsts[s]
            for n, i in enumerate(range(s, count, inflight)):
                sample = n % every == 0
                if sample:
                    poison(kv, dst)
                t = time.perf_counter()
                try:
                    ok, nb, done = await calls.fetch(rids[i], endpoint, dst)
                except DriverError:
                    raise
                except Exception as e:
                    sys.stderr.write(f"engine-path rx {rids[i]}: {e!r}\n")
                    failures += 1
                    continue
                if not ok:
                    failures += 1
                    continue
                lat.append(done - t)
                ok_count += 1
                nbytes += nb
                last = max(last, done)
                if sample:
                    wrong = check(kv, srcs[i], dst, self.body)
                    if wrong:
                        bad.append(f"{rids[i]}: {wrong}")
                    checked += 1

        await asyncio.gather(*(task(s) for s in range(min(inflight, count))))
        return {
            "t0": t0,
            "t1": last,
            "requests": count,
            "ok": ok_count,
            "failures": failures,
            "bytes": nbytes,
            "lat_us": [round(x * 1e6, 1) for x in lat],
            "checked": checked,
            "bad": bad[:5],
        }


def main(argv: list[str]) -> int:
    """``tx|rx SPEC_JSON``: serve commands until ``exit``, end of input or the spec's ``max_s``."""
    role, spec = argv[0], json.loads(argv[1])
    tree = spec.get("tree")
    if tree and (not sys.path or sys.path[0] != tree):
        sys.path.insert(0, tree)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return asyncio.run(Driver(role, spec, out).serve())


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
