"""The synthetic workload behind ``kvxferd demo``: a sender process, receiver processes, verified bytes.

The parent process starts one sender child and one or more receiver children
(``python -m kvxferd _demo-sender|_demo-receiver SPEC``); they talk to each
other only through kvxferd (ZMQ + NIXL on loopback) and to the parent only
through JSON lines on stdout. Both sides derive the same plan from the seed:
request ``i`` has a random block count and content that is a random tile per
layer, stamped with (request, layer, position) in each block's first 8 bytes,
so a block written to the wrong place or a stale block cannot pass the check.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.pool import IdAllocator

DEMO_POOL: dict[str, Any] = dict(
    num_layers=8, num_blocks=2048, block_elems=8192, dtype="float16", aux_slots=256
)


@dataclass(frozen=True)
class Spec:
    """What both sides of the demo agree on."""

    requests: int = 300
    seed: int = 1
    min_blocks: int = 16  # 512 tokens at 32 tokens per block
    max_blocks: int = 192  # 6144 tokens
    inflight: int = 8  # fetches in flight per receiver
    receivers: int = 1
    timeout_s: float = 600.0

    def block_counts(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        return rng.integers(self.min_blocks, self.max_blocks + 1, size=self.requests)


def request_id(i: int) -> str:
    return f"demo-{i}"


def expected_bytes(
    i: int, nblocks: int, num_layers: int, block_bytes: int, seed: int
) -> torch.Tensor:
    """The content of request ``i`` as ``[layer, block, byte]``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    tile = torch.randint(0, 256, (num_layers, 1, block_bytes), dtype=torch.uint8, generator=g)
    out = tile.expand(num_layers, nblocks, block_bytes).clone()
    layer = torch.arange(num_layers, dtype=torch.int64)[:, None]
    pos = torch.arange(nblocks, dtype=torch.int64)[None, :]
    stamp = (i << 32) | (layer << 20) | pos
    out[:, :, :8] = stamp.contiguous().view(torch.uint8).view(num_layers, nblocks, 8)
    return out


def aux_bytes(i: int) -> bytes:
    return f"first-token:{i}".encode()


def _emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


# -- children ----------------------------------------------------------------------------
def run_sender(spec: Spec) -> int:
    """Publish every request (bounded by pool space), close each once it ended."""
    from kvxferd.sender import Sender

    settings = load_sender_settings(listen="tcp://127.0.0.1:0", pool=DEMO_POOL)
    sender = Sender(settings).start()
    _emit("ready", endpoint=sender.endpoint, num_threads=settings.num_threads)
    layout = sender.pool.layout
    alloc = IdAllocator(
        layout.num_blocks, shuffle_seed=spec.seed
    )  # scattered, like a real allocator
    kv = sender.pool.kv_bytes_view()
    resident: deque[tuple[Any, np.ndarray]] = deque()
    failures = 0
    deadline = time.monotonic() + spec.timeout_s

    def retire_oldest() -> None:
        nonlocal failures
        handle, blocks = resident.popleft()
        outcome = handle.wait(max(0.0, deadline - time.monotonic()))
        if outcome is None or not outcome.ok:
            failures += 1
        if handle.close(timeout=max(0.0, deadline - time.monotonic())):
            alloc.give_back(blocks.tolist())

    for i, n in enumerate(spec.block_counts().tolist()):
        while alloc.free < n or len(resident) >= layout.aux_slots // 2:
            retire_oldest()
        blocks = alloc.take(n)
        kv[:, torch.from_numpy(blocks)] = expected_bytes(
            i, n, layout.num_layers, layout.block_bytes, spec.seed
        )
        resident.append((sender.publish(request_id(i), blocks, aux=aux_bytes(i)), blocks))
    while resident:
        retire_oldest()
    report = sender.shutdown()
    _emit("done", failures=failures, stats=sender.stats.snapshot(), shutdown=asdict(report))
    return 0 if failures == 0 and report.drained else 1


def run_receiver(spec: Spec, endpoint: str, index: int) -> int:
    """Fetch this receiver's share of the requests, verify every byte, report figures."""
    from kvxferd.receiver import Receiver

    settings = load_receiver_settings(name=f"demo-rx-{index}", pool=DEMO_POOL)
    receiver = Receiver(settings).start()
    layout = receiver.pool.layout
    alloc = IdAllocator(layout.num_blocks, shuffle_seed=spec.seed + 1 + index)
    kv = receiver.pool.kv_bytes_view()
    counts = spec.block_counts()
    mine = [i for i in range(spec.requests) if i % spec.receivers == index]
    window: deque[tuple[int, Any, np.ndarray, float]] = deque()
    latencies: list[float] = []
    moved = failures = mismatches = 0
    first = time.monotonic()
    last_progress = 0.0
    deadline = first + spec.timeout_s

    def finish_oldest() -> None:
        nonlocal moved, failures, mismatches
        i, handle, dst, started = window.popleft()
        outcome = handle.wait(max(0.0, deadline - time.monotonic()))
        if outcome is None or not outcome.ok:
            failures += 1
            sys.stderr.write(f"request {i}: {outcome}\n")
        else:
            latencies.append(handle.session.completion.set_at - started)
            want = expected_bytes(i, dst.size, layout.num_layers, layout.block_bytes, spec.seed)
            if not torch.equal(kv[:, torch.from_numpy(dst)], want) or outcome.aux != aux_bytes(i):
                mismatches += 1
            moved += outcome.nbytes
        if handle.close(timeout=max(0.0, deadline - time.monotonic())):
            alloc.give_back(dst.tolist())

    for i in mine:
        while len(window) >= spec.inflight or alloc.free < counts[i]:
            finish_oldest()
        dst = alloc.take(int(counts[i]))
        window.append((i, receiver.fetch(request_id(i), endpoint, dst), dst, time.monotonic()))
        now = time.monotonic()
        if now - last_progress > 0.25:
            last_progress = now
            _emit("progress", done=len(latencies) + failures, total=len(mine), bytes=moved)
    while window:
        finish_oldest()
    elapsed = time.monotonic() - first
    safe = receiver.shutdown()
    lat_ms = np.array(latencies) * 1000 if latencies else np.zeros(1)
    _emit(
        "summary",
        requests=len(mine),
        bytes=moved,
        failures=failures,
        mismatches=mismatches,
        elapsed_s=elapsed,
        p50_ms=float(np.percentile(lat_ms, 50)),
        p99_ms=float(np.percentile(lat_ms, 99)),
        blocks_safe=safe,
    )
    return 0 if failures == 0 and mismatches == 0 else 1


