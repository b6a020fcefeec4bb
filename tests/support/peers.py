"""Peers for integration tests: a sender and a receiver child process that report in JSON lines.

A test starts them with :class:`PeerProcess` (``python -m tests.support.peers sender|receiver ...``
from the repository root) and talks to them only through their stdout lines and
signals: no pickle, no multiprocessing queues. Every line a peer writes to stdout
is one JSON object with an ``"event"`` key::

    sender    ready {endpoint, pid, sender_id, num_threads}   once the Sender listens
              published {id}                                   one per request
              publish_refused {id, reason}
              ended {id, state, reason, in_doubt, drained, writes_in_flight, slices, workers}
              shutdown {drained, writes_in_doubt, threads_joined, elapsed_s, stats, workers, ...}
    receiver  ready {pid, receiver_id}
              fetched {id, state, reason, verified, mismatch, nbytes, ms, reusable}
              summary {fetched, done, verified, mismatches, not_done, in_doubt, shutdown_safe, ...}

The sender publishes ``{prefix}-0 .. {prefix}-{count-1}`` in order while source
blocks are free, closes each session once it ended (its blocks are reused only
when ``close`` said they are drained) and runs until SIGTERM; it then shuts
down and exits 0 when the shutdown report says drained, 3 otherwise. The
receiver fetches the ids it was given with a window of fetches in flight,
verifies every byte, and exits 0 (all done and verified), 1 (some fetch did not
complete) or 2 (a fetch reported done with wrong bytes).

The content of a request is a pure function of its id and shape
(:func:`request_content`), so the receiver checks bytes it was never told.
:class:`Publisher` is the sender's publish-and-close loop; a test can run it on
a Sender in its own process too.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvxferd.config import load_receiver_settings, load_sender_settings
from kvxferd.errors import Reason, RejectedError
from kvxferd.transfer.pool import IdAllocator, KvPool
from kvxferd.transfer.receiver import Receiver, RxHandle
from kvxferd.transfer.sender import Sender, TxHandle
from kvxferd.transfer.session import RxOutcome, RxState
from tests.support.child import ChildProcess

Emit = Callable[..., None]

# -- deterministic content ----------------------------------------------------------------


def request_seed(request_id: str) -> int:
    """A 63-bit seed derived from the request id alone."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def request_content(
    request_id: str, num_layers: int, blocks: int, block_bytes: int
) -> torch.Tensor:
    """The bytes of ``request_id`` as ``[layer, block, byte]`` (uint8).

    A random row plus a random offset per block, and each block's first 16
    bytes stamped with (seed, position): a block of another request, a stale
    block or a block written to the wrong place never matches.
    """
    if block_bytes < 16:
        raise ValueError("blocks must hold at least 16 bytes (the stamp)")
    seed = request_seed(request_id)
    g = torch.Generator().manual_seed(seed)
    row = torch.randint(0, 256, (block_bytes,), dtype=torch.uint8, generator=g)
    offsets = torch.randint(0, 256, (num_layers, blocks, 1), dtype=torch.uint8, generator=g)
    out = row + offsets  # uint8 arithmetic wraps modulo 256
    stamp = torch.empty(num_layers, blocks, 2, dtype=torch.int64)
    stamp[..., 0] = seed
    stamp[..., 1] = torch.arange(num_layers * blocks, dtype=torch.int64).view(num_layers, blocks)
    out[..., :16] = stamp.view(torch.uint8)
    return out


