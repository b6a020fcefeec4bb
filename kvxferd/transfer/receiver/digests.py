"""The receiver's digest checks: what landed against the digest its sender's done Result carried.

A fetch that asked for a digest (``RxSession.digest``: ``integrity.digest`` or the
engine's per-fetch choice) is not done when its done Result comes. The receiver
computes the digest of the fetch's destination bytes (kvxferd/transfer/digest.py: its
layers, its blocks in order, the piece's destination ranges for a mapped pair, then the
aux payload) and only then applies the Result: done when the two are equal, else failed
``digest_mismatch`` (counted ``digest_mismatches``, one WARNING line with the request id
and the sender). The write did end either way, so the blocks are released as after any
final Result; a piece's mismatch fails its instance fetch (session.py's RxGroup).

Where a check runs (all state changes stay on the io thread)::

    done Result --nbytes <= integrity.digest_inline_bytes--> computed on the io thread
                --larger--> queued to the kvxferd-rx-digest thread (one, started at the
                            first such check; it owns only its queue), computed there, its
                            verdict handed back as a ``DigestChecked`` command
    verdict (io thread) --> apply_result(done) | apply_result(failed, digest_mismatch)

A check of a few MiB takes milliseconds on the CPU (docs/performance.md, Issue 25): on the
io thread it would hold every other fetch's control messages that long. Meanwhile the
fetch stays open: its deadline or a cancel may end it first, and the verdict then only
releases its fence (the sender's Result said the write ended).
"""

from __future__ import annotations

import hmac
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvxferd.errors import Reason
from kvxferd.transfer import commands as cmd
from kvxferd.transfer.digest import kv_digest
from kvxferd.transfer.reshard import piece_for
from kvxferd.transfer.session import RxSession

if TYPE_CHECKING:
    from kvxferd.transfer.receiver.core import Receiver

jlog = logging.getLogger("kvxferd.journal")  # per-request lines: fields in extra (logs.py)


@dataclass(frozen=True, slots=True)
class Check:
    """One done Result waiting for its digest check: what to compute and what it must equal."""

    rx: RxSession
    nbytes: int
    aux_bytes: int
    theirs: bytes
    layers: tuple[int, int]  # this pool's layers
    ranges: tuple[np.ndarray, np.ndarray] | None  # destination ranges inside a block
    aux: torch.Tensor | None


class Digests:
    """The checks of one receiver; its thread (``kvxferd-rx-digest``) once a large one came."""

    def __init__(self, rx: Receiver) -> None:
        self.rx = rx
        self._queue: queue.SimpleQueue[Check | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # io thread only: starts it
        # A fault for tests to inject: called with the fetch once its bytes landed, before
        # its check (a byte flipped there must fail the fetch). None in service.
        self.landed: Callable[[RxSession], None] | None = None

    def check(self, f: RxSession, nbytes: int, aux_bytes: int, theirs: bytes) -> None:
        """A done Result for ``f``, which asked for a digest (io thread): check, then apply."""
        rx = self.rx
        if self.landed is not None:
            self.landed(f)
        c = self._plan(f, nbytes, aux_bytes, theirs)
        if nbytes <= rx.settings.integrity.digest_inline_bytes:
            self.verdict(c, self._compute(c))
            return
        rx.stats.add("digests_checked_off_io")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvxferd-rx-digest", daemon=True)
            self._thread.start()
        self._queue.put(c)

    def _plan(self, f: RxSession, nbytes: int, aux_bytes: int, theirs: bytes) -> Check:
        """What ``f``'s writes covered in this pool: its layers, blocks and, for a mapped
        pair (both sides declared a topology), its piece's destination ranges."""
        rx = self.rx
        layers, ranges = (f.layer_begin, f.layer_end), None
        own, record = rx.topology, rx.groups.records.get(f.sender_endpoint)
        piece = piece_for(own, record) if own is not None and record is not None else None
        if piece is not None and own is not None:
            lb = max(own.layer_begin + f.layer_begin, piece.layer_begin) - own.layer_begin
            le = min(own.layer_begin + f.layer_end, piece.layer_end) - own.layer_begin
            layers, ranges = (lb, le), (piece.ranges.dst, piece.ranges.length)
        aux = None
        if f.aux_slot >= 0 and aux_bytes:
            aux = rx.pool.aux[f.aux_slot, : min(aux_bytes, rx.pool.layout.aux_slot_bytes)]
        return Check(f, nbytes, aux_bytes, theirs, layers, ranges, aux)

    def _compute(self, c: Check) -> bytes | None:
        try:
            return kv_digest(
                self.rx.pool.kv_bytes_view(), c.layers, c.rx.dst_blocks, c.ranges, c.aux
            )
        except Exception:
            self.rx.guard.caught("rx digest")
            return None

    def _run(self) -> None:
        while (c := self._queue.get()) is not None:
            self.rx._command(cmd.DigestChecked(c, self._compute(c)))

    def verdict(self, c: Check, ours: bytes | None) -> None:
        """Apply ``c``'s Result (io thread): done when the digests are equal, else failed."""
        rx, f = self.rx, c.rx
        rx.stats.add("digests_checked")
        if ours is not None and c.theirs and hmac.compare_digest(ours, c.theirs):
            rx.messages.apply_result(f, "done", None, "", c.nbytes, c.aux_bytes, checked=True)
            return
        if ours is None:
            detail = "the digest of what landed could not be computed"
        elif not c.theirs:
            detail = "the sender's done Result carried no digest"
        else:
            detail = f"digest of what landed {ours.hex()} != the sender's {c.theirs.hex()}"
        rx.stats.add("digest_mismatches")
        jlog.warning(
            "digest mismatch",
            extra={
                "request_id": f.request_id,
                "role": "receiver",
                "peer": f.sender_endpoint,
                "fetch_id": f.fetch_id,
                "bytes": c.nbytes,
                "blocks": int(f.dst_blocks.size),
            },
        )
        rx.messages.apply_result(f, "failed", Reason.DIGEST_MISMATCH, detail, 0, 0, checked=True)

    def stop(self) -> None:
        """The receiver stops: the thread ends after the check it is on (if any)."""
        if self._thread is not None:
            self._queue.put(None)