# -- parent ------------------------------------------------------------------------------
class _Child:
    def __init__(self, role: str, spec: Spec, *extra: str) -> None:
        cmd = [sys.executable, "-m", "kvxferd", role, json.dumps(asdict(spec)), *extra]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
        )
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), True)
        self.role = role
        self.last: dict[str, Any] = {}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


def run_demo(spec: Spec, json_path: str | None = None, out=sys.stdout) -> int:  # type: ignore[no-untyped-def]
    """Start the processes, show progress, print (and optionally write) the summary."""
    deadline = time.monotonic() + spec.timeout_s + 30
    sender = _Child("_demo-sender", spec)
    children = [sender]
    try:
        line = ""
        while sender.proc.stdout and not line.startswith("{"):
            line = sender.proc.stdout.readline()
            if not line:
                break
        if not line:
            out.write("demo: sender failed to start\n")
            return 1
        ready = json.loads(line)
        receivers = [
            _Child("_demo-receiver", spec, ready["endpoint"], str(k)) for k in range(spec.receivers)
        ]
        children += receivers
        sel = selectors.DefaultSelector()
        for c in children:
            sel.register(c.proc.stdout, selectors.EVENT_READ, c)  # type: ignore[arg-type]
        open_streams = len(children)
        progress: dict[int, dict[str, Any]] = {}
        tty = sys.stderr.isatty()
        while open_streams and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.5):
                child: _Child = key.data
                line = key.fileobj.readline()  # type: ignore[union-attr]
                if not line:
                    sel.unregister(key.fileobj)
                    open_streams -= 1
                    continue
                if not line.startswith("{"):
                    sys.stderr.write(line)  # a library's stray output, not ours
                    continue
                msg = json.loads(line)
                child.last = msg
                if msg["event"] == "progress":
                    progress[id(child)] = msg
                    done = sum(p["done"] for p in progress.values())
                    moved = sum(p["bytes"] for p in progress.values())
                    text = f"demo: {done}/{spec.requests} requests, {moved / 1e9:.2f} GB"
                    sys.stderr.write(("\r" + text) if tty else text + "\n")
                    sys.stderr.flush()
        if tty:
            sys.stderr.write("\n")
        codes = [c.proc.wait(timeout=max(1.0, deadline - time.monotonic())) for c in children]
    except subprocess.TimeoutExpired:
        out.write("demo: timed out\n")
        return 1
    finally:
        for c in children:
            c.kill()
    sums = [c.last for c in children[1:]]
    if any(s.get("event") != "summary" for s in sums) or sender.last.get("event") != "done":
        out.write(f"demo: a process failed (exit codes {codes})\n")
        return 1
    elapsed = max(s["elapsed_s"] for s in sums)
    total_bytes = sum(s["bytes"] for s in sums)
    stats = sender.last["stats"]
    summary = {
        "requests": sum(s["requests"] for s in sums),
        "bytes": total_bytes,
        "elapsed_s": round(elapsed, 3),
        "gbps": round(total_bytes / elapsed / 1e9, 3) if elapsed > 0 else 0.0,
        "p50_ms": round(max(s["p50_ms"] for s in sums), 3),
        "p99_ms": round(max(s["p99_ms"] for s in sums), 3),
        "failures": sum(s["failures"] for s in sums) + sender.last["failures"],
        "mismatches": sum(s["mismatches"] for s in sums),
        "receivers": spec.receivers,
        "sender_threads": ready["num_threads"],
        "workers_used": sum(1 for k, v in stats.items() if k.startswith("worker_") and v > 0),
        "exit_codes": codes,
    }
    out.write(
        f"demo: {summary['requests']} requests, {total_bytes / 1e9:.2f} GB in {elapsed:.2f} s "
        f"({summary['gbps']:.2f} GB/s), p50 {summary['p50_ms']:.2f} ms, p99 {summary['p99_ms']:.2f} ms, "
        f"{summary['failures']} failures, {summary['mismatches']} mismatches, "
        f"{summary['workers_used']}/{summary['sender_threads']} workers used\n"
    )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=2)
    ok = summary["failures"] == 0 and summary["mismatches"] == 0 and not any(codes)
    return 0 if ok else 1