def request_aux(request_id: str, nbytes: int) -> bytes:
    """The auxiliary payload of ``request_id`` (``nbytes`` long)."""
    digest = hashlib.blake2b(f"aux:{request_id}".encode(), digest_size=64).digest()
    return (digest * (nbytes // 64 + 1))[:nbytes]


def fill_request(pool: KvPool, request_id: str, blocks: np.ndarray) -> None:
    """Write ``request_id``'s content into ``blocks`` of every layer of ``pool``."""
    layout = pool.layout
    content = request_content(request_id, layout.num_layers, blocks.size, layout.block_bytes)
    pool.kv_bytes_view()[:, torch.from_numpy(blocks)] = content


def check_request(
    pool: KvPool,
    request_id: str,
    blocks: np.ndarray,
    layers: tuple[int, int] | None = None,
    aux: bytes | None = None,
    aux_bytes: int = 0,
) -> str:
    """Why ``blocks`` (of layers ``[begin, end)``) do not hold ``request_id``; "" when byte-exact."""
    layout = pool.layout
    lb, le = layers or (0, layout.num_layers)
    want = request_content(request_id, layout.num_layers, blocks.size, layout.block_bytes)[lb:le]
    got = pool.kv_bytes_view()[lb:le][:, torch.from_numpy(blocks)]
    if not torch.equal(got, want):
        bad = (got != want).any(dim=-1).nonzero().tolist()
        first = bad[0]
        return f"{len(bad)} block(s) differ, first at layer {first[0] + lb} block #{first[1]}"
    if aux_bytes and aux != request_aux(request_id, aux_bytes):
        return f"aux differs: {aux!r:.80}"
    return ""


# -- publishing -----------------------------------------------------------------------------


@dataclass(slots=True)
class _Published:
    handle: TxHandle
    blocks: np.ndarray


def _worker_index(sender: Sender, request_id: str, peer_id: str) -> int | None:
    """The worker whose queue serves (request, receiver); None if the sender does not say."""
    worker_for = getattr(sender, "_worker_for", None)
    if worker_for is None:
        return None
    return int(worker_for(request_id, peer_id).index)


class Publisher:
    """Publish ``{prefix}-i`` in order while source blocks are free; close each session once it ends.

    Blocks go back to the allocator only when ``TxHandle.close`` returned True;
    otherwise they stay quarantined. Run ``step`` from one thread (or ``start``
    a thread that does); ``records`` holds one dict per closed session.
    """

    def __init__(
        self,
        sender: Sender,
        *,
        prefix: str,
        count: int,
        blocks: int,
        aux_bytes: int = 0,
        expected_fetches: int = 1,
        alloc: IdAllocator | None = None,
        close_timeout: float | None = None,
        emit: Emit | None = None,
    ) -> None:
        layout = sender.pool.layout
        if blocks > layout.num_blocks:
            raise ValueError(f"{blocks} blocks per request > pool of {layout.num_blocks}")
        self.sender = sender
        self.prefix, self.count, self.blocks = prefix, count, blocks
        self.aux_bytes, self.expected_fetches = aux_bytes, expected_fetches
        self.alloc = alloc or IdAllocator(layout.num_blocks, shuffle_seed=0)
        self.close_timeout = close_timeout
        self.emit: Emit = emit or (lambda event, **fields: None)
        self.paused = threading.Event()
        self.records: list[dict[str, Any]] = []
        self.worker_slices: Counter[int] = Counter()
        self.published = 0
        self._open: list[_Published] = []
        self._lock = threading.Lock()  # guards _open, records, worker_slices
        self._publishing = threading.Lock()  # held while writing into the pool and publishing
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def finished(self) -> bool:
        """Every request was published and every session closed."""
        with self._lock:
            return self.published >= self.count and not self._open

    def open_handles(self) -> list[TxHandle]:
        with self._lock:
            return [p.handle for p in self._open]

    def step(self) -> None:
        """Close every session that ended, then publish while blocks are free."""
        with self._lock:
            ended = [p for p in self._open if p.handle.wait(0) is not None]
        for p in ended:
            self._close(p, self.close_timeout)
        if not self.paused.is_set():
            self._publish_some()

    def pause(self, timeout: float = 10.0) -> None:
        """Publish nothing more; returns once no write into the pool is under way."""
        self.paused.set()
        if not self._publishing.acquire(timeout=timeout):
            raise RuntimeError(f"publisher still publishing after {timeout}s")
        self._publishing.release()

    def _publish_some(self) -> None:
        with self._publishing:
            self._publish_locked()

    def _publish_locked(self) -> None:
        while (
            not self.paused.is_set()
            and self.published < self.count
            and self.alloc.free >= self.blocks
        ):
            rid = f"{self.prefix}-{self.published}"
            blocks = self.alloc.take(self.blocks)
            fill_request(self.sender.pool, rid, blocks)
            aux = request_aux(rid, self.aux_bytes) if self.aux_bytes else None
            try:
                handle = self.sender.publish(
                    rid, blocks, aux=aux, expected_fetches=self.expected_fetches
                )
            except RejectedError as e:
                self.alloc.give_back(blocks.tolist())
                self.emit("publish_refused", id=rid, reason=str(e.reason), detail=e.detail)
                if e.reason is Reason.DRAINING:
                    self.paused.set()
                return
            with self._lock:
                self._open.append(_Published(handle, blocks))
            self.published += 1
            self.emit("published", id=rid)

    def _close(self, p: _Published, timeout: float | None) -> dict[str, Any]:
        h = p.handle
        drained = h.close(timeout)
        writes_in_flight = h.session.writes_in_flight  # read right after close answered
        outcome = h.wait(0)
        slices = h.session.slices()
        workers = [_worker_index(self.sender, h.request_id, sl.peer_id) for sl in slices]
        record: dict[str, Any] = {
            "id": h.request_id,
            "state": str(outcome.state) if outcome else None,
            "reason": str(outcome.reason) if outcome and outcome.reason else None,
            "in_doubt": bool(outcome and outcome.in_doubt),
            "drained": drained,
            "writes_in_flight": writes_in_flight,
            "slices": len(slices),
            "slice_states": [str(sl.state) for sl in slices],
            "workers": workers,
        }
        if drained:
            self.alloc.give_back(p.blocks.tolist())
        with self._lock:
            self._open.remove(p)
            self.records.append(record)
            self.worker_slices.update(w for w in workers if w is not None)
        self.emit("ended", **record)
        return record

    def close_all(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Close (cancelling if needed) every open session; call once the loop stopped."""
        with self._lock:
            still = list(self._open)
        return [self._close(p, timeout) for p in still]

    # -- a thread of its own (for a Sender in the test process) ---------------------------
    def start(self, period: float = 0.002) -> Publisher:
        def loop() -> None:
            while not self._stop.is_set():
                self.step()
                self._stop.wait(period)

        self._thread = threading.Thread(target=loop, name="test-publisher", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"publisher thread did not stop within {timeout}s")


# -- fetching -------------------------------------------------------------------------------


def parse_range(spec: str) -> range:
    """``"a:b"`` or ``"a:b:step"`` -> range(a, b, step)."""
    parts = [int(x) for x in spec.split(":")]
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"{spec!r} is not a:b or a:b:step")
    return range(*parts)


def parse_pair(spec: str) -> tuple[int, int]:
    """``"a:b"`` -> (a, b)."""
    r = parse_range(spec)
    if r.step != 1:
        raise argparse.ArgumentTypeError(f"{spec!r} is not a:b")
    return (r.start, r.stop)


@dataclass(slots=True)
class _Fetch:
    request_id: str
    handle: RxHandle
    blocks: np.ndarray
    t0: float


def _fetch_record(f: _Fetch, outcome: RxOutcome, mismatch: str, reusable: bool) -> dict[str, Any]:
    return {
        "id": f.request_id,
        "state": str(outcome.state),
        "reason": str(outcome.reason) if outcome.reason else None,
        "detail": outcome.detail,
        "verified": outcome.state is RxState.DONE and not mismatch,
        "mismatch": mismatch,
        "nbytes": outcome.nbytes,
        "ms": round((time.monotonic() - f.t0) * 1000, 3),
        "reusable": reusable,
    }


def fetch_all(
    receiver: Receiver,
    endpoint: str,
    request_ids: list[str],
    *,
    blocks: int,
    layers: tuple[int, int] | None = None,
    window: int = 4,
    aux_bytes: int = 0,
    deadline: float,
    stop: threading.Event | None = None,
    emit: Emit | None = None,
) -> dict[str, Any]:
    """Fetch ``request_ids`` with up to ``window`` in flight; verify, close, report each."""
    emit = emit or (lambda event, **fields: None)
    layout = receiver.pool.layout
    if blocks > layout.num_blocks:
        raise ValueError(f"{blocks} blocks per request > pool of {layout.num_blocks}")
    window = max(1, min(window, layout.num_blocks // blocks))
    alloc = IdAllocator(layout.num_blocks, shuffle_seed=os.getpid())
    todo = list(reversed(request_ids))
    flying: list[_Fetch] = []
    counts: Counter[str] = Counter()
    not_done: Counter[str] = Counter()
    while (todo or flying) and time.monotonic() < deadline:
        while (
            todo and len(flying) < window and alloc.free >= blocks and not (stop and stop.is_set())
        ):
            rid = todo[-1]
            dst = alloc.take(blocks)
            try:
                h = receiver.fetch(rid, endpoint, dst, layers=layers, want_aux=aux_bytes > 0)
            except RejectedError as e:  # a full table: retry once something finished
                alloc.give_back(dst.tolist())
                counts[f"fetch_refused_{e.reason}"] += 1
                break
            todo.pop()
            flying.append(_Fetch(rid, h, dst, time.monotonic()))
        if stop and stop.is_set() and not flying:
            break
        if not flying:
            time.sleep(0.005)  # nothing in flight: the pool or a table is full
            continue
        flying[0].handle.wait(0.005)
        for f in [f for f in flying if f.handle.wait(0) is not None]:
            outcome = f.handle.wait(0)
            assert outcome is not None
            mismatch = ""
            if outcome.state is RxState.DONE:
                mismatch = check_request(
                    receiver.pool, f.request_id, f.blocks, layers, outcome.aux, aux_bytes
                )
            reusable = f.handle.close()
            if reusable:
                alloc.give_back(f.blocks.tolist())
            flying.remove(f)
            counts["fetched"] += 1
            if outcome.state is RxState.DONE:
                counts["done"] += 1
                counts["mismatches" if mismatch else "verified"] += 1
            else:
                not_done[str(outcome.reason or outcome.state)] += 1
            if not reusable:
                counts["in_doubt"] += 1
            emit("fetched", **_fetch_record(f, outcome, mismatch, reusable))
    not_done["never_finished"] += len(flying)
    not_done["never_fetched"] += len(todo)
    return {
        "fetched": counts["fetched"],
        "done": counts["done"],
        "verified": counts["verified"],
        "mismatches": counts["mismatches"],
        "in_doubt": counts["in_doubt"],
        "not_done": {k: v for k, v in not_done.items() if v},
        "refusals": {k: v for k, v in counts.items() if k.startswith("fetch_refused_")},
    }


# -- child entry points ---------------------------------------------------------------------


_emit_lock = threading.Lock()


def _emit(event: str, **fields: Any) -> None:
    line = json.dumps({"event": event, **fields}, default=str)
    with _emit_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _die_with_parent() -> None:
    """Ask the kernel for SIGTERM if the spawning test process dies (no orphans)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def _install_stop() -> threading.Event:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    return stop


def sender_main(args: argparse.Namespace) -> int:
    stop = _install_stop()
    overrides = {"listen": "tcp://127.0.0.1:0", **json.loads(args.settings)}
    sender = Sender(load_sender_settings(**overrides)).start()
    _emit(
        "ready",
        endpoint=sender.endpoint,
        pid=os.getpid(),
        sender_id=sender.sender_id,
        num_threads=sender.settings.num_threads,
    )
    pub = Publisher(
        sender,
        prefix=args.prefix,
        count=args.count,
        blocks=args.blocks,
        aux_bytes=args.aux_bytes,
        expected_fetches=args.expected_fetches,
        close_timeout=args.close_timeout,
        emit=_emit,
    )
    deadline = time.monotonic() + args.max_seconds
    while not stop.is_set() and time.monotonic() < deadline:
        pub.step()
        stop.wait(0.002)
    pub.paused.set()
    report = sender.shutdown()
    _emit(
        "shutdown",
        **asdict(report),
        stats=sender.stats.snapshot(),
        workers={str(k): v for k, v in sorted(pub.worker_slices.items())},
        published=pub.published,
        ended=len(pub.records),
        by_signal=stop.is_set(),
    )
    return 0 if report.drained else 3


def receiver_main(args: argparse.Namespace) -> int:
    stop = _install_stop()
    receiver = Receiver(load_receiver_settings(**json.loads(args.settings))).start()
    _emit("ready", pid=os.getpid(), receiver_id=receiver.receiver_id)
    t0 = time.monotonic()
    ids = [f"{args.prefix}-{i}" for i in args.ids]
    summary = fetch_all(
        receiver,
        args.endpoint,
        ids,
        blocks=args.blocks,
        layers=args.layers,
        window=args.window,
        aux_bytes=args.aux_bytes,
        deadline=t0 + args.max_seconds,
        stop=stop,
        emit=_emit,
    )
    safe = receiver.shutdown()
    _emit(
        "summary",
        **summary,
        requested=len(ids),
        shutdown_safe=safe,
        elapsed_s=round(time.monotonic() - t0, 3),
        stats=receiver.stats.snapshot(),
    )
    if summary["mismatches"]:
        return 2
    return 0 if summary["verified"] == len(ids) else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tests.support.peers", description=__doc__.splitlines()[0]
    )
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("sender", help="publish requests until SIGTERM")
    s.add_argument("--settings", default="{}", help="JSON overrides for load_sender_settings")
    s.add_argument("--prefix", default="req")
    s.add_argument("--count", type=int, default=1, help="requests to publish")
    s.add_argument("--blocks", type=int, default=1, help="blocks per request")
    s.add_argument("--aux-bytes", type=int, default=0)
    s.add_argument("--expected-fetches", type=int, default=1)
    s.add_argument(
        "--close-timeout", type=float, default=None, help="seconds; default drain_timeout"
    )
    s.add_argument("--max-seconds", type=float, default=300.0, help="backstop if never signalled")
    r = sub.add_parser("receiver", help="fetch requests, verify bytes, exit")
    r.add_argument("--settings", default="{}", help="JSON overrides for load_receiver_settings")
    r.add_argument("--endpoint", required=True)
    r.add_argument("--prefix", default="req")
    r.add_argument("--ids", type=parse_range, default=range(0, 1), help="a:b[:step]")
    r.add_argument("--blocks", type=int, default=1, help="blocks per request")
    r.add_argument("--layers", type=parse_pair, default=None, help="a:b (default all layers)")
    r.add_argument("--window", type=int, default=4, help="fetches in flight")
    r.add_argument("--aux-bytes", type=int, default=0, help="expected aux length; 0 = no aux")
    r.add_argument("--max-seconds", type=float, default=300.0)
    return p


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    args = _parser().parse_args(argv)
    return sender_main(args) if args.role == "sender" else receiver_main(args)


# -- the test side --------------------------------------------------------------------------


class PeerError(AssertionError):
    """A peer did not report what the test waited for, in time."""


class PeerProcess(ChildProcess):
    """A peer child (``python -m tests.support.peers ROLE ...``): its JSON events, signals, bounded waits."""

    def __init__(self, role: str, args: list[str], log_dir: Path, name: str) -> None:
        super().__init__(
            "tests.support.peers", [role, *args], log_dir / f"{name}.stderr", name, env={}
        )
        self.role = role
        self.noise: list[str] = []  # stdout lines that were not JSON
        self._events: list[dict[str, Any]] = []
        self._start_reader()

    def _take(self, line: str) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if isinstance(event, dict) and "event" in event:
            event["t"] = time.monotonic()
            self._events.append(event)
        else:
            self.noise.append(line.rstrip("\n"))

    # -- events ------------------------------------------------------------------------------
    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        with self._cond:
            return [e for e in self._events if kind is None or e["event"] == kind]

    def wait_events(
        self,
        kind: str,
        count: int,
        timeout: float,
        where: Callable[[dict[str, Any]], bool] = lambda e: True,
    ) -> list[dict[str, Any]]:
        """The first ``count`` events of ``kind`` matching ``where``; PeerError after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [e for e in self._events if e["event"] == kind and where(e)]
                if len(found) >= count:
                    return found[:count]
                left = deadline - time.monotonic()
                if left <= 0 or self._eof:
                    break
                self._cond.wait(left)
        raise PeerError(
            f"{self.name}: {len(found)}/{count} {kind!r} events after {timeout}s\n{self.describe()}"
        )

    def wait_event(
        self, kind: str, timeout: float, where: Callable[[dict[str, Any]], bool] = lambda e: True
    ) -> dict[str, Any]:
        return self.wait_events(kind, 1, timeout, where)[0]

    # -- process -----------------------------------------------------------------------------
    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def wait_exit(self, timeout: float) -> int:
        """The exit code; PeerError if still running after ``timeout``."""
        return self._wait_exit_code(timeout, PeerError)

    def describe(self, lines: int = 25) -> str:
        last = [json.dumps(e)[:300] for e in self.events()[-5:]]
        return (
            f"[{self.name} pid {self.pid} exit {self.proc.poll()}]\n"
            f"last events: {last}\nstdout noise: {self.noise[-5:]}\n"
            "stderr tail:\n  " + "\n  ".join(self.stderr_tail(lines))
        )


if __name__ == "__main__":
    sys.exit(main())
