"""Test doubles for deterministic race tests of session and sender logic.

:class:`ControlledDataPlane` stands in for NIXL: every posted WRITE waits until
the test says how it ends, and each step signals an event, so a test drives
the exact interleaving it wants with events, never with sleeps. Integration
tests never use it: they run real NIXL between real processes.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from kvxferd.transfer.dataplane import XferState
from kvxferd.transfer.layout import Descs, IdArray, Layout
from kvxferd.transfer.reshard import Piece
from kvxferd.transfer.topology import Topology


@dataclass
class ControlledXfer:
    """A WRITE whose outcome the test decides with ``finish``.

    ``kind`` "descs": ``src``/``dst`` are the (n, 3) descriptors given to ``post_write``;
    "blocks": the block ids given to ``post_blocks`` (``layers`` holds the range); "probe":
    a ``probe_write`` (``dst``: the peer's scratch region written).
    """

    peer: str
    src: Descs
    dst: Descs
    kind: str = "descs"
    layers: tuple[int, int] = (0, 0)
    state: XferState = "PROC"
    posted: threading.Event = field(default_factory=threading.Event)
    polled: threading.Event = field(default_factory=threading.Event)
    released: bool = False
    notif: bytes = b""  # the notification the WRITE carries: delivered when it finishes ok
    deliver: Callable[[bytes], None] | None = None

    def poll(self) -> XferState:
        self.polled.set()
        return self.state

    def release(self) -> bool:
        if self.state == "PROC":
            return False
        self.released = True
        return True

    def finish(self, ok: bool = True) -> None:
        """End the WRITE; a successful one delivers its notification first (as NIXL does)."""
        if ok and self.notif and self.deliver is not None:
            self.deliver(self.notif)
        self.state = "DONE" if ok else "ERR"


# The doubles of this process by name: a notification reaches the one it names.
_FABRIC: weakref.WeakValueDictionary[str, ControlledDataPlane] = weakref.WeakValueDictionary()


class ControlledDataPlane:
    """A data plane whose writes stay in progress until the test finishes them.

    With ``prepped`` it accepts ``prepare_peer`` and ``prepare_piece`` (``pieces``: the
    peers prepared by piece) and KV writes arrive through ``post_blocks``; by default
    it declines, so KV writes come as descriptors.
    """

    def __init__(self, name: str = "controlled", *, prepped: bool = False) -> None:
        self.name = name
        self.prepped = prepped
        self.prepared: set[str] = set()
        self.pieces: dict[str, Piece] = {}
        self.xfers: list[ControlledXfer] = []
        self.probes: list[ControlledXfer] = []  # link-probe WRITEs (probe_write)
        self.scratch_bytes = 0  # > 0 (set before a Sender is made on it): links are probed
        self.posted = threading.Condition()
        self.fail_next_post: Exception | None = None
        self.closed = False
        self.delivered: list[tuple[str, bytes]] = []  # notifications for a receiver under test
        self._notes_lock = threading.Lock()
        self.sent: list[tuple[str, bytes]] = []  # notifications its WRITEs carry (peer, payload)
        # The agent name its notifications come from ("": ``name``; a Sender's NIXL agent is
        # named after its sender id: set ``notify_as = sender.sender_id``). A WRITE's
        # notification reaches the double named after its peer, in this process, once the
        # test finishes the WRITE ok.
        self.notify_as = ""
        _FABRIC[name] = self
        self.peers: set[str] = set()

    def metadata(self) -> bytes:
        return self.name.encode()

    def add_peer(self, metadata: bytes) -> str:
        peer = metadata.decode()
        self.peers.add(peer)
        return peer

    def add_peer_async(self, metadata: bytes, timeout_s: float) -> Future[str]:
        """``add_peer`` at once (no connect to wait for): the future is already done."""
        done: Future[str] = Future()
        done.set_result(self.add_peer(metadata))
        return done

    def prepare_peer(
        self, peer: str, layout: Layout, kv_base: int, mem_type: str, device_id: int
    ) -> bool:
        if self.prepped and peer in self.peers:
            self.prepared.add(peer)
            return True
        return False

    def prepare_piece(
        self,
        peer: str,
        piece: Piece,
        decode: Topology,
        kv_base: int,
        num_blocks: int,
        mem_type: str,
        device_id: int,
    ) -> bool:
        if self.prepped and peer in self.peers:
            self.prepared.add(peer)
            self.pieces[peer] = piece
            return True
        return False

    def remove_peer(self, peer: str) -> None:
        self.peers.discard(peer)
        self.prepared.discard(peer)
        self.pieces.pop(peer, None)

    def post_write(
        self, peer: str, src: Descs, dst: Descs, src_mem: str, dst_mem: str, notif: bytes = b""
    ) -> tuple[ControlledXfer, XferState]:
        return self._post(ControlledXfer(peer, src, dst, notif=notif))

    def probe_write(
        self, peer: str, dst_base: int, nbytes: int, device_id: int
    ) -> tuple[ControlledXfer, XferState]:
        """A link-probe WRITE, kept in ``probes`` (not ``xfers``) until the test finishes it."""
        if self.fail_next_post is not None:
            err, self.fail_next_post = self.fail_next_post, None
            raise err
        src = np.array([[0, nbytes, 0]], dtype=np.int64)  # the local scratch region's
        dst = np.array([[dst_base, nbytes, device_id]], dtype=np.int64)
        xfer = ControlledXfer(peer, src, dst, "probe")
        with self.posted:
            self.probes.append(xfer)
            self.posted.notify_all()
        xfer.posted.set()
        return xfer, "PROC"

    def post_blocks(
        self,
        peer: str,
        src_blocks: IdArray,
        dst_blocks: IdArray,
        layer_begin: int,
        layer_end: int,
        notif: bytes = b"",
    ) -> tuple[ControlledXfer, XferState]:
        if peer not in self.prepared:
            raise RuntimeError(f"no prepared descriptor list for peer {peer}")
        return self._post(
            ControlledXfer(
                peer, src_blocks, dst_blocks, "blocks", (layer_begin, layer_end), notif=notif
            )
        )

    def _post(self, xfer: ControlledXfer) -> tuple[ControlledXfer, XferState]:
        if self.fail_next_post is not None:
            err, self.fail_next_post = self.fail_next_post, None
            raise err
        if xfer.notif:
            self.sent.append((xfer.peer, xfer.notif))
            peer, sender = xfer.peer, self.notify_as or self.name

            def deliver(payload: bytes) -> None:
                target = _FABRIC.get(peer)
                if target is not None:
                    target.deliver(sender, payload)

            xfer.deliver = deliver
        with self.posted:
            self.xfers.append(xfer)
            self.posted.notify_all()
        xfer.posted.set()
        return xfer, "PROC"

    def wait_posted(self, count: int, timeout: float = 5.0) -> ControlledXfer:
        """Block until ``count`` writes were posted; return the last one."""
        with self.posted:
            if not self.posted.wait_for(lambda: len(self.xfers) >= count, timeout):
                raise TimeoutError(f"{count} writes not posted within {timeout}s")
            return self.xfers[count - 1]

    def progress(self) -> None:
        return None

    def notifications(self) -> list[tuple[str, bytes]]:
        """What ``deliver`` queued (a test stands in for the peer's notifications)."""
        with self._notes_lock:
            got, self.delivered = self.delivered, []
        return got

    def deliver(self, agent: str, payload: bytes) -> None:
        """Queue a notification for the next ``notifications`` (a receiver's test double)."""
        with self._notes_lock:
            self.delivered.append((agent, payload))

    def close(self) -> None:
        self.closed = True
