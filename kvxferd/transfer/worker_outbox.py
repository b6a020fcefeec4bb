"""A sender worker's outbox: Results and CancelAcks toward receivers that may not read.

Owned by one worker's thread (``kvxferd-worker-i``, or the listener for the inline
worker), like the DEALERs in it; no lock. Probes read only ``dealers()`` (a len).

A message is never sent blocking: it goes into its result endpoint's FIFO box and
is sent when that endpoint's DEALER can take it (tried at once, then each turn),
in order, until its own deadline (``worker_send_timeout_ms``). One message's
states::

    queued --the DEALER takes it------------------------> sent      (sent_<tag>)
    queued --past its deadline (the receiver not reading)--> dropped (send_timeouts)
    queued --the send raised (broken connection)---------> dropped (send_errors; the
                                                                     next one gets a new DEALER)
    queued --forget (the peer was evicted)---------------> gone      (the DEALER closes with
                                                                     a bounded linger, none
                                                                     when its process is gone)

A receiver that stops reading delays only its own messages. Nothing is queued
toward a peer a newer incarnation replaced (``messages_dropped_peer_gone``): its
endpoint now belongs to a process that never sent that fetch. Each endpoint's
DEALER expects the key its receiver registered with (its result ROUTER presents it).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import zmq

from kvxferd.errors import SendTimeout
from kvxferd.transfer import protocol as wire
from kvxferd.transfer.control import connect_dealer, send_bounded
from kvxferd.transfer.worker_tasks import Peer, WorkerHost

log = logging.getLogger("kvxferd.sender")


@dataclass(slots=True)
class _Outgoing:
    frame: bytes
    deadline: float
    tag: str
    fetch_id: int


class Outbox:
    """One worker's DEALERs and their FIFO boxes, by result endpoint."""

    def __init__(self, host: WorkerHost) -> None:
        self.host = host
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._outbox: dict[str, deque[_Outgoing]] = {}
        self._server_keys: dict[str, str] = {}  # endpoint -> the key its server presents

    def dealers(self) -> int:
        """DEALERs open (read by the probes from another thread: a len, no lock)."""
        return len(self._dealers)

    def pending(self) -> bool:
        """True while some message waits for its DEALER."""
        return any(self._outbox.values())

    def close(self) -> None:
        """Close every DEALER (the worker's end)."""
        # A bounded linger lets the last Results still queued reach their receivers.
        linger_ms = self.host.settings.deadlines.worker_send_timeout_ms
        for sock in self._dealers.values():
            sock.close(linger=linger_ms)
        self._dealers.clear()

    def _dealer(self, endpoint: str) -> zmq.Socket[bytes]:
        sock = self._dealers.get(endpoint)
        if sock is None:
            # SNDTIMEO 0: a send never waits; a message the socket cannot take stays queued.
            key = self._server_keys.get(endpoint, "")
            sock = connect_dealer(endpoint, self.host.socket_limits, 0, server_key=key)
            self._dealers[endpoint] = sock
        return sock

    def forget(self, endpoint: str, drop: bool = False) -> None:
        """The peer at ``endpoint`` was evicted: drop its box, close its DEALER."""
        self._outbox.pop(endpoint, None)
        self._server_keys.pop(endpoint, None)
        sock = self._dealers.pop(endpoint, None)
        if sock is not None:  # a Result still queued gets the usual bounded linger
            sock.close(linger=0 if drop else self.host.settings.deadlines.worker_send_timeout_ms)

    def enqueue(self, peer: Peer, msg: wire.Result | wire.CancelAck) -> None:
        """Queue ``msg`` toward ``peer``'s result endpoint and send what its DEALER takes now."""
        if self.host.peer_gone(peer):
            # Its endpoint now belongs to a newer incarnation, which never sent this fetch.
            self.host.stats.add("messages_dropped_peer_gone")
            return
        endpoint = peer.result_endpoint
        self._server_keys[endpoint] = peer.identity  # its result ROUTER presents that key
        deadline = time.monotonic() + self.host.settings.deadlines.worker_send_timeout_ms / 1000
        tag = msg.__struct_config__.tag
        out = _Outgoing(wire.encode(msg, peer.version), deadline, str(tag), msg.fetch_id)
        self._outbox.setdefault(endpoint, deque()).append(out)
        self._flush_one(endpoint)

    def flush(self) -> None:
        """Send what each DEALER takes now; drop what passed its deadline."""
        for endpoint in [e for e, box in self._outbox.items() if box]:
            self._flush_one(endpoint)

    def _flush_one(self, endpoint: str) -> None:
        """Send what ``endpoint``'s DEALER takes now, in order; drop what passed its deadline."""
        box = self._outbox.get(endpoint)
        stats = self.host.stats
        now = time.monotonic()
        while box:
            out = box[0]
            if now >= out.deadline:
                box.popleft()
                stats.add("send_timeouts")
                log.warning(
                    "%s for fetch %d not delivered to the receiver's result endpoint %s before"
                    " its deadline: the receiver is not reading, or its result ROUTER never"
                    " completed the handshake (with CURVE it must serve the key it registered"
                    " with, docs/protocol.md section 1)",
                    out.tag,
                    out.fetch_id,
                    endpoint,
                )
                continue
            try:
                sock = self._dealer(endpoint)
                if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:
                    return  # full: try again next turn
                send_bounded(sock, out.frame)
            except SendTimeout:
                return
            except zmq.ZMQError as e:
                box.popleft()
                stats.add("send_errors")
                log.warning("%s for fetch %d dropped: %s", out.tag, out.fetch_id, e)
                # The next message gets a fresh DEALER (a new connection), not this one.
                broken = self._dealers.pop(endpoint, None)
                if broken is not None:
                    broken.close(linger=0)
                continue
            box.popleft()
            stats.add(f"sent_{out.tag}")
        if box is not None and not box:
            del self._outbox[endpoint]
