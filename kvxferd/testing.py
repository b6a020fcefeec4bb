"""Test doubles for deterministic race tests of session and sender logic.

:class:`ControlledDataPlane` stands in for NIXL: every posted WRITE waits until
the test says how it ends, and each step signals an event, so a test drives
the exact interleaving it wants with events, never with sleeps. Integration
tests never use it: they run real NIXL between real processes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvxferd.dataplane import XferState
from kvxferd.layout import Descs


@dataclass
class ControlledXfer:
    """A WRITE whose outcome the test decides with ``finish``."""

    peer: str
    src: Descs
    dst: Descs
    state: XferState = "PROC"
    posted: threading.Event = field(default_factory=threading.Event)
    polled: threading.Event = field(default_factory=threading.Event)
    released: bool = False

    def poll(self) -> XferState:
        self.polled.set()
        return self.state

    def release(self) -> bool:
        if self.state == "PROC":
            return False
        self.released = True
        return True

    def finish(self, ok: bool = True) -> None:
        self.state = "DONE" if ok else "ERR"


class ControlledDataPlane:
    """A data plane whose writes stay in progress until the test finishes them."""

    def __init__(self, name: str = "controlled") -> None:
        self.name = name
        self.xfers: list[ControlledXfer] = []
        self.posted = threading.Condition()
        self.fail_next_post: Exception | None = None
        self.closed = False
        self.peers: set[str] = set()

    def metadata(self) -> bytes:
        return self.name.encode()

    def add_peer(self, metadata: bytes) -> str:
        peer = metadata.decode()
        self.peers.add(peer)
        return peer

    def remove_peer(self, peer: str) -> None:
        self.peers.discard(peer)

    def post_write(
        self, peer: str, src: Descs, dst: Descs, src_mem: str, dst_mem: str
    ) -> tuple[ControlledXfer, XferState]:
        if self.fail_next_post is not None:
            err, self.fail_next_post = self.fail_next_post, None
            raise err
        xfer = ControlledXfer(peer, src, dst)
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

    def close(self) -> None:
        self.closed = True
